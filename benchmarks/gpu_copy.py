"""The host side of a GPU worker: device -> host and host -> device copy rates for
gradient-sized buffers, pinned (what ps and byteps use: psring.strategies.ps's host
buckets) and pageable for contrast, timed with CUDA events. A parameter server's worker
copies every gradient to the host and every parameter back each step; these rates bound
that, and psring.predict reads them from the file this writes.

    python benchmarks/gpu_copy.py --out experiments/profiles/h100/copy_rates.json

Each size: 3 warm-up copies, then the median of --repeats, each timed with a pair of
events on one stream. The fit is t = alpha + bytes / rate (least squares over the
sizes), per direction and kind of host memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

SIZES_MIB = (0.25, 1, 4, 16, 64, 256)


def time_copy(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    """Median seconds of dst.copy_(src, non_blocking=True) on the current stream."""
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def fit(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """(alpha seconds, rate bytes/s) of t = alpha + bytes / rate, least squares."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sxx
    return max(0.0, my - slope * mx), 1.0 / slope


def measure(repeats: int) -> dict:
    dev = torch.device("cuda")
    out: dict = {}
    for pinned in (True, False):
        for direction in ("d2h", "h2d"):
            sizes, secs = [], []
            for mib in SIZES_MIB:
                n = int(mib * 2**20) // 4
                host = torch.empty(n, dtype=torch.float32, pin_memory=pinned)
                gpu = torch.randn(n, device=dev)
                host.normal_()
                dst, src = (host, gpu) if direction == "d2h" else (gpu, host)
                sizes.append(n * 4)
                secs.append(time_copy(dst, src, repeats))
            alpha, rate = fit(sizes, secs)
            out[f"{direction}_{'pinned' if pinned else 'pageable'}"] = {
                "bytes": sizes, "seconds": [round(s, 9) for s in secs],
                "alpha_s": round(alpha, 9), "rate_Bps": round(rate),
                "rate_GBps_at_largest": round(sizes[-1] / secs[-1] / 1e9, 2)}
    return out


def describe() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "capability": f"{props.major}.{props.minor}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write (atomically)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_copy: torch sees no CUDA device; run this on a GPU machine.",
              file=sys.stderr)
        return 2
    result = {**describe(), "repeats": args.repeats, "copies": measure(args.repeats)}
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(args.out)) or ".")
    with os.fdopen(fd, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, args.out)
    for name, c in result["copies"].items():
        print(f"{name:16s} {c['rate_GBps_at_largest']:7.2f} GB/s at "
              f"{c['bytes'][-1] / 2**20:.0f} MiB, fit: alpha {c['alpha_s'] * 1e6:.1f} us, "
              f"rate {c['rate_Bps'] / 1e9:.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
