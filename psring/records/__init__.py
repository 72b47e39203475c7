"""A run's records once it ran: logs, timelines, merges, profiles.

- ``runlog``: the run directory, its logs and atomic writes;
- ``trace``: timelines (trace.json, a PNG) from a run's step and server logs;
- ``merge``: joining the run directories of several hosts;
- ``profile``: a model's step on its own device, read from one short traced run (or
  written on paper), what the simulator and device mode take.
"""

from psring._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "StepLog": "runlog", "read_steps": "runlog", "read_manifest": "runlog",
    "write_trace": "trace", "Profile": "profile",
})
