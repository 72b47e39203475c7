"""Where a point ran, in words, and which of its settings say it (CLUSTER_KEYS).

    cluster_text({"strategy": "ps", "workers": 4, "hosts": 4, "servers": 2,
                  "link": "100mbit", "server_placement": "own-hosts"})
    # '4 hosts + 2 server hosts, 100mbit links, servers own-hosts'

Labels and figure footnotes use :func:`cluster_text`; the predicted crossovers group
their contenders by :func:`network_text`. A shared description of a cluster (issue 18)
is to replace the look-up these do.
"""

from __future__ import annotations

from types import SimpleNamespace

# psring.emulate's ClusterPlan is imported inside cluster_text, as before this module
# existed: it is to become one shared cluster description (issue 18), and emulate is
# being untangled from launch and config meanwhile.


#: the settings that place a run on an emulated cluster (psring.emulate)
CLUSTER_KEYS = ("hosts", "workers_per_host", "link", "delay", "server_placement")


def cluster_text(cfg: dict) -> str:
    """Where a point ran, in a few words: 'this machine', or e.g. '2 hosts, 1gbit links'
    with the servers' placement when it matters."""
    from ..emulate import ClusterPlan

    topo_cfg = {"hosts": 1, "workers_per_host": 0, "server_placement": "colocated",
                "link": "", "delay": "", "master_addr": "127.0.0.1", **cfg}
    plan = ClusterPlan.for_config(SimpleNamespace(**topo_cfg))
    if not plan.emulated:
        return "this machine"
    hosts = len({*plan.worker_host})
    text = f"{hosts} host{'s' if hosts > 1 else ''}"
    if plan.placement == "own-hosts" and plan.server_host:
        k = len(plan.server_host)
        text += f" + {k} server host{'s' if k > 1 else ''}"
    text += f", {plan.link or 'unshaped'} links"
    if plan.delay:
        text += f", {plan.delay} delay"
    if plan.server_host:
        text += f", servers {plan.placement}"
    return text


def network_text(cfg: dict) -> str:
    """The network a point ran on (its hosts and links), wherever its servers were."""
    return "this machine" if cfg.get("hosts", 1) == 1 and cfg.get("link", "") == "" \
        else f"{cfg.get('hosts', 1)} hosts, {cfg.get('link') or 'unshaped'} links"
