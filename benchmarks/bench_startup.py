"""The fixed cost of a run and of a sweep's point: what users wait for beyond training.

    .venv/bin/python benchmarks/bench_startup.py [--repeats 5] [--sweep-points 4]

Everything is timed as users start it, through the CLI, in processes of its own,
contenders alternated in each round:

- ``import torch``: ``python -c 'import torch'``, the floor every torch program pays;
- a 1-step run of each strategy (``psring run --steps 1``; 2 workers where the
  strategy has several), its wall time beside its training time (the slowest worker's
  step time from steps.jsonl): the difference is the run's fixed cost;
- the same with ``PSRING_FORK=0``: every worker and server a new interpreter, as
  before psring.runtime.forking;
- a sweep of ``--sweep-points`` 1-step points (``psring sweep``), wall time per point,
  both ways.

The goals of issue 18 are printed as measured ratios: a 1-step ``single`` run at most
1.5x ``import torch`` and a 1-step 2-worker ``ps`` run at most 2x (medians over the
rounds). Figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics as st
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PSRING = [sys.executable, "-m", "psring"]
STRATEGIES = [("single", 1), ("allreduce", 2), ("ddp", 2), ("ps", 2), ("async-ps", 2),
              ("hogwild", 2)]
MODES = {"fork": {}, "exec": {"PSRING_FORK": "0"}}
GOALS = {"single": 1.5, "ps": 2.0}


def timed(cmd: list[str], env: dict | None = None) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=300)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return took


def training_s(run_dir: Path) -> float:
    """The run's training time: per step, its slowest worker's step time, summed."""
    per_step: dict[int, float] = {}
    for line in (run_dir / "steps.jsonl").read_text().splitlines():
        r = json.loads(line)
        per_step[r["step"]] = max(per_step.get(r["step"], 0.0), r["step_s"])
    return sum(per_step.values())


def sweep_spec(path: Path, points: int) -> None:
    strategies = ["single", "allreduce", "ps", "async-ps", "ddp", "hogwild"][:points]
    path.write_text(f'repeats = 1\n[base]\nsteps = 1\nworkers = 2\n'
                    f'[grid]\nstrategy = {json.dumps(strategies)}\n')


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sweep-points", type=int, default=4)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="psring-startup-"))
    spec = tmp / "sweep.toml"
    sweep_spec(spec, args.sweep_points)
    torch_s: list[float] = []
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    sweeps: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for r in range(args.repeats):
            torch_s.append(timed([sys.executable, "-c", "import torch"]))
            modes = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for name, workers in STRATEGIES:
                for mode in modes:
                    out = tmp / f"{name}-{mode}-{r}"
                    wall = timed([*PSRING, "run", "--strategy", name, "--workers",
                                  str(workers), "--steps", "1", "--out", str(out)], MODES[mode])
                    runs.setdefault((name, mode), []).append((wall, training_s(out)))
                    shutil.rmtree(out)
            for mode in modes:
                out = tmp / f"sweep-{mode}-{r}"
                wall = timed([*PSRING, "sweep", str(spec), "--out", str(out)], MODES[mode])
                sweeps[mode].append(wall / args.sweep_points)
                shutil.rmtree(out)
            print(f"round {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    t = st.median(torch_s)
    print(f"\nimport torch: median {t:.2f} s ({min(torch_s):.2f}-{max(torch_s):.2f}), "
          f"{args.repeats} rounds, {os.cpu_count()} cores\n")
    print(f"{'1-step run':<22}{'mode':<6}{'wall s':>8}{'train s':>9}{'fixed s':>9}"
          f"{'wall/torch':>12}")
    verdicts = []
    for name, workers in STRATEGIES:
        for mode in MODES:
            walls = [w for w, _ in runs[(name, mode)]]
            trains = [x for _, x in runs[(name, mode)]]
            wall, train = st.median(walls), st.median(trains)
            label = f"{name} ({workers} worker{'s' if workers > 1 else ''})"
            print(f"{label:<22}{mode:<6}{wall:>8.2f}{train:>9.3f}{wall - train:>9.2f}"
                  f"{wall / t:>12.2f}")
            if mode == "fork" and name in GOALS:
                ok = wall / t <= GOALS[name]
                verdicts.append(f"{name}: {wall / t:.2f}x import torch (goal <= "
                                f"{GOALS[name]}x): {'met' if ok else 'NOT met'}")
    print(f"\nsweep of {args.sweep_points} 1-step points, wall per point: "
          + ", ".join(f"{m} {st.median(v):.2f} s" for m, v in sweeps.items())
          + f" (exec/fork {st.median(sweeps['exec']) / st.median(sweeps['fork']):.2f}x)")
    print("\n" + "\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
