"""Bounded-loss pushes (--loss-tolerance F), the receiving side: a parameter server's
(servers.server) or a transpose all-reduce's (psring.comm.transpose). The sending side
is psring.comm.lossy.

    ingress = Ingress(key)
    drain(sock, ingress)               # psring.comm.receiving: what waits on the socket
    push = ingress.complete(lossy_msg)  # a push Message, or (need, missing packets)

When a push's end marker arrives (a lossy_push; the datagrams sent ahead of it on the
same path have arrived or are lost: it is the push's deadline), :meth:`Ingress.complete`
makes it a plain push of what arrived, the missing elements zero and the rest scaled by
numel / delivered (an unbiased estimate of the gradient when packets are lost at
random: DLCP's bounded loss), if at most the fraction F is missing; else it says which
packets to send again. Datagrams are validated (and with a shared secret authenticated)
before use; what is kept waiting is bounded (MAX_HELD_BYTES, counted from each
transfer's whole size; oldest transfers dropped first). Many whole datagrams (a
coalesced receive's, or drain's batches in the ingress's arena) are checked together
(numpy), a transfer at a time, and written in place.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from psring.comm import buffers
from psring.comm.datagrams import (
    DATAGRAM_DTYPE,
    DATAGRAM_HEADER,
    DATAGRAM_MAGIC,
    DATAGRAM_STRUCT,
    DATAGRAM_VERSION,
    END_MAGIC,
    MAX_PACKETS,
    NACK_MAGIC,
    WIRE_CODES,
    Datagram,
    End,
    Nack,
    decode_datagram,
    decode_end,
    decode_nack,
    per_datagram,
    run_tag,
)
from psring.comm.protocol import DTYPES, Message, ProtocolError

#: bytes of consecutive receives a drain keeps together (psring.comm.receiving.drain)
ARENA_BYTES = 1 << 20



#: end markers and completed transfers an Ingress remembers (the oldest forgotten first)
REMEMBERED = 4096


def _remember(seen: OrderedDict, key: tuple[int, int], value) -> None:
    seen[key] = value
    while len(seen) > REMEMBERED:
        seen.popitem(last=False)


#: bytes of datagrams kept waiting for their lossy_push, over all transfers
MAX_HELD_BYTES = 1 << 30


@dataclass
class _Arriving:
    """One transfer's datagrams as they arrive, each payload written in its place."""

    packets: int
    dtype: str
    #: packet i's payload at [i * whole, ...); a missing one's place is zeroed when the
    #: push is made (psring.comm.buffers: the memory may be a finished push's)
    data: np.ndarray
    #: the run tag and shard its first datagram named (the others must agree)
    tag: int = -1
    shard: int = -1
    #: which packets arrived
    got: np.ndarray = field(default=None)  # type: ignore[assignment]
    #: the last packet's payload bytes, once it arrived (every other one is whole)
    last: int = -1
    #: when a packet of it last arrived (time.monotonic)
    heard: float = 0.0

    def __post_init__(self) -> None:
        self.got = np.zeros(self.packets, np.bool_)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


#: the header bytes of a datagram's number, and the others (which a transfer's share)
_INDEX = slice(DATAGRAM_DTYPE.fields["index"][1], DATAGRAM_DTYPE.fields["index"][1] + 4)


#: where a datagram's header has its worker and its transfer id
_WORKER = DATAGRAM_DTYPE.fields["worker"][1]
_TRANSFER = DATAGRAM_DTYPE.fields["transfer"][1]


def _transfers(rows: np.ndarray) -> list[np.ndarray] | None:
    """The rows (datagrams, whole; ``rows`` contiguous) of each transfer among ``rows``,
    by worker and transfer id, in arrival order within each: indices into them; None
    when all are one transfer's (as a coalesced receive's). The other fields of a
    transfer's headers are checked when it is kept (:meth:`Ingress._keep_rows`)."""
    k, size = rows.shape
    keys = np.ndarray((k,), "<u8", rows, _TRANSFER, (size,)) * np.uint64(1 << 16) \
        + np.ndarray((k,), "<u2", rows, _WORKER, (size,))
    if (keys == keys[0]).all():
        return None
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    bounds = [0, *(np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist(), k]
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def whole_bytes(dtype: str) -> int:
    """A full datagram's payload bytes of ``dtype``."""
    return per_datagram(dtype) * DTYPES[dtype].itemsize


class Ingress:
    """The datagrams of transfers in progress, by (worker, transfer id); the end
    markers and resend requests that arrived (the transpose all-reduce's); the
    transfers completed lately, whose datagrams that come late are dropped (counted
    ``late``) rather than held as a new transfer."""

    def __init__(self, key: bytes | None = None,
                 accept: Callable[[int, int, int, str, int, int], bool] | None = None):
        self.key = key
        #: accept(worker, transfer, packets, dtype, tag, shard): whether a transfer not
        #: seen before may be held (a worker's pulls: only those it asked for)
        self.accept = accept
        self.transfers: OrderedDict[tuple[int, int], _Arriving] = OrderedDict()
        self.held = 0
        self.counts = {"datagrams": 0, "bad_datagrams": 0, "evicted": 0, "late": 0}
        self.ends: OrderedDict[tuple[int, int], End] = OrderedDict()
        #: when each transfer's latest end marker came (time.monotonic): a resend
        #: round is followed by markers too (psring.comm.pulls)
        self.marked_times: OrderedDict[tuple[int, int], float] = OrderedDict()
        #: end markers kept so far (a waiter wakes when it grows)
        self.marked = 0
        self.finished: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.nacks: list[Nack] = []
        self.buffers = buffers.SHARED
        #: where drain receives (psring.comm.receiving.drain)
        self.arena = bytearray(ARENA_BYTES)

    def ended(self, worker: int, transfer: int) -> bool:
        """Whether the transfer's end marker arrived (all of its packets have left)."""
        return (worker, transfer) in self.ends

    def marked_since(self, worker: int, transfer: int, since: float) -> bool:
        """Whether an end marker of the transfer arrived after ``since`` (time.monotonic):
        after a resend request, the end of its round of resends."""
        return self.marked_times.get((worker, transfer), float("-inf")) > since

    def streaming(self, least: int) -> bool:
        """Whether a transfer of at least ``least`` packets is arriving (held, its end
        marker not come yet)."""
        return any(t.packets >= least and key not in self.ends
                   for key, t in self.transfers.items())

    def heard(self, worker: int, transfer: int) -> float | None:
        """When a packet of the transfer last arrived (time.monotonic), None if none."""
        t = self.transfers.get((worker, transfer))
        return t.heard if t is not None else None

    def datagram(self, data: bytes) -> None:
        """Keep one datagram or end marker (or count it as bad and drop it)."""
        magic = bytes(data[:4])
        if magic == END_MAGIC:
            self._end(data)
            return
        if magic == NACK_MAGIC:
            self._nack(data)
            return
        try:
            d = decode_datagram(data, self.key)
        except ProtocolError:
            self.counts["bad_datagrams"] += 1
            return
        self.counts["datagrams"] += 1
        self.keep(d)

    def datagrams(self, data: bytes | memoryview, size: int,
                  receives: list[int] | None = None) -> None:
        """Keep the datagrams of one coalesced receive (UDP GRO) or of drain's runs:
        ``data`` cut every ``size`` bytes, the last piece perhaps shorter. Unsigned
        whole ones are checked and kept a transfer at a time (numpy); any other piece
        one by one. ``receives``: where in ``data`` each of several receives ends
        (drain's runs): when one transfer's whole cannot be kept at once, each receive
        is tried at once first."""
        buf = memoryview(data)
        k = len(buf) // size
        if self.key is None and k > 1 and size > DATAGRAM_HEADER:
            rows = np.frombuffer(buf, np.uint8, count=k * size).reshape(k, size)
            groups = _transfers(rows)
            if groups is not None:  # (several transfers' datagrams, interleaved)
                for rows_of_one in (rows[g] for g in groups):
                    if len(rows_of_one) < 2 or not self._keep_rows(rows_of_one):
                        for row in rows_of_one:
                            self.datagram(row.data)
            elif self._keep_rows(rows):
                pass
            elif receives and len(receives) > 1:  # (a packet seen before)
                begin = 0
                for end in receives:
                    self.datagrams(buf[begin:end], size)
                    begin = end
            else:
                for i in range(k):
                    self.datagram(buf[i * size:(i + 1) * size])
        else:
            k = 0
        for i in range(k, -(-len(buf) // size)):
            self.datagram(buf[i * size:(i + 1) * size])

    def _keep_rows(self, rows: np.ndarray) -> bool:
        """Keep ``rows`` (one datagram each, all whole) if they are all good packets of
        one transfer not seen before; False (nothing kept) for the one-by-one path.
        (Some 40 numpy calls a receive of up to 45 datagrams: kept few, in place.)"""
        k, size = rows.shape
        head = rows[0, :DATAGRAM_HEADER]
        # every header field but the packet's number the same as the first's
        if not ((rows[:, :_INDEX.start] == head[:_INDEX.start]).all()
                and (rows[:, _INDEX.stop:DATAGRAM_HEADER] == head[_INDEX.stop:]).all()):
            return False
        magic, version, code, worker, shard, tag, transfer, _, packets, n = \
            DATAGRAM_STRUCT.unpack(head.tobytes())
        if code >= len(WIRE_CODES):
            return False
        dtype = WIRE_CODES[code]
        whole = whole_bytes(dtype)
        if magic != DATAGRAM_MAGIC or version != DATAGRAM_VERSION \
                or size - DATAGRAM_HEADER != whole or n != per_datagram(dtype) \
                or not 0 < packets <= MAX_PACKETS:
            return False
        # the packets' numbers, read in place (a column of the rows)
        index = np.ndarray((k,), "<u4", rows, _INDEX.start, (size,))
        first = int(index[0])
        # (in order, as a sender's runs arrive: a slice; else each number once)
        in_order = first + k <= packets and bool((index == np.arange(
            first, first + k, dtype=np.uint32)).all())
        if not in_order and (not (index < packets).all() or len(np.unique(index)) != k):
            return False
        t = self._arriving(worker, transfer, packets, dtype, tag, shard)
        if t is None:
            return False
        payloads = rows[:, DATAGRAM_HEADER:]
        if in_order:
            if t.got[first:first + k].any():
                return False
            t.got[first:first + k] = True
            t.data[first * whole:(first + k) * whole].reshape(k, whole)[:] = payloads
        else:  # (a row a copy: each payload one item, not 1408 one-byte ones)
            if t.got[index].any():
                return False
            t.got[index] = True
            item = np.dtype((np.void, whole))
            t.data.reshape(packets, whole).view(item)[index] = payloads.view(item)
        if t.got[packets - 1] and t.last < 0:
            t.last = whole
        self.counts["datagrams"] += k
        return True

    def _control(self, data: bytes | memoryview, decode: Callable):
        """A control datagram decoded by ``decode``, or None (counted as bad)."""
        try:
            return decode(data, self.key)
        except ProtocolError:
            self.counts["bad_datagrams"] += 1
            return None

    def _end(self, data: bytes | memoryview) -> None:
        e = self._control(data, decode_end)
        if e is not None and (e.worker, e.transfer) not in self.finished:  # (not a copy
            _remember(self.ends, (e.worker, e.transfer), e)                # come late)
            _remember(self.marked_times, (e.worker, e.transfer), time.monotonic())
            self.marked += 1

    def _nack(self, data: bytes | memoryview) -> None:
        n = self._control(data, decode_nack)
        if n is not None and len(self.nacks) < REMEMBERED:  # (taken by take_nacks)
            self.nacks.append(n)

    def take_nacks(self) -> list[Nack]:
        """The resend requests that arrived since the last call."""
        got, self.nacks = self.nacks, []
        return got

    def _arriving(self, worker: int, transfer: int, packets: int, dtype: str, tag: int,
                  shard: int) -> _Arriving | None:
        """The transfer's record, made at its first packet; None when the packet
        disagrees with it, the transfer is complete already (a packet come late) or
        would not fit what may be held."""
        key = (worker, transfer)
        t = self.transfers.get(key)
        if t is None and key in self.finished:
            self.counts["late"] += 1
            return None
        if t is None:
            if packets * whole_bytes(dtype) > MAX_HELD_BYTES or self.accept is not None \
                    and not self.accept(worker, transfer, packets, dtype, tag, shard):
                return None
            t = self.transfers[key] = self._new(packets, dtype, tag, shard)
            self.held += t.nbytes
            while self.held > MAX_HELD_BYTES and len(self.transfers) > 1:
                _, old = self.transfers.popitem(last=False)
                self.held -= old.nbytes
                self.counts["evicted"] += 1
        if (t.packets, t.dtype, t.tag, t.shard) != (packets, dtype, tag, shard):
            return None
        t.heard = time.monotonic()
        return t

    def _new(self, packets: int, dtype: str, tag: int, shard: int) -> _Arriving:
        return _Arriving(packets, dtype, self.buffers.take(packets * whole_bytes(dtype)),
                         tag, shard)

    def keep(self, d: Datagram) -> None:
        """Keep one packet of a transfer: a datagram's, or one sent again over a
        reliable channel (psring.comm.transpose)."""
        whole = whole_bytes(d.dtype)
        t = self._arriving(d.worker, d.transfer, d.packets, d.dtype, d.run_tag, d.shard)
        if t is None or t.got[d.index] \
                or d.index < d.packets - 1 and len(d.payload) != whole:
            # disagrees with its transfer, came twice, or a packet but the last not full
            self.counts["bad_datagrams"] += 1
            return
        t.got[d.index] = True
        t.data[d.index * whole:d.index * whole + len(d.payload)] = \
            np.frombuffer(d.payload, np.uint8)
        if d.index == d.packets - 1:
            t.last = len(d.payload)

    def complete(self, msg: Message) -> Message | tuple[int, list]:
        """A lossy_push's gradient as a push Message, or (need, missing packet numbers)
        when more than its tolerance is missing. ProtocolError for a lossy_push that
        breaks a rule or that its datagrams contradict (before any memory is taken)."""
        h = msg.header
        numel, packets, dtype = h["numel"], h["packets"], h["dtype"]
        if dtype not in ("float32", "float16", "bfloat16") or numel <= 0 \
                or not 0 < packets <= MAX_PACKETS \
                or packets != math.ceil(numel / per_datagram(dtype)):
            raise ProtocolError(f"lossy_push of {numel} {dtype} elements in {packets} "
                                f"packets")
        if not 0 <= h["tolerance"] < 1:
            raise ProtocolError(f"lossy_push tolerance {h['tolerance']!r} outside [0, 1)")
        t = self.transfers.get((h["worker"], h["transfer"]))
        if t is not None and (t.packets, t.dtype, t.tag, t.shard) != (
                packets, dtype, run_tag(h["run"]), h["shard"]):
            raise ProtocolError("lossy_push disagrees with its datagrams' packets, dtype, "
                                "run or shard")
        per = per_datagram(dtype)
        itemsize = DTYPES[dtype].itemsize
        tail = numel - (packets - 1) * per  # (the last packet's elements)
        if t is not None and t.last >= 0 and t.last != tail * itemsize:
            raise ProtocolError("a datagram's elements do not fit its place in the push")
        if t is None:  # (nothing arrived)
            t = self._new(packets, dtype, run_tag(h["run"]), h["shard"])
        missing = np.flatnonzero(~t.got)
        lost = len(missing) * per - (per - tail if t.got.size and not t.got[-1] else 0)
        if lost > h["tolerance"] * numel:
            # the fewest packets that bring the missing part within the tolerance
            excess = lost - math.floor(h["tolerance"] * numel)
            return min(len(missing), math.ceil(excess / per)), missing.tolist()
        grad = self._assemble(t, numel, DTYPES[dtype], lost, missing)
        key = (h["worker"], h["transfer"])
        if self.transfers.pop(key, None) is not None:
            self.held -= t.nbytes
        self.ends.pop(key, None)
        self.marked_times.pop(key, None)
        _remember(self.finished, key, None)
        header = {"v": h["v"], "op": "push", "run": h["run"], "worker": h["worker"],
                  "seq": h["seq"], "shard": h["shard"], "step": h["step"],
                  "offset": h["offset"], "tensors": [[dtype, [numel]]],
                  "delivered": numel - lost}
        return Message(header, [grad])

    def whole(self, worker: int, transfer: int, numel: int) -> torch.Tensor | None:
        """A transfer of exactly ``numel`` elements once every packet of it arrived
        (the tensor takes its memory over), else None: a pull's, which loses nothing."""
        key = (worker, transfer)
        t = self.transfers.get(key)
        if t is None or not t.got.all():
            return None
        whole = whole_bytes(t.dtype)
        itemsize = DTYPES[t.dtype].itemsize
        if t.last != numel * itemsize - (t.packets - 1) * whole:
            return None  # (a last packet that does not end the elements: never taken)
        del self.transfers[key]
        self.held -= t.nbytes
        self.ends.pop(key, None)
        self.marked_times.pop(key, None)
        _remember(self.finished, key, None)
        return torch.frombuffer(t.data, dtype=DTYPES[t.dtype], count=numel)

    def missing(self, worker: int, transfer: int, packets: int) -> np.ndarray:
        """The packet numbers of a transfer of ``packets`` not arrived yet (all of them
        when none did)."""
        t = self.transfers.get((worker, transfer))
        return np.arange(packets) if t is None else np.flatnonzero(~t.got)

    @staticmethod
    def _assemble(t: _Arriving, numel: int, dtype: torch.dtype, lost: int,
                  missing: np.ndarray) -> torch.Tensor:
        """The transfer's elements (a missing packet's zero), scaled up by what was lost."""
        if len(missing):
            t.data.reshape(t.packets, -1)[missing] = 0
        # (the tensor takes the transfer's buffer over: the transfer is done with it)
        grad = torch.frombuffer(t.data, dtype=dtype, count=numel)
        if lost:  # unbiased: each element arrived with probability delivered / numel
            grad.mul_(numel / (numel - lost))
        return grad
