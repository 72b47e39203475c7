"""Where a point ran, in words, and which of its settings say it (CLUSTER_KEYS).

    cluster_text({"strategy": "ps", "workers": 4, "hosts": 4, "servers": 2,
                  "link": "100mbit", "server_placement": "own-hosts"})
    # '4 hosts + 2 server hosts, 100mbit links, servers own-hosts'

Labels and figure footnotes use :func:`cluster_text` (psring.cluster.spec's words for a
run's cluster); the predicted crossovers group their contenders by :func:`network_text`.
"""

from __future__ import annotations

from psring.config import cluster_of

#: the settings that place a run on an emulated cluster (psring.cluster.spec)
CLUSTER_KEYS = ("hosts", "workers_per_host", "link", "delay", "server_placement")


def cluster_text(cfg: dict) -> str:
    """Where a point ran, in a few words: 'this machine', or e.g. '2 hosts, 1gbit links'
    with the servers' placement when it matters."""
    return cluster_of(cfg).text()


def network_text(cfg: dict) -> str:
    """The network a point ran on (its hosts and links), wherever its servers were."""
    return "this machine" if cfg.get("hosts", 1) == 1 and cfg.get("link", "") == "" \
        else f"{cfg.get('hosts', 1)} hosts, {cfg.get('link') or 'unshaped'} links"
