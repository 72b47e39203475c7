"""The outbox (psring.comm.outbox): one thread runs the jobs several senders queue,
urgent ones (resends, which a receiver waits for) ahead of those still queued."""

from __future__ import annotations

import threading

from psring.comm.outbox import Outbox


def test_urgent_jobs_go_ahead_of_the_queued_ones_and_close_runs_what_is_left():
    box, ran, gate = Outbox("test"), [], threading.Event()
    box.put(lambda job: gate.wait(5), None)  # (holds the thread while the rest queue)
    for name in ("a", "b"):
        box.put(ran.append, name)
    box.put(ran.append, "resend", urgent=True)
    box.put(ran.append, "c")
    gate.set()
    box.close()
    assert not box.thread.is_alive()
    assert ran == ["resend", "a", "b", "c"]
