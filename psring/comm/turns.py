"""First come, first served among the senders that share one link: a parameter
server's datagram pulls leave one at a time (psring.comm.egress).

    turns = Turns()
    ticket = turns.take()        # where the job is queued (one thread: the handler)
    turns.wait(ticket)           # on the job's sender thread: its turn has come
    ...                          # its datagrams at the link's pace, turns.moving()
    turns.release(ticket)        # the next one's turn

Paced senders sharing a link each get a share of it, so N pulls of one size all end
at the end of the pull phase, as TCP's do. Taking turns (Homa's senders send the
message with the fewest bytes left first; a synchronous server's pulls are all one
size, so the first answered goes first), the first worker has its parameters after
1/N of the phase and computes while the others' arrive; the last ends when it would
have. A waiting job goes anyway once the link has been still for :data:`STILL_S`
(a sender closed or failed with its jobs queued): a wait is bounded, never a hang.
"""

from __future__ import annotations

import threading
import time

#: seconds without a send on the link (nothing released, nothing sent) after which a
#: job stops waiting for the turns before it
STILL_S = 1.0


class Turns:
    """Tickets in the order jobs are queued; a job is sent once every ticket before
    it is released, or once the link has been still for :data:`STILL_S`."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.issued = 0   # tickets handed out
        self.serving = 0  # the first ticket not released
        self.released: set[int] = set()  # released out of order (after a still link)
        self.moved = time.monotonic()  # the last send or release

    def take(self) -> int:
        with self.cond:
            self.issued += 1
            return self.issued - 1

    def moving(self) -> None:
        """A send on the link (the turn's holder, or a resend): the queue moves."""
        self.moved = time.monotonic()

    def wait(self, ticket: int) -> bool:
        """Until ``ticket``'s turn (True), or until the link has been still for
        :data:`STILL_S` (False)."""
        with self.cond:
            while self.serving < ticket:
                if not self.cond.wait(STILL_S) \
                        and time.monotonic() - self.moved >= STILL_S:
                    return False
            return True

    def release(self, ticket: int) -> None:
        with self.cond:
            self.released.add(ticket)
            while self.serving in self.released:
                self.released.discard(self.serving)
                self.serving += 1
            self.moved = time.monotonic()
            self.cond.notify_all()
