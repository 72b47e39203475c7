"""Bounded-loss pushes (--loss-tolerance F): gradients as UDP datagrams, at most the
fraction F of each allowed to be lost. Both sides: the sender a worker uses, and the
:class:`Ingress` that collects datagrams into pushes (a parameter server's,
servers.server; a transpose all-reduce's, psring.comm.transpose).

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

The receiving side: when a push's end marker arrives (a lossy_push; the datagrams sent
ahead of it on the same path have arrived or are lost: it is the push's deadline),
:meth:`Ingress.complete` makes it a plain push of what arrived, the missing elements
zero and the rest scaled by numel / delivered (an unbiased estimate of the gradient
when packets are lost at random: DLCP's bounded loss), if at most the fraction F is
missing; else it says which packets to send again. Datagrams are validated (and with a
shared secret authenticated) before use; what is kept waiting is bounded
(MAX_HELD_BYTES, oldest transfers dropped first).
"""

from __future__ import annotations

import errno
import math
import queue
import random
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlparse

import numpy as np
import torch

from psring.comm.protocol import (
    DATAGRAM_DTYPE,
    DATAGRAM_HEADER,
    DATAGRAM_MAGIC,
    DATAGRAM_PAYLOAD,
    DATAGRAM_SIGNATURE,
    DATAGRAM_VERSION,
    DTYPE_NAMES,
    DTYPES,
    MAX_PACKETS,
    WIRE_CODES,
    Datagram,
    Message,
    ProtocolError,
    decode_datagram,
    encode_block,
    encode_datagrams,
    per_datagram,
    run_tag,
)

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
#: Linux's UDP_GRO option: the kernel hands a socket many datagrams of one flow in one
#: receive, with their size (an int) in a control message
UDP_GRO = getattr(socket, "UDP_GRO", 104)
#: errors that say the kernel or the route cannot segment (then one send a datagram)
NO_GSO = {errno.EINVAL, errno.ENOPROTOOPT, errno.EOPNOTSUPP, errno.EIO}


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

    def run(self, i: int, j: int) -> list[memoryview]:
        """Packets i to j − 1, as the buffers of one send."""
        if self.each is not None:
            return self.each[i:j]
        end = (j - 1) * self.width + (self.last if j == self.count else self.width)
        return [self.block[i * self.width:end]]

    def packet(self, i: int) -> memoryview:
        return self.run(i, i + 1)[0]


class LossySender:
    """Datagrams to one server, sent by a thread of their own so that a push from a
    gradient hook never waits for the link; ``on_sent(token)`` runs in that thread
    once a job's datagrams are all handed to the kernel (the client then sends the
    lossy_push behind them)."""

    def __init__(self, endpoint: str, run: str, worker: int, key: bytes | None = None,
                 on_sent: Callable[[object], None] = lambda token: None,
                 pace_bits: float | None = None):
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
        self.datagrams = 0
        self.gso = True  # (until the kernel refuses a segmented send)
        self.stopping = False
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, daemon=True,
                                       name=f"datagrams-{endpoint}")
        self.thread.start()

    def send(self, transfer_id: int, shard: int, grad: torch.Tensor,
             token: object = None) -> Transfer:
        """Cut ``grad`` (1-d, contiguous, CPU) into datagrams and queue them all."""
        dtype = DTYPE_NAMES[grad.dtype]
        raw = grad.reshape(-1).view(torch.uint8).numpy()
        common = (grad, per_datagram(dtype), grad.numel(), dtype)
        if self.key:
            signed = encode_datagrams(self.worker, shard, self.tag, transfer_id, dtype, raw,
                                      self.key)
            t = Transfer(*common, len(signed), each=signed)
        else:
            buf, last = encode_block(self.worker, shard, self.tag, transfer_id, dtype, raw)
            t = Transfer(*common, buf.shape[0], memoryview(buf).cast("B"), buf.shape[1],
                         last)
        self.jobs.put((t, range(t.count), token))
        return t

    def resend(self, t: Transfer, missing: list[int], need: int,
               token: object = None) -> int:
        """Queue again ``need`` of the ``missing`` packets (at least one, chosen at
        random); returns how many."""
        chosen = self.choose(t, missing, need)
        self.jobs.put((t, chosen, token))
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

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            t, which, token = job
            self._out(t, which)
            self.on_sent(token)

    def _out(self, t: Transfer, which) -> None:
        """Send packets ``which`` of ``t``: consecutive ones together, one segmented
        send a run (UDP GSO), each run at most a millisecond of the link's time when
        paced, so a run stays within the pacing's credit."""
        for i, j in runs(which, self.batch_limit()):
            if self.stopping:
                return
            data = t.run(i, j)
            self._send(data, j - i, t.width if t.each is None else len(data[0]))
            self.datagrams += j - i
            if self.pace_bits:  # at the link's pace: a burst beyond it queues, or drops
                pace(self.pace_bits, sum(len(d) for d in data) + FRAME_OVERHEAD * (j - i))

    def batch_limit(self) -> int:
        """The most datagrams one send carries: what fits GSO_MAX_BYTES, and when paced
        a millisecond of the link (at least one)."""
        size = DATAGRAM_HEADER + DATAGRAM_PAYLOAD + (DATAGRAM_SIGNATURE if self.key else 0)
        most = GSO_MAX_BYTES // size
        if self.pace_bits:
            most = min(most, int(self.pace_bits * 1e-3 / 8 / (size + FRAME_OVERHEAD)))
        return max(1, most) if self.gso else 1

    def _send(self, data: list[memoryview], k: int, size: int) -> None:
        """Send ``k`` datagrams of ``size`` bytes (the last perhaps shorter), ``data``
        end to end."""
        send, addr = self.sock.sendto, self.addr
        try:
            if k == 1:
                send(data[0], addr)
                return
            self.sock.sendmsg(data,  # (the kernel gathers them: no copy here)
                              [(socket.SOL_UDP, UDP_SEGMENT, struct.pack("=H", size))],
                              0, addr)
        except OSError as e:
            if k > 1 and e.errno in NO_GSO:  # (no segmentation here: one by one)
                self.gso = False
                whole = b"".join(data) if len(data) > 1 else data[0]
                for m in range(k):
                    self._send([whole[m * size:(m + 1) * size]], 1, size)
            # else ENOBUFS, a refused port: lost datagrams, as on the wire

    def close(self) -> None:
        self.stopping = True
        self.jobs.put(None)
        self.thread.join(timeout=5.0)
        self.sock.close()


def runs(which, limit: int) -> list[tuple[int, int]]:
    """``which`` (ascending packet numbers) as the [i, j) runs one segmented send can
    carry: consecutive numbers, at most ``limit`` of them."""
    idx = np.asarray(which, np.int64)
    if idx.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(idx) != 1) + 1
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
    credit: a sleep wakes late, and without it each oversleep would be lost link
    time (a tenth of the rate at 100 Mbit/s); tbf's burst holds far more."""

    #: seconds of link time a late sender may catch up on
    CREDIT_S = 1e-3

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free_at = 0.0  # when the link would be idle

    def __call__(self, bits_per_s: float, frame_bytes: int) -> None:
        with self.lock:
            now = time.perf_counter()
            self.free_at = max(self.free_at, now - self.CREDIT_S) + frame_bytes * 8 / bits_per_s
            ahead = self.free_at - now
        if ahead > 1e-3:
            time.sleep(ahead)


pace = _Pacer()


# -- the receiving side: a server's (servers.server), or a transpose all-reduce's ---------

SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


def receiving_socket(host: str, port: int, buffer_bytes: int) -> socket.socket:
    """A non-blocking UDP socket bound to (``host``, ``port``; 0: any free one) whose
    kernel buffer holds ``buffer_bytes`` of datagrams (root may go beyond
    net.core.rmem_max, 208 KiB by default; others get what it allows). OSError when
    the port cannot be bound."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    try:
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, buffer_bytes)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    try:  # (many datagrams a receive where the kernel coalesces them; else one)
        s.setsockopt(socket.SOL_UDP, UDP_GRO, 1)
    except OSError:
        pass
    s.setblocking(False)
    return s


def drain(sock: socket.socket, ingress: "Ingress", most: int | None = None) -> int:
    """Hand the datagrams waiting on ``sock`` to ``ingress`` (all, or about ``most``:
    a coalesced receive is handed whole); returns how many."""
    n = 0
    control = socket.CMSG_SPACE(4)
    while most is None or n < most:
        try:
            data, ancillary, _, _ = sock.recvmsg(65536, control)
        except (BlockingIOError, InterruptedError):
            break
        size = next((int.from_bytes(c[2][:4], "little") for c in ancillary
                     if c[0] == socket.SOL_UDP and c[1] == UDP_GRO), 0)
        if size and len(data) > size:  # (coalesced: UDP GRO)
            ingress.datagrams(data, size)
            n += -(-len(data) // size)
        else:
            ingress.datagram(data)
            n += 1
    return n


#: bytes of datagrams kept waiting for their lossy_push, over all transfers
MAX_HELD_BYTES = 1 << 30


@dataclass
class _Arriving:
    """One transfer's datagrams as they arrive, each payload written in its place."""

    packets: int
    dtype: str
    #: the run tag and shard its first datagram named (the others must agree)
    tag: int = -1
    shard: int = -1
    #: which packets arrived
    got: np.ndarray = field(default=None)  # type: ignore[assignment]
    #: packet i's payload at [i * whole, ...), a missing one's place zero
    data: np.ndarray = field(default=None)  # type: ignore[assignment]
    #: the last packet's payload bytes, once it arrived (every other one is whole)
    last: int = -1

    def __post_init__(self) -> None:
        self.got = np.zeros(self.packets, np.bool_)
        # (zeroed now, in one pass: the pages a transfer's datagrams would otherwise
        # fault in one by one, between them, cost ten times as much)
        self.data = np.empty(self.packets * whole_bytes(self.dtype), np.uint8)
        self.data.fill(0)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


#: the header bytes of a datagram's number, and the others (which a transfer's share)
_INDEX = slice(DATAGRAM_DTYPE.fields["index"][1], DATAGRAM_DTYPE.fields["index"][1] + 4)
_SAME = np.r_[0:_INDEX.start, _INDEX.stop:DATAGRAM_HEADER]


def whole_bytes(dtype: str) -> int:
    """A full datagram's payload bytes of ``dtype``."""
    return per_datagram(dtype) * DTYPES[dtype].itemsize


class Ingress:
    """The datagrams of transfers in progress, by (worker, transfer id)."""

    def __init__(self, key: bytes | None = None):
        self.key = key
        self.transfers: OrderedDict[tuple[int, int], _Arriving] = OrderedDict()
        self.held = 0
        self.counts = {"datagrams": 0, "bad_datagrams": 0, "evicted": 0}

    def datagram(self, data: bytes) -> None:
        """Keep one datagram (or count it as bad and drop it)."""
        try:
            d = decode_datagram(data, self.key)
        except ProtocolError:
            self.counts["bad_datagrams"] += 1
            return
        self.counts["datagrams"] += 1
        self.keep(d)

    def datagrams(self, data: bytes | memoryview, size: int) -> None:
        """Keep the datagrams of one coalesced receive (UDP GRO): ``data`` cut every
        ``size`` bytes, the last piece perhaps shorter. Unsigned ones of one transfer,
        whole, are checked and kept all at once (numpy); any other piece one by one."""
        buf = memoryview(data)
        k = len(buf) // size
        if self.key is None and k > 1 and size > DATAGRAM_HEADER:
            rows = np.frombuffer(buf, np.uint8, count=k * size).reshape(k, size)
            if not self._keep_rows(rows):
                for i in range(k):
                    self.datagram(buf[i * size:(i + 1) * size])
        else:
            k = 0
        for i in range(k, -(-len(buf) // size)):
            self.datagram(buf[i * size:(i + 1) * size])

    def _keep_rows(self, rows: np.ndarray) -> bool:
        """Keep ``rows`` (one datagram each, all whole) if they are all good packets of
        one transfer not seen before; False (nothing kept) for the one-by-one path."""
        k, size = rows.shape
        raw = rows[:, :DATAGRAM_HEADER]
        # every header field but the packet's number the same as the first's
        if not (raw[:, _SAME] == raw[0, _SAME]).all():
            return False
        first = raw[0].copy().view(DATAGRAM_DTYPE)[0]
        code = int(first["code"])
        if code >= len(WIRE_CODES):
            return False
        dtype = WIRE_CODES[code]
        whole = whole_bytes(dtype)
        index = np.ascontiguousarray(raw[:, _INDEX]).view("<u4").reshape(k).astype(np.int64)
        packets = int(first["packets"])
        if bytes(first["magic"]) != DATAGRAM_MAGIC \
                or int(first["version"]) != DATAGRAM_VERSION or size - DATAGRAM_HEADER != whole \
                or int(first["n"]) != per_datagram(dtype) \
                or not 0 < packets <= MAX_PACKETS or not (index < packets).all():
            return False
        # (in order, as a sender's runs arrive: a slice; else each number once)
        in_order = bool((np.diff(index) == 1).all())
        if not in_order and len(np.unique(index)) != k:
            return False
        t = self._arriving(int(first["worker"]), int(first["transfer"]), packets, dtype,
                           int(first["tag"]), int(first["shard"]))
        if t is None or t.got[index].any():
            return False
        t.got[index] = True
        payloads = rows[:, DATAGRAM_HEADER:]
        if in_order:
            start = int(index[0]) * whole
            t.data[start:start + k * whole].reshape(k, whole)[:] = payloads
        else:  # (a row a copy: each payload one item, not 1408 one-byte ones)
            item = np.dtype((np.void, whole))
            t.data.reshape(packets, whole).view(item)[index] = payloads.view(item)
        if t.got[packets - 1] and t.last < 0:
            t.last = whole
        self.counts["datagrams"] += k
        return True

    def _arriving(self, worker: int, transfer: int, packets: int, dtype: str, tag: int,
                  shard: int) -> _Arriving | None:
        """The transfer's record, made at its first packet; None when the packet
        disagrees with it or the transfer would not fit what may be held."""
        key = (worker, transfer)
        t = self.transfers.get(key)
        if t is None:
            if packets * whole_bytes(dtype) > MAX_HELD_BYTES:
                return None
            t = self.transfers[key] = _Arriving(packets, dtype, tag, shard)
            self.held += t.nbytes
            while self.held > MAX_HELD_BYTES and len(self.transfers) > 1:
                _, old = self.transfers.popitem(last=False)
                self.held -= old.nbytes
                self.counts["evicted"] += 1
        if (t.packets, t.dtype, t.tag, t.shard) != (packets, dtype, tag, shard):
            return None
        return t

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
            t = _Arriving(packets, dtype, run_tag(h["run"]), h["shard"])
        missing = np.flatnonzero(~t.got)
        lost = len(missing) * per - (per - tail if t.got.size and not t.got[-1] else 0)
        if lost > h["tolerance"] * numel:
            # the fewest packets that bring the missing part within the tolerance
            excess = lost - math.floor(h["tolerance"] * numel)
            return min(len(missing), math.ceil(excess / per)), missing.tolist()
        grad = self._assemble(t, numel, DTYPES[dtype], lost)
        if self.transfers.pop((h["worker"], h["transfer"]), None) is not None:
            self.held -= t.nbytes
        header = {"v": h["v"], "op": "push", "run": h["run"], "worker": h["worker"],
                  "seq": h["seq"], "shard": h["shard"], "step": h["step"],
                  "offset": h["offset"], "tensors": [[dtype, [numel]]],
                  "delivered": numel - lost}
        return Message(header, [grad])

    @staticmethod
    def _assemble(t: _Arriving, numel: int, dtype: torch.dtype, lost: int) -> torch.Tensor:
        """The transfer's elements (a missing packet's zero), scaled up by what was lost."""
        # (the tensor takes the transfer's buffer over: the transfer is done with it)
        grad = torch.frombuffer(t.data, dtype=dtype, count=numel)
        if lost:  # unbiased: each element arrived with probability delivered / numel
            grad.mul_(numel / (numel - lost))
        return grad
