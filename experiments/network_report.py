"""Runs on a network under pressure (issue 32): the step's tail and how TCP met it.

    psring sweep experiments/incast.toml --out runs/incast
    python experiments/network_report.py runs/incast

For each setting (its repeats' medians): p50 and p99 step on the described cluster's
clock (`psring report`'s job step, warm-up left out), TCP's retransmitted segments and
retransmission timeouts per step, summed over the hosts (the kernel's counters of each
host's namespace, recorded by the cluster's agent in cluster.json: set-up included),
the fraction of IPv4 packets the links dropped (their forwarders' records, with --loss),
and with held-out evaluation the final accuracy and the time to the target. A Markdown
table on stdout; with ``--plot FILE``, also a figure of the time to the target against
the links' loss, one line per strategy and transport (TCP, or bounded loss), and per
queue and host count where the sweep has several (medians of the seeds, their range as
bars).

    python experiments/network_report.py runs/loss_kernel --plot tta-loss.png
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from psring.cluster.link import read_links
from psring.records.runlog import iter_run_dirs
from psring.report.cluster import cluster_text
from psring.report.runs import summarize

#: the settings a row is named by, besides the strategy, where not these defaults
KNOBS = {"loss": 0.0, "loss_burst": 1.0, "link_buffer": "", "loss_tolerance": 0.0,
         "credit_window": ""}


def network(run_dir: Path, steps: int) -> dict:
    """TCP's counters per step and the links' drop fraction of one run."""
    try:
        tcp = json.loads((run_dir / "cluster.json").read_text()).get("tcp", {})
    except (OSError, ValueError):
        tcp = {}
    total = defaultdict(int)
    for counters in tcp.values():
        for k, v in counters.items():
            total[k] += v
    links = read_links(run_dir)
    ways = [w for r in links.values() for w in (r["up"], r["down"])]
    packets = sum(w["packets"] for w in ways)
    return {"retrans_per_step": total["RetransSegs"] / steps,
            "timeouts_per_step": total["TCPTimeouts"] / steps,
            "dropped": sum(w["dropped"] for w in ways) / packets if packets else None}


def name(cfg: dict) -> str:
    knobs = [f"{k}={cfg[k]}" for k, default in KNOBS.items() if cfg.get(k, default) != default]
    return cfg["strategy"] + (f" ({', '.join(knobs)})" if knobs else "")


def rows(paths: list[str]) -> list[str]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for d in iter_run_dirs(paths):
        s = summarize(d)
        cfg = json.loads((d / "manifest.json").read_text())["config"]
        groups[(cluster_text(cfg), name(cfg))].append({**s, **network(d, s["steps"])})
    out = ["| setting | cluster | runs | p50 step ms | p99 step ms | retrans / step | "
           "RTOs / step | packets dropped | final acc | time to target s |",
           "|---|---|---|---|---|---|---|---|---|---|"]

    def med(rs: list[dict], key: str, fmt: str, scale: float = 1.0) -> str:
        vals = [r[key] for r in rs if r.get(key) is not None]
        return format(statistics.median(vals) * scale, fmt) if vals else "-"

    for (where, setting), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        out.append(f"| {setting} | {where} | {len(rs)} | {med(rs, 'step_p50_s', '.1f', 1e3)} | "
                   f"{med(rs, 'step_p99_s', '.1f', 1e3)} | {med(rs, 'retrans_per_step', '.1f')} | "
                   f"{med(rs, 'timeouts_per_step', '.2f')} | {med(rs, 'dropped', '.4f')} | "
                   f"{med(rs, 'accuracy_final', '.3f')} | {med(rs, 'time_to_accuracy_s', '.2f')} |")
    return out


def tta_series(paths: list[str]) -> dict[str, dict[float, list[float]]]:
    """Time to the target by loss (per cent), per line: the strategy, its transport and,
    where the runs differ in them, the hosts and the queue."""
    runs = []
    for d in iter_run_dirs(paths):
        cfg = json.loads((d / "manifest.json").read_text())["config"]
        runs.append((cfg, summarize(d).get("time_to_accuracy_s")))
    vary = {k for k in ("hosts", "link_buffer") if len({c.get(k) for c, _ in runs}) > 1}
    series: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for cfg, tta in runs:
        if tta is None:
            continue
        name = cfg["strategy"] + (" bounded" if cfg.get("loss_tolerance") else " TCP")
        if "hosts" in vary:
            name += f", {cfg['hosts']} hosts"
        if "link_buffer" in vary:
            name += f", {cfg.get('link_buffer') or 'deep'} port"
        series[name][100 * cfg.get("loss", 0.0)].append(tta)
    return series


def plot_tta(paths: list[str], out: Path) -> Path:
    """The figure of :func:`tta_series`, written to ``out``."""
    # imported here: matplotlib costs half a second and only --plot needs it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    series = tta_series(paths)
    # a color per strategy (and hosts, queue), solid for TCP, dashed for bounded loss
    kinds = sorted({name.replace(" bounded", "").replace(" TCP", "") for name in series})
    color = dict(zip(kinds, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    for name, by_loss in sorted(series.items()):
        xs = sorted(by_loss)
        mid = [statistics.median(by_loss[x]) for x in xs]
        err = [[m - min(by_loss[x]) for x, m in zip(xs, mid)],
               [max(by_loss[x]) - m for x, m in zip(xs, mid)]]
        ax.errorbar(xs, mid, yerr=err, marker="o", capsize=3, label=name,
                    linestyle="--" if "bounded" in name else "-",
                    color=color[name.replace(" bounded", "").replace(" TCP", "")])
    ax.set_xlabel("loss per link direction (%)")
    ax.set_ylabel("seconds to the target accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    plot = None
    if "--plot" in argv:
        i = argv.index("--plot")
        if i + 1 >= len(argv):
            print("--plot needs a file name, e.g. --plot tta-loss.png", file=sys.stderr)
            return 2
        plot, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    if not argv:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: python experiments/network_report.py SWEEP_DIR... [--plot FILE]",
              file=sys.stderr)
        return 2
    print("\n".join(rows(argv)))
    if plot is not None:
        print(f"figure: {plot_tta(argv, plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
