"""psring.library's parts that need no launch: the global batch sampler (DistributedSampler's
contract), the settings psring.init() reads, what a server-side update takes from a
script's optimizer, the hooks that weigh each backward and move inputs, and a script's
run alone (single) in this process. (Launched runs of scripts and the examples:
tests/multiproc/test_script_runs.py.)"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from psring.config import RunConfig
from psring.errors import ConfigError, PsringError
from psring.library import start
from psring.library.hooks import grad_tensors, to_device
from psring.library.sampler import GlobalBatchSampler, shares
from psring.library.wrap import server_sgd
from psring.workers import entry

ALONE = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
         "PSRING_RUN_ID", start.ENV)


@pytest.fixture
def alone(monkeypatch):
    """A process outside any launch (psring.init(strategy=...) runs it here)."""
    for name in ALONE:
        monkeypatch.delenv(name, raising=False)


def epochs(sampler: GlobalBatchSampler, n: int) -> list[list[list[int]]]:
    out = []
    for e in range(n):
        sampler.set_epoch(e)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("sizes", [None, [8, 24], [1, 2, 29]])
def test_the_workers_slices_are_each_global_batch_exactly(sizes):
    """Per epoch (set_epoch, as DistributedSampler), the workers' rows of each global
    batch are that batch's rows, in rank order; epoch e's batch i is the run's global
    batch e * per_epoch + i, a new permutation each epoch."""
    world = len(sizes) if sizes else 4
    samplers = [GlobalBatchSampler(100, 32, r, world, seed=5, uneven=sizes)
                for r in range(world)]
    alone = GlobalBatchSampler(100, 32, 0, 1, seed=5)
    per_rank = [epochs(s, 3) for s in samplers]
    whole = epochs(alone, 3)
    assert len(alone) == len(samplers[0]) == 3  # three whole batches of 32 in 100
    for e in range(3):
        for i in range(3):
            joined = [j for r in range(world) for j in per_rank[r][e][i]]
            assert joined == whole[e][i] == alone.batch(3 * e + i)
    assert len({j for b in whole[0] for j in b}) == 96 and whole[1] != whole[0]


def test_without_set_epoch_each_iteration_is_the_next_epoch_and_steps_cap_the_run():
    s = GlobalBatchSampler(100, 32, 0, 1, seed=5)
    assert [list(s) for _ in range(2)] == epochs(GlobalBatchSampler(100, 32, 0, 1, seed=5), 2)
    capped = GlobalBatchSampler(100, 32, 0, 1, max_steps=4, seed=5)
    assert [len(b) for b in epochs(capped, 3)] == [3, 1, 0]  # 4 steps in all
    assert len(capped) == 0


def test_accumulation_reads_k_global_batches_a_step_in_micro_batches():
    """--accumulate 2: an epoch holds whole optimizer steps of two global (micro-)
    batches each, and each worker yields its slice of every one."""
    ranks = [GlobalBatchSampler(100, 16, r, 2, seed=1, accumulate=2) for r in range(2)]
    alone = GlobalBatchSampler(100, 16, 0, 1, seed=1, accumulate=2)
    assert len(alone) == 6 and alone.per_epoch == 3  # 100 // 32 steps, 2 micro each
    got = [list(s) for s in ranks]
    for m, batch in enumerate(alone):
        assert got[0][m] + got[1][m] == batch == alone.batch(m // 2, m % 2)


def test_a_batch_that_does_not_split_or_a_misused_sampler_is_refused():
    with pytest.raises(ConfigError, match="multiple of 3"):
        shares(32, 3)
    with pytest.raises(ConfigError, match="do not split a global batch of 32"):
        shares(32, 2, [8, 8])
    with pytest.raises(ConfigError, match="holds no optimizer step"):
        GlobalBatchSampler(10, 32, 0, 1)
    ds = TensorDataset(torch.arange(64.0))
    with pytest.raises(ConfigError, match=r"batch_sampler=sampler\), not sampler="):
        next(iter(DataLoader(ds, sampler=GlobalBatchSampler(64, 16, 0, 1))))
    assert len(next(iter(DataLoader(ds, batch_sampler=GlobalBatchSampler(64, 16, 0, 1))))[0]) \
        == 16


def test_init_outside_a_launch_without_arguments_names_the_fix(alone):
    with pytest.raises(ConfigError, match="psring launch --strategy S --workers N"):
        start.init()
    with pytest.raises(ConfigError, match="stps is not one"):
        start.init(strategy="single", stps=3)
    with pytest.raises(ConfigError, match="workers=2"):
        start.init(strategy="allreduce", workers=2)


def test_the_runs_flags_come_from_the_launch_and_steps_are_a_cap(monkeypatch, tmp_path):
    monkeypatch.setenv(start.ENV, f"--strategy ps --workers 2 --steps 5 --out {tmp_path}")
    cfg = start._config(None, {})
    assert (cfg.strategy, cfg.workers, cfg.steps) == ("ps", 2, 5)
    with pytest.raises(ConfigError, match="disagrees with the launch's --steps 5"):
        start._config(None, {"steps": 6})
    monkeypatch.setenv(start.ENV, f"--strategy ps --workers 2 --out {tmp_path}")
    assert start._config(None, {}).steps == 0  # no --steps: the script decides
    monkeypatch.setenv(start.ENV, "--stratgy ps")
    with pytest.raises(ConfigError, match="flags psring run does not take"):
        start._config(None, {})


def test_a_parameter_server_strategy_under_torchrun_needs_servers_named(monkeypatch,
                                                                       tmp_path):
    for name in ("PSRING_RUN_ID", start.ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"psring server --bind.*--server-addrs"):
        start._config("ps", {"out": str(tmp_path)})
    monkeypatch.setenv(start.ENV, f"--strategy byteps --out {tmp_path}")
    with pytest.raises(ConfigError, match="byteps under torchrun needs parameter servers"):
        start._config(None, {})
    monkeypatch.setenv(start.ENV, f"--strategy ps --out {tmp_path} "
                                  f"--server-addrs tcp://127.0.0.1:5555")
    assert start._config(None, {}).server_addrs == "tcp://127.0.0.1:5555"
    with pytest.raises(ConfigError, match="async-ps under torchrun"):  # (psring's own worker)
        entry.servers_named(RunConfig(strategy="async-ps", workers=2))


def test_the_servers_take_sgd_and_refuse_what_they_cannot_apply():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    cfg = RunConfig(strategy="byteps", workers=2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5, weight_decay=1e-4)
    assert server_sgd(sgd, model, cfg) == {"lr": 0.2, "momentum": 0.5, "weight_decay": 1e-4}
    loaded = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loaded.state[model[0].weight]["momentum_buffer"] = torch.ones(3, 4)
    bad = [
        (torch.optim.Adam(model.parameters()), "the optimizer is Adam; pass --update-on worker"),
        (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True), "Nesterov"),
        (torch.optim.SGD([{"params": model[0].parameters()},
                          {"params": model[1].parameters(), "lr": 0.01}], lr=0.1),
         "2 parameter groups"),
        (torch.optim.SGD(model[0].parameters(), lr=0.1), "another set of them"),
        (loaded, "already holds a state"),
    ]
    for opt, says in bad:
        with pytest.raises(ConfigError, match=says):
            server_sgd(opt, model, cfg)
    with pytest.raises(ConfigError, match="ps updates only on its servers"):
        server_sgd(bad[0][0], model, RunConfig(strategy="ps", workers=2))


@dataclass
class Out:
    loss: torch.Tensor
    logits: torch.Tensor


def test_every_output_gradients_flow_through_is_found_and_inputs_move():
    x = torch.ones(2, requires_grad=True)
    y, z = x * 2, x * 3
    assert grad_tensors(y) == [y]
    assert grad_tensors({"aux": torch.ones(1), "out": [y, (z,)]}) == [y, z]
    assert grad_tensors(Out(y, z)) == [y, z]  # (a dataclass, as HuggingFace returns)
    assert grad_tensors((torch.ones(1),)) == []
    meta = torch.device("meta")
    moved = to_device({"a": [torch.ones(2), (torch.ones(1), "text")], "b": Out(y, z)}, meta)
    assert moved["a"][0].device == meta and moved["a"][1][0].device == meta
    assert moved["a"][1][1] == "text" and isinstance(moved["a"][1], tuple)
    assert moved["b"].logits.device == meta


def test_init_leaves_the_scripts_random_numbers_alone(alone, tmp_path):
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    dist = start.init(strategy="single", seed=4, out=str(tmp_path / "run"))
    try:
        assert torch.equal(torch.rand(3), expected)
    finally:
        dist.close()


class HalfWay(nn.Module):
    """A forward that returns its loss and its logits, the one made from the other."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, target=None):
        logits = self.lin(x)
        return (logits - target).pow(2).mean(), logits


def test_each_backward_is_weighed_once_whatever_the_forward_returns(alone, tmp_path):
    """dist.accumulate with --accumulate 2: each micro-batch's gradient counts 1/2, also
    through a forward that returns the loss beside the logits it came from (a weight on
    each output would apply twice), and optimizer.step()/zero_grad() wait for the last
    micro-batch; the model is SGD on the mean of the two micro-batches' gradients."""
    torch.manual_seed(0)
    ref, x, t = HalfWay(), torch.randn(2, 8, 4), torch.randn(2, 8, 2)
    dist = start.init(strategy="single", accumulate=2, out=str(tmp_path / "run"))
    model = HalfWay()
    model.load_state_dict(ref.state_dict())
    model, opt = dist.wrap(model, torch.optim.SGD(model.parameters(), lr=0.5))
    for m in range(2):
        with dist.accumulate(model) as s:
            assert dist.sync_gradients == (m == 1)
            loss, _ = model(x[m], target=t[m])
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.loss = loss
    dist.finish()
    grads = torch.autograd.grad(sum(ref(x[m], t[m])[0] for m in range(2)) / 2,
                                list(ref.parameters()))
    for p, q, g in zip(model.parameters(), ref.parameters(), grads):
        assert torch.allclose(p, q - 0.5 * g, atol=1e-6)
    records = [json.loads(r) for r in (tmp_path / "run" / "steps.jsonl").read_text().split()]
    assert [r["step"] for r in records] == [0] and records[0]["backward_end_s"] > 0


def test_a_scripts_steps_are_counted_and_the_run_ends_where_it_says(alone, tmp_path):
    """In-process, alone (single): steps numbered by the run (dist.step() counts; a
    number given must be the next), a skipped update recorded as one, evaluation names
    that would overwrite the record's refused, finish after any number of steps with
    the manifest saying how many, and nothing after finish."""
    out = tmp_path / "run"
    dist = start.init(strategy="single", out=str(out))
    model = nn.Linear(4, 1)
    model, opt = dist.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.module is model and dist.unwrap(model) is model  # (as DDP's users know)
    with pytest.raises(PsringError, match=r"dist.step\(1\).*0 is next"):
        with dist.step(1):
            pass
    with dist.step() as s:  # no optimizer.step(): an update skipped (GradScaler's inf)
        s.loss = model(torch.ones(2, 4)).pow(2).mean()
        s.loss.backward()
    with dist.step(1) as s:
        model(torch.ones(2, 4)).sum().backward()  # (no s.loss: the record says null)
        opt.step()
    with pytest.raises(PsringError, match="the record's own"):
        dist.evaluate(2, lambda m: {"time": 1.0})
    dist.finish()
    with pytest.raises(PsringError, match=r"after dist.finish\(\).*after 2 steps"):
        dist.finish()
    with pytest.raises(PsringError, match=r"after dist.finish\(\)"):
        with dist.step():
            pass
    records = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and records[0]["updated"] is False
    assert records[0]["loss"] > 0 and records[1]["loss"] is None
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["steps"] == 2 and (out / "model.pt").exists()


def test_steps_beyond_the_cap_and_drop_last_false_are_refused(alone, tmp_path):
    dist = start.init(strategy="single", steps=1, out=str(tmp_path / "run"))
    try:
        with pytest.raises(PsringError, match="drop_last=False"):
            dist.sampler(64, 16, drop_last=False)
        model = nn.Linear(4, 1)
        model, opt = dist.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with dist.step():
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        with pytest.raises(PsringError, match="--steps 1 is the most this run takes"):
            with dist.step():
                pass
    finally:
        dist.close()
