"""Running runs: the orchestration above the mechanisms it drives.

- ``launch``: one run: a RunConfig in, its cluster, servers and workers started,
  supervised and waited for (psring.runtime's supervisor, psring.cluster's hosts);
- ``sweep``: a TOML definition run point by point (resumable);
- ``compare``: ``psring compare``, the default sweep (``compare.toml``, installed
  beside it);
- ``profiling``: ``psring profile``, a short traced ``single`` run read as a profile.
"""

from psring._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "launch": "launch", "Sweep": "sweep", "run_sweep": "sweep", "run_compare": "compare",
})
