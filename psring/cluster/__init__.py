"""Where a run's processes live: the cluster a run describes, and the emulated one built
for it.

- ``spec``: one description of a run's cluster (hosts, workers per host, links,
  servers and placement); pure, no torch, no processes;
- ``emulate``: emulated hosts as network namespaces joined by shaped links
  (docs/emulation.md), with ``netns`` the namespace system calls;
- ``netif``: the network interface a worker started by torchrun on a real host uses.
"""

from psring._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "Cluster": "spec", "Host": "spec", "parse_rate": "spec", "format_rate": "spec",
    "EmulatedCluster": "emulate", "network_for": "emulate",
})
