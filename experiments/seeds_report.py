"""The seeds' published scaling beside psring's device-mode measurements.

    psring sweep experiments/seeds_horovod.toml --out runs/seeds_horovod
    python experiments/seeds_report.py runs/seeds_horovod        # a Markdown table
    psring sweep experiments/seeds_sentiment.toml --out runs/seeds_sentiment
    python experiments/seeds_report.py runs/seeds_sentiment

For each model (or device profile): samples/s of each point (`psring report`'s figure:
the per-worker batch over the median step, on the described cluster's clock), its
speed-up over the model's one-worker point (one device), the scaling efficiency
(speed-up / workers), and the published figure for the same setting where there is one
(PUBLISHED, sources cited). Then the published directions and whether the measurements
agree with each.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

#: Horovod's README table of October 2017 (horovod PR #44): 16 Pascal GPUs (4 servers x
#: 4), batch 64 per GPU; speed-up over one GPU. psring's ps stands for distributed
#: TensorFlow, allreduce for Horovod over TCP; RDMA is beside it, not emulated here.
#: the device count behind each published speed-up
PUBLISHED_DEVICES = {"seeds_horovod": 16, "seeds_horovod_h100": 16}
PUBLISHED = {
    "seeds_horovod": {
        ("inception_v3", "ps"): 10.0, ("inception_v3", "allreduce"): 14.8,
        ("inception_v3", "allreduce over RDMA"): 15.0,
        ("resnet101", "ps"): 8.0, ("resnet101", "allreduce"): 14.1,
        ("resnet101", "allreduce over RDMA"): 14.6,
        ("vgg16", "ps"): 0.6, ("vgg16", "allreduce"): 10.0,
        ("vgg16", "allreduce over RDMA"): 13.7,
    },
}


#: efficiencies closer than this are a tie, not a direction (run-to-run spread here)
TIE = 0.02


# the same cluster with H100s (seeds_horovod_h100.toml): the published figures are the
# Pascal GPUs', shown beside as the 2017 reference
PUBLISHED["seeds_horovod_h100"] = PUBLISHED["seeds_horovod"]


def _label(r: dict) -> str:
    v = r["varied"]
    return str(v.get("model") or v.get("device_profile") or r["config"]["model"])


def _network(r: dict) -> str:
    return r["config"].get("link") or "one host"


def rows_of(sweep_dir: Path) -> tuple[dict, list[dict], list[dict]]:
    from psring.report.points import collect

    spec, rows, problems = collect(sweep_dir)
    base = {_label(r): r["samples_per_s"] for r in rows if r["workers"] == 1}
    out = []
    for r in rows:
        if r["workers"] == 1 or _label(r) not in base:
            continue
        s = r["samples_per_s"] / base[_label(r)]
        out.append({"model": _label(r), "strategy": r["config"]["strategy"],
                    "network": _network(r), "workers": r["workers"],
                    "hosts": r["hosts"],
                    "samples_per_s": r["samples_per_s"], "speedup": s,
                    "efficiency": s / r["workers"]})
    out.sort(key=lambda x: (x["model"], x["strategy"], x["network"], x["workers"]))
    return spec, out, problems


def _published(pub: float | None, devices: int) -> str:
    return f"{pub:.1f}x ({pub / devices:.0%} of {devices})" if pub else "-"


def table(spec: dict, rows: list[dict], problems: list[dict]) -> list[str]:
    published = PUBLISHED.get(spec["name"], {})
    devices = PUBLISHED_DEVICES.get(spec["name"], 0)
    lines = ["| model | strategy | network | workers (hosts) | samples/s | speed-up | "
             "efficiency | published |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pub = published.get((r["model"], r["strategy"]))
        lines.append(f"| {r['model']} | {r['strategy']} | {r['network']} | {r['workers']} "
                     f"({r['hosts']}) | {r['samples_per_s']:.0f} | {r['speedup']:.1f}x | "
                     f"{r['efficiency']:.0%} | "
                     f"{_published(pub, devices)} |")
    shown = {(r["model"], r["strategy"]) for r in rows}
    for (model, strategy), pub in published.items():
        if (model, strategy) not in shown:
            lines.append(f"| {model} | {strategy} | - | - | not emulated | - | - | "
                         f"{_published(pub, devices)} |")
    for p in problems:
        lines.append(f"\n(point {p['id']}: {p['status']}: {p['error'][:300]})")
    return lines


def _first_wins(what: str, claim: str, a: tuple[str, float | None],
                b: tuple[str, float | None]) -> list[str]:
    """One published claim that ``a`` scales better than ``b``, with the measured
    efficiencies and the verdict ([] when either was not measured)."""
    if a[1] is None or b[1] is None:
        return []
    if abs(a[1] - b[1]) < TIE:
        verdict = f"a tie (within {TIE * 100:.0f} points: one 8-step run per point does not tell)"
    else:
        verdict = "reproduced" if a[1] > b[1] else "NOT reproduced"
    return [f"- {what}: published, {claim}; measured {a[0]} {a[1]:.0%} vs {b[0]} "
            f"{b[1]:.0%}: {verdict}"]


def directions(spec: dict, rows: list[dict]) -> list[str]:
    """The published directions, each with the measured verdict (efficiency at the most
    workers measured)."""
    def eff(**match):
        got = [r for r in rows if all(r[k] == v for k, v in match.items())]
        return max(got, key=lambda r: r["workers"])["efficiency"] if got else None

    models = sorted({r["model"] for r in rows})
    out = []
    if spec["name"] in ("seeds_horovod", "seeds_horovod_h100"):
        pub = PUBLISHED["seeds_horovod"]
        for m in models:
            out += _first_wins(m, f"Horovod's ring beats the PS ({pub[(m, 'allreduce')]:.1f}x "
                                  f"vs {pub[(m, 'ps')]:.1f}x)",
                               ("the ring", eff(model=m, strategy="allreduce")),
                               ("the PS", eff(model=m, strategy="ps")))
        for strategy in ("allreduce", "ps"):  # every pair of models, better first
            ranked = sorted(models, key=lambda m: -pub[(m, strategy)])
            for better, worse in itertools.combinations(ranked, 2):
                out += _first_wins(strategy, f"{better} scales better "
                                             f"({pub[(better, strategy)]:.1f}x vs "
                                             f"{pub[(worse, strategy)]:.1f}x)",
                                   (better, eff(model=better, strategy=strategy)),
                                   (worse, eff(model=worse, strategy=strategy)))
    if spec["name"] == "seeds_sentiment":
        for m in models:
            out += _first_wins(m, "InfiniBand scales better across hosts than Ethernet",
                               ("InfiniBand", eff(model=m, network="200gbit")),
                               ("Ethernet", eff(model=m, network="10gbit")))
        if len(models) == 2:
            small, large = models  # mlstm4096, mlstm8192
            out += _first_wins("on InfiniBand", "the larger model scales better",
                               (large, eff(model=large, network="200gbit")),
                               (small, eff(model=small, network="200gbit")))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    spec, rows, problems = rows_of(Path(argv[0]))
    print("\n".join(table(spec, rows, problems)))
    print()
    print("\n".join(directions(spec, rows)) or "(no direction to check yet)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
