"""What a fault cost a run, read from its logs: what ``psring report SWEEP``'s Faults
section (psring.report.aggregate.fault_rows, for a grid key ``fault`` that names cases:
psring.runs.sweep, as in experiments/faults.toml) sets beside the fault-free run.

    from psring.report.faults import effects
    effects(run_dir, records, cfg)
    # {"fault_step": 10, "recovery_s": 2.4, "steps_redone": 3, "lost_s": 3.1,
    #  "samples_per_s_before": 410.0, "samples_per_s_after": 380.0, "losses": [...], ...}
    tta_with_losses(evals, 0.9, effects(...)["losses"])   # 9.7

Per run (from faults.jsonl, restarts.jsonl, steps.jsonl and evals.jsonl):

- ``recovery_s``: from the first fault placed (the process killed) to the first step
  at or past the one it stopped completed by a worker: a restart's start, the steps it
  redoes and that step again; for a run that goes on without the lost worker, how long
  the survivors stalled;
- ``steps_redone`` and ``lost_s``: each restart's, as :func:`fault_summary` counts them
  for ``psring report``'s line too (from the last step logged before the failure to the
  same step logged again after it);
- ``samples_per_s_before`` / ``_after``: every worker's steps before the fault, and
  after the recovery (a run that lost a worker goes on with fewer), on the wall clock;
- time to the target accuracy with the faults' cost (``tta_with_losses``): the clock at
  the first evaluation that reached it plus the time lost in the restarts before it
  (a restarted run's clock goes on from its checkpoint's, so the work lost and the
  restart itself are not on it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from psring.records.runlog import FAULTS, RESTARTS, read_steps, shares_of


def restart_losses(restarts: list[dict], records: list[dict]) -> list[tuple[float, float]]:
    """Each restart's (time of the restart, seconds lost): from the last step logged
    before the failure to the same step logged again after it (0 when it never was)."""
    out = []
    for r in restarts:
        again = [x["time"] for x in records
                 if x["step"] == r["reached"] - 1 and x["time"] > r["time"]]
        lost = min(again) - r["reached_at"] if again and r["reached"] else 0.0
        out.append((r["time"], lost))
    return out


def fault_summary(run_dir: Path, records: list[dict]) -> dict[str, Any] | None:
    """The faults a run met and its restarts (None: neither), from faults.jsonl and
    restarts.jsonl and the run's step ``records``: the faults' flags (``fired``), the
    processes it went on without (``lost``), the restarts, the steps redone, and the
    seconds lost (``lost_s``; each restart's in ``losses``, restart_losses's)."""
    logged, restarts = read_steps(run_dir, FAULTS), read_steps(run_dir, RESTARTS)
    if not logged and not restarts:
        return None
    losses = restart_losses(restarts, records)
    return {"fired": [f["fault"] for f in logged if "fault" in f],
            "lost": [f["lost"] for f in logged if "lost" in f], "restarts": len(restarts),
            "steps_redone": sum(r["steps_redone"] for r in restarts),
            "lost_s": sum(lost for _, lost in losses), "losses": losses,
            "first": next((f for f in logged if "fault" in f), None)}


def effects(run_dir: Path, records: list[dict], cfg: dict[str, Any]) -> dict[str, Any] | None:
    """What the run's faults cost it (the module docstring): fault_summary's figures
    and the recovery, the fault's step and the throughput before and after; None for a
    run without a fault placed or a restart."""
    out = fault_summary(run_dir, records)
    if out is None:
        return None
    out.update({"fault_step": None, "recovery_s": None,
                "samples_per_s_before": None, "samples_per_s_after": None})
    fired = out.pop("first")
    if fired:
        t_fault, step = fired["time"], int(fired.get("step", 0))
        out["fault_step"] = step
        after = [r["time"] for r in records if r["time"] > t_fault and r["step"] >= step]
        if after:
            out["recovery_s"] = min(after) - t_fault
            # each worker's samples a step (--worker-batch: its share; --accumulate)
            shares = shares_of(cfg)
            per = {w: n * cfg.get("accumulate", 1) for w, n in enumerate(shares)}
            out["samples_per_s_before"] = _rate(
                [r for r in records if r["time"] < t_fault and r["step"] >= 1], per)
            out["samples_per_s_after"] = _rate(
                [r for r in records if r["time"] >= min(after)], per)
    return out


def _rate(records: list[dict], per_worker: dict[int, float]) -> float | None:
    """Samples a second (wall clock) over a span of step records, each a worker's step
    of ``per_worker[worker]`` samples: the steps after the span's first, over the time
    from that first step's end to the last record (None when the span holds one step)."""
    if not records:
        return None
    first = min(r["step"] for r in records)
    first_end = max(r["time"] for r in records if r["step"] == first)
    rest = [r for r in records if r["step"] > first]
    span = max((r["time"] for r in rest), default=first_end) - first_end
    return sum(per_worker[r["worker"]] for r in rest) / span if rest and span > 0 else None


def tta_with_losses(evals: list[dict], target: float | None,
                     losses: list[tuple[float, float]]) -> float | None:
    """Training seconds to the first evaluation at ``target`` or above, plus the
    seconds lost in the restarts (``losses``, restart_losses's) before it."""
    if target is None:
        return None
    for e in sorted(evals, key=lambda e: (e["step"], e.get("time", 0.0))):
        if e["accuracy"] >= target:
            return e["train_s"] + sum(lost for t, lost in losses if t < e.get("time", 0.0))
    return None

