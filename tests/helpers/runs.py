"""Run psring as a user would (a subprocess, or its CLI in this process), prove that a
run's processes are gone afterwards, and read what a run wrote.

    from tests.helpers import SMALL, assert_no_processes, psring

    psring("run", "--strategy", "allreduce", "--workers", 2, *SMALL, "--out", out)
    assert_no_processes(out)
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.helpers import zygote

#: tests/, where the test plugins (tests/plugins) live
TESTS = Path(__file__).resolve().parents[1]
PSRING = [sys.executable, "-m", "psring"]


def env_with_plugins() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS / "plugins"),
                                                      env.get("PYTHONPATH", "")]))
    env["PSRING_PLUGINS"] = "faulty"
    return env


def psring(*args: str, timeout: float = 120, env: dict | None = None,
           check: bool = True) -> subprocess.CompletedProcess:
    """Run the psring CLI; the run's own hard deadline is ``timeout`` seconds."""
    p = zygote.start(list(args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        _stopped(p)
    if check and p.returncode != 0:
        raise AssertionError(f"psring {' '.join(map(str, args))} exited {p.returncode}:\n"
                             f"{out}\n{err}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _stopped(p) -> None:
    """A command still running (its deadline passed, or the test failed): SIGTERM, so
    the launcher stops what it started, then SIGKILL."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def psring_together(*runs: list, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Several psring commands at once, each one's exit checked: for runs whose numbers
    (parameters, records) are compared, never their times; on 2 cores their interpreter
    starts and torch imports overlap with each other's communication waits."""
    procs = [zygote.start(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for args in runs]
    deadline = time.monotonic() + timeout  # one deadline for all of them
    done = []
    try:
        for args, p in zip(runs, procs):
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            if p.returncode != 0:
                raise AssertionError(f"psring {' '.join(map(str, args))} exited "
                                     f"{p.returncode}:\n{out}\n{err}")
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        # SIGTERM first: a launcher stops its workers and tears its emulated hosts down
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            _stopped(p)
    return done


def cli_here(*args: str) -> subprocess.CompletedProcess:
    """The psring CLI called in this process (``psring.cli.main``) with input it must
    refuse before starting anything: the same code as the command, without a new
    interpreter's torch import (~1.2 s here) per case. The refusal's exit status through
    a real process is checked once per command (tests/multiproc/test_cli.py)."""
    import contextlib
    import io

    from psring.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess(["psring", *map(str, args)], code, out.getvalue(),
                                       err.getvalue())


def interruptible() -> None:
    """Popen preexec_fn: give the child the default SIGINT disposition. A test runner
    started as a background job (``cmd &`` without job control) ignores SIGINT, its
    children inherit that, and Python then never raises KeyboardInterrupt: a Ctrl-C
    test would test nothing."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def live_processes() -> list[tuple[int, list[str], str]]:
    """Every live (not zombie) process but this one, from /proc: (pid, the fields of its
    stat after the command's name — state, ppid, pgrp, session, ... —, its command
    line with spaces for NULs)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text().split(") ", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if stat[0] != "Z":
            found.append((int(entry.name), stat, cmd))
    return found


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """Live processes whose command line contains ``text`` (e.g. a test's run directory)."""
    return [(pid, cmd) for pid, _, cmd in live_processes() if text in cmd]


def process_named(run_dir, name: str) -> int | None:
    """The run's live process named ``name`` (worker-1, server-0: its /proc/PID/comm,
    which the worker and server entry points set whether forked or started anew)."""
    for pid, _ in processes_mentioning(str(run_dir)):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                return pid
        except OSError:
            continue
    return None


def assert_no_processes(text: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while True:
        left = processes_mentioning(str(text))
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes left behind: {left}")
        time.sleep(0.1)


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except OSError:
        return False
    return state != "Z"


def load_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(Path(run_dir) / "model.pt", map_location="cpu", weights_only=True)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor max|a-b| / max|b| over all parameters."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item()
               for k in a)


def read_steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "steps.jsonl").read_text().splitlines()]


#: a small, fast workload shared by the multi-process tests
SMALL = ("--model", "mlp", "--width", "256", "--depth", "2", "--features", "64",
         "--batch-size", "32", "--steps", "12", "--lr", "0.1", "--bucket-mb", "0.1")


def read_evals(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "evals.jsonl").read_text().splitlines()]


def assert_evals(run_dir: Path, steps: int) -> list[dict]:
    """evals.jsonl: the initial model and then every max(1, steps // 10) steps and the
    last, rank 0's training time growing, accuracy a fraction, and learning seen."""
    evals = read_evals(run_dir)
    every = max(1, steps // 10)
    assert [e["step"] for e in evals] == sorted({*range(0, steps + 1, every), steps})
    assert evals[0]["train_s"] == 0.0
    assert all(a["train_s"] < b["train_s"] for a, b in zip(evals, evals[1:]))
    assert all(0 <= e["accuracy"] <= 1 and e["loss"] > 0 and e["eval_s"] > 0 for e in evals)
    # it learned (at some point: asynchronous SGD with momentum may later overshoot)
    assert min(e["loss"] for e in evals[1:]) < evals[0]["loss"]
    assert max(e["accuracy"] for e in evals[1:]) > evals[0]["accuracy"]
    return evals


def once_across_workers(tmp_path_factory, name: str, make) -> dict:
    """``make(folder)`` (which returns a JSON-able dict) once per test session, however
    many xdist workers ask: the first takes a lock beside the workers' temporary
    folders and records the result there; the others wait on the lock and read it.
    (xdist's --dist loadgroup would send a fixture's users to one worker, but under
    pytest 9.2 its group no longer reaches the scheduler: a shared run ran twice.)"""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / f"once-{name}"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = folder / "result.json"
        if done.exists():
            return json.loads(done.read_text())
        folder.mkdir(parents=True, exist_ok=True)
        result = make(folder)
        tmp = done.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, done)
        return result
