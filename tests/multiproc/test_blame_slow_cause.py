"""The run's error names the worker that caused a failure even when that worker is slow
to exit: a peer's cascade exits first, and the cause, its error line already printed,
is still closing its connections when the supervisor's wait for it ends
(psring.runtime.process.Supervisor._reported)."""

from __future__ import annotations

import sys

import pytest

from psring.errors import RunFailed
from psring.runtime import process
from psring.runtime.process import ProcessSpec, Supervisor, error_line
from tests.helpers import pid_alive

#: the cause: prints psring's worker error line, then takes long to close (as a worker
#: tearing down its process group on a loaded machine does)
_LINE = error_line("[worker 1/2]", "RuntimeError: injected failure in worker 1")
CAUSE = f"import sys, time; print({_LINE!r}, file=sys.stderr, flush=True); time.sleep(60)"
#: the peer: fails at once with gloo's word for the cause's silence
CASCADE = ("import sys, time; time.sleep(0.3); print('[worker 0/2] error: Application "
           "timeout caused by a remote worker hanging', file=sys.stderr, flush=True); "
           "sys.exit(2)")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cause_prints", [True, False])
def test_a_slow_exiting_cause_is_named_not_its_peers_cascade(tmp_path, monkeypatch,
                                                             cause_prints):
    monkeypatch.setattr(process, "BLAME_WAIT_S", 0.5)  # (the cause outlives the wait)
    sup = Supervisor(tmp_path / "logs")
    peer = sup.start(ProcessSpec("worker-0", [sys.executable, "-c", CASCADE]))
    cause = sup.start(ProcessSpec("worker-1", [sys.executable, "-c", CAUSE if cause_prints
                                               else "import time; time.sleep(60)"]))
    with pytest.raises(RunFailed) as e:
        sup.wait()
    first = str(e.value).splitlines()[0]
    if cause_prints:
        assert first.startswith("worker-1 failed (it reported an error)"), first
        assert "also failed: worker-0" in first
        assert "injected failure in worker 1" in str(e.value)
    else:  # nothing names a cause: the cascade is all there is to report
        assert first.startswith("worker-0 failed (exit code 2)"), first
    assert not pid_alive(peer.proc.pid) and not pid_alive(cause.proc.pid)


@pytest.mark.timeout(60)
def test_a_cause_that_exits_just_after_the_last_look_is_named(tmp_path, monkeypatch):
    # the cause exits between the supervisor's look at who failed and its check that
    # nothing runs any more: the failures it reports are looked at again, not the last
    # look's (which held only the peer's cascade)
    exits = ("import sys, time; time.sleep(0.6); print("
             f"{_LINE!r}, file=sys.stderr, flush=True); sys.exit(1)")
    sup = Supervisor(tmp_path / "logs")
    peer = sup.start(ProcessSpec("worker-0", [sys.executable, "-c", CASCADE]))
    cause = sup.start(ProcessSpec("worker-1", [sys.executable, "-c", exits]))
    look = Supervisor._unexpected

    def look_then_let_it_exit(self):
        failed = look(self)
        if failed == [peer] and cause.proc.returncode is None:
            cause.proc.wait(timeout=30)  # (it exits right after this look)
        return failed

    monkeypatch.setattr(Supervisor, "_unexpected", look_then_let_it_exit)
    with pytest.raises(RunFailed) as e:
        sup.wait()
    first = str(e.value).splitlines()[0]
    assert first.startswith("worker-1 failed (exit code 1)"), first
    assert "also failed: worker-0" in first
    assert not pid_alive(peer.proc.pid) and not pid_alive(cause.proc.pid)
