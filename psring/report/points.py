"""A sweep's points, read back from their logs (steps.jsonl, manifest.json, evals.jsonl).

:func:`collect` reads a sweep directory: its definition, one row per finished point
(:func:`load_point`: the run's summary, psring.report.runs, plus what a sweep report
needs) and the points that failed or did not run. A point's *setting* is its id without
the repeat number (:func:`setting_of`).

*Communication time* of a step (:func:`comm_time`) = time blocked on communication
(``comm_s``) plus the time communication ran hidden under backward (the union of the
buckets' in-flight intervals before backward ended), less, in synchronous strategies,
the time a worker was blocked only because a slower peer was still in backward (its
*peer wait*, :func:`peer_waits`). It is what the cost model predicts (docs/cost-model.md).
"""

from __future__ import annotations

import json
import re
import statistics as st
from collections import defaultdict
from pathlib import Path
from typing import Any

from psring.errors import ConfigError
from psring.records.runlog import PHASES, read_evals, read_manifest, read_steps, warmup_steps
from psring.report.faults import effects
from psring.report.runs import summarize
from psring.runs.sweep import SWEEP_FILE, point_status
from psring.strategies import STRATEGIES


def peer_waits(records: list[dict]) -> dict[tuple[int, int], float]:
    """(worker, step) -> seconds a worker of a synchronous step could not have been
    communicating because a slower peer had not finished its backward yet: the latest
    backward end among the step's workers minus its own (on the wall clock the
    processes of a host share; the step's start is its end ``time`` minus ``step_s``)."""
    ends: dict[int, dict[int, float]] = defaultdict(dict)
    for r in records:
        if "backward_end_s" in r:
            ends[r["step"]][r["worker"]] = r["time"] - r["step_s"] + r["backward_end_s"]
    return {(w, step): max(e.values()) - t for step, e in ends.items() for w, t in e.items()}


def comm_time(r: dict, peer_wait: float = 0.0) -> float:
    """Blocked time plus the communication in flight before backward ended (the union
    of the buckets' [launch, done] intervals cut at the end of backward): what a
    strategy spent communicating, hidden or not, less ``peer_wait`` (time blocked only
    because a slower peer was still computing). Strategies that log no buckets (ddp
    syncs inside torch) count their blocked time only."""
    end = r.get("backward_end_s", 0.0)
    spans = sorted((a, min(b, end)) for a, b in zip(r.get("bucket_launch_s") or [],
                                                   r.get("bucket_done_s") or [])
                   if 0 < a < end and b > a)
    hidden, reach = 0.0, 0.0
    for a, b in spans:
        a = max(a, reach)
        if b > a:
            hidden += b - a
            reach = b
    return max(0.0, r["comm_s"] - max(0.0, peer_wait)) + hidden


def _round_comm(records: list[dict], waits: dict[tuple[int, int], float]) -> list[float]:
    """Per synchronous step, the communication time of its slowest worker: the round
    ends for everyone only when the last worker has the result. Workers differ when
    they sit differently in the network: a worker beside its parameter server gets the
    new parameters at once, one behind a link waits for them to cross it."""
    by_step: dict[int, float] = {}
    for r in records:
        c = comm_time(r, waits.get((r["worker"], r["step"]), 0.0))
        by_step[r["step"]] = max(by_step.get(r["step"], 0.0), c)
    return list(by_step.values())


def load_point(run_dir: Path) -> dict[str, Any]:
    """One finished point: the run summary plus what the sweep report needs."""
    row = summarize(run_dir)
    manifest = read_manifest(run_dir)
    cfg = manifest["config"]
    row["machine"] = manifest.get("host") or {}  # (hostname, cores: whose calibration fits)
    records = read_steps(run_dir)
    skip = warmup_steps(cfg["steps"])
    kept = [r for r in records if r["step"] >= skip] or records
    row["config"] = cfg
    row["servers"] = cfg["servers"]
    row["phase_ms"] = {p: st.median(r[p] for r in kept) * 1e3 for p in PHASES}
    # in a synchronous step a worker blocked on a slower peer is waiting, not
    # communicating; asynchronous workers' steps are not rounds, so nothing is subtracted
    cls = STRATEGIES.get(cfg["strategy"]) if cfg["strategy"] in STRATEGIES else None
    synchronous = cls is not None and cls.caps.synchronous and cls.caps.cost_model is not None
    waits = peer_waits(records) if synchronous else {}
    row["comm_time_s"] = st.median(_round_comm(kept, waits) if synchronous else
                                   [comm_time(r) for r in kept])
    row["peer_wait_ms"] = st.median(waits.get((r["worker"], r["step"]), 0.0)
                                    for r in kept) * 1e3
    pbytes = manifest.get("parameter_bytes") or 0
    # what the cost model's M is: the gradients as sent (compressed with --compress)
    row["gradient_bytes"] = manifest.get("wire_bytes") or pbytes
    fws = manifest.get("flops_per_worker_step")
    row["intensity"] = fws / pbytes if fws and pbytes else None
    # loss curve: per step, mean over workers; time since the end of the first step (whose
    # time is mostly connection set-up: gloo connects on the first collective)
    by_step: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        by_step[r["step"]].append(r)
    steps = sorted(by_step)
    start = max(r["time"] for r in by_step[steps[0]])
    # a step's time: when its last worker finished it
    row["curve"] = [] if row["timing_only"] else [
        (s, max(r["time"] for r in by_step[s]) - start,
         st.fmean(r["loss"] for r in by_step[s])) for s in steps
        if all(r["loss"] is not None for r in by_step[s])]  # (a script's may not say)
    row["staleness"] = [r["staleness"] for r in records if "staleness" in r]
    row["evals"] = sorted(read_evals(run_dir), key=lambda e: e["step"])
    row["accuracy_final"] = row["evals"][-1]["accuracy"] if row["evals"] else None
    row["train_seconds"] = max(r["time"] for r in records) - start
    row["fault_effects"] = effects(run_dir, records, cfg)  # (None: no fault, no restart)
    return row


def setting_of(point_id: str) -> str:
    return re.sub(r"_r\d+$", "", point_id)


def collect(sweep_dir: Path) -> tuple[dict, list[dict], list[dict]]:
    """(the sweep's definition, finished points' rows, failed/missing points)."""
    sweep_dir = Path(sweep_dir)
    try:
        spec = json.loads((sweep_dir / SWEEP_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{sweep_dir} is not a sweep directory ({SWEEP_FILE}: {e}); run "
                          f"`psring sweep SPEC --out {sweep_dir}` first.") from None
    rows, problems = [], []
    for pid in spec["points"]:
        status = point_status(sweep_dir / pid)
        if status is None:
            problems.append({"id": pid, "status": "not run", "error": ""})
        elif status.get("status") != "ok":
            problems.append({"id": pid, "status": status.get("status", "?"),
                             "error": status.get("error", "")})
        else:
            row = load_point(sweep_dir / pid)
            row["id"], row["setting"] = pid, setting_of(pid)
            row["varied"] = status.get("varied", {})
            rows.append(row)
    return spec, rows, problems
