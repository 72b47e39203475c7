"""First come, first served among the senders that share one link: a parameter
server's datagram pulls leave one at a time (psring.comm.egress).

    turns = Turns()
    ticket = turns.take(group, lane)  # queued (one thread: the handler); group: one
                                      # pull's parts, lane: one sender's jobs
    turns.wait(ticket)           # on the job's sender thread: its turn has come
    ...                          # its datagrams at the link's pace, turns.moving()
    turns.release(ticket)        # the next one's turn

Paced senders sharing a link each get a share of it, so N pulls of one size all end
at the end of the pull phase, as TCP's do. Taking turns (Homa's senders send the
message with the fewest bytes left first; a synchronous server's pulls are all one
size, so the first answered goes first, each answered range by range: its ranges
one after another), the first worker has its parameters after
1/N of the phase and computes while the others' arrive; the last ends when it would
have. A waiting job goes anyway once the link has been still for :data:`STILL_S`
(a sender closed or failed with its jobs queued): a wait is bounded, never a hang.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Hashable

#: seconds without a send on the link (nothing released, nothing sent) after which a
#: job stops waiting for the turns before it
STILL_S = 1.0


class Turns:
    """Tickets served one at a time: a job is sent once it holds the turn, or once the
    link has been still for :data:`STILL_S`. The turn goes to the ticket of the
    earliest group, then the earliest ticket within it: a group (one pull, answered
    range by range) that took its first ticket before another has each of its later
    tickets served before that other's, so a pull is sent whole before the next (as
    Homa sends the message with the fewest bytes left first: of pulls of one size, the
    one begun first), not range by range among all of them."""

    #: groups remembered (the oldest forgotten first: long done)
    GROUPS = 4096

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.issued = 0   # tickets handed out
        self.pending: dict[int, tuple[int, int]] = {}  # ticket -> (group's rank, ticket)
        self.ranks: OrderedDict = OrderedDict()  # group -> its first ticket
        self.lanes: dict = {}  # lane -> the rank of its last ticket
        self.moved = time.monotonic()  # the last send or release

    def take(self, group: Hashable = None, lane: Hashable = None) -> int:
        """A ticket, behind every pending ticket of the groups begun before ``group``
        (None: a group of its own), and behind every ticket taken before on ``lane``:
        the jobs one thread runs in the order queued (a sender's) must have their
        turns in that order too, or a thread waiting for a later job's turn would hold
        up the earlier one the turn went to (until the link was still for
        :data:`STILL_S`)."""
        with self.cond:
            ticket = self.issued
            self.issued += 1
            rank = ticket if group is None else self.ranks.setdefault(group, ticket)
            if group is not None and len(self.ranks) > self.GROUPS:
                self.ranks.popitem(last=False)
            if lane is not None:
                rank = self.lanes[lane] = max(rank, self.lanes.get(lane, rank))
            self.pending[ticket] = (rank, ticket)
            return ticket

    def turn(self) -> int | None:
        """The ticket whose turn it is (None: none pending)."""
        with self.cond:
            return min(self.pending, key=self.pending.__getitem__, default=None)

    def moving(self) -> None:
        """A send on the link (the turn's holder, or a resend): the queue moves."""
        self.moved = time.monotonic()

    def wait(self, ticket: int) -> bool:
        """Until ``ticket``'s turn (True), or until the link has been still for
        :data:`STILL_S` (False)."""
        with self.cond:
            while self.turn() != ticket:
                if not self.cond.wait(STILL_S) \
                        and time.monotonic() - self.moved >= STILL_S:
                    return False
            return True

    def release(self, ticket: int) -> None:
        with self.cond:
            self.pending.pop(ticket, None)
            self.moved = time.monotonic()
            self.cond.notify_all()
