"""The CLI as a user meets it: bad input is one paragraph and a non-zero exit, never a
traceback; a failing worker fails the run quickly and leaves no process behind."""

import socket
import time

import pytest
import torch

from tests.helpers import (
    SMALL,
    assert_no_processes,
    cli_here,
    env_with_plugins,
    interruptible,
    psring,
)


def assert_clean_error(proc, needle):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert needle in proc.stderr, proc.stderr
    err_lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("psring: error:")]
    assert len(err_lines) == 1, proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, needle", [
    (["--strategy", "warp-drive"], "valid strategy names are: single, allreduce, ddp"),
    (["--model", "bert"], "valid model names are: mlp, cnn, svm, resnet18"),
    (["--model", "no_such_pkg.mod:build"], "cannot import 'no_such_pkg.mod'"),
    (["--model", "vgg16", "--image-size", "16"], "--image-size must be at least 32"),
    (["--target-accuracy", "90"], "fraction of the held-out rows"),
    (["--strategy", "allreduce", "--workers", "0"], "--workers must be at least 1"),
    (["--strategy", "allreduce", "--workers", "3", "--batch-size", "32"],
     "multiple of --workers 3"),
    (["--model", "cnn", "--features", "50"], "perfect square"),
])
def test_bad_input_is_a_clear_error(tmp_path, args, needle):
    proc = cli_here("run", *args, "--out", tmp_path / "r")
    assert proc.returncode == 2
    assert_clean_error(proc, needle)
    assert not (tmp_path / "r" / "steps.jsonl").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [
    ["run", "--strategy", "warp-drive"],
    ["advise", "--hosts", "2", "--link", "fast"],
])
def test_a_refusal_through_the_real_command_exits_2(tmp_path, command):
    """The refusals above and in the other files are called in-process (cli_here); the
    command itself, as a user starts it, exits with the same status and paragraph."""
    proc = psring(*command, "--out", tmp_path / "r", check=False, timeout=60)
    assert proc.returncode == 2
    assert_clean_error(proc, "psring: error:")
    assert not (tmp_path / "r").exists()


@pytest.mark.timeout(60)
def test_cuda_requested_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA; this one has a GPU")
    proc = cli_here("run", "--device", "cuda", "--out", tmp_path / "r")
    assert proc.returncode == 2
    assert_clean_error(proc, "--device cpu")


@pytest.mark.timeout(60)
def test_port_in_use_is_reported_before_spawning(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = psring("run", "--strategy", "allreduce", "--workers", 2, "--master-port", port,
                      "--out", tmp_path / "r", check=False)
    assert proc.returncode == 2
    assert_clean_error(proc, f"127.0.0.1:{port} is already in use")
    assert not (tmp_path / "r" / "logs").exists()  # nothing was started


@pytest.mark.timeout(120)
def test_failing_worker_fails_the_run_quickly_with_its_error(tmp_path):
    out = tmp_path / "faulty"
    t0 = time.monotonic()
    proc = psring("run", "--strategy", "faulty", "--workers", 2, *SMALL, "--steps", "50",
                  "--timeout", "600", "--out", out, check=False, env=env_with_plugins())
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1
    assert "worker-1 failed (exit code 1)" in proc.stderr, proc.stderr
    assert "injected failure in worker 1 at step 3" in proc.stderr
    assert "Traceback" not in proc.stderr.split("its last lines:")[0]
    # worker 0 sat in an all-reduce with a 600 s timeout: the launcher stopped it
    assert elapsed < 60
    assert_no_processes(out)


@pytest.mark.timeout(60)
def test_strategies_lists_the_registry():
    out = psring("strategies").stdout
    for name in ("single", "allreduce", "ddp"):
        assert name in out


@pytest.mark.timeout(60)
def test_report_on_nothing_is_a_clear_error(tmp_path):
    proc = cli_here("report", tmp_path)
    assert proc.returncode == 2
    assert_clean_error(proc, "no run directories")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_signal_to_launcher_stops_everything(tmp_path, sig, code):
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "psring", "run", "--strategy", "allreduce",
                             "--workers", "2", *SMALL, "--steps", "100000", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=interruptible)
    try:
        deadline = time.monotonic() + 60
        while not (out / "steps.jsonl").exists() or (out / "steps.jsonl").stat().st_size == 0:
            assert time.monotonic() < deadline, "the run never started training"
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        t0 = time.monotonic()
        os.kill(proc.pid, getattr(signal, sig))
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert time.monotonic() - t0 < 15
    assert "were stopped" in err
    assert_no_processes(out)
