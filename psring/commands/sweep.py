"""``psring sweep`` and ``psring compare``: many runs from a definition, then the
report.

    psring sweep experiments/intensity.toml --out runs/intensity   (resumable)
    psring compare [--out DIR]

Imported by psring.cli once ``forking.allow()`` has run (the runs' processes are forked
from this one; a calibration that computes here leaves threads behind, and the runs'
processes then start anew).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from psring.report import write_report
from psring.runs.compare import run_compare
from psring.runs.sweep import Sweep, default_out, format_summary, run_sweep_with_progress


def sweep(args: argparse.Namespace) -> int:
    """``psring sweep SPEC``: every point not done yet, then (``--report``) the report."""
    definition = Sweep.load(args.spec)
    if args.repeats is not None:
        definition = definition.changed(repeats=args.repeats)
    out = Path(args.out) if args.out else default_out(definition)
    res = run_sweep_with_progress(definition, out)
    print(format_summary(res), file=sys.stderr)
    if args.report:
        path, table = write_report(out)
        print(table)
        print(f"report: {path}")
    print(f"sweep directory: {out}")
    return 1 if res.failed else 0


def compare(args: argparse.Namespace) -> int:
    """``psring compare``: the default sweep (psring.runs.compare) and its report."""
    root, res = run_compare(args.out, workers=args.workers, repeats=args.repeats)
    print(format_summary(res), file=sys.stderr)
    path, table = write_report(root)
    print(table)
    print(f"report: {path}")
    return 1 if res.failed else 0
