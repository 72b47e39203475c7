"""Which failed process a run's error names: a worker that failed only because a peer
went (its log says so) is a cascade, and the supervisor waits a moment for the cause
(psring.runtime.process.Supervisor._cascade, BLAME_WAIT_S)."""

from __future__ import annotations

import types

import pytest

from psring.runtime.process import Supervisor
from workers.entry import broken_connections_named


def _child(tmp_path, text: str):
    log = tmp_path / "worker-0.log"
    log.write_text(text)
    return types.SimpleNamespace(log_path=log)


@pytest.mark.parametrize("gloo", [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer",
    "Application timeout caused by a remote worker crashing",
    "Application timeout caused by a remote worker hanging or bugs in the application",
])
def test_a_worker_that_lost_a_peer_is_a_cascade(tmp_path, gloo):
    # what the worker itself says of it (workers/entry.py), whatever gloo's wording
    with pytest.raises(Exception) as e:
        with broken_connections_named(0):
            raise RuntimeError(gloo)
    assert Supervisor._cascade(_child(tmp_path, f"psring: error: {e.value}\n"))


def test_a_worker_that_failed_on_its_own_is_the_cause(tmp_path):
    assert not Supervisor._cascade(_child(tmp_path, "RuntimeError: injected failure in "
                                                    "worker 1\n"))
