"""What the test files share, imported explicitly from here:

    from tests.helpers import SMALL, assert_no_processes, needs_emulation, psring

- :mod:`tests.helpers.runs`: the psring CLI as a subprocess or in this process, the
  check that a run's processes are gone, and readers of a run's files;
- :mod:`tests.helpers.zygote`: where those subprocesses come from: forked from one
  process per session that imported torch and psring once (``zygote.start``);
- :mod:`tests.helpers.servers`: a parameter server in a thread or a child process and
  a raw client that speaks the wire protocol;
- :mod:`tests.helpers.emulation`: can this machine build emulated clusters, and is a
  run's cluster gone afterwards;
- :mod:`tests.helpers.multihost`: torchrun on emulated hosts, as on real machines;
- :mod:`tests.helpers.adasumref`: the model an Adasum run should end with;
- :mod:`tests.helpers.layout`: docs/architecture_graph.py, the import graph, as a module.

Fixtures and hooks stay in tests/conftest.py. The test folders are packages under
``tests``, so pytest puts the repository root on ``sys.path`` and ``tests.helpers``
imports from any test file, wherever pytest is started.
"""

from tests.helpers.adasumref import trained_by_the_tree
from tests.helpers.emulation import (
    assert_cluster_gone,
    cluster_state,
    cut_link,
    emulation_unavailable,
    leftovers,
    needs_emulation,
)
from tests.helpers.multihost import Hosts, Node, emulated_hosts, next_port, user_env, wait_all
from tests.helpers.runs import (
    PSRING,
    SMALL,
    TESTS,
    assert_evals,
    assert_no_processes,
    cli_here,
    env_with_plugins,
    interruptible,
    live_processes,
    load_model,
    max_rel_diff,
    once_across_workers,
    pid_alive,
    process_named,
    processes_mentioning,
    psring,
    psring_together,
    read_evals,
    read_steps,
)
from tests.helpers.servers import LiveServer, RawClient, ops, req, rss_kib, start_server_process

__all__ = [
    "PSRING", "SMALL", "TESTS", "Hosts", "LiveServer", "Node", "RawClient",
    "assert_cluster_gone", "assert_evals", "assert_no_processes", "cli_here", "cluster_state",
    "cut_link", "emulated_hosts", "emulation_unavailable", "env_with_plugins", "interruptible",
    "leftovers", "live_processes", "load_model", "max_rel_diff",
    "needs_emulation", "next_port", "once_across_workers", "ops", "pid_alive",
    "process_named", "processes_mentioning", "psring", "psring_together", "read_evals",
    "read_steps", "req", "rss_kib",
    "start_server_process", "trained_by_the_tree", "user_env", "wait_all",
]
