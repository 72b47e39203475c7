"""How large a cluster of device workers (--compute device) this machine emulates
faithfully: each case is one `psring run` through the CLI, on emulated hosts.

    python benchmarks/bench_device_capacity.py                  # the cases below
    python benchmarks/bench_device_capacity.py --cases r50-16   # one of them

Faithful (docs/emulation.md, "Device mode"):

- **compute**: in a compute-bound case (fast links, little to send) the median step is
  the profile's compute (forward + backward + update, on the described clock) within 5%;
- **links**: in a link-bound case the busiest host link carries at least 90% of its
  rate in the steady state, measured from the link itself: the bytes each emulated
  host's eth0 sent (its namespace's /proc/PID/net/dev, sampled while the run goes).

Profiles are on paper (psring profile --on-paper): the model's real parameter list, and
step times in the range published for a V100 at batch 64 (ResNet-50 about 0.2 s, VGG-16
about 0.3 s); they set the ratio of compute to communication, which is what is tested.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PSRING = [sys.executable, "-m", "psring"]
#: models the size of the issue's targets, with small images (the parameter list does
#: not depend on the image size; the synthetic data set stays small)
MODELS = {
    "resnet50": ["--model", "resnet50", "--image-size", "32", "--classes", "1000"],
    "vgg16": ["--model", "vgg16", "--image-size", "32", "--classes", "1000"],
    "mlp": ["--model", "mlp", "--width", "256", "--depth", "2", "--features", "64"],
}


@dataclass
class Case:
    name: str
    kind: str  # "compute" or "link": which faithfulness it tests
    model: str
    step_ms: float  # the device's forward + backward at the per-worker batch
    workers: int
    hosts: int
    link: str
    time_scale: float = 1.0
    strategy: str = "allreduce"
    steps: int = 12
    per_worker_batch: int = 64
    extra: list[str] = field(default_factory=list)


CASES = [
    Case("mlp-4-compute", "compute", "mlp", 100, 4, 4, "10gbit"),
    Case("r50-8-compute", "compute", "resnet50", 200, 8, 4, "10gbit", time_scale=10),
    Case("r50-16-compute", "compute", "resnet50", 200, 16, 4, "10gbit", time_scale=10),
    Case("r50-8-compute-ddp", "compute", "resnet50", 200, 8, 4, "10gbit", time_scale=10,
         strategy="ddp"),
    Case("r50-4-link", "link", "resnet50", 20, 4, 4, "1gbit"),
    Case("r50-16-link", "link", "resnet50", 20, 16, 4, "1gbit", time_scale=4),
    Case("vgg16-8-link", "link", "vgg16", 30, 8, 4, "1gbit", time_scale=4),
    Case("vgg16-8-compute", "compute", "vgg16", 300, 8, 4, "10gbit", time_scale=20),
    # compute-bound as the criterion means it: links fast enough that the ring hides in
    # backward, buckets small enough that the last one's tail is a few ms
    Case("r50-16-25gbit", "compute", "resnet50", 200, 16, 4, "25gbit", time_scale=25,
         extra=["--bucket-mb", "5"]),
    Case("vgg16-8-100gbit", "compute", "vgg16", 300, 8, 4, "100gbit", time_scale=100,
         steps=8, extra=["--bucket-mb", "5"]),
    # link-bound at the rule's S: 968 MB a step over each host's link, 0.8 s at 10 Gbit/s
    Case("vgg16-8-10gbit-S20", "link", "vgg16", 300, 8, 4, "10gbit", time_scale=20),
    # the same with 25 MB buckets: 22 all-reduces a step instead of 111, each paying
    # gloo's per-hop wake-ups of 8 processes on 2 cores
    Case("vgg16-8-100gbit-b25", "compute", "vgg16", 300, 8, 4, "100gbit", time_scale=100,
         steps=8),
    # at the time scale the capacity rule asks for (psring.train.device.capacity)
    Case("vgg16-8-S10", "compute", "vgg16", 300, 8, 4, "10gbit", time_scale=10),
    Case("vgg16-8-rule", "compute", "vgg16", 300, 8, 4, "10gbit", time_scale=15),
    # one described cluster at several time scales: how far S moves a result
    *[Case(f"r50-4-1gbit-S{k}", "scale", "resnet50", 200, 4, 4, "1gbit", time_scale=k)
      for k in (1, 2, 5)],
    *[Case(f"mlp-4-1gbit-S{k}", "scale", "mlp", 20, 4, 4, "1gbit", time_scale=k)
      for k in (1, 5, 10)],
]


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*PSRING, *map(str, argv)], capture_output=True, text=True, **kw)


def eth0_tx(pid: int) -> int:
    for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]:
        name, rest = line.split(":", 1)
        if name.strip() == "eth0":
            return int(rest.split()[8])  # transmit bytes
    raise KeyError("eth0")


def measure(case: Case, root: Path) -> dict:
    prof = root / f"profile-{case.model}-{case.step_ms:g}ms-b{case.per_worker_batch}"
    if not prof.exists():
        # at the published image size: FLOPs, which place the gradients in backward,
        # depend on it (the parameter list does not)
        # (a later flag wins: the run's 32 x 32 becomes 224 x 224 for the profile)
        paper = MODELS[case.model] + (["--image-size", "224"]
                                      if "--image-size" in MODELS[case.model] else [])
        p = _run(["profile", "--on-paper", *paper, "--batch-size",
                  case.per_worker_batch, "--step-ms", case.step_ms, "--out", prof])
        if p.returncode:
            raise RuntimeError(p.stderr)
    out = root / case.name
    argv = ["run", "--strategy", case.strategy, "--workers", case.workers, "--hosts",
            case.hosts, "--link", case.link, *MODELS[case.model], "--samples", 512,
            "--batch-size",
            case.workers * case.per_worker_batch, "--steps", case.steps, "--compute",
            "device", "--device-profile", prof, "--time-scale", case.time_scale,
            "--timeout", 600, "--out", out, *case.extra]
    t0 = time.monotonic()
    proc = subprocess.Popen([*PSRING, *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    samples: list[tuple[float, int, list[int]]] = []  # (time, steps logged, tx per host)
    while proc.poll() is None:
        time.sleep(0.25)
        try:
            state = json.loads((out / "cluster.json").read_text())
            tx = [eth0_tx(h["pid"]) for h in state["hosts"]]
            steps = (out / "steps.jsonl").read_text().count("\n")
        except (OSError, ValueError, KeyError):
            continue
        samples.append((time.monotonic(), steps, tx))
    err = proc.stderr.read()
    if proc.returncode:
        raise RuntimeError(f"{case.name}: {err[-2000:]}")
    wall = time.monotonic() - t0
    manifest = json.loads((out / "manifest.json").read_text())
    records = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    warm = max(2, case.steps // 4)
    kept = [r for r in records if r["step"] >= warm]
    c = manifest["compute"]
    compute = c["forward_s"] + c["backward_s"] + c["update_s"]
    step = statistics.median(max(r["step_s"] for r in kept if r["step"] == s)
                             for s in {r["step"] for r in kept})
    measured_compute = statistics.median(r["forward_s"] + r["backward_s"] for r in kept)
    # the links: between the first sample past warm-up and the last one of training
    window = [s for s in samples if warm * case.workers <= s[1] < case.steps * case.workers]
    util = None
    if len(window) >= 2:
        (ta, _, a), (tb, _, b) = window[0], window[-1]
        rate = manifest["cluster"]["emulated_link_bits_per_s"]
        util = max((y - x) * 8 / (tb - ta) / rate for x, y in zip(a, b))
    return {"case": case.name, "kind": case.kind, "workers": case.workers,
            "hosts": case.hosts, "link": case.link, "time_scale": case.time_scale,
            "model_mb": manifest["parameter_bytes"] / 1e6,
            "profile_compute_ms": (c["forward_s"] + c["backward_s"]) * 1e3,
            "measured_compute_ms": measured_compute * 1e3,
            "compute_ratio": measured_compute / (c["forward_s"] + c["backward_s"]),
            "step_ms": step * 1e3, "step_over_compute": step / compute,
            "busiest_link_utilization": util, "wall_s": wall,
            "wall_per_step_s": wall / case.steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(c.name for c in CASES))
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args()
    wanted = args.cases.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="psring-capacity-") as tmp:
        for case in [c for c in CASES if c.name in wanted]:
            row = measure(case, Path(tmp))
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
