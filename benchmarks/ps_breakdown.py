"""Diagnostic (not a target): where a ps run's step goes, from its own logs.

    .venv/bin/python benchmarks/ps_breakdown.py RUN_DIR [RUN_DIR ...]

For each run (``psring run --strategy ps ... --trace``; any ps, async-ps or byteps run
works, --trace adds nothing this needs), the median over the steps after warm-up of:
each worker phase (forward, backward, comm, update), each bucket's time from its
launch to its parameters being back (the copy to the host, the push, the servers' sum
and update, the pull and the copy back, end to end), and from servers.jsonl what the
servers spent inside requests: adding pushes (``apply_s`` of a push), and how long the
pulls were held for the last push of their step (``wait_s`` of a pull). What is left of
a bucket's time after the server's own work is transport, copies and queueing.
benchmarks/gpu_check.sh runs it on the GPU machine's ps runs (issue 45).
"""

from __future__ import annotations

import json
import statistics as st
import sys
from collections import defaultdict
from pathlib import Path

WARMUP = 3


def _lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _ms(xs) -> str:
    xs = list(xs)
    return f"{st.median(xs) * 1e3:7.2f}" if xs else "      -"


def breakdown(run: Path) -> list[str]:
    steps = [r for r in _lines(run / "steps.jsonl") if r.get("step", 0) >= WARMUP]
    if not steps:
        return [f"{run}: no steps after the first {WARMUP}"]
    manifest = json.loads((run / "manifest.json").read_text())
    cfg = manifest.get("config", {})
    out = [f"{run.name}: {cfg.get('strategy')} x{cfg.get('workers')} workers, "
           f"{cfg.get('servers', '-')} server(s), device {manifest.get('device', '?')}, "
           f"{len(steps)} worker steps after the first {WARMUP}; medians in ms"]
    out.append("  step " + _ms(r["step_s"] for r in steps) + "  " + "  ".join(
        f"{k[:-2]} {_ms(r[k] for r in steps).strip()}"
        for k in ("forward_s", "backward_s", "comm_s", "update_s")))
    buckets = defaultdict(list)
    for r in steps:
        for i, (a, b) in enumerate(zip(r.get("bucket_launch_s") or [],
                                       r.get("bucket_done_s") or [])):
            buckets[i].append(b - a)
    for i, ts in sorted(buckets.items()):
        out.append(f"  bucket {i}: launch to parameters back {_ms(ts).strip()}")
    # (a push names its step; a pull the version it waits for)
    served = [r for r in _lines(run / "servers.jsonl") if r.get("op") in ("push", "pull")
              and (r.get("step") if r["op"] == "push" else r.get("version") or 0) >= WARMUP]
    per_step: dict[tuple, float] = defaultdict(float)
    for r in served:
        if r["op"] == "push":
            per_step[(r["server"], r["step"])] += r.get("apply_s", 0.0)
    if per_step:
        out.append(f"  servers: adding a step's pushes {_ms(per_step.values()).strip()} per "
                   f"server; a pull held for its step's last push "
                   f"{_ms(r.get('wait_s', 0.0) for r in served if r['op'] == 'pull').strip()}")
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for d in argv:
        print("\n".join(breakdown(Path(d))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
