"""Receiver-driven pacing of bounded-loss pushes (--credit-window): the server grants.

    granter = Granter(udp_sock, window_bytes=64 * 1024, key=secret)
    drain(udp_sock, ingress, heard=granter.heard)    # every receive: who sent what
    granter.expire()                                  # now and then: flows gone quiet

A sender of a bounded-loss push (psring.comm.lossy.LossySender with ``credits``) sends
its first :data:`UNSCHEDULED` datagrams blind, then only the packets a grant allows
(NDP's pull packets, Homa's grants). The receiver keeps the datagrams granted and not
yet arrived, over all its senders, within its credit window: as each receive arrives
it grants the flows still waiting, round robin, a few packets each (:data:`CHUNK`), so
N pushes into one server put at most a window on its port whatever N is — the
incast a window of senders each pacing to its own link does not avoid.

A grant is a small UDP datagram to the address the flow's datagrams come from
(psring.comm.datagrams.encode_grant), cumulative, so a lost one is made good by the
next. A datagram lost on the way never arrives: its grant stays outstanding until the
flow goes quiet for :data:`EXPIRE_S` (or ends), and the sender, granted nothing for its
own bounded wait, sends one packet more on its own (psring.comm.lossy): a loss costs a
bounded wait, never TCP's 200 ms timeout.
"""

from __future__ import annotations

import collections
import socket
import time
from dataclasses import dataclass

import numpy as np

from psring.comm.datagrams import (
    DATAGRAM_DTYPE,
    DATAGRAM_HEADER,
    DATAGRAM_MAGIC,
    MAX_PACKETS,
    Grant,
    encode_grant,
)

#: packets a sender sends before its first grant
UNSCHEDULED = 2
#: packets one grant adds to a flow
CHUNK = 4
#: bytes a datagram takes on the wire (a full one, with its Ethernet, IPv4, UDP headers)
WIRE_BYTES = 1514
#: seconds without a datagram after which a flow's outstanding grants are written off
EXPIRE_S = 0.02
#: ended flows remembered (a late resend of theirs is not a new flow)
ENDED_KEPT = 4096
#: flows granted at once, at most (each expires EXPIRE_S after its last datagram)
MAX_FLOWS = 4096


@dataclass
class _Flow:
    addr: tuple
    shard: int
    tag: int
    packets: int
    granted: int = UNSCHEDULED
    #: packets [0, highest) are behind the sender: it sends in order, so the highest
    #: number heard is where it is (a flow written off and heard again resumes there)
    highest: int = 0
    last: float = 0.0

    @property
    def owed(self) -> int:
        """Granted packets the sender has not got to (lost ones below the highest
        heard are not owed: a resend is asked for over TCP)."""
        return max(0, min(self.granted, self.packets) - self.highest)


class Granter:
    """The receiving side's grants, one per server (its UDP socket)."""

    def __init__(self, sock: socket.socket, window_bytes: int, key: bytes | None = None):
        self.sock, self.key = sock, key
        self.window = max(1, window_bytes // WIRE_BYTES)  # packets in flight, all senders
        self.flows: dict[tuple[int, int], _Flow] = {}
        self.waiting: collections.deque[tuple[int, int]] = collections.deque()
        #: flows that ended lately: a resend of theirs (sent unscheduled) is not a flow
        self.ended: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        self.counts = {"grants": 0, "expired": 0}

    def heard(self, addr: tuple, head: bytes | memoryview, count: int) -> None:
        """``count`` datagrams of one receive arrived from ``addr``, the first's header
        ``head``: account for them, then grant what the window allows."""
        if len(head) < DATAGRAM_HEADER:
            return
        h = np.frombuffer(bytes(head[:DATAGRAM_HEADER]), DATAGRAM_DTYPE)[0]
        if bytes(h["magic"]) != DATAGRAM_MAGIC or not 0 < int(h["packets"]) <= MAX_PACKETS:
            return  # (the ingress counts it as bad; nothing to grant)
        key = (int(h["worker"]), int(h["transfer"]))
        reach = int(h["index"]) + count  # (a coalesced receive: consecutive packets)
        flow = self.flows.get(key)
        if flow is None and key in self.ended:
            return
        if flow is None:
            if len(self.flows) >= MAX_FLOWS:  # (a flood of made-up transfers)
                return
            flow = self.flows[key] = _Flow(addr, int(h["shard"]), int(h["tag"]),
                                           int(h["packets"]))
            self.waiting.append(key)
        flow.highest = max(flow.highest, reach)
        flow.granted = max(flow.granted, flow.highest)
        flow.last = time.monotonic()
        if flow.highest >= flow.packets:
            self.done(key)
        self.grant()

    def done(self, key: tuple[int, int]) -> None:
        """The flow is whole (or its lossy_push came): it owes and waits for nothing."""
        self.flows.pop(key, None)
        self.ended[key] = None
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    def expire(self, now: float | None = None) -> None:
        """Write off the flows that went quiet (their outstanding grants were lost, or
        their sender stopped), so their share of the window goes to the others."""
        now = time.monotonic() if now is None else now
        for key in [k for k, f in self.flows.items() if now - f.last > EXPIRE_S]:
            del self.flows[key]
            self.counts["expired"] += 1
        if self.flows:
            self.grant()

    def outstanding(self) -> int:
        return sum(f.owed for f in self.flows.values())

    def grant(self) -> None:
        """Round robin over the flows still waiting, CHUNK packets each, while the
        window has room; no flow owed more than its even share of the window (at least
        a CHUNK), so a flow that came first does not hold the whole window."""
        room = self.window - self.outstanding()
        share = max(CHUNK, self.window // max(1, len(self.flows)))
        turns = len(self.waiting)
        while room > 0 and turns > 0:
            key = self.waiting.popleft()
            turns -= 1
            flow = self.flows.get(key)
            if flow is None or flow.granted >= flow.packets:
                continue  # (done, expired or all granted: out of the round)
            more = min(CHUNK, room, flow.packets - flow.granted, share - flow.owed)
            if more <= 0:
                self.waiting.append(key)  # (owed its share: its turn comes again)
                continue
            flow.granted += more
            room -= more
            self._send(key, flow)
            self.waiting.append(key)
            turns += 1 if room > 0 else 0

    def _send(self, key: tuple[int, int], flow: _Flow) -> None:
        g = Grant(key[0], flow.shard, flow.tag, key[1], flow.granted)
        try:
            self.sock.sendto(encode_grant(g, self.key), flow.addr)
            self.counts["grants"] += 1
        except OSError:
            pass  # (a full buffer or a gone peer: a lost grant, made good by the next)
