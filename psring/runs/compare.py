"""``psring compare``: a small default sweep over every strategy, then its report.

    psring compare [--out DIR] [--workers N] [--repeats R]

Runs ``compare.toml`` (beside this module: every registered strategy on one MLP, ``single``
with 1 worker, the others with N), one point after another so runs don't compete for
the cores, with a progress bar; then writes the sweep report (report.md and plots)
into DIR and prints its key table. The cost model's predictions need a calibration:
if none is found (``psring calibrate``; see psring.predict.calibration), a quick one is
measured first and kept in DIR. Rerunning with the same ``--out`` resumes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from psring.predict.calibration import find_calibration
from psring.predict.measure import calibrate
from psring.runs.sweep import Sweep, SweepResult, run_sweep_with_progress
from psring.strategies import STRATEGIES

#: the definition compare runs, installed with the package (setup.py's package_data)
SPEC = Path(__file__).resolve().with_name("compare.toml")


def default_sweep(workers: int = 2, repeats: int | None = None) -> Sweep:
    """compare.toml with every registered strategy (plugins included) on ``workers``."""
    sweep = Sweep.load(SPEC)
    grid = {**sweep.grid, "strategy": list(STRATEGIES), "workers": [workers]}
    return sweep.changed(grid=grid,
                         repeats=repeats if repeats is not None else sweep.repeats)


def run_compare(out: str | None = None, workers: int = 2,
                repeats: int | None = None) -> tuple[Path, SweepResult]:
    root = Path(out or os.path.join("runs", f"compare-{time.strftime('%Y%m%d-%H%M%S')}"))
    root.mkdir(parents=True, exist_ok=True)
    if find_calibration(root) is None:
        print("psring: no cost-model calibration found (psring calibrate); measuring a "
              "quick one first", flush=True)
        calibrate(quick=True).save(root / "calibration.json")
    res = run_sweep_with_progress(default_sweep(workers, repeats), root)
    return root, res
