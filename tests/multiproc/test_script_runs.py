"""A user's own training script (tests/helpers/script_train.py: a regression, its own
loss and DataLoader) under psring launch: every synchronous strategy ends with the
parameters of the same script under single; what a strategy cannot drive is refused by
name; a worker that fails stops the run, nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import assert_no_processes, load_model, max_rel_diff
from tests.helpers.runs import PSRING, TESTS, psring_together, read_steps

SCRIPT = ["--", "python", str(TESTS / "helpers" / "script_train.py")]
STEPS = ("--steps", "8")


def _launch(strategy: str, out, *extra: str) -> list:
    return ["launch", "--strategy", strategy, "--workers", "2", *STEPS, *extra,
            "--out", out, *SCRIPT]


@pytest.mark.timeout(240)
def test_the_script_under_each_synchronous_strategy_trains_its_alone_model(tmp_path):
    """The reference is the script's profile: `single`, one worker, the same seed and
    steps. (With them, at once: the script under torchrun, Adam with clipping and a
    schedule where the workers update; each launch's start overlaps the others' steps.
    The script run with no launch at all, psring.init(strategy="single"):
    tests/unit/test_library.py.)"""
    from psring.predict.profile import Profile

    # (ps with uneven batches: 8 and 24 rows of each global batch of 32)
    runs = {"allreduce": ("allreduce",),
            "ps": ("ps", "--servers", "2", "--batch-size", "32", "--worker-batch", "8,24"),
            "byteps": ("byteps",), "ddp": ("ddp",)}
    # two micro-batches a step, the first under dist.no_sync()
    accumulate = {"allreduce", "ddp"}
    others = [_launch("byteps", tmp_path / "sched", "--update-on", "worker")
              + ["--schedule", "--optimizer", "adam", "--clip", "0.05"],
              ["profile", "--steps", "8", "--out", tmp_path / "profile", *SCRIPT]]
    torchrun = _torchrun(tmp_path / "torchrun")
    psring_together(*[_launch(args[0], tmp_path / name, *args[1:])
                      + (["--accumulate", "2"] if name in accumulate else [])
                      for name, args in runs.items()], *others, timeout=220)
    _, err = torchrun.communicate(timeout=100)
    assert torchrun.returncode == 0, err[-3000:]
    assert _session_gone(torchrun.pid)  # (its workers' command lines name no run dir)
    runs["torchrun"] = ("allreduce",)  # (the same script under torchrun: 2 ranks)
    reference = load_model(tmp_path / "profile")  # (single, traced)
    for name in runs:
        out = tmp_path / name
        assert max_rel_diff(load_model(out), reference) < 1e-4, name
        _check_records(out, name)
    assert len(read_steps(tmp_path / "sched")) == 16
    prof = Profile.from_run(tmp_path / "profile")
    # the script's model (16 -> 32 -> 1): its four tensors' bytes, not psring's mlp
    assert prof.param_bytes == [16 * 32 * 4, 32 * 4, 32 * 4, 4]
    assert prof.batch_size == 32 and all(t >= 0 for t in prof.ready_s)
    assert (tmp_path / "profile" / "trace.json").exists()
    assert_no_processes(tmp_path)


def _torchrun(out) -> subprocess.Popen:
    """The script under torchrun (one node, two ranks, allreduce), started."""
    import os
    from pathlib import Path

    from psring.runtime.process import free_port

    env = {**os.environ, "PSRING_RUN_ARGS": f"--strategy allreduce --steps 8 --threads 1 "
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
    import time
    from pathlib import Path

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


def _check_records(out, name: str) -> None:
    """Every worker's steps recorded, phases that add up, evaluations, the manifest."""
    steps = read_steps(out)
    assert sorted((r["worker"], r["step"]) for r in steps) == \
        [(w, s) for w in (0, 1) for s in range(8)]
    for r in steps:  # the phases are laps of one clock
        parts = sum(r[p] for p in ("data_s", "forward_s", "backward_s", "comm_s",
                                   "update_s"))
        assert parts == pytest.approx(r["step_s"], abs=2e-4), (name, r)
        assert r["loss"] > 0
    evals = [json.loads(x) for x in (out / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 8] and evals[1]["mse"] < evals[0]["mse"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["model"] == "script script_train.py"
    assert manifest["flops_per_sample"] > 0


@pytest.mark.timeout(120)
def test_what_the_servers_cannot_do_is_refused_and_a_failing_worker_stops_the_run(tmp_path):
    # (an optimizer the servers do not apply: tests/unit/test_library.py)
    cases = {"clip": (_launch("ps", tmp_path / "clip") + ["--clip", "1"],
                      "optimizer.synchronize(): ps sums the gradients on its servers"),
             "schedule": (_launch("ps", tmp_path / "schedule") + ["--schedule"],
                          "lr 0.1 -> 0.05; an LR scheduler?"),
             "no_sync": (_launch("allreduce", tmp_path / "no_sync")
                         + ["--accumulate", "2", "--forget-no-sync"],
                         "a second backward in dist.step(0)"),
             "fails": (_launch("allreduce", tmp_path / "fails", "--timeout", "60")
                       + ["--fail-rank", "1"], "worker-1 failed (exit code 3)"),
             # forked, as `python script.py` would run it
             "exits": (["launch", "--strategy", "single", "--out", tmp_path / "exits", "--",
                        "python", TESTS / "helpers" / "script_exits.py"],
                       "file absolute: True; path[0] is its folder: True\n"
                       "a message for the user\nexit handler ran")}
    procs = {name: subprocess.Popen([*PSRING, *map(str, args)], stderr=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, text=True)
             for name, (args, _) in cases.items()}
    errs = {}
    for name, (_, says) in cases.items():
        _, errs[name] = procs[name].communicate(timeout=100)
        assert procs[name].returncode == 1, errs[name]
        assert says in errs[name], errs[name]
    assert "failing on purpose" in errs["fails"]  # (the failed worker's last lines)
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
