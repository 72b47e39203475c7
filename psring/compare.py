"""``psring compare``: every registered strategy on one small default workload.

Runs each strategy with 2 workers (``single`` with 1) on the same model, global batch,
seed and steps, one after another (so runs don't compete for the cores), with a
progress display, then prints the report table with speedups over ``single``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .config import RunConfig
from .launch import launch
from .strategies import STRATEGIES

#: the default workload: an MLP big enough that communication shows (~9.6 MB of
#: gradients per step), small enough for all strategies to run in well under 2 minutes
DEFAULT = RunConfig(model="mlp", width=1024, depth=3, batch_size=64, steps=30)


def compare_configs(out: str, workers: int = 2, base: RunConfig = DEFAULT) -> list[RunConfig]:
    cfgs = []
    for name in STRATEGIES:
        cls = STRATEGIES.get(name)
        n = min(workers, cls.max_workers or workers)
        cfgs.append(base.replace(strategy=name, workers=n, out=os.path.join(out, name)))
    return cfgs


def run_compare(out: str | None = None, workers: int = 2, base: RunConfig = DEFAULT) -> Path:
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    root = Path(out or os.path.join("runs", f"compare-{time.strftime('%Y%m%d-%H%M%S')}"))
    cfgs = compare_configs(str(root), workers, base)
    with Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("worker-steps"), TimeElapsedColumn()) as bar:
        tasks = {c.strategy: bar.add_task(c.strategy, total=c.steps * c.workers) for c in cfgs}
        for c in cfgs:
            task = tasks[c.strategy]
            launch(c, progress=lambda done, total, t=task: bar.update(t, completed=done))
    return root
