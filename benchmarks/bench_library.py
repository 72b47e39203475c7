"""No cost for the convenience (issue 33): a step through psring.library against the
same strategy, model and batch under psring's own loop, and how soon each starts.

    .venv/bin/python benchmarks/bench_library.py [--repeats 3] [--steps 60]

Both are timed as users start them, through the CLI, alternated in each round:
``psring run --strategy S ...`` and ``psring launch --strategy S ... -- python
benchmarks/library_script.py`` (psring's mlp and synthetic data, fed as the loop feeds
them). Per strategy, medians over the rounds of: the run's p50 step (steps.jsonl, warm-up
excluded as psring report does), the p50 step period (worker 0's wall time from one
step's end to the next: the step as the run's throughput sees it, whatever each loop
leaves outside its recorded step_s), the step without data_s (what the strategy and
the model cost), the wall time of the command, and its time to the first step's end (the
command's start-up). Ratios are library / psring run, the median over the rounds of
each round's ratio (the two ran back to back there: a round's machine state divides
out); the goals are at most 1.03 for the step (its period) and at most 1.0 for the
start. Real compute on this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics as st
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PSRING = [sys.executable, "-m", "psring"]
SCRIPT = str(Path(__file__).with_name("library_script.py"))
WORKLOAD = ["--model", "mlp", "--width", "512", "--depth", "2", "--features", "256",
            "--batch-size", "64"]
STRATEGIES = {"allreduce": ["--workers", "2"], "ps": ["--workers", "2"],
              "byteps": ["--workers", "2", "--update-on", "worker"]}


def one(kind: str, strategy: str, steps: int, out: Path) -> dict:
    flags = ["--strategy", strategy, *STRATEGIES[strategy], *WORKLOAD, "--steps", str(steps),
             "--out", str(out)]
    cmd = [*PSRING, "run", *flags] if kind == "run" else \
        [*PSRING, "launch", *flags, "--", "python", SCRIPT]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    recs = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    skip = max(1, steps // 10)
    kept = [r for r in recs if r["step"] >= skip]
    first_end = min(r["time"] for r in recs if r["step"] == 0)
    # the wall time from one step's end to the next (worker 0): what a step costs the
    # run, whatever the loop leaves outside the recorded step_s
    ends = sorted(r["time"] for r in kept if r["worker"] == 0)
    return {"step": st.median(r["step_s"] for r in kept),
            "period": st.median(b - a for a, b in zip(ends, ends[1:])),
            "step_no_data": st.median(r["step_s"] - r["data_s"] for r in kept),
            "wall": wall, "first_step": first_end - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    results: dict = {(s, k): [] for s in STRATEGIES for k in ("run", "library")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for s in STRATEGIES:
                for kind in (("run", "library") if r % 2 == 0 else ("library", "run")):
                    out = Path(tmp) / f"{s}-{kind}-{r}"
                    results[(s, kind)].append(one(kind, s, args.steps, out))
    print(f"{'strategy':<10} {'figure':<22} {'psring run':>11} {'library':>9} {'ratio':>7}")
    for s in STRATEGIES:
        for key, what in (("step", "p50 step ms"), ("period", "p50 step period ms"),
                          ("step_no_data", "p50 step - data ms"),
                          ("first_step", "to first step s"), ("wall", "wall s")):
            runs, libs = results[(s, "run")], results[(s, "library")]
            a, b = st.median(x[key] for x in runs), st.median(x[key] for x in libs)
            ratio = st.median(y[key] / x[key] for x, y in zip(runs, libs))
            scale = 1000 if key.startswith("step") or key == "period" else 1
            print(f"{s:<10} {what:<22} {a * scale:>11.2f} {b * scale:>9.2f} {ratio:>7.3f}")


if __name__ == "__main__":
    main()
