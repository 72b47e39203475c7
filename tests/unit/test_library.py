"""psring.library's parts that need no run: the global batch sampler, the settings
psring.init() reads, and what a server-side update takes from a script's optimizer.
(Runs of a script: tests/multiproc/test_script_runs.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psring.config import RunConfig
from psring.errors import ConfigError
from psring.library import session
from psring.library.sampler import GlobalBatchSampler, shares
from psring.library.wrap import _first_grad_tensor, server_sgd


@pytest.mark.parametrize("sizes", [None, [8, 24], [1, 2, 29]])
def test_the_workers_slices_are_each_global_batch_exactly(sizes):
    world = len(sizes) if sizes else 4
    samplers = [GlobalBatchSampler(100, 32, r, world, steps=7, seed=5, uneven=sizes)
                for r in range(world)]
    alone = list(GlobalBatchSampler(100, 32, 0, 1, steps=7, seed=5))
    per_rank = [list(s) for s in samplers]
    assert len(alone) == 7 and all(len(b) == 7 for b in per_rank)
    for step in range(7):
        joined = [i for r in range(world) for i in per_rank[r][step]]
        assert joined == alone[step]  # in rank order: the same rows, the same order
    # three batches an epoch: the fourth starts a new permutation of all 100
    epoch0 = {i for b in alone[:3] for i in b}
    assert len(epoch0) == 96 and alone[3] != alone[0]
    assert samplers[0].start_at(5).batch(5) == per_rank[0][5] == list(samplers[0])[0]


def test_a_batch_that_does_not_split_is_refused():
    with pytest.raises(ConfigError, match="multiple of 3"):
        shares(32, 3)
    with pytest.raises(ConfigError, match="do not split a global batch of 32"):
        shares(32, 2, [8, 8])
    with pytest.raises(ConfigError, match="holds no global batch"):
        GlobalBatchSampler(10, 32, 0, 1, steps=1)


def test_init_outside_a_launch_without_arguments_names_the_fix(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", session.ENV):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="psring launch --strategy S --workers N"):
        session.init()
    with pytest.raises(ConfigError, match="stps is not one"):
        session.init(strategy="single", stps=3)
    with pytest.raises(ConfigError, match="workers=2"):
        session.init(strategy="allreduce", workers=2)


def test_the_runs_flags_come_from_the_launch_and_arguments_must_agree(monkeypatch, tmp_path):
    monkeypatch.setenv(session.ENV, f"--strategy ps --workers 2 --steps 5 --out {tmp_path}")
    cfg = session._config(None, {})
    assert (cfg.strategy, cfg.workers, cfg.steps) == ("ps", 2, 5)
    with pytest.raises(ConfigError, match="disagrees with the launch's --steps 5"):
        session._config(None, {"steps": 6})
    monkeypatch.setenv(session.ENV, "--stratgy ps")
    with pytest.raises(ConfigError, match="flags psring run does not take"):
        session._config(None, {})


def test_the_servers_take_sgd_and_refuse_what_they_cannot_apply():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    cfg = RunConfig(strategy="byteps", workers=2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5, weight_decay=1e-4)
    assert server_sgd(sgd, model, cfg) == {"lr": 0.2, "momentum": 0.5, "weight_decay": 1e-4}
    bad = [
        (torch.optim.Adam(model.parameters()), "the optimizer is Adam; pass --update-on worker"),
        (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True), "Nesterov"),
        (torch.optim.SGD([{"params": model[0].parameters()},
                          {"params": model[1].parameters(), "lr": 0.01}], lr=0.1),
         "2 parameter groups"),
        (torch.optim.SGD(model[0].parameters(), lr=0.1), "another set of them"),
    ]
    for opt, says in bad:
        with pytest.raises(ConfigError, match=says):
            server_sgd(opt, model, cfg)
    with pytest.raises(ConfigError, match="ps updates only on its servers"):
        server_sgd(bad[0][0], model, RunConfig(strategy="ps", workers=2))


def test_the_backward_clock_starts_at_the_first_output_gradients_flow_through():
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    assert _first_grad_tensor(y) is y
    assert _first_grad_tensor({"aux": torch.ones(1), "out": [y]}) is y
    assert _first_grad_tensor((torch.ones(1),)) is None


def test_init_leaves_the_scripts_random_numbers_alone(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", session.ENV):
        monkeypatch.delenv(name, raising=False)
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    dist = session.init(strategy="single", steps=2, seed=4, out=str(tmp_path / "run"))
    try:
        assert torch.equal(torch.rand(3), expected)
    finally:
        dist.close()
