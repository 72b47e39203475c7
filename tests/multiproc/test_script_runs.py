"""Users' own training scripts under psring launch: the two examples written in DDP's and
Accelerate's idioms (examples/ddp_style.py, examples/accelerate_style.py) and a
regression script of psring's five calls (tests/helpers/script_train.py). Every
synchronous strategy ends with the parameters the same script ends with under
`single`; what a strategy cannot do is refused by name; a failing worker stops the run;
nothing is left behind, the script's DataLoader workers included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from psring.report import summarize_all
from psring.runtime.process import free_port
from tests.helpers import (
    assert_no_processes,
    load_model,
    max_rel_diff,
    processes_mentioning,
    zygote,
)
from tests.helpers.runs import TESTS, psring, psring_together, read_steps

EXAMPLES = TESTS.parent / "examples"
DDP_STYLE = ["--", "python", str(EXAMPLES / "ddp_style.py")]
ACCELERATE_STYLE = ["--", "python", str(EXAMPLES / "accelerate_style.py")]
SCRIPT = ["--", "python", str(TESTS / "helpers" / "script_train.py")]
#: the edits of the gradient that a server-side update refuses (ddp_style's default)
NO_EDITS = ["--clip", "0", "--no-scaler"]


def _launch(strategy: str, out, *flags: str, workers: int = 2) -> list:
    return ["launch", "--strategy", strategy, "--workers", str(workers), *flags,
            "--out", out]


#: ddp_style.py: name -> (launch flags, the script's flags); a clip right after
#: backward, GradScaler, two micro-batches under model.no_sync(), early stopping
DDP_RUNS = {
    "single": (("single", "--workers", "1"), ["--micro", "2"]),
    "single-plain": (("single", "--workers", "1"), NO_EDITS),
    "allreduce": (("allreduce",), ["--micro", "2"]),
    "hallreduce": (("hallreduce",), ["--micro", "2"]),
    "ddp": (("ddp",), ["--micro", "2"]),
    "byteps-worker": (("byteps", "--update-on", "worker"), ["--micro", "2"]),
    "ps": (("ps", "--servers", "2"), NO_EDITS),
    "byteps": (("byteps",), NO_EDITS),
}
#: accelerate_style.py with --accumulate 2: name -> launch flags
ACCELERATE_RUNS = {
    "single": ("single", "--workers", "1"),
    "allreduce": ("allreduce",),
    "ddp": ("ddp",),
    "hallreduce": ("hallreduce", "--steps", "100"),  # (a cap the script stops short of)
    "ps": ("ps", "--servers", "2", "--worker-batch", "16,48"),
    "byteps": ("byteps",),
}


@pytest.mark.timeout(300)
def test_the_examples_train_singles_model_under_every_synchronous_strategy(tmp_path):
    """Each example against itself under `single` (≤ 1e-4 relative), all launched at once
    (with them: the regression script under torchrun, and its profile)."""
    runs = []
    for name, ((strategy, *flags), script) in DDP_RUNS.items():
        runs.append(_launch(strategy, tmp_path / f"ddp-{name}", *flags) + DDP_STYLE + script)
    for name, (strategy, *flags) in ACCELERATE_RUNS.items():
        runs.append(_launch(strategy, tmp_path / f"acc-{name}", *flags, "--accumulate", "2")
                    + ACCELERATE_STYLE)
    runs.append(["profile", "--out", tmp_path / "profile", *SCRIPT])
    # where the workers update, any optimizer, a schedule, and Horovod's synchronize()
    runs.append(_launch("byteps", tmp_path / "adam", "--update-on", "worker") + SCRIPT
                + ["--schedule", "--optimizer", "adam", "--clip", "0.05"])
    torchrun = _torchrun(tmp_path / "torchrun")
    done = psring_together(*runs, timeout=280)
    _, err = torchrun.communicate(timeout=120)
    assert torchrun.returncode == 0, err[-3000:]
    assert _session_gone(torchrun.pid)  # (its workers' command lines name no run dir)

    for name in DDP_RUNS:
        ref = "single" if "--micro" in DDP_RUNS[name][1] else "single-plain"
        _same_model(tmp_path / f"ddp-{name}", tmp_path / f"ddp-{ref}", name)
        _early_stop_and_one_view(tmp_path / f"ddp-{name}", tmp_path / f"ddp-{ref}", name)
    for name in ACCELERATE_RUNS:
        _same_model(tmp_path / f"acc-{name}", tmp_path / "acc-single", name)
        # 1536 rows, global micro-batches of 64, 2 a step: 12 steps an epoch, 2 epochs
        steps = read_steps(tmp_path / f"acc-{name}")
        assert len(steps) == 24 * (1 if name == "single" else 2), name
        assert all(0 < r["backward_end_s"] <= r["step_s"] for r in steps), name
    assert len(read_steps(tmp_path / "adam")) == 2 * 16
    _same_model(tmp_path / "torchrun", tmp_path / "profile", "torchrun")
    # the script's prints stream to the terminal (rank 0's), psring's own lines do not
    out = done[0].stdout
    assert "epoch 0:" in out and "[worker 0/" not in out
    assert summarize_all([str(tmp_path / "acc-byteps")])[0]["loss_final"] is None  # (no s.loss)
    assert_no_processes(tmp_path)


def _same_model(run: Path, ref: Path, name: str) -> None:
    assert max_rel_diff(load_model(run), load_model(ref)) < 1e-4, name


def _early_stop_and_one_view(run: Path, ref: Path, name: str) -> None:
    """ddp_style stops early (75 of its 8 x 25 steps; no --steps), the manifest says so,
    and its last checkpoint between steps is the final model, with the momentum
    single's optimizer has (the servers' own where they update)."""
    steps = read_steps(run)
    assert max(r["step"] for r in steps) == 74, name
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["config"]["steps"] == 75, name
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 2 and ckpt["model"].keys() == load_model(run).keys(), name
    assert max_rel_diff(ckpt["model"], load_model(run)) == 0, name
    mine = ckpt["optimizer"]["state"]
    theirs = torch.load(ref / "checkpoint.pt", weights_only=True)["optimizer"]["state"]
    assert sorted(mine) == sorted(theirs) == [0, 1, 2, 3], name
    for i in theirs:
        want = theirs[i]["momentum_buffer"]
        assert (mine[i]["momentum_buffer"] - want).abs().max() <= 1e-4 * want.abs().max(), name


def _torchrun(out) -> subprocess.Popen:
    """The regression script under torchrun (one node, two ranks, allreduce; 8 of its 16
    steps, as the profile's), started."""
    env = {**os.environ, "PSRING_RUN_ARGS": f"--strategy allreduce --threads 1 --steps 8 "
                                            f"--timeout 60 --out {out}"}
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "1", "--nproc-per-node",
         "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port("127.0.0.1")),
         str(TESTS / "helpers" / "script_train.py")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True)


def _session_gone(sid: int, within: float = 10.0) -> bool:
    """No live process is left in session ``sid`` (a process started with
    start_new_session leads its own), polling ``within`` seconds for the reaping."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        left = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # (session id; not a zombie)
                left.append(stat.parent.name)
        if not left:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(150)
def test_what_the_servers_cannot_do_is_refused_and_a_failing_worker_stops_the_run(tmp_path):
    """Exit 1 with the cause named: gradients edited after backward where the servers
    update (a clip, GradScaler), a schedule there, a second backward outside no_sync, a
    worker failing, a script ending without dist.finish(); a forked script ends as
    `python script.py` would. First, a run whose DataLoader has persistent workers:
    none of them outlives psring launch."""
    loader = _launch("single", tmp_path / "loader", workers=1) + [
        "--", "python", TESTS / "helpers" / "script_loader.py"]
    cases = {"clip": (_launch("ps", tmp_path / "clip") + DDP_STYLE + ["--no-scaler"],
                      "p.grad changed after backward in dist.step(0)"),
             "scaler": (_launch("byteps", tmp_path / "scaler") + DDP_STYLE + ["--clip", "0"],
                        "GradScaler's unscale_"),
             "schedule": (_launch("ps", tmp_path / "schedule") + SCRIPT + ["--schedule"],
                          "lr 0.1 -> 0.05; an LR scheduler?"),
             "no_sync": (_launch("allreduce", tmp_path / "no_sync") + SCRIPT
                         + ["--accumulate", "2", "--forget-no-sync"],
                         "a second backward in dist.step(0)"),
             "fails": (_launch("allreduce", tmp_path / "fails", "--timeout", "60") + SCRIPT
                       + ["--fail-rank", "1"], "worker-1 failed (exit code 3)"),
             "no_finish": (_launch("ps", tmp_path / "no_finish") + SCRIPT + ["--no-finish"],
                           "ended after 16 step(s) without dist.finish()"),
             # forked, as `python script.py` would run it
             "exits": (["launch", "--strategy", "single", "--out", tmp_path / "exits", "--",
                        "python", TESTS / "helpers" / "script_exits.py"],
                       "file absolute: True; path[0] is its folder: True\n"
                       "a message for the user\nexit handler ran")}
    first = zygote.start(loader, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    procs = {name: zygote.start(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
             for name, (args, _) in cases.items()}
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert not processes_mentioning(str(tmp_path / "loader")), "DataLoader workers left"
    errs = {}
    for name, (_, says) in cases.items():
        _, errs[name] = procs[name].communicate(timeout=120)
        assert procs[name].returncode == 1, errs[name]
        assert says in errs[name], errs[name]
    assert "failing on purpose" in errs["fails"]  # (the failed worker's last lines)
    assert not (tmp_path / "no_finish" / "model.pt").exists()
    assert_no_processes(tmp_path)


@pytest.mark.timeout(60)
def test_launch_without_a_command_or_with_what_scripts_lack_is_refused(tmp_path, capsys):
    from psring.cli import main

    for args, says in [([], "needs the command each worker runs"),
                       (["--compute", "device", *SCRIPT], "--compute device"),
                       (["--checkpoint-every", "2", *SCRIPT], "--checkpoint-every")]:
        code = main(["launch", "--strategy", "allreduce", "--out", str(tmp_path / "x"), *args])
        assert code == 2
        assert says in capsys.readouterr().err
    assert not (tmp_path / "x" / "steps.jsonl").exists()


#: what docs/your-script.md's template leaves to the script: a dataset, a model, its
#: optimizer and loss, the epochs, a held-out set and an accuracy
TEMPLATE_PRELUDE = '''
import torch

torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
X = torch.randn(512, 16, generator=g)
Y = (X[:, :4].sum(1) > 0).long()
dataset = torch.utils.data.TensorDataset(X, Y)
held_out = (X[:128], Y[:128])
epochs = 2
torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
loss_fn = torch.nn.functional.cross_entropy


def accuracy(m, data):
    with torch.no_grad():
        x, y = data
        return (m(x).argmax(1).cpu() == y).float().mean().item()
'''


def _docs_template() -> str:
    """The first python block of docs/your-script.md ("The five calls"), as written."""
    text = (TESTS.parent / "docs" / "your-script.md").read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert "psring.init()" in block and "dist.finish()" in block
    return block


@pytest.mark.timeout(120)
def test_the_docs_template_runs_as_written(tmp_path):
    """docs/your-script.md's template, with only what it leaves to the script defined
    before it, runs under ps with two servers (issue 45: every code block of the docs
    runs): its epochs, steps and evaluations as written. (That a script of the five
    calls trains single's model under ps: the examples' test above.)"""
    script = tmp_path / "train.py"
    script.write_text(TEMPLATE_PRELUDE + _docs_template())
    psring(*_launch("ps", tmp_path / "ps", "--servers", "2"), "--", "python", script,
           timeout=100)
    assert (tmp_path / "ps" / "model.pt").is_file()
    # 512 rows, a global batch of 128: 4 steps an epoch, 2 epochs; evaluated each epoch
    assert len(read_steps(tmp_path / "ps")) == 2 * 8
    evals = [json.loads(line) for line in (tmp_path / "ps" / "evals.jsonl").read_text()
             .splitlines()]
    assert [e["step"] for e in evals] == [4, 8] and evals[-1]["accuracy"] > 0.6
    assert_no_processes(tmp_path)
