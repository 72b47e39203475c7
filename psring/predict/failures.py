"""What failures cost a strategy over a long job: ``psring advise --mtbf HOURS``.

    from psring.predict.failures import Failures, with_failures
    f = Failures(mtbf_s=50_000 * 3600, checkpoint_s=1800, restart_s=120, job_s=24 * 3600)
    step, why = with_failures(0.335, caps, workers=16, servers=2, f=f)

A first-order model (Young 1974, Daly 2006: the expected cost of a failure is the
restart plus half the work since the last checkpoint), from each process failing
independently at rate 1/MTBF:

- a strategy that must restart on any failure (every ring; ``ps`` and ``byteps``
  without backups; any strategy when a server dies) loses, per failure, the restart
  and on average half a checkpoint interval: its expected time per step is
  ``step × (1 + λ (R + C/2))`` with λ the failures per second of all its processes;
- a strategy that goes on without a lost worker (``async-ps``:
  Capabilities.survives_lost_workers) pays nothing at once for a worker's failure, but
  trains on with one worker fewer until the job ends; over a job of length T a worker
  is lost for T / MTBF of it in expectation, so the mean share of its n workers left
  is ``1 − (n − 1)/n · T / (2 MTBF)`` (first order, at least a half), and its step
  counts per sample by that share; its servers' failures restart it, and so does
  worker 0's (it writes the model and the evaluations: Capabilities.may_lose).

Where λ (R + C/2) or T / MTBF is not small the first-order figures understate the cost;
the sentence says so. Measured what one failure costs each strategy on this machine:
experiments/faults.toml (docs/results/2026-11-26-redesign-host-model-faults-svm.md,
"Faults as a comparison axis").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Failures:
    """The failure rate and what a failure costs, on the job's clock (seconds)."""

    #: mean time between failures of one process (a worker or a server)
    mtbf_s: float
    #: interval between checkpoints: on average half of it is redone after a restart
    checkpoint_s: float = 1800.0
    #: a restart's own cost: processes started again, rendezvous, the checkpoint loaded
    restart_s: float = 120.0
    #: the job's length: how long a strategy that goes on without a worker trains short
    job_s: float = 24 * 3600.0

    def __post_init__(self) -> None:
        for name in ("mtbf_s", "checkpoint_s", "job_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)!r}")
        if self.restart_s < 0:
            raise ValueError(f"restart_s must be at least 0, not {self.restart_s!r}")


def with_failures(step_s: float, caps: Any, workers: int, servers: int,
                  f: Failures) -> tuple[float, str]:
    """The expected time per step of a strategy whose step without failures is
    ``step_s``, with ``workers`` workers and ``servers`` servers (0 for none), and a
    sentence on what its failures cost (the module docstring)."""
    per_s = 1.0 / f.mtbf_s
    lost = f.restart_s + f.checkpoint_s / 2  # what a restart costs, on average
    # worker 0 writes the model and the evaluations: a run never goes on without it
    # (Capabilities.may_lose), so its failure restarts even a strategy that survives
    survives = bool(getattr(caps, "survives_lost_workers", False)) and workers > 1
    restarting = ((servers + 1) if survives else workers + servers) * per_s
    slow = 1.0 + restarting * lost
    alive = 1.0
    if survives:  # each other worker lost for T/MTBF of the job, in expectation
        alive = max(0.5, 1.0 - (workers - 1) / workers * per_s * f.job_s / 2)
    step = step_s * slow / alive
    parts = []
    if restarting:
        parts.append(f"{restarting * 86400:.2g} restarts a day, each {lost / 60:.0f} min "
                     f"lost (+{slow - 1:.1%})")
    if survives:
        parts.append(f"goes on without a lost worker: on average {alive:.0%} of its "
                     f"workers over the job")
    rough = restarting * lost > 0.1 or (survives and per_s * f.job_s > 0.2)
    why = "; ".join(parts) + (" (first order: a rough figure at this failure rate)"
                              if rough else "")
    return step, why
