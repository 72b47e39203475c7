"""psring's SGD is torch.optim.SGD's arithmetic, bit for bit, and a worker's training
path never imports torch._dynamo (about 1 s of start-up in every worker process)."""

import subprocess
import sys

import pytest
import torch

from psring.train.optim import SGD


@pytest.mark.parametrize("momentum,weight_decay", [(0.9, 0.01), (0.0, 0.01), (0.9, 0.0),
                                                    (0.0, 0.0)])
def test_sgd_is_torch_sgd_bit_for_bit(momentum, weight_decay):
    torch.manual_seed(0)
    p0 = [torch.randn(300), torch.randn(4, 5)]
    ours = [p.clone().requires_grad_() for p in p0]
    ref = [p.clone().requires_grad_() for p in p0]
    opt = SGD(ours, lr=0.1, momentum=momentum, weight_decay=weight_decay)
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=momentum, weight_decay=weight_decay)
    for _step in range(4):
        grads = [torch.randn_like(p) for p in p0]
        for a, b, g in zip(ours, ref, grads):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        for a, b in zip(ours, ref):
            assert torch.equal(a, b)
    if momentum:
        for a, b in zip(ours, ref):
            assert torch.equal(opt.state[a]["momentum_buffer"],
                               ref_opt.state[b]["momentum_buffer"])
    opt.zero_grad()
    assert all(p.grad is None for p in ours)
    before = [p.clone() for p in ours]
    opt.step()  # no gradients: nothing moves
    assert all(torch.equal(a, b) for a, b in zip(ours, before))


def test_sgd_refuses_negative_settings():
    with pytest.raises(ValueError, match="lr, momentum and weight_decay"):
        SGD([torch.zeros(1)], lr=-0.1)


SCRIPT = """
import logging, sys, tempfile
from pathlib import Path
import torch
from psring.config import RunConfig
from psring.workers.entry import run_worker
out = tempfile.mkdtemp()
cfg = RunConfig(strategy="single", steps=2, out=out, samples=256, batch_size=32)
run_worker(cfg, 0, 1, 0, 1, logging.getLogger("t"))
print("DYNAMO", "torch._dynamo" in sys.modules)
"""


@pytest.mark.timeout(60)
def test_training_does_not_import_dynamo():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "DYNAMO False" in proc.stdout, proc.stdout
