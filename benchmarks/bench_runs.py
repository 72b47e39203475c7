"""Benchmarks of what users run: separate processes, contenders alternated, paired ratios.

    .venv/bin/python benchmarks/bench_runs.py [--pairs 5] [--only NAME [NAME ...]]

Each comparison is two commands, A and B, each a whole run in processes of its own:
``psring run`` through the CLI, as users start it, or a reference script written from
PyTorch's own documentation (benchmarks/ref_ddp.py: a plain DDP training loop;
benchmarks/ref_rpc_ps.py: the RPC tutorial's batch-updating parameter server). A and B
run one after the other, ``--pairs`` times, which goes first alternating; a run's figure
is its median step time over steps 3.. (a step as long as its slowest worker), and the
comparison's figure is the median of the paired ratios A/B, with their min–max.
(In-process micro-benchmarks, benchmarks/bench_foundation.py, are diagnostics: they
share one process's allocator and caches between contenders, which hid the slow
backward these runs found.)

``ps`` runs as users get it: servers on Unix sockets on one Linux host ("ps ipc / tcp"
compares the transports). Workload: psring's default ``mlp`` (1024x3, 9.5 MB of
gradients) on its synthetic task, 2 workers, global batch 64, 60 steps, seed 3.
Comparisons with ``@1gbit`` run on 2 emulated hosts joined by 1 Gbit/s links
(docs/emulation.md: root or user namespaces).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics as st
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOAD = ["--workers", "2", "--batch-size", "64", "--seed", "3", "--steps", "60"]
LINK = ["--hosts", "2", "--link", "1gbit"]


def psring(*args: str) -> list[str]:
    return ["psring", "run", *args, *WORKLOAD]


def reference(script: str) -> list[str]:
    return ["ref", str(HERE / script), "--workers", "2", "--batch-size", "64",
            "--steps", "60", "--seed", "3"]


#: name -> (A, B, target for the median of A/B, or None: reported)
COMPARISONS = {
    "allreduce / ddp": (psring("--strategy", "allreduce"), psring("--strategy", "ddp"), 1.0),
    "allreduce / torch DDP loop": (psring("--strategy", "allreduce"), reference("ref_ddp.py"),
                                   1.0),
    "ps / torch.rpc batch-update PS": (psring("--strategy", "ps"),
                                       reference("ref_rpc_ps.py"), 0.8),
    "ps ipc / tcp": (psring("--strategy", "ps"), psring("--strategy", "ps", "--transport", "tcp"),
                     None),
    "allreduce fp16 / none": (psring("--strategy", "allreduce", "--compress", "fp16"),
                              psring("--strategy", "allreduce"), None),
    "ps fp16 / none": (psring("--strategy", "ps", "--compress", "fp16"),
                       psring("--strategy", "ps"), None),
    "allreduce bf16 / none": (psring("--strategy", "allreduce", "--compress", "bf16"),
                              psring("--strategy", "allreduce"), None),
    "ps bf16 / none": (psring("--strategy", "ps", "--compress", "bf16"),
                       psring("--strategy", "ps"), None),
    "allreduce fp16 / none @1gbit": (psring("--strategy", "allreduce", "--compress", "fp16",
                                            *LINK),
                                     psring("--strategy", "allreduce", *LINK), None),
    "ps fp16 / none @1gbit": (psring("--strategy", "ps", "--compress", "fp16", *LINK),
                              psring("--strategy", "ps", *LINK), None),
    "allreduce bf16 / none @1gbit": (psring("--strategy", "allreduce", "--compress", "bf16",
                                            *LINK),
                                     psring("--strategy", "allreduce", *LINK), None),
    "ps bf16 / none @1gbit": (psring("--strategy", "ps", "--compress", "bf16", *LINK),
                              psring("--strategy", "ps", *LINK), None),
}


def median_step(run_dir: Path) -> float:
    """Median over steps 3.. of each step's slowest worker's step_s."""
    by_step: dict[int, float] = {}
    for line in (run_dir / "steps.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["step"] >= 3:
            by_step[r["step"]] = max(by_step.get(r["step"], 0.0), r["step_s"])
    return st.median(by_step.values())


def run(cmd: list[str], out: Path) -> float:
    if cmd[0] == "psring":
        argv = [sys.executable, "-m", "psring", *cmd[1:], "--out", str(out)]
    else:
        argv = [sys.executable, *cmd[1:]]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    if cmd[0] == "psring":
        return median_step(out)
    return json.loads(proc.stdout.strip().splitlines()[-1])["step_s"]


def compare(name: str, pairs: int, tmp: Path) -> None:
    a, b, target = COMPARISONS[name]
    ratios, ta, tb = [], [], []
    for i in range(pairs):
        order = [("a", a), ("b", b)] if i % 2 == 0 else [("b", b), ("a", a)]
        got = {}
        for tag, cmd in order:
            out = tmp / f"{len(list(tmp.iterdir()))}-{tag}"
            got[tag] = run(cmd, out)
            shutil.rmtree(out, ignore_errors=True)
        ta.append(got["a"])
        tb.append(got["b"])
        ratios.append(got["a"] / got["b"])
        print(f"   pair {i + 1}: {got['a'] * 1e3:7.2f} ms / {got['b'] * 1e3:7.2f} ms = "
              f"{ratios[-1]:.3f}", flush=True)
    verdict = "" if target is None else \
        f"  target <= {target}: {'met' if st.median(ratios) <= target else 'NOT met'}"
    print(f"{name}: median {st.median(ratios):.3f} (min {min(ratios):.3f}, max "
          f"{max(ratios):.3f}); A {st.median(ta) * 1e3:.2f} ms, B {st.median(tb) * 1e3:.2f} ms"
          f"{verdict}\n", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--only", nargs="+", choices=list(COMPARISONS), default=None,
                    metavar="NAME", help=f"comparisons to run: {', '.join(COMPARISONS)}")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-runs-"))
    try:
        for name in args.only or COMPARISONS:
            print(f"{name} ({args.pairs} pairs, alternated)", flush=True)
            compare(name, args.pairs, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
