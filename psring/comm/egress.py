"""Pulled parameters as datagrams (a synchronous run's bounded-loss pulls), the
server's side; the worker's is psring.comm.pulls.

    egress = Egress(key)
    egress.learn(run, worker, "198.18.0.2", port=40123, pace_bits=1e9)  # from its pull
    egress.piece(pull_header, numel=n, start=0, values=params[:m])       # a ready range
    egress.nacked(nack)        # a worker's resend request: what of it was sent, again

A pull whose request names a datagram port is answered as one transfer of UDP
datagrams (psring.comm.datagrams; its id the pull's seq) to that port at the address
the request came from, instead of params messages over TCP. Packet i holds the pull's
elements [i·per, …), as over TCP they would arrive range by range: as the handler
answers each range, the packets it completes leave at once (those wholly inside it
straight from it, those it shares with a neighbouring range from a staging buffer;
a sender thread per worker, paced at the run's link rate and batched by UDP GSO:
psring.comm.lossy), so the pull streams as a TCP one does; end markers follow its last
packet. The workers' pulls take turns on the server's link, in the order answered
(psring.comm.turns): a synchronous server's first worker has its parameters after
1/N of the pull phase, not at its end as over TCP, where they share the link.
Nothing of a pull may be lost (a replica must be the servers' parameters exactly):
the worker asks for the packets it misses, at once when the end markers
say the rest was lost, else after a quiet spell, rather than after TCP's
retransmission timeout, and the server sends those of them it has sent before again,
as often as asked, each round followed by end markers (the worker asks at once for
what a round did not bring). Each worker's last KEPT pulls are kept for that.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from psring.comm.datagrams import Nack, per_datagram, run_tag
from psring.comm.lossy import LossySender, Transfer
from psring.comm.protocol import DTYPE_NAMES
from psring.comm.turns import Turns

#: pulls per worker kept for its resend requests (a synchronous worker has one in
#: flight per shard; the one before may still be asked for by a late request)
KEPT = 2
#: seconds after a part has left during which a request for it is not answered: the
#: request may have crossed it on the way, or waited in the server's socket while the
#: server was busy (the worker asks again, a few milliseconds later, if it was lost)
CROSSED_S = 0.005


@dataclass
class _Pull:
    """One pull answered as datagrams: the elements of the packets its ranges share
    (staged), how much of each packet is ready, and which are sent."""

    shard: int
    tag: int
    staged: torch.Tensor
    per: int
    packets: int
    #: elements staged, per packet
    covered: np.ndarray
    sent: np.ndarray
    #: (first packet, its transfer) of each batch sent: what a resend is cut from
    parts: list[tuple[int, Transfer]]

    def size(self, i: np.ndarray) -> np.ndarray:
        """Elements of packets ``i`` (the last one's are what is left)."""
        return np.minimum((i + 1) * self.per, self.staged.numel()) - i * self.per


class Egress:
    """The datagram pulls of one server: where each worker's go, what was sent."""

    def __init__(self, key: bytes | None = None):
        self.key = key
        #: (run tag, worker) -> the LossySender to its datagram port
        self.senders: dict[tuple[int, int], LossySender] = {}
        #: (worker, transfer) -> the pull; each worker's last KEPT
        self.pulls: OrderedDict[tuple[int, int], _Pull] = OrderedDict()
        #: (worker, transfer, first packet) of each part its sender has handed to the
        #: kernel -> when (set by the senders' threads): only those are sent again when
        #: asked, not what still waits for its turn (the pace, the other workers')
        self.left: dict[tuple[int, int, int], float] = {}
        self.counts = {"pulled_datagrams": 0, "pull_resends": 0}
        #: the pulls leave the server's link one at a time, in the order answered
        self.turns = Turns()

    def learn(self, run: str, worker: int, host: str, port: int, pace_bits: int,
              burst: int = 0) -> None:
        """Worker ``worker``'s pulls go to (``host``, ``port``) at ``pace_bits`` bit/s
        (0: unpaced), at most ``burst`` bytes ahead of that pace (0: a millisecond's):
        the address its pull came from, the port, pace and burst it named."""
        key = (run_tag(run), worker)
        old = self.senders.get(key)
        if old is not None and (old.addr, old.burst_bytes) == ((host, port), burst):
            return
        if old is not None:
            old.close()
        where = f"[{host}]" if ":" in host else host
        self.senders[key] = LossySender(f"tcp://{where}:{port}", run, worker, self.key,
                                        on_sent=self._left, pace_bits=pace_bits or None,
                                        burst_bytes=burst, turns=self.turns)

    def _left(self, token: object) -> None:
        if token is not None:  # (a resend's is None)
            self.left[token] = time.monotonic()

    def piece(self, header: dict, numel: int, start: int, values: torch.Tensor) -> None:
        """Elements [start, start + len(values)) of the ``numel`` a pull (its request's
        ``header``) asks for are ready: send the packets they complete."""
        tag, worker, transfer = run_tag(header["run"]), header["worker"], header["seq"]
        p = self.pulls.get((worker, transfer))
        if p is None:
            p = self._new(worker, transfer, header["shard"], tag, numel, values.dtype)
        n, flat, per = values.numel(), values.reshape(-1), p.per
        end = start + n
        # only the packets this range shares with another are staged (their part in
        # it); the packets wholly inside it leave straight from it
        inner = (-(-start // per), end // per if end < p.staged.numel() else p.packets)
        head, tail = min(end, inner[0] * per), max(start, min(end, inner[1] * per))
        p.staged[start:head].copy_(flat[:head - start])
        p.staged[tail:end].copy_(flat[tail - start:])
        first, last = start // per, (end - 1) // per
        idx = np.arange(first, last + 1)
        p.covered[first:last + 1] += np.minimum((idx + 1) * per, end) - np.maximum(
            idx * per, start)
        ready = (p.covered[first:last + 1] == p.size(idx)) & ~p.sent[first:last + 1]
        sender = self.senders[(tag, worker)]
        for i, j in _spans(idx[ready]):
            for a, b, staged in _by_source(i, j, inner):
                lo, hi = a * per, min(b * per, p.staged.numel())
                part = p.staged[lo:hi] if staged else flat[lo - start:hi - start]
                p.parts.append((a, sender.send_part(transfer, p.shard, part, a, p.packets,
                                                    token=(worker, transfer, a))))
            p.sent[i:j] = True
            self.counts["pulled_datagrams"] += j - i
        if ready.any() and p.sent.all():  # (its last packets: the end markers follow)
            sender.send_end(transfer, p.shard, p.packets)

    def _new(self, worker: int, transfer: int, shard: int, tag: int, numel: int,
             dtype: torch.dtype) -> _Pull:
        per = per_datagram(DTYPE_NAMES[dtype])
        packets = max(1, math.ceil(numel / per))
        p = _Pull(shard, tag, torch.empty(numel, dtype=dtype), per, packets,
                  np.zeros(packets, np.int64), np.zeros(packets, np.bool_), [])
        self.pulls[(worker, transfer)] = p
        mine = [k for k in self.pulls if k[0] == worker]
        for k in mine[:-KEPT]:  # (oldest first)
            for first, _ in self.pulls.pop(k).parts:
                self.left.pop((*k, first), None)
        return p

    def nacked(self, nack: Nack) -> int:
        """Send again the packets a resend request names that were sent; how many."""
        p = self.pulls.get((nack.worker, nack.transfer))
        sender = self.senders.get((nack.run_tag, nack.worker))
        if p is None or sender is None or (p.tag, p.shard) != (nack.run_tag, nack.shard):
            return 0  # (a request for a pull long done, or not this server's)
        asked = np.asarray(nack.missing, np.int64)
        asked = asked[asked < p.packets]
        asked = asked[p.sent[asked]]  # (a packet not yet sent goes when it is whole)
        again, now = 0, time.monotonic()
        # (once all of it has left, its end markers right behind, a request can only
        # have come after them, or after a long quiet: what it names did not arrive,
        # however lately it left)
        ended = p.sent.all() and all((nack.worker, nack.transfer, first) in self.left
                                     for first, _ in p.parts)
        for first, t in p.parts:
            left = self.left.get((nack.worker, nack.transfer, first))
            if left is None or (now - left < CROSSED_S and not ended):
                continue  # (still to leave, or just left: not lost)
            mine = asked[(asked >= first) & (asked < first + t.count)] - first
            if mine.size:
                again += sender.resend(t, mine.tolist(), int(mine.size))
        if again and ended:  # (the round's end: the worker asks at once for what it
            # did not bring. Not before the pull has left whole: its markers say so)
            sender.send_end(nack.transfer, p.shard, p.packets, urgent=True)
        self.counts["pull_resends"] += again
        return again

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
        self.senders.clear()
        self.pulls.clear()


def _by_source(i: int, j: int, inner: tuple[int, int]) -> list[tuple[int, int, bool]]:
    """Packets [i, j) as runs of one source each: (a, b, staged), the ``inner``
    packets [k0, k1) from the range itself, the others from the staging buffer."""
    k0, k1 = inner
    cuts = sorted({i, j, min(max(k0, i), j), min(max(k1, i), j)})
    return [(a, b, not (k0 <= a and b <= k1)) for a, b in zip(cuts, cuts[1:])]


def _spans(idx: np.ndarray) -> list[tuple[int, int]]:
    """Ascending packet numbers as [i, j) runs of consecutive ones."""
    if idx.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(idx) != 1) + 1
    return [(int(idx[a]), int(idx[b - 1]) + 1)
            for a, b in zip(np.r_[0, cuts], np.r_[cuts, idx.size])]
