"""One thread that runs the jobs several senders queue: resends first, then the rest in
the order they were queued.

    outbox = Outbox("transpose-send")
    sender = LossySender(endpoint, run, worker, outbox=outbox)  # its jobs run here
    ...
    outbox.close()  # after the last job; then the senders' sockets

A datagram sender (psring.comm.lossy.LossySender) hands its jobs to an outbox so that
a gradient hook never waits for the link; by default each sender has an outbox of its
own. A resend goes ahead of the transfers still queued: its receiver is waiting for it,
and behind a bucket's worth of datagrams it would cost the receiver another idle
timeout. A transpose all-reduce's senders to every peer share one: its rank has one link,
the pace is shared anyway, and one thread instead of one per peer spares the cores a
thread switch for every wakeup of each.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable


class Outbox:
    """A thread running ``run(job)`` for each :meth:`put`, one at a time: urgent jobs
    (resends, which a receiver waits on) before the others, each kind in order."""

    def __init__(self, name: str):
        self.cond = threading.Condition()
        self.urgent: deque = deque()
        self.jobs: deque = deque()
        self.closing = False
        self.thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self.thread.start()

    def put(self, run: Callable[[Any], None], job: Any, urgent: bool = False) -> None:
        with self.cond:
            (self.urgent if urgent else self.jobs).append((run, job))
            self.cond.notify()

    def _next(self) -> tuple | None:
        """The next job (None: closed and nothing left)."""
        with self.cond:
            while not (self.urgent or self.jobs or self.closing):
                self.cond.wait()
            if self.urgent:
                return self.urgent.popleft()
            return self.jobs.popleft() if self.jobs else None

    def _loop(self) -> None:
        while (item := self._next()) is not None:
            run, job = item
            run(job)
            # (nothing of the job held while waiting for the next: a sender's block
            # goes back to its buffers once the sender is done with it)
            item = run = job = None

    def close(self, timeout: float = 5.0) -> None:
        """Run what is queued, then stop the thread (waiting at most ``timeout``)."""
        with self.cond:
            self.closing = True
            self.cond.notify()
        self.thread.join(timeout=timeout)
