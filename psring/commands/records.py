"""What reads a run's records: ``psring report``, ``psring merge``, ``psring trace``.

    psring report runs/ar runs/single [--json]
    psring report runs/intensity              (a sweep: report.md and plots)
    psring merge host0/run host1/run --out runs/merged
    psring trace runs/ps                      (after psring run ... --trace)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from psring.records.merge import merge as merge_runs
from psring.records.trace import TRACE, load_trace, render_png, write_trace
from psring.report import render_table, summarize_all, write_report
from psring.runs.sweep import is_sweep_dir


def report(args: argparse.Namespace) -> int:
    """A sweep directory: its report.md and plots; run directories: their table."""
    if len(args.dirs) == 1 and is_sweep_dir(args.dirs[0]) and not args.json:
        path, table = write_report(args.dirs[0])
        print(table)
        print(f"report: {path}")
        return 0
    rows = summarize_all(args.dirs)
    print(json.dumps(rows, indent=2) if args.json else render_table(rows))
    return 0


def merge(args: argparse.Namespace) -> int:
    """The run directories of one torchrun launch's hosts joined into one."""
    manifest = merge_runs(args.dirs, args.out)
    parts = manifest["merged_from"]
    print(f"merged run {manifest['launch']['run_id']}: "
          + ", ".join(f"{p['dir']} (rank{'s' * (len(p['ranks']) != 1)} "
                      f"{', '.join(map(str, p['ranks']))})" for p in parts)
          + f" -> {args.out}")
    return 0


def trace(args: argparse.Namespace) -> int:
    """A traced run's trace.json (built from its logs when missing) and its picture."""
    run_dir = Path(args.dir)
    path = run_dir / TRACE
    if args.rebuild or not path.exists():
        write_trace(run_dir)
    png = render_png(load_trace(path), Path(args.png) if args.png else run_dir / "trace.png",
                     steps=args.steps)
    print(f"trace: {path} (open in https://ui.perfetto.dev)\npicture: {png}")
    return 0
