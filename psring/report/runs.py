"""Summaries of run directories: ``psring report DIR [DIR...] [--json]``.

For each run: samples/s, step time p50/p95 (and p99 in --json), the share of the step
spent computing (data + forward + backward + update) versus blocked on communication,
the speedup over a ``single`` run of the same workload when one is among the directories
given, and the last held-out accuracy with the time to ``--target-accuracy``
(evals.jsonl). The first steps (warm-up: allocator, connection set-up) are left out of
the figures. A run that met faults (--kill-worker, --kill-server) or restarted
(--max-restarts) gets a line under the table: the faults, the restarts, the steps redone
and the time lost (from the last step logged before a failure to the same step logged
again).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from psring.errors import ConfigError
from psring.records.merge import missing_ranks
from psring.records.runlog import (
    PHASES,
    iter_run_dirs,
    read_evals,
    read_manifest,
    read_steps,
    shares_of,
    warmup_steps,
)
from psring.report.faults import fault_summary
from psring.strategies import STRATEGIES
from psring.train.evaluate import time_to_accuracy

#: config keys that define "the same workload" for speedups
WORKLOAD_KEYS = ("model", "width", "depth", "data", "samples", "features", "classes",
                 "batch_size", "accumulate", "seed")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100 * (len(s) - 1)))))
    return s[k]


def _steps_of(run_dir: Path, manifest: dict[str, Any]) -> list[dict]:
    """The run's step records, or a ConfigError when there are none or when some of
    its ranks logged on other hosts (a torchrun launch not merged yet)."""
    records = read_steps(run_dir)
    if not records:
        raise ConfigError(f"{run_dir}: no step records in steps.jsonl (the run did not get "
                          f"through a step); see {run_dir}/logs.")
    absent = missing_ranks(run_dir, manifest)
    if absent:
        raise ConfigError(
            f"{run_dir} holds the steps of this host's workers only: rank"
            f"{'s' * (len(absent) > 1)} {', '.join(map(str, absent))} of this torchrun "
            f"launch logged on other hosts. Copy their --out directories here and join "
            f"them: psring merge {run_dir} OTHER_DIRS... --out MERGED, then report MERGED.")
    return records


def _job_steps(by_step: dict[int, list[dict]], workers: int,
               cfg: dict[str, Any]) -> list[float]:
    """Each step's time for the whole job: from when its last worker started it to when
    its last worker finished it, on the described clock (wall seconds / --time-scale,
    as step_s). Not the largest step_s of the step: a parameter server's workers end
    their steps at different moments (each when its own pushes are acknowledged, then
    waits for its pulls in the next), so each worker's step_s mixes its own phase with
    the others', and the largest of several such overstates the job's period (by 30%
    on a colocated PS of 4 hosts, measured 2026-11-26). A worker starts a step when it
    ends the last one, so back to back these add up to the run's elapsed time; time
    spent between steps (a held-out evaluation) is in neither. [] where a step lacks a
    worker's record or its time (the caller then takes the largest step_s). Under
    torchrun the hosts' clocks differ by a constant that cancels in the differences."""
    scale = float(cfg.get("time_scale") or 1.0)
    out = []
    for rs in by_step.values():
        if len({r["worker"] for r in rs}) != workers or any("time" not in r for r in rs):
            return []
        last_start = max(r["time"] - r["step_s"] * scale for r in rs)
        out.append((max(r["time"] for r in rs) - last_start) / scale)
    return out


def _speed(kept: list[dict], cfg: dict[str, Any]) -> tuple[list[float], float]:
    """(each step's time, samples per second) over the steps after warm-up."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    by_worker: dict[int, list[dict]] = defaultdict(list)
    for r in kept:
        by_step[r["step"]].append(r)
        by_worker[r["worker"]].append(r)
    step_times = _job_steps(by_step, len(by_worker), cfg) or \
        [max(r["step_s"] for r in rs) for rs in by_step.values()]
    # each worker's samples a step (--worker-batch: its own share of the global batch),
    # over the part of the run it was there for (a worker lost to a fault, that the run
    # went on without, stopped adding samples when it died)
    shares = shares_of(cfg)
    longest = max(len(rs) for rs in by_worker.values())
    samples_per_s = sum(shares[w] * cfg["accumulate"] * len(rs) / longest /
                        statistics.median(r["step_s"] for r in rs)
                        for w, rs in by_worker.items())
    return step_times, samples_per_s


def _losses(records: list[dict], last_step: int,
            timing_only: bool) -> tuple[list[float], list[float]]:
    """The workers' losses at the first step and at the last; none when timing only."""
    if timing_only:  # --compute device: its losses are of made-up gradients
        return [], []
    # (a script's step may not say its loss: psring.library's s.loss)
    return ([r["loss"] for r in records if r["step"] == 0 and r["loss"] is not None],
            [r["loss"] for r in records if r["step"] == last_step and r["loss"] is not None])


def summarize(run_dir: Path) -> dict[str, Any]:
    """One run's figures (the module docstring's), read from its logs."""
    manifest = read_manifest(run_dir)
    cfg = manifest["config"]
    records = _steps_of(run_dir, manifest)
    skip = warmup_steps(cfg["steps"])
    kept = [r for r in records if r["step"] >= skip] or records
    step_times, samples_per_s = _speed(kept, cfg)
    total = sum(r["step_s"] for r in kept)
    phase_share = {p: sum(r[p] for r in kept) / total for p in PHASES}
    evals = read_evals(run_dir)
    target = cfg.get("target_accuracy") or 0
    tta_s, tta_step = time_to_accuracy(evals, target) if target and evals else (None, None)
    last_step = max(r["step"] for r in records)
    timing_only = bool(manifest.get("timing_only"))
    first, final = _losses(records, last_step, timing_only)
    return {
        "run": str(run_dir),
        "strategy": cfg["strategy"],
        "workers": cfg["workers"],
        # the hosts the workers ran on: emulated (--hosts), or under torchrun as many
        # as the rendezvous saw
        "hosts": (manifest.get("launch") or {}).get("hosts") or cfg.get("hosts", 1),
        "model": cfg["model"],
        "batch_size": cfg["batch_size"],
        "steps": last_step + 1,
        "samples_per_s": samples_per_s,
        "step_p50_s": statistics.median(step_times),
        "step_p95_s": percentile(step_times, 95),
        "step_p99_s": percentile(step_times, 99),
        "compute_share": 1.0 - phase_share["comm_s"],
        "comm_share": phase_share["comm_s"],
        "phase_share": phase_share,
        "loss_first": statistics.fmean(first) if first else None,
        "loss_final": statistics.fmean(final) if final else None,
        "timing_only": timing_only,
        # held-out evaluation (evals.jsonl): the last one, and time to --target-accuracy
        "accuracy_final": max(evals, key=lambda e: e["step"])["accuracy"] if evals else None,
        "target_accuracy": target or None,
        "time_to_accuracy_s": tta_s,
        "steps_to_accuracy": tta_step,
        "parameter_bytes": manifest.get("parameter_bytes"),
        "arithmetic_intensity": manifest.get("arithmetic_intensity"),
        # (a script's arguments are part of what it trains: --clip 0 is another run)
        "workload": {**{k: cfg.get(k) for k in WORKLOAD_KEYS},
                     **({"script": manifest["script"]} if "script" in manifest else {})},
        # who started the workers, and where (torchrun: every rank's host)
        "launch": manifest.get("launch") or {},
        "speedup_vs_single": None,
        "faults": fault_summary(run_dir, records),
    }


def add_speedups(rows: list[dict[str, Any]]) -> None:
    baselines = {json.dumps(r["workload"], sort_keys=True): r for r in rows
                 if r["strategy"] == "single"}
    for r in rows:
        base = baselines.get(json.dumps(r["workload"], sort_keys=True))
        if base is not None:
            r["speedup_vs_single"] = r["samples_per_s"] / base["samples_per_s"]


def summarize_all(paths: list[str]) -> list[dict[str, Any]]:
    dirs = list(iter_run_dirs(paths))
    if not dirs:
        raise ConfigError(f"no run directories (with a manifest.json) in {', '.join(paths)}; "
                          f"pass the --out of a finished `psring run` or `psring compare`.")
    rows = [summarize(d) for d in dirs]
    add_speedups(rows)
    order = {name: i for i, name in enumerate(STRATEGIES)}
    rows.sort(key=lambda r: (json.dumps(r["workload"], sort_keys=True),
                             order.get(r["strategy"], len(order)), r["workers"]))
    return rows


def _accuracy_text(r: dict[str, Any]) -> str:
    if r["accuracy_final"] is None:
        return "-"
    text = f"{r['accuracy_final']:.3f}"
    if r["target_accuracy"]:
        text += (f"; {r['target_accuracy']:g} at {r['time_to_accuracy_s']:.2f} s"
                 if r["time_to_accuracy_s"] is not None else
                 f"; {r['target_accuracy']:g} not reached")
    return text


def render_table(rows: list[dict[str, Any]]) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="psring report (medians exclude warm-up steps)")
    for col in ("strategy", "workers", "hosts", "samples/s", "step p50 ms", "step p95 ms",
                "compute %", "comm %", "speedup", "loss first→final", "held-out acc",
                "run"):
        table.add_column(col, justify="left" if col in ("strategy", "run") else "right")
    for r in rows:
        speed = f"{r['speedup_vs_single']:.2f}x" if r["speedup_vs_single"] is not None else "-"
        if r.get("timing_only"):
            loss = "timing only"
        elif r["loss_final"] is None:  # (a script's steps that did not say their loss)
            loss = "-"
        else:
            loss = (f"{r['loss_first']:.3f}→{r['loss_final']:.3f}"
                    if r["loss_first"] is not None else f"{r['loss_final']:.3f}")
        table.add_row(r["strategy"], str(r["workers"]), str(r.get("hosts", 1)),
                      f"{r['samples_per_s']:.0f}",
                      f"{r['step_p50_s'] * 1e3:.1f}", f"{r['step_p95_s'] * 1e3:.1f}",
                      f"{r['compute_share'] * 100:.0f}", f"{r['comm_share'] * 100:.0f}",
                      speed, loss, _accuracy_text(r), r["run"])
    console = Console(width=190, record=True, force_terminal=False)
    with console.capture() as cap:
        console.print(table)
    return cap.get() + "".join(_fault_line(r) for r in rows if r.get("faults"))


def _fault_line(r: dict[str, Any]) -> str:
    f = r["faults"]
    text = f"{r['run']}: faults {', '.join(f['fired']) or 'none placed'}"
    if f.get("lost"):
        text += f"; went on without {', '.join(f['lost'])}"
    if f["restarts"]:
        text += (f"; {f['restarts']} restart(s) from checkpoints, {f['steps_redone']} "
                 f"step(s) redone, {f['lost_s']:.2f} s lost")
    return text + "\n"
