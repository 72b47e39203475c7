"""psring.library's parts that need no run: the global batch sampler, the settings
psring.init() reads, and what a server-side update takes from a script's optimizer.
(Runs of a script: tests/multiproc/test_script_runs.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psring.config import RunConfig
from psring.errors import ConfigError
from psring.library import start
from psring.library.hooks import grad_tensors
from psring.library.sampler import GlobalBatchSampler, shares
from psring.library.wrap import server_sgd


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
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", start.ENV):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="psring launch --strategy S --workers N"):
        start.init()
    with pytest.raises(ConfigError, match="stps is not one"):
        start.init(strategy="single", stps=3)
    with pytest.raises(ConfigError, match="workers=2"):
        start.init(strategy="allreduce", workers=2)


def test_the_runs_flags_come_from_the_launch_and_arguments_must_agree(monkeypatch, tmp_path):
    monkeypatch.setenv(start.ENV, f"--strategy ps --workers 2 --steps 5 --out {tmp_path}")
    cfg = start._config(None, {})
    assert (cfg.strategy, cfg.workers, cfg.steps) == ("ps", 2, 5)
    with pytest.raises(ConfigError, match="disagrees with the launch's --steps 5"):
        start._config(None, {"steps": 6})
    monkeypatch.setenv(start.ENV, "--stratgy ps")
    with pytest.raises(ConfigError, match="flags psring run does not take"):
        start._config(None, {})


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


def test_every_output_gradients_flow_through_is_found():
    x = torch.ones(2, requires_grad=True)
    y, z = x * 2, x * 3
    assert grad_tensors(y) == [y]
    assert grad_tensors({"aux": torch.ones(1), "out": [y, (z,)]}) == [y, z]
    assert grad_tensors((torch.ones(1),)) == []


def test_init_leaves_the_scripts_random_numbers_alone(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", start.ENV):
        monkeypatch.delenv(name, raising=False)
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    dist = start.init(strategy="single", steps=2, seed=4, out=str(tmp_path / "run"))
    try:
        assert torch.equal(torch.rand(3), expected)
    finally:
        dist.close()


def test_a_scripts_steps_are_numbered_in_order_all_run_and_recorded(monkeypatch, tmp_path):
    """In-process, alone (single): what the step and finish calls refuse, a skipped
    update recorded as one, and evaluation names that would overwrite the record's."""
    import json

    from psring.errors import PsringError

    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", start.ENV):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    dist = start.init(strategy="single", steps=3, out=str(out))
    model = nn.Linear(4, 1)
    model, opt = dist.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(PsringError, match=r"dist.step\(1\).*0 is next"):
        with dist.step(1):
            pass
    with dist.step(0) as s:  # no optimizer.step(): an update skipped (GradScaler's inf)
        s.loss = model(torch.ones(2, 4)).pow(2).mean()
        s.loss.backward()
    with pytest.raises(PsringError, match="the record's own"):
        dist.evaluate(1, lambda m: {"time": 1.0})
    with pytest.raises(PsringError, match="after 1 of the run's 3 steps"):
        dist.finish()
    records = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0] and records[0]["updated"] is False
    assert records[0]["loss"] > 0
