"""Bounded-loss pushes (--loss-tolerance F): gradients as UDP datagrams, at most the
fraction F of each allowed to be lost. The sending side, the one a worker uses
(psring.comm.psclient; a transpose all-reduce's, psring.comm.transpose); the
receiving side, that collects datagrams into pushes, is psring.comm.ingress.

    sender = LossySender("tcp://198.18.0.3:5555", run="r1", worker=0, on_sent=ready)
    transfer = sender.send(transfer_id, shard=0, grad=flat_gradient_range, token=key)
    ...  # ready(key): send the lossy_push; the server answers ack, or resend
    sender.resend(transfer, missing, need, token=key)

Datagrams leave in layer order: a push's range is a piece of the flat parameters in
the model's order, so its first packets are of the layers the next forward needs first
(DLCP's priority by layer; the emulated links drop at random, so the order decides only
what arrives first). A resend picks the missing packets it sends again at random, not
by magnitude as DLCP's priorities would: the receiver's scaling is unbiased only if
what stays missing is a random part of the push.

The sender paces its datagrams at the host link's rate (one token bucket per process,
:data:`pace`), and its socket's send buffer is below tbf's queue, so it does not
overflow its own link's queue; it has no congestion control beyond that (incast at a
server's port drops them: docs/results/2026-11-27-network-and-library.md, "Incast").
The waiting is the sender thread's, never the training loop's. Consecutive datagrams
leave together, one segmented send (UDP GSO, ``UDP_SEGMENT``) of up to 64 KiB or a
millisecond of the link, which the kernel cuts into the same datagrams: a push costs
Python a call per batch, not per datagram (one by one where the kernel refuses).

The receiving side is psring.comm.ingress.
"""

from __future__ import annotations

import errno
import random
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlparse

import numpy as np
import torch

from psring.comm import buffers
from psring.comm.credits import UNSCHEDULED
from psring.comm.datagrams import (
    DATAGRAM_HEADER,
    DATAGRAM_PAYLOAD,
    DATAGRAM_SIGNATURE,
    End,
    block_bytes,
    decode_grant,
    encode_block,
    encode_datagrams,
    encode_end,
    per_datagram,
    run_tag,
)
from psring.comm.outbox import Outbox
from psring.comm.protocol import DTYPE_NAMES, ProtocolError
from psring.comm.turns import Turns

#: bytes each datagram's frame adds: Ethernet 14, IPv4 20, UDP 8
FRAME_OVERHEAD = 42
#: bytes of datagrams the kernel holds for the socket before a send waits
SEND_BUFFER_BYTES = 1 << 20
#: Linux's UDP_SEGMENT option (linux/udp.h; Python's socket module lacks it before
#: 3.12): one send of many equal datagrams that the kernel cuts apart (UDP GSO), so a
#: push costs Python a call per batch, not per datagram
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
#: the most datagrams one segmented send carries: its 64 KiB limit at psring's size
GSO_MAX_BYTES = 65000
#: seconds a credited sender waits at least for a grant before one packet more goes on
#: its own (four of its measured round trips if longer): a lost grant or datagram costs
#: this, never TCP's 200 ms retransmission timeout
GRANT_WAIT_S = 0.004
#: copies of a transfer's end marker, back to back: all of them lost (p**3 at a loss
#: rate p) costs its receiver an idle timeout (psring.comm.transpose)
END_COPIES = 3
#: the most packets a resend sends twice, when every one of them is needed (an
#: all-gather's, or beyond a push's bound): one lost again (p at a loss rate p) would
#: cost its receiver another round trip; both copies, p**2
TWICE_MOST = 32
#: errors that say the kernel or the route cannot segment (then one send a datagram)
NO_GSO = {errno.EINVAL, errno.ENOPROTOOPT, errno.EOPNOTSUPP, errno.EIO}
#: the IPv4 TOS byte of a datagram of each priority level, lowest first (DSCP class
#: selectors CS1-CS4); unmarked traffic (TOS 0: TCP, the pulls, the acks) ranks above
#: them all at a priority-aware emulated switch (--switch priority, psring.cluster.link)
PRIORITY_TOS = (0x20, 0x40, 0x60, 0x80)


class Marks:
    """DLCP's packet priorities (--switch priority): each datagram's level from its
    layer and its gradients' magnitude. A datagram of the model's front half (its
    first element before ``model_numel`` / 2 in the flat order: the layers the next
    forward needs first, and backward produces last) ranks two levels above one of the
    back half; within a push, one whose mean |gradient| is at least the push's median
    one level above the rest. Level 3 is the highest, 0 the first a switch drops."""

    def __init__(self, model_numel: int):
        self.half = max(1, model_numel) / 2

    @classmethod
    def for_switch(cls, switch: str, model_numel: int) -> "Marks | None":
        """The marks a run's datagrams carry under ``--switch`` (None: unmarked)."""
        return cls(model_numel) if switch == "priority" else None

    def levels(self, grad: torch.Tensor, offset: int, per: int) -> np.ndarray:
        """(packets,) uint8 levels of ``grad`` (elements from ``offset`` of the flat
        model) cut into datagrams of ``per`` elements."""
        n = grad.numel()
        starts = np.arange(0, n, per)
        mags = np.abs(grad.detach().reshape(-1).float().numpy())
        mean = np.add.reduceat(mags, starts) / np.diff(np.r_[starts, n])
        loud = mean >= np.median(mean)
        front = offset + starts < self.half
        return (2 * front + loud).astype(np.uint8)


@dataclass
class Transfer:
    """One push's datagrams, kept until the server acknowledges it: unsigned, all in one
    buffer (``block``: packet i at [i·width, …), the last ``last`` bytes long), so a run
    of them is one slice; signed, one object each (``each``)."""

    grad: torch.Tensor
    per: int
    numel: int
    dtype: str
    count: int
    block: memoryview | None = None
    width: int = 0
    last: int = 0
    each: list[memoryview] | None = None
    #: each packet's priority level (Marks), None: unmarked
    levels: np.ndarray | None = None
    #: the transfer's id (the lossy_push's ``transfer``): what its grants name
    transfer: int = 0
    #: the shard it is a part of (the receiver's)
    shard: int = 0
    #: all of it has left, its end markers behind it (a sender with ``ends``)
    ended: bool = False

    def run(self, i: int, j: int) -> list[memoryview]:
        """Packets i to j − 1, as the buffers of one send."""
        if self.each is not None:
            return self.each[i:j]
        end = (j - 1) * self.width + (self.last if j == self.count else self.width)
        return [self.block[i * self.width:end]]

    def packet(self, i: int) -> memoryview:
        return self.run(i, i + 1)[0]


class LossySender:
    """Datagrams to one server, sent by an outbox's thread (its own, or one ``outbox``
    shared with other senders: psring.comm.outbox) so that a push from a gradient hook
    never waits for the link; ``on_sent(token)`` runs in that thread once a job's
    datagrams are all handed to the kernel (the client then sends the lossy_push
    behind them)."""

    def __init__(self, endpoint: str, run: str, worker: int, key: bytes | None = None,
                 on_sent: Callable[[object], None] = lambda token: None,
                 pace_bits: float | None = None, marks: Marks | None = None,
                 credits: bool = False, ends: bool = False, burst_bytes: int = 0,
                 turns: Turns | None = None, outbox: Outbox | None = None):
        u = urlparse(endpoint)
        if u.scheme != "tcp" or u.hostname is None or u.port is None:
            raise ValueError(f"bounded-loss pushes need a tcp:// server, not {endpoint}")
        self.addr = (u.hostname, u.port)
        self.tag, self.worker, self.key, self.on_sent = run_tag(run), worker, key, on_sent
        family = socket.AF_INET6 if ":" in u.hostname else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        #: the link's rate (bit/s) the datagrams leave at, as frames; None: unpaced
        #: (also to a server on this host: its datagrams never cross the link)
        self.pace_bits = None if same_host(self.addr) else pace_bits
        #: bytes it may put on its port's queue at once (the run's Cluster.pacing_burst:
        #: a shallow port's half), 0: a millisecond's. One send, what it may run ahead of
        #: the pace and what it may catch up on after a late wakeup add up to them: a
        #: quarter, a quarter and a half (the catching up the most: a loaded machine's
        #: late wakeups would otherwise cost the link's time)
        self.burst_bytes = burst_bytes
        budget = burst_bytes * 8 / self.pace_bits if burst_bytes and self.pace_bits else 0
        self.credit_s = budget / 2 if budget else _Pacer.CREDIT_S
        self.ahead_s = budget / 4 if budget else _Pacer.AHEAD_S
        self.marks = marks
        #: the turns it takes with the other senders on its link (a server's pulls:
        #: one at a time, psring.comm.turns); None: it sends as soon as it can
        self.turns = turns if self.pace_bits else None
        #: --credit-window: a transfer's datagrams beyond the first UNSCHEDULED wait for
        #: the server's grants (psring.comm.credits), each wait bounded
        self.credits = credits
        #: a transfer's datagrams followed by END_COPIES end markers (the transpose
        #: all-reduce: its receivers wait for them, not for a barrier over TCP)
        self.ends = ends
        self.rtt = GRANT_WAIT_S / 4  # (a first guess; each first grant measures it)
        self.probes = 0
        self.datagrams = 0
        self.gso = True  # (until the kernel refuses a segmented send)
        #: the blocks of datagrams, kept for the next transfers (psring.comm.buffers)
        self.buffers = buffers.SHARED
        self.stopping = False
        #: the thread its jobs run on: its own, or one its owner shares among senders
        #: (then the owner closes it, before the senders)
        self.own_outbox = outbox is None
        self.outbox = Outbox(f"datagrams-{endpoint}") if outbox is None else outbox

    def send(self, transfer_id: int, shard: int, grad: torch.Tensor,
             token: object = None, offset: int = 0) -> Transfer:
        """Cut ``grad`` (1-d, contiguous, CPU; elements from ``offset`` of the flat
        model, for the marks) into datagrams and queue them all."""
        t = self._transfer(transfer_id, shard, grad)
        if self.marks is not None:
            t.levels = self.marks.levels(grad, offset, t.per)
        self.outbox.put(self._job, (t, range(t.count), token, None))
        return t

    def send_part(self, transfer_id: int, shard: int, part: torch.Tensor, first: int,
                  packets: int, token: object = None) -> Transfer:
        """Queue packets ``first`` on of a transfer of ``packets`` in all, ``part``
        (1-d, contiguous, CPU) their elements: a pull answered range by range
        (psring.comm.egress). Unmarked: parameters rank above gradients at a
        priority switch, as TCP does."""
        t = self._transfer(transfer_id, shard, part, first, packets)
        # (a pull's parts one after another: its later ranges ahead of the pulls
        # answered after it, but never ahead of this sender's own queued jobs)
        ticket = self.turns.take((self.worker, transfer_id), lane=id(self)) \
            if self.turns is not None else None
        self.outbox.put(self._job, (t, range(t.count), token, ticket))
        return t

    def send_end(self, transfer_id: int, shard: int, packets: int,
                 urgent: bool = False) -> None:
        """Queue the end markers of a transfer of ``packets`` sent in parts
        (send_part), behind its last part: every packet of it has left. ``urgent``:
        behind the resends queued before them instead (a resend round's end: what it
        did not bring was lost, and its receiver may ask again at once)."""
        self.outbox.put(self._job, (End(self.worker, shard, self.tag, transfer_id, packets),
                                    None, None, None), urgent=urgent)

    def _transfer(self, transfer_id: int, shard: int, grad: torch.Tensor, first: int = 0,
                  packets: int | None = None) -> Transfer:
        """``grad``'s datagrams, numbered from ``first`` of ``packets`` (None: its own)."""
        dtype = DTYPE_NAMES[grad.dtype]
        raw = grad.reshape(-1).view(torch.uint8).numpy()
        common = (grad, per_datagram(dtype), grad.numel(), dtype)
        if self.key:
            signed = encode_datagrams(self.worker, shard, self.tag, transfer_id, dtype, raw,
                                      self.key, first, packets)
            t = Transfer(*common, len(signed), each=signed)
        else:
            buf, last = encode_block(self.worker, shard, self.tag, transfer_id, dtype, raw,
                                     self.buffers.take(block_bytes(len(raw))), first, packets)
            t = Transfer(*common, buf.shape[0], memoryview(buf).cast("B"), buf.shape[1],
                         last)
        t.transfer, t.shard = transfer_id, shard
        return t

    def resend(self, t: Transfer, missing: list[int], need: int,
               token: object = None) -> int:
        """Queue again ``need`` of the ``missing`` packets (at least one, chosen at
        random); returns how many."""
        chosen = self.choose(t, missing, need)
        # (none to spare, and few: each goes twice, so that one lost again costs no
        # further round trip)
        again = chosen * 2 if len(chosen) <= min(need, TWICE_MOST) else chosen
        self.outbox.put(self._job, (t, again, token, None), urgent=True)  # (its receiver waits)
        return len(chosen)

    @staticmethod
    def choose(t: Transfer, missing: list[int], need: int) -> list[int]:
        """``need`` of the missing packets and a quarter more (at most all of them:
        some of a resend is lost again, and each round costs a round trip), chosen at
        random, not by magnitude: the receiver scales what arrived by numel /
        delivered, which is unbiased only if what stays missing is a random part."""
        valid = sorted({i for i in missing if 0 <= i < t.count})
        take = min(len(valid), max(1, need + (need + 3) // 4))
        rng = random.Random(t.count * 1_000_003 + len(valid) * 1009 + need)
        return sorted(rng.sample(valid, take))

    def _job(self, job: tuple) -> None:
        """One queued job, on the outbox's thread: a transfer's packets (in their turn,
        if it takes turns), or end markers; then ``on_sent``."""
        t, which, token, ticket = job
        if isinstance(t, End):
            self._markers(t)
        elif ticket is not None:
            self.turns.wait(ticket)
            try:
                self._out(t, which)
            finally:
                self.turns.release(ticket)
        else:
            self._out(t, which)
        if self.ends and isinstance(which, range) and len(which) == t.count:
            t.ended = True
            self._end(t)
        elif self.ends and isinstance(t, Transfer) and t.ended:
            self._end(t)  # (a resend round's: what it did not bring was lost, and its
            #              receiver may ask again at once)
        self.on_sent(token)

    def _end(self, t: Transfer) -> None:
        """The end markers of transfer ``t``: all of its packets have left."""
        self._markers(End(self.worker, t.shard, self.tag, t.transfer, t.count))

    def _markers(self, end: End) -> None:
        """END_COPIES copies of ``end``, back to back."""
        marker = encode_end(end, self.key)
        # (at a priority switch, marked as the lowest level: behind every datagram of
        # the transfer still queued, never ahead of them)
        tos = None if self.marks is None else PRIORITY_TOS[0]
        for _ in range(END_COPIES):
            self._send([memoryview(marker)], 1, len(marker), tos)

    def _out(self, t: Transfer, which) -> None:
        """Send packets ``which`` of ``t``: with credits a whole transfer as its grants
        allow (a resend, small, goes at once), else all of them now."""
        if self.credits and isinstance(which, range) and len(which) == t.count > UNSCHEDULED:
            self._granted(t)
        else:
            self._runs(t, which)

    def _granted(self, t: Transfer) -> None:
        """The first UNSCHEDULED packets, then what each grant allows; granted nothing
        for a bounded wait (a few round trips: a lost grant, or the datagram that would
        have earned it), one more packet on its own."""
        allowed, sent, t0 = UNSCHEDULED, 0, time.perf_counter()
        while sent < t.count and not self.stopping:
            if sent < allowed:
                self._runs(t, range(sent, min(allowed, t.count)))
                sent = min(allowed, t.count)
                continue
            upto = self._grant_for(t, max(GRANT_WAIT_S, 4 * self.rtt))
            if upto is None:
                allowed = sent + 1
                self.probes += 1
            else:
                if allowed == UNSCHEDULED:  # (the first grant: a round trip)
                    self.rtt = 0.5 * self.rtt + 0.5 * (time.perf_counter() - t0)
                allowed = max(allowed, upto)

    def _grant_for(self, t: Transfer, wait: float) -> int | None:
        """The most packets the grants that come within ``wait`` seconds allow ``t``
        (None: none came); grants of other transfers, or broken, are dropped."""
        deadline = time.perf_counter() + wait
        best = None
        while True:
            left = deadline - time.perf_counter()
            if best is not None:
                left = 0.0  # (take every grant already here, wait no longer)
            ready, _, _ = select.select([self.sock], [], [], max(0.0, left))
            if not ready:
                return best
            while True:
                try:
                    data = self.sock.recv(256, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:  # (an ICMP error of an earlier send: the port refused)
                    continue
                try:
                    g = decode_grant(data, self.key)
                except ProtocolError:
                    continue
                if (g.worker, g.run_tag, g.transfer) == (self.worker, self.tag, t.transfer):
                    best = max(best or 0, min(g.upto, t.count))
            if best is None and time.perf_counter() >= deadline:
                return None

    def _runs(self, t: Transfer, which) -> None:
        """Send packets ``which`` of ``t``: consecutive ones together, one segmented
        send a run (UDP GSO), each run at most a millisecond of the link's time when
        paced, so a run stays within the pacing's credit."""
        for i, j in runs(which, self.batch_limit(), t.levels):
            if self.stopping:
                return
            data = t.run(i, j)
            tos = None if t.levels is None else PRIORITY_TOS[int(t.levels[i])]
            self._send(data, j - i, t.width if t.each is None else len(data[0]), tos)
            self.datagrams += j - i
            if self.turns is not None:
                self.turns.moving()
            if self.pace_bits:  # at the link's pace: a burst beyond it queues, or drops
                pace(self.pace_bits, sum(len(d) for d in data) + FRAME_OVERHEAD * (j - i),
                     self.credit_s, min(_Pacer.AHEAD_S, self.ahead_s))

    def batch_limit(self) -> int:
        """The most datagrams one send carries: what fits GSO_MAX_BYTES, and when paced
        a millisecond of the link (at least one)."""
        size = DATAGRAM_HEADER + DATAGRAM_PAYLOAD + (DATAGRAM_SIGNATURE if self.key else 0)
        most = GSO_MAX_BYTES // size
        if self.pace_bits:
            most = min(most, int(self.pace_bits * 1e-3 / 8 / (size + FRAME_OVERHEAD)))
        if self.burst_bytes:  # (one send within what the port may take at once)
            most = min(most, self.burst_bytes // 4 // (size + FRAME_OVERHEAD))
        return max(1, most) if self.gso else 1

    def _send(self, data: list[memoryview], k: int, size: int, tos: int | None = None) -> None:
        """Send ``k`` datagrams of ``size`` bytes (the last perhaps shorter), ``data``
        end to end; ``tos``: their IPv4 TOS byte (a priority mark), None: unmarked."""
        addr = self.addr
        cmsg = [] if tos is None else [(socket.IPPROTO_IP, socket.IP_TOS,
                                         struct.pack("=i", tos))]
        try:
            if k == 1:
                if cmsg:
                    self.sock.sendmsg(data[:1], cmsg, 0, addr)
                else:
                    self.sock.sendto(data[0], addr)
                return
            self.sock.sendmsg(data,  # (the kernel gathers them: no copy here)
                              [(socket.SOL_UDP, UDP_SEGMENT, struct.pack("=H", size)), *cmsg],
                              0, addr)
        except OSError as e:
            if k > 1 and e.errno in NO_GSO:  # (no segmentation here: one by one)
                self.gso = False
                whole = b"".join(data) if len(data) > 1 else data[0]
                for m in range(k):
                    self._send([whole[m * size:(m + 1) * size]], 1, size, tos)
            # else ENOBUFS, a refused port: lost datagrams, as on the wire

    def close(self) -> None:
        self.stopping = True
        if self.own_outbox:
            self.outbox.close()
        self.sock.close()


def runs(which, limit: int, levels: np.ndarray | None = None) -> list[tuple[int, int]]:
    """``which`` (ascending packet numbers) as the [i, j) runs one segmented send can
    carry: consecutive numbers of one priority level (``levels``, per packet: one
    send has one TOS), at most ``limit`` of them."""
    if isinstance(which, range) and which.step == 1 and levels is None:
        # (a whole transfer, or what a grant allows: one run, cut every limit)
        return [(i, min(i + limit, which.stop)) for i in range(which.start, which.stop, limit)]
    idx = np.asarray(which, np.int64)
    if idx.size == 0:
        return []
    breaks = np.diff(idx) != 1
    if levels is not None:
        breaks |= np.diff(levels[idx]) != 0
    cuts = np.flatnonzero(breaks) + 1
    out = []
    for a, b in zip(np.r_[0, cuts], np.r_[cuts, idx.size]):
        start, end = int(idx[a]), int(idx[b - 1]) + 1
        out += [(i, min(i + limit, end)) for i in range(start, end, limit)]
    return out


def same_host(addr: tuple[str, int]) -> bool:
    """Whether ``addr`` is an address of this network namespace: the route the kernel
    picks for it leaves from that same address (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(addr)
        except OSError:
            return False
        return probe.getsockname()[0] == addr[0]


class _Pacer:
    """One token bucket for all of a process's senders (several servers' shards, or a
    transpose all-reduce's peers share the host's one link): each send takes its
    frame's time at the link's rate, and a sender ahead of the clock by more than a
    millisecond sleeps it off. A sender behind the clock keeps up to a millisecond of
    credit: a sleep wakes late, and without it each oversleep would be lost link time
    (a tenth of the rate at 100 Mbit/s); tbf's burst holds far more. A sender may
    allow itself more credit (a deep port), or less of both (a shallow one: what runs
    ahead of the pace queues at the port, LossySender.burst_bytes)."""

    #: seconds of link time a late sender may catch up on
    CREDIT_S = 1e-3
    #: seconds a sender may run ahead of the clock before it sleeps
    AHEAD_S = 1e-3

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free_at = 0.0  # when the link would be idle

    def __call__(self, bits_per_s: float, frame_bytes: int, credit_s: float = CREDIT_S,
                 ahead_s: float = AHEAD_S) -> None:
        with self.lock:
            now = time.perf_counter()
            self.free_at = max(self.free_at, now - credit_s) + frame_bytes * 8 / bits_per_s
            ahead = self.free_at - now
        if ahead > ahead_s:
            time.sleep(ahead)


pace = _Pacer()
