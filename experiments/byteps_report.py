"""Per-host aggregation (byteps) against ps and the ring, from sweeps' run directories.

    psring sweep experiments/byteps_links.toml --out runs/byteps_links
    python experiments/byteps_report.py runs/byteps_links        # host-link bytes
    psring sweep experiments/byteps_direction.toml --out runs/byteps_direction
    python experiments/byteps_report.py runs/byteps_direction    # BytePS's direction

Host-link bytes: the emulated links' byte counters (the kernel's, recorded by the
cluster's agent into each run's cluster.json) of the same setting run for two step
counts; their difference over the extra steps is one step's traffic, set-up excluded.
Per worker host: bytes out (pushes) and in (pulls) per step, in units of the model's
gradient bytes M.

Direction: per model and link, each strategy's measured step (the slowest worker's
median, on the described cluster's clock) beside the simulator's prediction for the run
(`psring.predict.replay`: the run's own compute and bucket launches, the cluster's
links; a run's own --device-link, psring.comm.interconnect), and each strategy's speed-up
over allreduce, measured and predicted.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def link_bytes(rows: list[dict], run_of) -> list[str]:
    by = defaultdict(dict)
    for r in rows:
        c = r["config"]
        by[(c["strategy"], c["update_on"] or "server")][c["steps"]] = r
    lines = ["| strategy | worker host | out per step | in per step | out / M | in / M |",
             "|---|---|---|---|---|---|"]
    ratio = {}
    for (strategy, _update), runs in sorted(by.items()):
        if len(runs) < 2:
            continue
        lo, hi = sorted(runs)[0], sorted(runs)[-1]
        a, b = (json.loads((run_of(runs[s]) / "cluster.json").read_text())["link_bytes"]
                for s in (lo, hi))
        m = runs[hi]["gradient_bytes"]
        cfg = runs[hi]["config"]
        worker_hosts = -(-cfg["workers"] // cfg["workers_per_host"])
        outs = []
        for h in range(worker_hosts):
            name = f"host-{h}"
            out = (b[name]["from_host"] - a[name]["from_host"]) / (hi - lo)
            inn = (b[name]["to_host"] - a[name]["to_host"]) / (hi - lo)
            outs.append(out)
            lines.append(f"| {strategy} | {name} | {out / 1e6:.1f} MB | {inn / 1e6:.1f} MB | "
                         f"{out / m:.2f} | {inn / m:.2f} |")
        ratio[strategy] = sum(outs) / len(outs)
    if "ps" in ratio and "byteps" in ratio:
        lines.append("")
        lines.append(f"byteps / ps, bytes out of a worker host per step: "
                     f"{ratio['byteps'] / ratio['ps']:.3f}")
    return lines


def direction(rows: list[dict], run_of) -> list[str]:
    from psring.comm.interconnect import NVLINK, alpha_beta
    from psring.predict.calibration import Calibration, find_calibration
    from psring.predict.replay import replay

    # the hosts' interconnect at NVLink's figures on paper, for runs that had loopback
    nvlink = alpha_beta(NVLINK)
    path = find_calibration()
    cal = Calibration.load(path) if path else None
    lines = ["| model | link | strategy | device link | measured step ms | predicted ms | "
             "error | predicted, NVLink inside the hosts |", "|---|---|---|---|---|---|---|---|"]
    by = defaultdict(dict)
    for r in rows:
        c = r["config"]
        key = (Path(c.get("device_profile") or c["model"]).name, c["link"])
        # (replay prices a run's own --device-link; NVLink on paper for the others)
        pred = replay(run_of(r), cal) if cal else None
        fast = replay(run_of(r), cal, inside=None if c.get("device_link") else nvlink) \
            if cal else None
        name = (c["strategy"], c.get("device_link") or "loopback")
        by[key][name] = (r["step_p50_s"], pred.step_s if pred else None,
                         fast.step_s if fast else None)
    ms = lambda x: f"{x * 1e3:.0f}" if x else "-"  # noqa: E731
    for (model, link), st in sorted(by.items()):
        for (name, inside), (meas, pred, fast) in sorted(st.items()):
            err = f"{(pred - meas) / meas:+.0%}" if pred else "-"
            lines.append(f"| {model} | {link} | {name} | {inside} | {meas * 1e3:.0f} | "
                         f"{ms(pred)} | {err} | {ms(fast)} |")
    lines += ["", "| model | link | over allreduce | device link | speed-up, measured | "
              "predicted | predicted, NVLink inside |", "|---|---|---|---|---|---|---|"]
    ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
    for (model, link), st in sorted(by.items()):
        base = st.get(("allreduce", "loopback"))
        for (name, inside), (mb, pb, fb) in sorted(st.items()):
            if base is None or name == "allreduce":
                continue
            ma, pa, fa = base
            lines.append(f"| {model} | {link} | {name} | {inside} | {ratio(ma, mb)} | "
                         f"{ratio(pa, pb)} | {ratio(fa, fb)} |")
    if cal is None:
        lines.append("\n(no calibration: run `psring calibrate` for the predictions)")
    return lines


def main(argv: list[str]) -> int:
    from psring.report.points import collect

    if len(argv) != 1:
        print(__doc__)
        return 2
    root = Path(argv[0])
    spec, rows, problems = collect(root)
    run_of = lambda r: root / r["id"]  # noqa: E731
    steps = {r["config"]["steps"] for r in rows}
    lines = link_bytes(rows, run_of) if len(steps) > 1 else direction(rows, run_of)
    for p in problems:
        lines.append(f"\npoint {p['id']}: {p['status']} {p['error']}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
