"""The processes of a run (psring.runs.launch starts them): supervising, forking, the
rendezvous of workers on several hosts.

- ``process``: the supervisor (fail-stop on the first failure, no orphans);
- ``forking``: starting those processes as forks of a launcher that imported torch once;
- ``rendezvous``: workers started by torchrun on several hosts (run id, deadlines);
- ``allocator``: glibc malloc thresholds for worker and server processes;
- ``faults``: faults placed from the command line (--kill-worker, --kill-server) and
  restarts from the last checkpoint (--max-restarts).
"""

from psring._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "Supervisor": "process", "ProcessSpec": "process",
})
