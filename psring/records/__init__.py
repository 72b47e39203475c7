"""A run's records once it ran: logs, timelines, merges, sweeps of many runs.

- ``runlog``: the run directory, its logs and atomic writes;
- ``trace``: timelines (trace.json, a PNG) from a run's step and server logs;
- ``merge``: joining the run directories of several hosts;
- ``sweep``: a TOML definition run point by point (resumable);
- ``compare``: ``psring compare``, the default sweep.
"""

from psring._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "StepLog": "runlog", "read_steps": "runlog", "read_manifest": "runlog",
    "write_trace": "trace", "Sweep": "sweep", "run_sweep": "sweep",
    "run_compare": "compare",
})
