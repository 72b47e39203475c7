"""Fail-stop for real: SIGKILL one worker or one parameter server mid-run, and the whole
run comes down within seconds, naming who died and how, leaving no process behind."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import SMALL, assert_no_processes, process_named, zygote


def wait_for_training(proc: subprocess.Popen, out: Path, timeout: float = 60) -> None:
    """Until some steps are logged (the run is training), failing if it exits first."""
    deadline = time.monotonic() + timeout
    while not (out / "steps.jsonl").exists() or (out / "steps.jsonl").stat().st_size < 2000:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never started training"
        time.sleep(0.05)


def start_and_kill(tmp_path: Path, args: list, name: str, sig: int = signal.SIGKILL):
    """Start a long run, wait until it trains, send ``sig`` to one of its processes (by
    name); return (exit code, stderr, seconds it took)."""
    out = tmp_path / "run"
    proc = zygote.start(["run", *args, "--steps", "1000000", "--out", out],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_training(proc, out)
        victim = process_named(out, name)
        assert victim is not None
        t0 = time.monotonic()
        os.kill(victim, sig)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_no_processes(out)
    return proc.returncode, err, elapsed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,victim", [("allreduce", "worker-1"), ("ps", "server-0")])
def test_sigkill_of_a_process_mid_step_stops_the_run(tmp_path, strategy, victim):
    code, err, elapsed = start_and_kill(
        tmp_path, ["--strategy", strategy, "--workers", 2, *SMALL], victim)
    assert code == 1
    assert f"{victim} failed (killed by SIGKILL)" in err
    assert elapsed < 15  # the launcher polls; the survivors are stopped, not waited for


@pytest.mark.timeout(120)
def test_a_hung_worker_fails_the_run_at_the_deadline_naming_what_was_awaited(tmp_path):
    """SIGSTOP (a hang, not a death): the survivor's collective times out after
    --timeout and the run fails saying what it waited for."""
    code, err, elapsed = start_and_kill(
        tmp_path, ["--strategy", "allreduce", "--workers", 2, *SMALL, "--timeout", 4],
        "worker-1", sig=signal.SIGSTOP)
    assert code == 1
    assert "no progress within --timeout 4 s while waiting for the other workers' gradients" \
        in err
    assert 3.5 < elapsed < 30  # the deadline, then the stopped worker is SIGKILLed
