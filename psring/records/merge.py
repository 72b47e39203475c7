"""One run from the run directories of its hosts: ``psring merge``.

Under torchrun each host's workers write to that host's ``--out``: node 0's directory
has the manifest (rank 0 writes it, naming every rank's host), the model and the
evaluations; every directory has its own workers' steps and ``workers.jsonl`` (one line
per worker: run id, rank, host). Copied back to one machine:

    psring merge runs/hostA runs/hostB --out runs/two-hosts
    psring report runs/two-hosts

The directories must be of one launch (the same run id, agreed through torchrun's
rendezvous: psring.runtime.rendezvous) and together hold every rank; else a ConfigError says
which directory is of which run, or which ranks are missing. Steps a directory shares
with another (the same directory given twice, or a shared file system) count once.
Step records carry no run id: give each launch a fresh --out (or --resume into it), as
`psring run` requires; a directory's steps are those of the ranks its last launch had.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from psring.errors import ConfigError
from psring.records.runlog import (
    EVALS,
    FAULTS,
    MANIFEST,
    MODEL,
    RESTARTS,
    STEPS,
    WORKERS,
    atomic_write_json,
    read_manifest,
    read_steps,
)

#: files copied from node 0's directory as they are
RANK0_FILES = (EVALS, MODEL)
SERVERS = "servers.jsonl"


def _launches(d: Path) -> list[str]:
    """The run ids of the launches that wrote to ``d``, oldest first."""
    ids: list[str] = []
    for w in read_steps(d, WORKERS):
        if w.get("run") and w["run"] not in ids:
            ids.append(w["run"])
    return ids


def merge(dirs: list[str | Path], out: str | Path) -> dict[str, Any]:
    """Write the merged run to ``out``; return its manifest."""
    paths = _distinct_dirs(dirs)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} already exists and is not empty: give --out a new "
                          f"directory.")
    run = _one_launch(paths)
    head = _head(paths, run)
    manifest = read_manifest(head)
    workers = _workers(paths, run, manifest)
    steps: dict[tuple[int, int], dict] = {}
    for p in paths:
        # a directory's steps of this run: those of the ranks that logged it here
        ranks = {w["rank"] for w in read_steps(p, WORKERS) if w.get("run") == run}
        for r in read_steps(p):
            if r.get("worker") in ranks:
                steps[(r["step"], r["worker"])] = r
    out.mkdir(parents=True, exist_ok=True)
    _write_lines(out / STEPS, [steps[k] for k in sorted(steps)])
    _write_lines(out / WORKERS, [workers[r] for r in sorted(workers)])
    # (a directory reached twice, by another path: its records once)
    servers = {json.dumps(rec, sort_keys=True): rec
               for p in paths for rec in read_steps(p, SERVERS)}
    if servers:
        _write_lines(out / SERVERS, sorted(servers.values(), key=lambda r: r.get("time", 0)))
    _merge_faults(paths, out)
    for name in RANK0_FILES:
        if (head / name).exists():
            shutil.copy2(head / name, out / name)
    manifest["merged_from"] = [{"dir": str(p.resolve()), "ranks": sorted(
        {w["rank"] for w in read_steps(p, WORKERS) if w.get("run") == run})} for p in paths]
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


def _merge_faults(paths: list[Path], out: Path) -> None:
    """Every host's faults, and the restarts once each: each host's directory records
    a restart of the launch (psring.runtime.elastic), the one that had got furthest
    stands for it."""
    fired = {json.dumps(rec, sort_keys=True): rec for p in paths for rec in read_steps(p, FAULTS)}
    if fired:
        _write_lines(out / FAULTS, sorted(fired.values(), key=lambda r: r.get("time", 0)))
    restarts: dict[int, dict] = {}
    for rec in (r for p in paths for r in read_steps(p, RESTARTS)):
        seen = restarts.get(rec.get("attempt"))
        if seen is None or rec.get("reached", 0) > seen.get("reached", 0):
            restarts[rec.get("attempt")] = rec
    if restarts:
        _write_lines(out / RESTARTS, [restarts[a] for a in sorted(restarts)])


def _distinct_dirs(dirs: list[str | Path]) -> list[Path]:
    """The directories given, each once, refusing one that is not a directory."""
    paths: list[Path] = []
    for p in map(Path, dirs):
        if not p.is_dir():
            raise ConfigError(f"{p} is not a directory: pass each host's --out of one "
                              f"torchrun launch.")
        if p.resolve() not in {q.resolve() for q in paths}:
            paths.append(p)
    return paths


def _one_launch(paths: list[Path]) -> str:
    """The run id every directory's last launch shares, or a refusal naming them."""
    runs = {}
    for p in paths:
        ids = _launches(p)
        if not ids:
            raise ConfigError(f"{p} has no {WORKERS}: it is not the run directory of a "
                              f"psring worker (or its workers never started).")
        runs[p] = ids[-1]  # a directory resumed into holds its last launch's steps
    if len(set(runs.values())) > 1:
        listing = "; ".join(f"{p}: run {r}" for p, r in runs.items())
        raise ConfigError(f"these directories are of different launches ({listing}); "
                          f"merge the directories of one launch only: every host of a "
                          f"torchrun launch logs the same run id in {WORKERS}.")
    return next(iter(runs.values()))


def _head(paths: list[Path], run: str) -> Path:
    """The directory holding run ``run``'s manifest (node 0's host: rank 0 writes it)."""
    heads = [p for p in paths if (p / MANIFEST).exists()
             and read_manifest(p).get("launch", {}).get("run_id") == run]
    if not heads:
        raise ConfigError(f"none of {', '.join(map(str, paths))} holds the manifest of run "
                          f"{run}: add the directory of node 0's host (rank 0 writes it).")
    return heads[0]


def _workers(paths: list[Path], run: str, manifest: dict) -> dict[int, dict]:
    """Every rank's worker record of the run, by rank; refuses a run missing ranks."""
    world = manifest["config"]["workers"]
    workers = {}
    for p in paths:
        for w in read_steps(p, WORKERS):
            if w.get("run") == run:
                workers[w["rank"]] = w
    missing = sorted(set(range(world)) - set(workers))
    if missing:
        known = {w["rank"]: w.get("host") for w in manifest.get("launch", {}).get("workers", [])}
        names = ", ".join(f"{r} ({known.get(r, '?')})" for r in missing)
        raise ConfigError(f"run {run} had {world} workers, but no directory given holds "
                          f"the steps of rank{'s' if len(missing) > 1 else ''} {names}: add "
                          f"the --out of {'their hosts' if len(missing) > 1 else 'its host'}.")
    return workers


def _write_lines(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))


def missing_ranks(run_dir: Path, manifest: dict) -> list[int]:
    """Ranks of a torchrun launch whose steps are not in ``run_dir`` (a host's directory
    not merged yet); [] for runs of ``psring run``."""
    launch = manifest.get("launch", {})
    if launch.get("launcher") != "torchrun":
        return []
    have = {r.get("worker") for r in read_steps(run_dir)}
    return sorted(set(range(manifest["config"]["workers"])) - have)
