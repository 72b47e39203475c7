"""psring.runtime.rendezvous without torchrun: the attempt's keys, and the watchdog (in a child
process: it ends the process it runs in). The multi-host flows are
tests/emulation/test_multihost.py."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from psring.runtime.process import free_port


def test_each_attempt_of_a_launch_has_keys_of_its_own():
    from torch.distributed import HashStore

    from psring.runtime.rendezvous import _attempt

    store = HashStore()
    assert [_attempt(store, 0), _attempt(store, 1)] == ["psring/1/", "psring/1/"]
    # a restarted round: every rank starts once more, and they agree again
    assert [_attempt(store, 1), _attempt(store, 0)] == ["psring/2/", "psring/2/"]


# (the store in process, a HashStore: what is watched is the watchdog, not TCP. With a
# TCPStore on loopback this test took 19-33 s in about half of the full test sessions,
# 5-7 s alone, the cause not found: the suite's slowest test)
_WATCHED = """
import logging, os, sys, time
from torch.distributed import HashStore
from psring.runtime import rendezvous
store = HashStore()
rendezvous._store = lambda *args, **kwargs: store
rendezvous.Rendezvous._client = lambda self: store
rendezvous.GRACE_S = 0.5
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], WORLD_SIZE="1", RANK="0")
launch = rendezvous.join(0, 1, 1.0, {"host": "here"}, logging.getLogger(), "[worker 0/1]")
launch.stage("building the model", waiting=False)
time.sleep(3)  # longer than --timeout + grace, but on its own: no deadline
print("still here", flush=True)
launch.stage("waiting for the others")
time.sleep(5)
print("not reached", flush=True)
"""


@pytest.mark.timeout(60)
def test_the_watchdog_bounds_waits_on_others_not_work_of_ones_own():
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_WATCHED), str(free_port())],
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 1, proc.stderr
    assert "still here" in proc.stdout and "not reached" not in proc.stdout
    assert re.search(r"no progress for \d+ s \(--timeout 1 s \+ 0.5 s grace\) at: waiting "
                     r"for the others", proc.stderr), proc.stderr
