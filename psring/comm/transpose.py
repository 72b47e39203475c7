"""A transpose all-reduce whose reduce-scatter may lose a bounded fraction of each
transfer (``allreduce --loss-tolerance F``; OptiReduce's Transpose AllReduce, DLCP's
bounded loss).

    tar = TransposeAllReduce(rank, world, address, tolerance=0.02, pace_bits=1e8)
    tar.all_reduce(flat_gradients)   # in place: the average, the same on every rank

Each rank owns one of ``world`` equal shards of a bucket. Every rank sends each other
rank that rank's shard of its gradient as UDP datagrams (psring.comm.lossy), all at once
(no ring of world - 1 dependent hops for a loss to hold up), then a barrier over gloo
marks the end of the sends: what was sent before it and has not arrived is lost. The
owner keeps each source's shard when at most the fraction F of it is missing (the
missing elements zero, the rest scaled by numel / delivered: unbiased); beyond F the
source sends the owner enough of the missing packets again, chosen at random, over
gloo (reliable: one round, never more). The owner sums the shards and an all-gather
over gloo, reliable, gives every rank the same result: the replicas cannot drift
apart, whatever was lost.

The datagrams' addresses are exchanged once, as tensors (nothing is pickled).
"""

from __future__ import annotations

import ipaddress
import math
import queue
import select
import time

import torch
import torch.distributed as dist

from psring.comm.credits import Granter
from psring.comm.ingress import Ingress, drain, receiving_socket
from psring.comm.lossy import LossySender, Marks
from psring.comm.protocol import (
    Datagram,
    Message,
    decode,
    encode,
    per_datagram,
    run_tag,
)

#: bytes of datagrams the kernel may hold for the receiving socket: a bucket's shards
#: from every peer, not dropped for want of room
RECEIVE_BUFFER_BYTES = 64 << 20
#: seconds a rank waits for datagrams between looks at its senders (grants go out as
#: datagrams come: a long wait would hold the others' credit back)
WAIT_S = 2e-4
#: the run id the datagrams carry (the group's own: every rank the same)
RUN = "transpose"


class TransposeAllReduce:
    def __init__(self, rank: int, world: int, address: str, tolerance: float,
                 pace_bits: float | None = None, timeout: float = 300.0,
                 key: bytes | None = None, marks: Marks | None = None,
                 credit_window: int = 0):
        self.rank, self.world, self.tolerance, self.timeout = rank, world, tolerance, timeout
        self.sock = receiving_socket(address, 0, RECEIVE_BUFFER_BYTES)
        peers = self._exchange_addresses(address, self.sock.getsockname()[1])
        self.ingress = Ingress(key)  # (with the run's secret: signed datagrams only)
        #: --credit-window: this rank grants the others what they may send it
        self.granter = Granter(self.sock, credit_window, key) if credit_window else None
        self.sent: queue.SimpleQueue = queue.SimpleQueue()
        self.senders = {p: LossySender(f"tcp://{a}:{port}", RUN, rank, key,
                                       on_sent=self.sent.put, pace_bits=pace_bits,
                                       marks=marks, credits=bool(credit_window))
                        for p, (a, port) in enumerate(peers) if p != rank}
        self.transfer = 0
        #: elements of this rank's shard that arrived from the others (resends
        #: included), and that they sent: the delivered fraction is their ratio
        self.delivered = self.expected = 0

    def _exchange_addresses(self, address: str, port: int) -> list[tuple[str, int]]:
        mine = torch.tensor([int(ipaddress.IPv4Address(address)), port], dtype=torch.int64)
        everyone = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(everyone, mine)
        return [(str(ipaddress.IPv4Address(int(t[0]))), int(t[1])) for t in everyone]

    def all_reduce(self, buf: torch.Tensor, offset: int = 0) -> None:
        """``buf`` (1-d float32, each rank's gradient already divided by world; its
        elements from ``offset`` of the flat model, for the marks) becomes the sum over
        the ranks, the same on every rank, in place."""
        self.transfer += 1
        size = math.ceil(buf.numel() / self.world)
        padded = torch.zeros(size * self.world, dtype=torch.float32)
        padded[:buf.numel()] = buf
        shards = padded.view(self.world, size)
        transfers = {p: s.send(self.transfer, p, shards[p], token=p, offset=offset + p * size)
                     for p, s in self.senders.items()}
        self._wait_sent(len(transfers))
        dist.barrier()  # everyone's datagrams are out: what is missing now is lost
        self._drain()
        if self.granter is not None:  # (nothing more comes of this transfer's)
            for key in list(self.granter.flows):
                self.granter.done(key)
        mine = shards[self.rank].clone()
        for part in self._complete(transfers, size):
            mine += part
        gathered = [torch.empty(size, dtype=torch.float32) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        buf.copy_(torch.cat(gathered)[:buf.numel()])

    def _wait_sent(self, jobs: int) -> None:
        """Until the senders' threads have sent ``jobs`` shards, reading what the
        others send meanwhile (the socket's buffer may be small: rmem_max) and, with
        credits, granting as it comes."""
        deadline = time.monotonic() + self.timeout
        while jobs:
            try:
                self.sent.get_nowait()
                jobs -= 1
                continue
            except queue.Empty:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("transpose all-reduce: the datagrams were not sent "
                                   "within --timeout")
            select.select([self.sock], [], [], WAIT_S)
            self._drain()

    def _drain(self) -> None:
        drain(self.sock, self.ingress,
              heard=self.granter.heard if self.granter is not None else None)
        if self.granter is not None:
            self.granter.expire()

    def _header(self, source: int, numel: int) -> Message:
        """The end marker of ``source``'s shard of this transfer, as a server gets it
        (made by the protocol module, and checked by it, as one from the wire)."""
        packets = math.ceil(numel / per_datagram("float32"))
        return decode(encode("lossy_push", {
            "run": RUN, "worker": source, "seq": self.transfer, "shard": self.rank,
            "step": 0, "offset": 0, "numel": numel, "packets": packets, "dtype": "float32",
            "tolerance": self.tolerance, "transfer": self.transfer}))

    def _complete(self, transfers: dict, size: int) -> list[torch.Tensor]:
        """Each other rank's part of this rank's shard, within the bound after one
        reliable round of resends for those beyond it."""
        done = {p: self.ingress.complete(self._header(p, size)) for p in self.senders}
        asks = {p: d for p, d in done.items() if isinstance(d, tuple)}
        self._resend_round(asks, transfers, size)
        out = []
        for p in self.senders:
            push = self.ingress.complete(self._header(p, size)) if p in asks else done[p]
            if isinstance(push, tuple):
                raise RuntimeError(f"transpose all-reduce: rank {p}'s part still misses "
                                   f"{len(push[1])} packets after its resend")
            self.delivered += push.header["delivered"]
            self.expected += size
            out.append(push.tensors[0])
        return out

    def _resend_round(self, asks: dict[int, tuple[int, list[int]]], transfers: dict,
                      size: int) -> None:
        """Over gloo, every rank taking part asked or not: each owner tells each source
        which packets it misses (``need`` first); each source answers with the ones it
        chooses (at random: LossySender.choose), as [k, their numbers..., their
        elements...]."""
        empty = torch.empty(0, dtype=torch.float32)
        requests = [torch.tensor([asks[p][0], *asks[p][1]], dtype=torch.float32)
                    if p in asks else empty for p in range(self.world)]
        replies = []
        for p, req in enumerate(_all_to_all(requests)):
            if req.numel() == 0:
                replies.append(empty)
                continue
            t = transfers[p]
            chosen = LossySender.choose(t, [int(i) for i in req[1:]], int(req[0]))
            replies.append(torch.cat([torch.tensor([len(chosen), *chosen], dtype=torch.float32),
                                      *(t.grad[i * t.per:(i + 1) * t.per] for i in chosen)]))
        for p, ans in enumerate(_all_to_all(replies)):
            if ans.numel():
                self._keep_resent(p, ans, size)

    def _keep_resent(self, source: int, ans: torch.Tensor, size: int) -> None:
        per = per_datagram("float32")
        packets = math.ceil(size / per)
        k = int(ans[0])
        at = 1 + k
        for i in (int(x) for x in ans[1:1 + k]):
            n = min(per, size - i * per)
            payload = memoryview(ans[at:at + n].numpy().tobytes())
            at += n
            self.ingress.keep(Datagram(source, self.rank, run_tag(RUN), self.transfer, i,
                                       packets, "float32", payload))

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
        self.sock.close()


def _all_to_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """tensors[p] to rank p; returns what each rank sent this one (float32, any
    lengths): their lengths first, then the elements, two all_to_all_single's."""
    world = len(tensors)
    sizes = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    theirs = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(theirs, sizes)
    out = torch.empty(int(theirs.sum()), dtype=torch.float32)
    dist.all_to_all_single(out, torch.cat(tensors) if world else torch.empty(0),
                           output_split_sizes=theirs.tolist(),
                           input_split_sizes=sizes.tolist())
    return list(out.split(theirs.tolist()))
