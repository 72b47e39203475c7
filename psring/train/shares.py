"""How a run's global batch is split among its workers: equal shares, checked
(:func:`check_global_batch`), or shares in proportion to the speeds measured in an
earlier run (:func:`proportional_shares`, ``--worker-batch proportional:RUN_DIR``).

    psring run --strategy allreduce --workers 2 --slow-worker 1:3 --out runs/even
    psring run ... --worker-batch proportional:runs/even     # shares from runs/even
"""

from __future__ import annotations

import math
from pathlib import Path

from psring.errors import ConfigError
from psring.records.runlog import read_manifest, read_steps, shares_of, warmup_steps


def gradient_weight(cfg, rank: int, world: int) -> float | None:
    """--worker-batch: what this worker's mean loss over its n samples is weighed by,
    n / (B / N): every synchronous strategy averages N workers' gradients, so the
    average is then the global batch's mean gradient, what single computes. None with
    equal shares."""
    if not cfg.worker_batch:
        return None
    return world * cfg.worker_batches[rank] / cfg.batch_size


def proportional_shares(run_dir: str, batch_size: int, workers: int) -> list[int]:
    """Shares of ``batch_size`` in proportion to each worker's speed in the run in
    ``run_dir``: samples per second, its share there over its median forward + backward
    time a step (warm-up left out), rounded by largest remainder, at least 1 each."""

    records = read_steps(Path(run_dir))
    if not records:
        raise ConfigError(f"--worker-batch proportional:{run_dir}: no step records there; "
                          f"name the run directory of an earlier run of these workers.")
    kept = [r for r in records if r["step"] >= warmup_steps(max(r["step"] for r in records) + 1)]
    by_worker: dict[int, list[float]] = {}
    for r in kept or records:
        by_worker.setdefault(r["worker"], []).append(r["forward_s"] + r["backward_s"])
    if sorted(by_worker) != list(range(workers)):
        raise ConfigError(f"--worker-batch proportional:{run_dir}: that run had "
                          f"{len(by_worker)} worker(s), this one {workers}; measure with "
                          f"the same --workers.")
    try:  # the shares that run computed (an earlier uneven run measures per sample too)
        before = shares_of(read_manifest(Path(run_dir))["config"])
    except Exception:  # noqa: BLE001 - step records without a manifest: equal shares
        before = [1] * workers
    speed = [before[w] / max(sorted(v)[len(v) // 2], 1e-9)
             for w, v in sorted(by_worker.items())]
    if batch_size < workers:
        raise ConfigError(f"--batch-size {batch_size} cannot give {workers} workers a "
                          f"sample each.")
    # in proportion, rounded down, then the samples left by largest remainder; a worker
    # so slow its share rounds to 0 still gets one (taken from the largest share)
    exact = [batch_size * s / sum(speed) for s in speed]
    shares = [max(1, int(e)) for e in exact]
    for i in sorted(range(workers), key=lambda i: int(exact[i]) - exact[i]):
        if sum(shares) >= batch_size:
            break
        shares[i] += 1
    while sum(shares) > batch_size:
        shares[shares.index(max(shares))] -= 1
    return shares


def check_global_batch(batch_size: int, workers: int) -> None:
    """--batch-size is the global batch: a positive multiple of the workers, so each
    gets an equal slice; else a ConfigError that suggests the next one."""
    if batch_size < 1 or batch_size % workers:
        raise ConfigError(
            f"--batch-size {batch_size} is the global batch and must be a positive "
            f"multiple of --workers {workers}, so each worker gets an equal slice; "
            f"try --batch-size {max(1, math.ceil(max(batch_size, 1) / workers)) * workers}.")
