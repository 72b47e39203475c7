"""The scaling question for the seeds' models: `psring advise --max-workers 1024` on each
H100 profile of experiments/profiles/h100, 8 GPUs a host joined by NVLink 4 (an H100
box: --device-link nvlink4) over 100 Gbit/s links, priced with the GPU servers' costs on
paper (experiments/published.py's GPU: α 10 µs a message, 10 GB/s through a host's
memory). Prints one Markdown table: each strategy's predicted
efficiency at 8, 64, 512 and 1024 workers and the largest count that keeps 80%; each
model's advise.json and scaling.png stay under --out.

    python experiments/scaling_seeds.py --out runs/scaling-seeds

Nothing here is measured: the profiles are the H100's, the cluster is described.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from published import GPU

HERE = Path(__file__).resolve().parent
PROFILES = HERE / "profiles" / "h100"
MODELS = ("resnet50", "resnet101", "inception_v3", "vgg16", "mlstm4096", "gpt2-small")
SIZES = (8, 64, 512, 1024)


def advise(model: str, cal: Path, out: Path, link: str, per_host: int,
           max_workers: int, device_link: str) -> dict:
    """One model's `psring advise --max-workers`, through the CLI as a user runs it."""
    cmd = [sys.executable, "-m", "psring", "advise", "--profile",
           str(PROFILES / f"{model}.json"), "--calibration", str(cal),
           "--workers-per-host", str(per_host), "--max-workers", str(max_workers),
           "--link", link, "--device-link", device_link, "--out", str(out / model)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=600)
    return json.loads((out / model / "advise.json").read_text())["scaling"]


def rows(model: str, sc: dict) -> list[str]:
    out = []
    for name, points in sc["strategies"].items():
        by = {p["workers"]: p for p in points}
        if len(by) < 2:
            continue
        cells = [f"{by[n]['efficiency']:.0%}" if n in by else "" for n in SIZES]
        out.append(f"| {model} | {name} | " + " | ".join(cells)
                   + f" | {sc['recommended_workers'][name]} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/scaling-seeds")
    ap.add_argument("--link", default="100gbit")
    ap.add_argument("--workers-per-host", type=int, default=8)
    ap.add_argument("--max-workers", type=int, default=1024)
    ap.add_argument("--device-link", default="nvlink4")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cal = GPU.save(out / "gpu-calibration.json")
    lines = ["| model | strategy | " + " | ".join(map(str, SIZES)) + " | keeps 80% to |",
             "|---|---|" + "---|" * len(SIZES) + "---|"]
    priced = []
    for model in MODELS:
        sc = advise(model, cal, out, args.link, args.workers_per_host, args.max_workers,
                    args.device_link)
        lines += rows(model, sc)
        priced.append(f"{model} {sc['priced_s']:.1f} s")
    print("\n".join(lines))
    print()
    print("priced (every strategy, every setting, 1 to "
          f"{args.max_workers} workers): " + ", ".join(priced))
    return 0


if __name__ == "__main__":
    sys.exit(main())
