"""Runs on a network under pressure (issue 32): the step's tail and how TCP met it.

    psring sweep experiments/incast.toml --out runs/incast
    python experiments/network_report.py runs/incast

For each setting (its repeats' medians): p50 and p99 step on the described cluster's
clock (`psring report`'s job step, warm-up left out), TCP's retransmitted segments and
retransmission timeouts per step, summed over the hosts (the kernel's counters of each
host's namespace, recorded by the cluster's agent in cluster.json: set-up included),
the fraction of IPv4 packets the links dropped (their forwarders' records, with --loss),
and with held-out evaluation the final accuracy and the time to the target. A Markdown
table on stdout.
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


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: python experiments/network_report.py SWEEP_DIR...", file=sys.stderr)
        return 2
    print("\n".join(rows(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
