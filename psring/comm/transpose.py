"""A transpose all-reduce whose reduce-scatter may lose a bounded fraction of each
transfer (``allreduce --loss-tolerance F``; OptiReduce's Transpose AllReduce, DLCP's
bounded loss).

    tar = TransposeAllReduce(rank, world, address, tolerance=0.02, pace_bits=1e8)
    tar.all_reduce(flat_gradients)   # in place: the average, the same on every rank

Each rank owns one of ``world`` equal shards of a bucket. Every rank sends each other
rank that rank's shard of its gradient as UDP datagrams (psring.comm.lossy), all at once
(no ring of world - 1 dependent hops for a loss to hold up), each part followed by end
markers. Its control runs over the same datagrams, as OptiReduce's does, not over TCP:
a source's part is looked at once its end marker arrives, or once the source has been
quiet for an idle timeout that adapts to the gaps between its datagrams (its markers
lost). The owner keeps the part when at most the fraction F of it is missing (the
missing elements zero, the rest scaled by numel / delivered: unbiased); beyond F it
asks the source for the missing packets (a resend request, a datagram naming some of
them, chosen at random), again after each quiet spell or as the markers that end
each round of resends come, until the part is within F;
a source never heard at all is asked for everything after a while (all of its part
lost, markers included; a straggler ignores a request for a transfer it has not sent
yet). Each rank answers requests on a thread of its own, which receives every
datagram (in batches while a part streams in), so a rank already in the all-gather
still answers. The owner sums the parts and sends the sum to every other rank as
datagrams too, the all-gather: the same
machinery with no bound (a part is kept only whole, every missing packet asked for
again), so every rank holds the same bytes and the replicas cannot drift apart,
whatever was lost, and no TCP retransmission timeout holds up a step. A bucket's
datagrams are queued as soon as it is ready (:meth:`TransposeAllReduce.scatter`, from
the gradient hook), so they leave while the bucket before is still collected;
collecting and queueing the sums run on the communication thread in the buckets' order
(:meth:`TransposeAllReduce.finish`), collecting the others' sums where the step waits
(:meth:`Gathering.wait`).

The datagrams' addresses are exchanged once, as tensors (nothing is pickled).
"""

from __future__ import annotations

import ipaddress
import math
import random
import select
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from psring.comm.credits import Granter
from psring.comm.datagrams import NACK_MOST, Nack, encode_nack, per_datagram, run_tag
from psring.comm.ingress import Ingress
from psring.comm.lossy import LossySender, Marks
from psring.comm.outbox import Outbox
from psring.comm.protocol import Message, decode, encode
from psring.comm.receiving import drain, receiving_socket

#: bytes of datagrams the kernel may hold for the receiving socket: a bucket's shards
#: from every peer, not dropped for want of room
RECEIVE_BUFFER_BYTES = 64 << 20
#: seconds the waiting thread sleeps between looks at the parts (a quarter of
#: IDLE_MIN_S: a quiet source is noticed within it); the receiving thread wakes it
#: sooner when an end marker arrives, and at each receive while a resend request is out
WAIT_S = 5e-3
#: the run id the datagrams carry (the group's own: every rank the same)
RUN = "transpose"
#: seconds a source may be quiet, at least, before what has not arrived of its part
#: counts as lost (its end markers lost too) or a resend request is made again (a
#: tenth of TCP's least retransmission timeout, and beyond a credited sender's wait
#: for a lost grant) ...
IDLE_MIN_S = 0.02
#: ... or this many times the usual gap between its receives (smoothed: one long pause
#: must not stretch every later wait), or this many round trips of a resend request
IDLE_GAPS = 4
#: ... but never more than this (a bound whatever was measured: a spurious resend
#: request costs packets sent twice, a runaway timeout a step)
IDLE_MAX_S = 0.5
#: seconds a source never heard is waited for, once every other part is in, before it
#: is asked for everything, then again after each idle timeout: all of its part lost,
#: its end markers too, or a straggler (which ignores a request for a transfer it has
#: not sent yet, or sends the part twice if the request comes just as it sends)
SILENT_S = 1.0
#: buckets whose datagrams (their scatter's and their gather's) a rank keeps to answer
#: resend requests
KEPT = 4
#: copies of a resend request, back to back
NACK_COPIES = 2
#: where the kernel coalesces nothing (no GRO on the path, or several sources
#: interleaved), a receiving thread woken for each datagram spends the cores on its
#: wakes: while a transfer of at least STREAM_PACKETS streams in, it waits after each
#: drain until about RECEIVE_BATCH datagrams may have come, by the rate they came at,
#: at most RECEIVE_PAUSE_S (as a NIC moderates its interrupts). What it adds: a wait of
#: at most that before a part's end marker is seen.
RECEIVE_BATCH = 160
RECEIVE_PAUSE_S = 5e-3
STREAM_PACKETS = 64
#: the header a part is looked at with (TransposeAllReduce._header): its fields but
#: the part's own, as the protocol module makes and checks them
LOOKED_AT = decode(encode("lossy_push", {
    "run": RUN, "worker": 0, "seq": 1, "shard": 0, "step": 0, "offset": 0, "numel": 1,
    "packets": 1, "dtype": "float32", "tolerance": 0.0, "transfer": 1}))


class Timeouts:
    """How long each source may be quiet before what has not arrived of its part counts
    as lost (OptiReduce's adaptive timeouts): IDLE_GAPS times the larger of the usual
    gap between the source's receives and a resend request's round trip, within
    [IDLE_MIN_S, IDLE_MAX_S].

    A receive that ends a quiet spell a request of ours ended measures the round trip,
    not a gap: the spell was this rank's own wait, and counted as a gap it lengthened the
    next wait, so under steady loss each timeout grew the next by half again (steps of
    tens of seconds after a few dozen)."""

    def __init__(self, sources):
        self.gaps = dict.fromkeys(sources, 0.0)
        self.rtt = 0.0

    def heard(self, p: int, before: float, heard: float, asked: float | None) -> None:
        """Source ``p``'s newest receive went from ``before`` to ``heard``; ``asked``:
        when it was last asked for packets (None: not in this transfer)."""
        if asked is not None and before < asked <= heard:  # (what a request brought)
            self.rtt = _smooth(self.rtt, heard - asked)
        else:
            self.gaps[p] = _smooth(self.gaps[p], heard - before)

    def idle(self, p: int) -> float:
        return min(IDLE_MAX_S, max(IDLE_MIN_S, IDLE_GAPS * max(self.gaps[p], self.rtt)))


def _smooth(mean: float, sample: float) -> float:
    return 0.8 * mean + 0.2 * sample if mean else sample


@dataclass
class Scattered:
    """A bucket scattered (:meth:`TransposeAllReduce.scatter`): its transfer id (its
    all-gather's is the next), its shards' size, this rank's own shard (where the
    others' parts are summed), and the bucket the sum goes back into."""

    transfer: int
    size: int
    mine: torch.Tensor
    buf: torch.Tensor
    #: where the bucket begins in the flat model (the marks)
    offset: int = 0


class Gathering:
    """A transpose all-reduce's all-gather in flight: each owner's sum sent to every
    other rank as datagrams, every packet of it asked for again until in (no bound:
    the replicas cannot drift apart). ``wait()`` collects the others' sums and writes
    the whole into the bucket."""

    def __init__(self, tar: "TransposeAllReduce", sc: Scattered):
        self.tar, self.sc = tar, sc

    def wait(self) -> None:
        tar, sc = self.tar, self.sc
        sums = tar._collect(sc.transfer + 1, sc.size, gather=True)
        whole = torch.cat([sums.get(p, sc.mine) for p in range(tar.world)])
        sc.buf.copy_(whole[:sc.buf.numel()])


class TransposeAllReduce:
    def __init__(self, rank: int, world: int, address: str, tolerance: float,
                 pace_bits: float | None = None, timeout: float = 300.0,
                 key: bytes | None = None, marks: Marks | None = None,
                 credit_window: int = 0):
        self.rank, self.world, self.tolerance, self.timeout = rank, world, tolerance, timeout
        self.key = key
        self.sock = receiving_socket(address, 0, RECEIVE_BUFFER_BYTES)
        self.peers = self._exchange_addresses(address, self.sock.getsockname()[1])
        self.ingress = Ingress(key)  # (with the run's secret: signed datagrams only)
        #: --credit-window: this rank grants the others what they may send it
        self.granter = Granter(self.sock, credit_window, key) if credit_window else None
        # one thread sends to every peer, each shard whole in turn; rank r's first to
        # r + 1, so that at any moment each rank's downlink has one sender, not an incast.
        # (With credits each sender keeps its own: a wait for a grant would hold up the
        # other peers' shards.)
        self.outbox = None if credit_window else Outbox("transpose-send")
        order = [(rank + k) % world for k in range(1, world)]
        self.senders = {p: LossySender(f"tcp://{self.peers[p][0]}:{self.peers[p][1]}",
                                       RUN, rank, key, pace_bits=pace_bits, marks=marks,
                                       credits=bool(credit_window), ends=True,
                                       outbox=self.outbox)
                        for p in order}
        self.transfer = 0
        #: the last KEPT buckets' transfers (scatter and gather), by transfer and
        #: receiver: what a resend request may ask for
        self.outgoing: dict[int, dict] = {}
        #: when a quiet source's missing packets count as lost
        self.timeouts = Timeouts(self.senders)
        #: elements of this rank's shard that arrived from the others (resends
        #: included), and that they sent: the delivered fraction is their ratio
        self.delivered = self.expected = 0
        # every datagram is received, and every request answered, by one thread
        self.cond = threading.Condition()
        #: the transfers a waiting thread has resend requests out for (then each
        #: receive may complete a part, and wakes it)
        self.asking: set[int] = set()
        self.stopping = False
        self.receiver = threading.Thread(target=self._receive, daemon=True,
                                         name="transpose-receive")
        self.receiver.start()

    def _exchange_addresses(self, address: str, port: int) -> list[tuple[str, int]]:
        mine = torch.tensor([int(ipaddress.IPv4Address(address)), port], dtype=torch.int64)
        everyone = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(everyone, mine)
        return [(str(ipaddress.IPv4Address(int(t[0]))), int(t[1])) for t in everyone]

    def all_reduce(self, buf: torch.Tensor, offset: int = 0) -> None:
        """``buf`` (1-d float32, each rank's gradient already divided by world; its
        elements from ``offset`` of the flat model, for the marks) becomes the sum over
        the ranks, the same on every rank, in place."""
        self.start(buf, offset).wait()

    def start(self, buf: torch.Tensor, offset: int = 0) -> "Gathering":
        """:meth:`all_reduce` up to its all-gather: the reduce-scatter done, the
        all-gather launched; ``buf`` holds the sum once the handle's ``wait()`` returns.
        (:meth:`scatter` then :meth:`finish`, on one thread.)"""
        return self.finish(self.scatter(buf, offset))

    def scatter(self, buf: torch.Tensor, offset: int = 0) -> "Scattered":
        """Queue ``buf``'s shards for their owners and return at once (its datagrams go
        out on the senders' threads). A bucket's scatter may run as soon as the bucket
        is ready, while the bucket before it is still being collected: the links do not
        idle while an owner waits for its parts."""
        size = math.ceil(buf.numel() / self.world)
        padded = torch.zeros(size * self.world, dtype=torch.float32)
        padded[:buf.numel()] = buf
        shards = padded.view(self.world, size)
        with self.cond:  # (before any request for it can come)
            # (a bucket's scatter an odd id, its gather the next: the k-th bucket's ids
            # are the same on every rank, whatever its threads' order)
            self.transfer += 2
            transfer = self.transfer - 1
            self.outgoing[transfer] = {
                p: s.send(transfer, p, shards[p], offset=offset + p * size)
                for p, s in self.senders.items()}
            self._forget_old(transfer)
        return Scattered(transfer, size, shards[self.rank].clone(), buf, offset)

    def _forget_old(self, transfer: int) -> None:
        for old in [t for t in self.outgoing if t <= transfer - 2 * KEPT]:
            del self.outgoing[old]

    def finish(self, sc: "Scattered") -> "Gathering":
        """The rest of a :meth:`scatter`: this rank's shard summed from the others'
        parts (waited for, within the bound), and the sum queued for every other rank
        (the all-gather; the handle's ``wait()`` collects theirs)."""
        for part in self._collect(sc.transfer, sc.size).values():
            sc.mine += part
        with self.cond:
            self.outgoing[sc.transfer + 1] = {
                p: s.send(sc.transfer + 1, self.rank, sc.mine,
                          offset=sc.offset + self.rank * sc.size)
                for p, s in self.senders.items()}
            self._forget_old(sc.transfer + 1)
        return Gathering(self, sc)

    # -- the owner's side: the parts of its shard -----------------------------------------
    def _collect(self, transfer: int, size: int,
                 gather: bool = False) -> dict[int, torch.Tensor]:
        """Each other rank's part of this rank's shard, within the bound (``gather``:
        each other rank's own shard, summed, whole): waited for, and asked for again
        (resend requests) until it is; bounded by --timeout."""
        start = time.monotonic()
        parts: dict[int, Message] = {}
        last = dict.fromkeys(self.senders)  # (when each was last heard)
        asked: dict[int, float] = {}  # (when each was last asked)
        with self.cond:
            while len(parts) < len(self.senders):
                now = time.monotonic()
                for p in self.senders:
                    if p not in parts:
                        self._look(p, transfer, size, gather, now, start, parts, last,
                                   asked)
                if len(parts) == len(self.senders):
                    break
                if now - start > self.timeout:
                    late = sorted(set(self.senders) - set(parts))
                    raise TimeoutError(f"transpose all-reduce: the parts of rank(s) {late} "
                                       f"did not come within --timeout")
                if asked:
                    self.asking.add(transfer)
                self.cond.wait(WAIT_S)
            self.asking.discard(transfer)
            if self.granter is not None:  # (nothing more comes of this transfer's)
                for key in [k for k in self.granter.flows if k[1] == transfer]:
                    self.granter.done(key)
        if not gather:  # (an all-gather's parts arrive whole, or not at all)
            self.delivered += sum(parts[p].header["delivered"] for p in self.senders)
            self.expected += size * len(self.senders)
        return {p: parts[p].tensors[0] for p in self.senders}

    def _look(self, p: int, transfer: int, size: int, gather: bool, now: float,
              start: float, parts: dict, last: dict, asked: dict) -> None:
        """Source ``p``'s part: kept once in (its end marker, or quiet) and within the
        bound; asked for again when it is not, and quiet."""
        heard = self.ingress.heard(p, transfer)
        if heard is not None and last[p] is not None and heard > last[p]:
            self.timeouts.heard(p, last[p], heard, asked.get(p))
        last[p] = heard
        quiet = now - max(heard or 0.0, asked.get(p, 0.0)) > self.timeouts.idle(p)
        if heard is None:
            # never heard: asked for everything once the others are in (or it was
            # asked before and has stayed quiet)
            others_in = all(q in parts or q == p for q in self.senders)
            if (p in asked and quiet) or (p not in asked and others_in
                                          and now - start > SILENT_S):
                packets = math.ceil(size / per_datagram("float32"))
                self._ask(p, transfer, packets, list(range(packets)), now, asked)
            return
        if not (self.ingress.ended(p, transfer) or quiet or p in asked):
            return
        got = self.ingress.complete(self._header(p, transfer, size, gather))
        # (markers after this rank's last request: the resend round is over)
        round_over = p in asked and self.ingress.marked_since(p, transfer, asked[p])
        if isinstance(got, Message):
            parts[p] = got
        elif p not in asked or quiet or round_over:
            need, missing = got
            self._ask(p, transfer, need, missing, now, asked)

    def _ask(self, p: int, transfer: int, need: int, missing: list[int], now: float,
             asked: dict) -> None:
        """A resend request to source ``p``: ``need`` packets, some of ``missing``."""
        listed = sorted(random.sample(missing, min(len(missing), NACK_MOST)))
        wire = encode_nack(Nack(self.rank, self.rank, run_tag(RUN), transfer,
                                min(need, len(listed)), tuple(listed)), self.key)
        for _ in range(NACK_COPIES):
            try:
                self.sock.sendto(wire, self.peers[p])
            except OSError:
                pass  # (as if lost on the wire: asked again after the idle timeout)
        asked[p] = now

    def _header(self, source: int, transfer: int, numel: int, gather: bool) -> Message:
        """The end marker of ``source``'s shard of this transfer, as a server gets it:
        the fields of :data:`LOOKED_AT` made by the protocol module and checked by it,
        as one from the wire, once; this part's own filled in (Ingress.complete checks
        them)."""
        return Message({**LOOKED_AT.header, "worker": source, "seq": transfer,
                        "shard": source if gather else self.rank, "numel": numel,
                        "packets": math.ceil(numel / per_datagram("float32")),
                        "tolerance": 0.0 if gather else self.tolerance,
                        "transfer": transfer, "tensors": []})  # (nothing shared)

    # -- the receiving thread: every datagram, every request answered ------------------------
    def _receive(self) -> None:
        last = time.monotonic()
        while not self.stopping:
            try:
                ready, _, _ = select.select([self.sock], [], [], 0.05)
            except (OSError, ValueError):  # (closed)
                return
            got = 0
            with self.cond:
                marked = self.ingress.marked
                if ready:
                    got = drain(self.sock, self.ingress,
                                heard=self.granter.heard if self.granter is not None
                                else None)
                    for n in self.ingress.take_nacks():
                        self._answer(n)
                if self.granter is not None:
                    self.granter.expire()
                # (the waiter wakes for news only: a receive of a part still streaming
                # changes nothing it acts on, and each wake costs the cores a switch)
                if self.ingress.marked != marked or (ready and self.asking):
                    self.cond.notify_all()
                streaming = got > 0 and self.ingress.streaming(STREAM_PACKETS)
            if streaming:  # (the datagrams wait in the socket's buffer meanwhile)
                since = time.monotonic() - last
                time.sleep(min(RECEIVE_PAUSE_S, RECEIVE_BATCH * since / got))
            last = time.monotonic()

    def _answer(self, n: Nack) -> None:
        """Send again ``n.need`` of the packets rank ``n.worker`` asks for, if the
        transfer is still kept (a request for one not sent yet, or long done, waits
        for the next, or is moot)."""
        t = self.outgoing.get(n.transfer, {}).get(n.worker)
        if t is not None and n.run_tag == run_tag(RUN):
            self.senders[n.worker].resend(t, list(n.missing), n.need)

    def close(self) -> None:
        self.stopping = True
        self.receiver.join(timeout=5.0)
        if self.outbox is not None:
            self.outbox.close()
        for s in self.senders.values():
            s.close()
        self.sock.close()
