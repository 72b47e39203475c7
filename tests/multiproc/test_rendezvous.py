"""psring.runtime.rendezvous without torchrun: the attempt's keys, the watchdog, and closing (in
child processes: the watchdog ends the process it runs in). The multi-host flows are
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


# (~6 s alone; in a full suite on two cores it once did not end within 50 s, its
# "still here" printed: as the exit test below, which has taken up to 49 s there.
# Unexplained: what holds these small processes that long on a loaded machine)
@pytest.mark.timeout(150)
def test_the_watchdog_bounds_waits_on_others_not_work_of_ones_own():
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_WATCHED), str(free_port())],
                          capture_output=True, text=True, timeout=140)
    assert proc.returncode == 1, proc.stderr
    assert "still here" in proc.stdout and "not reached" not in proc.stdout
    assert re.search(r"no progress for \d+ s \(--timeout 1 s \+ 0.5 s grace\) at: waiting "
                     r"for the others", proc.stderr), proc.stderr


# The heartbeat's store call blocks in C++ with the GIL released (HashStore.wait, as a
# TCPStore call to a busy store does); the interpreter then finalizes slowly (a cycle
# with a slow __del__, freed by its last collection). A daemon thread that takes the GIL
# back then is ended inside C++, and the process aborts.
_EXIT_IN_A_STORE_CALL = """
import gc, logging, os, sys, threading, time
from datetime import timedelta
from torch.distributed import HashStore
from psring.runtime import rendezvous

store = HashStore()
in_call = threading.Event()

class SlowClient:
    def __getattr__(self, name):
        return getattr(store, name)
    def set(self, key, value):
        in_call.set()
        try:
            store.wait(["never"], timedelta(seconds=0.5))
        except Exception:
            pass
        store.set(key, value)

class SlowExit:
    def __del__(self):
        time.sleep(1)

rendezvous._store = lambda *args, **kwargs: store
rendezvous.Rendezvous._client = lambda self: SlowClient()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], WORLD_SIZE="1", RANK="0")
launch = rendezvous.join(0, 1, 30.0, {"host": "here"}, logging.getLogger(), "[worker 0/1]")
launch.stage("training")
assert in_call.wait(10)
launch.close()
gc.disable()
keep = SlowExit()
keep.me = keep
del keep
print("closed", flush=True)
"""


# (~5 s alone; beside the rest of the suite on two cores it has taken up to 49 s)
@pytest.mark.timeout(150)
def test_a_script_exits_cleanly_while_the_heartbeat_is_in_a_store_call():
    """close() waits for the heartbeat's store call: a script under torchrun that
    trained and called dist.finish() aborted at its exit otherwise (SIGABRT)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_EXIT_IN_A_STORE_CALL),
                           str(free_port())], capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stderr
    assert "closed" in proc.stdout and "terminate called" not in proc.stderr
