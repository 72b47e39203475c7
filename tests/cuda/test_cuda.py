"""psring's CUDA paths on a real GPU: every strategy one GPU allows, run through the CLI
and checked against ``single`` on CUDA; the backend chosen when workers share a GPU;
compression, Adasum, checkpoints, device mode from a GPU profile, and what the phase
timings mean on an asynchronous device. Skipped, with the reason, where torch sees no
GPU (CI, this project's own machine); run on a GPU machine by benchmarks/gpu_check.sh.

    pytest tests/cuda -n 4 --dist loadgroup

Tolerances: the MLP's float32 matrix products run as float32 on CUDA (torch leaves
``allow_tf32`` off for matmuls), so the workers' sums differ from ``single``'s only in
their order: 1e-4 relative, as on the CPU.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    SMALL,
    assert_no_processes,
    load_model,
    max_rel_diff,
    once_across_workers,
    psring,
    psring_together,
    read_steps,
)

pytestmark = [
    pytest.mark.cuda,
    # one xdist worker for all where xdist can (pytest < 9.2): the timed ones run alone
    pytest.mark.xdist_group("cuda"),
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="torch sees no CUDA device here (a CPU build, or no GPU): the "
                              "CUDA paths run on a GPU machine (benchmarks/gpu_check.sh)"),
]

CUDA = (*SMALL, "--device", "cuda", "--threads", "1")
PHASES = ("data_s", "forward_s", "backward_s", "comm_s", "update_s")

#: (name, strategy, workers, extra flags): every synchronous CUDA path one GPU allows.
#: One worker: NCCL at world size 1; two and four share the GPU over gloo.
SYNC_RUNS = [
    ("allreduce-1", "allreduce", 1, ()),
    ("ddp-1", "ddp", 1, ()),
    ("hallreduce-1", "hallreduce", 1, ()),
    ("byteps-1", "byteps", 1, ()),
    ("ps-1", "ps", 1, ()),
    ("allreduce-2", "allreduce", 2, ()),
    ("allreduce-4", "allreduce", 4, ()),
    ("ddp-2", "ddp", 2, ()),
    ("hallreduce-4", "hallreduce", 4, ("--hosts", "1")),
    ("byteps-2", "byteps", 2, ()),
    ("byteps-2-worker", "byteps", 2, ("--update-on", "worker")),
    ("ps-2", "ps", 2, ()),
    ("ps-2-shards", "ps", 2, ("--servers", "2")),
]


@pytest.fixture(scope="session")
def cuda_runs(tmp_path_factory) -> dict[str, Path]:
    """single on CUDA and every run of SYNC_RUNS, started together (their numbers are
    compared, not their times), plus async-ps and hogwild under --device auto; once
    per session, whichever xdist worker asks first."""
    def make(root: Path) -> dict:
        runs = {"single": ["run", "--strategy", "single", "--workers", 1, *CUDA]}
        for name, strategy, workers, extra in SYNC_RUNS:
            runs[name] = ["run", "--strategy", strategy, "--workers", workers, *CUDA, *extra]
        runs["async-ps-2"] = ["run", "--strategy", "async-ps", "--workers", 2, *CUDA]
        runs["hogwild-auto"] = ["run", "--strategy", "hogwild", "--workers", 2, *SMALL]
        psring_together(*([*args, "--out", root / name] for name, args in runs.items()),
                        timeout=400)
        assert_no_processes(str(root))
        return {name: str(root / name) for name in runs}

    return {k: Path(v) for k, v in once_across_workers(tmp_path_factory, "cuda",
                                                       make).items()}


def manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def worker_log(run: Path, rank: int = 0) -> str:
    return (run / "logs" / f"worker-{rank}.log").read_text()


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name,strategy,workers,extra", SYNC_RUNS,
                         ids=[r[0] for r in SYNC_RUNS])
def test_every_synchronous_strategy_ends_as_single_does_on_cuda(cuda_runs, name, strategy,
                                                                workers, extra):
    got, ref = load_model(cuda_runs[name]), load_model(cuda_runs["single"])
    assert max_rel_diff(got, ref) < 1e-4
    m = manifest(cuda_runs[name])
    assert m["device"] == "cuda" and m["accelerator"]["name"]
    records = read_steps(cuda_runs[name])
    assert len(records) == 12 * workers
    for r in records:  # the phases still add up to the step on an asynchronous device
        assert abs(sum(r[p] for p in PHASES) - r["step_s"]) <= 0.05 * r["step_s"] + 1e-4, r


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name,backend", [("allreduce-1", "nccl"), ("ddp-1", "nccl"),
                                          ("allreduce-2", "gloo"), ("hallreduce-4", "gloo"),
                                          ("byteps-2", "gloo")])
def test_workers_sharing_one_gpu_use_gloo_and_say_why(cuda_runs, name, backend):
    log = worker_log(cuda_runs[name])
    assert f"joining process group ({backend}:" in log
    if backend == "gloo":
        assert "NCCL takes one rank per GPU" in log


@pytest.mark.timeout(500)
def test_async_ps_learns_and_hogwild_runs_on_the_cpu_under_auto(cuda_runs):
    records = read_steps(cuda_runs["async-ps-2"])
    assert len(records) == 24
    first = statistics.mean(r["loss"] for r in records if r["step"] < 3)
    last = statistics.mean(r["loss"] for r in records if r["step"] >= 9)
    assert last < first
    assert manifest(cuda_runs["hogwild-auto"])["device"] == "cpu"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_compression_adasum_and_resume_on_cuda(tmp_path, cuda_runs):
    """fp16/bf16 gradients (allreduce over gloo, ps), Adasum between two workers sharing
    the GPU (gloo's point-to-point through host memory) against the same on the CPU, and
    a run resumed from its checkpoint against one never interrupted."""
    runs = {
        "ar-fp16": ["--strategy", "allreduce", "--workers", 2, *CUDA, "--compress", "fp16"],
        "ar-bf16": ["--strategy", "allreduce", "--workers", 2, *CUDA, "--compress", "bf16"],
        "ps-bf16": ["--strategy", "ps", "--workers", 2, *CUDA, "--compress", "bf16"],
        "adasum-cuda": ["--strategy", "allreduce", "--workers", 2, *CUDA,
                        "--reduce", "adasum"],
        "adasum-cpu": ["--strategy", "allreduce", "--workers", 2, *SMALL, "--device", "cpu",
                       "--reduce", "adasum"],
        "first-half": ["--strategy", "allreduce", "--workers", 2, *CUDA, "--steps", 6,
                       "--checkpoint-every", 3],
    }
    psring_together(*(["run", *args, "--out", tmp_path / n] for n, args in runs.items()),
                    timeout=300)
    psring("run", "--resume", tmp_path / "first-half", "--steps", 12, timeout=200)
    assert_no_processes(str(tmp_path))
    ref = load_model(cuda_runs["single"])
    for name, eps in (("ar-fp16", 2.0**-11), ("ar-bf16", 2.0**-8), ("ps-bf16", 2.0**-8)):
        got = load_model(tmp_path / name)
        rel = max(((got[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)
        assert rel < 2 * 12 * eps, name
    assert max_rel_diff(load_model(tmp_path / "adasum-cuda"),
                        load_model(tmp_path / "adasum-cpu")) < 1e-4
    assert max_rel_diff(load_model(tmp_path / "first-half"), load_model(cuda_runs["allreduce-2"])) \
        < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_profile_on_the_gpu_and_device_mode_from_it(tmp_path):
    """A GPU profile names its GPU, places the last gradient near backward's end (CUDA
    events, not the hooks' queueing times), and drives a device-mode run, which runs on
    the CPU under --device auto."""
    out = tmp_path / "prof"
    psring("profile", "--device", "cuda", "--model", "resnet18", "--image-size", "64",
           "--batch-size", "32", "--steps", "8", "--out", out, timeout=300)
    prof = json.loads((out / "profile.json").read_text())
    assert prof["source"]["device"] == "cuda" and prof["source"]["accelerator"]["name"]
    assert max(prof["ready_s"]) >= 0.8 * prof["backward_s"], prof["ready_s"]
    assert prof["ready_s"] != sorted(prof["ready_s"])  # resnet's last layers are ready first
    dm = tmp_path / "device-mode"
    psring("run", "--strategy", "allreduce", "--workers", 2, "--compute", "device",
           "--device-profile", out / "profile.json", "--model", "resnet18", "--image-size",
           "32", "--batch-size", "64", "--samples", "256", "--eval-samples", "0",
           "--steps", "4", "--out", dm, timeout=300)
    assert manifest(dm)["device"] == "cpu"
    assert_no_processes(str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_phase_times_mean_the_same_on_cuda(tmp_path):
    """One-worker allreduce and ddp on a large MLP agree on backward (NCCL's stream is
    not synchronized into it), and --slow-worker 0:3 triples forward + backward (the
    sleep comes after the forward's kernels are done, not after they are queued)."""
    big = ("--model", "mlp", "--width", "4096", "--depth", "6", "--features", "1024",
           "--batch-size", "512", "--steps", "16", "--device", "cuda", "--threads", "1",
           "--eval-samples", "0")
    runs = {"allreduce": ["--strategy", "allreduce"], "ddp": ["--strategy", "ddp"],
            "single": ["--strategy", "single"],
            "slow": ["--strategy", "single", "--slow-worker", "0:3"]}
    for name, args in runs.items():  # one at a time: these are timed
        psring("run", *args, "--workers", 1, *big, "--out", tmp_path / name, timeout=200)
    assert_no_processes(str(tmp_path))

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in read_steps(tmp_path / name)[4:])

    assert med("allreduce", "backward_s") == pytest.approx(med("ddp", "backward_s"), rel=0.25)
    compute = {n: med(n, "forward_s") + med(n, "backward_s") for n in ("single", "slow")}
    assert 2.2 < compute["slow"] / compute["single"] < 4.0, compute


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_examples_run_on_cuda_and_train_singles_model(tmp_path, monkeypatch):
    """The three example scripts under psring launch on the GPU (inputs, held-out sets
    and labels moved by the wrapped model and dist.to_device), each strategy against
    the same script under single on CUDA; ddp_style with its clip and GradScaler where
    the workers update."""
    # cuDNN runs float32 convolutions in TF32 unless told not to (torch's default,
    # cudnn.allow_tf32): with 10 mantissa bits, two workers' half batches and single's
    # whole one round apart at ~1e-3 (digits.py, seen on an H100). Parity is checked in
    # float32 proper; docs/your-script.md states the TF32 caveat.
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    examples = Path(__file__).resolve().parents[2] / "examples"
    runs, pairs = [], []
    for script, flags in (("digits.py", ["--epochs", "1"]), ("ddp_style.py", []),
                          ("accelerate_style.py", [])):
        for strategy, extra in (("single", ["--workers", "1"]), ("allreduce", []),
                                ("ps", ["--servers", "2"]),
                                ("byteps", ["--update-on", "worker"])):
            edits = ["--clip", "0", "--no-scaler"] if script == "ddp_style.py" \
                and strategy == "ps" else []
            name = f"{script[:-3]}-{strategy}{'-plain' if edits else ''}"
            runs.append(["launch", "--strategy", strategy, "--workers", "2", *extra,
                         "--device", "cuda", "--out", tmp_path / name, "--", "python",
                         examples / script, *flags, *edits])
            pairs.append((name, f"{script[:-3]}-single"))
        if script == "ddp_style.py":  # (ps's reference: the same edits off)
            runs.append(["launch", "--strategy", "single", "--device", "cuda", "--out",
                         tmp_path / "ddp_style-single-plain", "--", "python",
                         examples / script, "--clip", "0", "--no-scaler"])
    psring_together(*runs, timeout=380)
    diffs = {}
    for name, ref in pairs:
        ref = ref + ("-plain" if name.endswith("-plain") else "")
        diffs[name] = max_rel_diff(load_model(tmp_path / name), load_model(tmp_path / ref))
        assert manifest(tmp_path / name)["device"].startswith("cuda"), name
    print("relative difference from single:", diffs)
    assert all(d < 1e-4 for d in diffs.values()), diffs
    assert_no_processes(str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_compare_runs_on_cuda_and_reports_every_strategy(tmp_path):
    """`psring compare` on the GPU machine (its figures of record are gpu_check.sh's,
    run alone): every strategy finishes, on CUDA where it can (hogwild on the CPU), and
    the report predicts each one."""
    psring("compare", "--repeats", "1", "--out", tmp_path / "cmp", timeout=380)
    report = (tmp_path / "cmp" / "report.md").read_text()
    assert "## Step-time prediction" in report
    points = [d for d in (tmp_path / "cmp").iterdir() if (d / "manifest.json").is_file()]
    assert len(points) >= 8
    for d in points:
        device = json.loads((d / "manifest.json").read_text())["device"]
        assert device.startswith("cpu" if "hogwild" in d.name else "cuda"), (d.name, device)
    assert_no_processes(str(tmp_path))
