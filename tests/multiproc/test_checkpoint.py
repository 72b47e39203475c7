"""Checkpoints: atomic, verified, refused when torn or tampered with; a run killed with
SIGKILL and resumed ends with exactly the parameters of a run never interrupted."""

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from psring.errors import ConfigError
from psring.train import checkpoint
from tests.helpers import (
    SMALL,
    assert_no_processes,
    cli_here,
    load_model,
    max_rel_diff,
    psring,
    read_evals,
    read_steps,
    zygote,
)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model/w": torch.randn(100, generator=g), "momentum/w": torch.randn(100, generator=g)}


def test_save_verify_and_prune(tmp_path):
    for step in (5, 10, 15):
        checkpoint.save(tmp_path, step, tensors(step), {"note": step})
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000010", "step-00000015"]  # the two newest are kept
    ck = checkpoint.latest(tmp_path)
    assert ck.step == 15 and ck.meta == {"note": 15}
    assert torch.equal(ck.tensors["model/w"], tensors(15)["model/w"])


def test_torn_checkpoint_is_ignored_and_tampered_one_refused(tmp_path):
    checkpoint.save(tmp_path, 10, tensors(10))
    checkpoint.save(tmp_path, 20, tensors(20))
    # a crash between state.pt and its commit mark: step 30 is ignored
    torn = tmp_path / "checkpoints" / "step-00000030"
    torn.mkdir()
    (torn / "state.pt").write_bytes(b"half a file")
    # step 20's data changed after it was committed: refused, step 10 used
    state = tmp_path / "checkpoints" / "step-00000020" / "state.pt"
    data = bytearray(state.read_bytes())
    data[-20] ^= 0xFF
    state.write_bytes(bytes(data))
    refused = []
    ck = checkpoint.latest(tmp_path, log=refused.append)
    assert ck.step == 10
    assert "no checkpoint.json" in refused[0] and "SHA-256" in refused[1]
    # nothing usable at all: a clear error, not a silent fresh start
    (tmp_path / "checkpoints" / "step-00000010" / "checkpoint.json").write_text("{")
    with pytest.raises(ConfigError, match="no usable checkpoint"):
        checkpoint.latest(tmp_path)


def test_a_pickle_in_a_checkpoint_is_not_loaded(tmp_path):
    """state.pt is loaded with weights_only=True, even when its hash matches."""
    d = checkpoint.save(tmp_path, 1, tensors(1))

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    torch.save({"model/w": Evil()}, d / "state.pt")
    info = json.loads((d / "checkpoint.json").read_text())
    import hashlib

    raw = (d / "state.pt").read_bytes()
    info["files"]["state.pt"] = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    (d / "checkpoint.json").write_text(json.dumps(info))
    with pytest.raises(ConfigError, match="weights_only"):
        checkpoint.verify(d)
    assert not (tmp_path / "pwned").exists()


def test_resume_refuses_clearly(tmp_path):
    out = tmp_path / "plain"
    psring("run", "--strategy", "single", *SMALL, "--out", out)
    proc = cli_here("run", "--resume", out)
    assert proc.returncode == 2 and "--checkpoint-every" in proc.stderr
    proc = cli_here("run", "--resume", tmp_path / "nothing")
    assert proc.returncode == 2 and "not a psring run directory" in proc.stderr
    proc = cli_here("run", "--strategy", "single", *SMALL, "--checkpoint-every", -1,
                    "--out", tmp_path / "neg")
    assert proc.returncode == 2 and "--checkpoint-every must be >= 0" in proc.stderr


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy, extra", [("allreduce", []), ("ddp", []),
                                             ("ps", ["--servers", 2])])
def test_sigkilled_run_resumes_to_exactly_the_uninterrupted_parameters(tmp_path, strategy,
                                                                       extra):
    # 40 steps: the kill lands after the step-20 checkpoint with 20 slowed steps to go
    steps, every = 40, 10
    args = ["--strategy", strategy, "--workers", 2, *SMALL, *extra, "--steps", steps,
            "--checkpoint-every", every, "--eval-every", every]
    # the uninterrupted reference runs meanwhile: only its parameters are compared
    ref = tmp_path / "ref"
    ref_proc = zygote.start(["run", *args, "--out", ref], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)

    out = tmp_path / "killed"
    # worker 1 slowed (a sleep; the arithmetic is unchanged) so the kill lands mid-run
    proc = zygote.start(["run", *args, "--slow-worker", "1:25", "--out", out],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / f"step-{2 * every:08d}" / "checkpoint.json").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # the launcher: no cleanup code runs
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            _, err = ref_proc.communicate(timeout=120)
        finally:
            if ref_proc.poll() is None:
                ref_proc.kill()
    assert ref_proc.returncode == 0, err
    # its workers (and servers) notice (parent-death signal) and exit
    assert_no_processes(out, within=15)
    assert not (out / "model.pt").exists()
    killed_at = max(r["step"] for r in read_steps(out))
    assert killed_at < steps - 1

    # a flag given on resume overrides the run's: the slowdown only placed the kill
    res = psring("run", "--resume", out, "--slow-worker", "1:1", timeout=120)
    assert "resuming" in res.stderr
    assert_no_processes(out)
    records = read_steps(out)
    # every step exactly once per worker: the steps after the checkpoint were rerun
    assert sorted((r["step"], r["worker"]) for r in records) == \
        [(s, w) for s in range(steps) for w in range(2)]
    assert max_rel_diff(load_model(out), load_model(ref)) == 0.0
    # every evaluation exactly once, the same results as the uninterrupted run's, and
    # the training clock continued from the checkpoint's
    evals, ref_evals = read_evals(out), read_evals(ref)
    assert [e["step"] for e in evals] == [e["step"] for e in ref_evals] == \
        list(range(0, steps + 1, 10))
    assert [e["accuracy"] for e in evals] == [e["accuracy"] for e in ref_evals]
    assert all(a["train_s"] < b["train_s"] for a, b in zip(evals, evals[1:]))


@pytest.mark.timeout(240)
def test_kills_at_any_moment_never_leave_a_bad_checkpoint_in_use(tmp_path):
    """Checkpoint every step (a ~9 MB state: each write takes a while) and SIGKILL the
    whole run at assorted moments: whatever the kill interrupted, the newest checkpoint
    that is used verifies, and a resume from it works."""
    for i, delay in enumerate((0.4, 1.3)):
        out = tmp_path / f"k{i}"
        proc = zygote.start(["run", "--strategy", "allreduce", "--workers", "2",
                             "--width", "1024", "--depth", "3", "--batch-size", "16",
                             "--steps", "100000", "--checkpoint-every", "1", "--out", out],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 90
            while not list((out / "checkpoints").glob("*/checkpoint.json")):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "no checkpoint was written"
                time.sleep(0.02)
            time.sleep(delay)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert_no_processes(out, within=15)
        ck = checkpoint.latest(out)  # raises if nothing usable
        assert ck is not None and ck.step >= 1
        assert any(k.startswith("model/") for k in ck.tensors)
        assert any(k.startswith("momentum/") for k in ck.tensors)
    res = psring("run", "--resume", out, "--steps", ck.step + 2, timeout=120)
    assert "resuming" in res.stderr
    assert_no_processes(out)
    assert (out / "model.pt").exists()
