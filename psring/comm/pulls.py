"""Pulled parameters as datagrams (a synchronous run's bounded-loss pulls), the
worker's side; the server's is psring.comm.egress.

    pulls = DatagramPulls(["tcp://198.18.0.3:5555"], run="r1", worker=0, key=None)
    fields["datagrams"] = pulls.port              # in the pull request, then:
    pulls.expect(seq, shard=0, numel=n)            # before the request leaves
    for seq, tensor in pulls.receive(): ...        # when pulls.fileno() is readable
    pulls.ask_again()                              # at pulls.due(): resend requests

The pull's answer arrives as one transfer of datagrams (its id the request's seq) on a
UDP socket of the worker's own, bound to the address its requests leave from. A
transfer is taken when every packet of it has arrived: nothing of a pull may be lost.
The server follows a pull's last packet with end markers: a pull whose markers came
asks its server at once for what is missing (resend requests,
psring.comm.datagrams.Nack: what has not come by its markers was lost); the server
follows each round of resends with end markers too, and what a round did not bring is
asked for at once when they come; without them (lost too), again after a few of its
round trips while the resends do not come, the wait doubling (at most MAX_WAIT_S).
Only those round trips are measured (a request made after the markers is answered by
resends alone, Karn's rule; one made while the server still streams, or waits for the
other workers' pushes, would time those). A pull without
its markers (still streaming, its server waiting, it waiting its turn on the server's
link behind the other workers' pulls, or the markers lost) asks every MAX_WAIT_S; the
server answers only for what has left (psring.comm.egress). So a lost datagram costs
a round trip or a few, never TCP's 200 ms retransmission timeout; a server sends only
what it has sent before again.
Datagrams of transfers this worker did not ask for are dropped unread.
"""

from __future__ import annotations

import math
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import torch

from psring.comm.datagrams import (
    MAX_PACKETS,
    NACK_MOST,
    WIRE_CODES,
    Nack,
    encode_nack,
    per_datagram,
    run_tag,
)
from psring.comm.ingress import Ingress
from psring.comm.receiving import drain, receiving_socket

#: bytes of datagrams the kernel may hold for a worker's socket: every server's answer
#: to one pull of the whole model, not dropped for want of room
RECEIVE_BUFFER_BYTES = 64 << 20
#: seconds a pull whose end markers came waits, at least, for its resends before it
#: asks again
MIN_WAIT_S = 0.002
#: ... or this many of its measured round trips (a resend request made after the
#: markers, to the first packet after it)
WAIT_RTTS = 3
#: the longest wait between requests while nothing comes, and the wait of a pull whose
#: end markers have not come (most likely its server still streams it, waits for the
#: other workers' pushes or sends their pulls first, unless the markers were lost):
#: asked this often
MAX_WAIT_S = 0.05
#: resend requests at once, each naming up to NACK_MOST packets
NACKS_AT_ONCE = 4


@dataclass
class _Expected:
    shard: int
    numel: int
    #: the server's datagram address, where its resend requests go
    server: tuple[str, int]
    #: when it was sent, its last packet arrived or it last asked (the wait runs from it)
    since: float
    #: resend requests in a row that nothing followed (the wait doubles with each)
    unanswered: int = 0
    #: packets, once its first datagram (or its end marker) said how many
    packets: int = 0
    #: its end markers came: every packet of it has left the server
    ended: bool = False
    #: a resend request went after the end markers: what comes now are resends
    asked_ended: bool = False
    #: when it last asked (0: not yet)
    asked_at: float = 0.0
    #: end markers came after its last request: the resend round is over, and what it
    #: did not bring was lost (asked for at once)
    round_over: bool = False


class DatagramPulls:
    """A worker's receiving side of pulls answered as datagrams."""

    def __init__(self, servers: list[str], run: str, worker: int, key: bytes | None):
        self.servers = [_address(a) for a in servers]
        self.run, self.worker, self.key, self.tag = run, worker, key, run_tag(run)
        self.sock = receiving_socket(_local_address(self.servers[0]), 0,
                                     RECEIVE_BUFFER_BYTES)
        self.port = self.sock.getsockname()[1]
        self.ingress = Ingress(key, accept=self._accept)
        self.expected: dict[int, _Expected] = {}
        self.rtt = MIN_WAIT_S / WAIT_RTTS  # (a first guess; each answered request measures it)
        self.counts = {"pull_nacks": 0}

    def fileno(self) -> int:
        return self.sock.fileno()

    def expect(self, seq: int, shard: int, numel: int) -> None:
        """The pull sent under ``seq`` to ``shard`` for ``numel`` elements."""
        self.expected[seq] = _Expected(shard, numel, self.servers[shard], time.monotonic())

    def forget(self, seq: int) -> None:
        """A pull answered otherwise (over TCP), or abandoned."""
        self.expected.pop(seq, None)

    def _accept(self, worker: int, transfer: int, packets: int, dtype: str, tag: int,
                shard: int) -> bool:
        e = self.expected.get(transfer)
        return (e is not None and (worker, tag, shard) == (self.worker, self.tag, e.shard)
                and packets == max(1, math.ceil(e.numel / per_datagram(dtype))))

    def receive(self) -> list[tuple[int, torch.Tensor]]:
        """The pulls whose every packet has arrived: (seq, elements), each once."""
        drain(self.sock, self.ingress)
        done = []
        for seq, e in list(self.expected.items()):
            heard = self.ingress.heard(self.worker, seq)
            if heard is not None and heard > e.since:
                if e.unanswered and e.asked_ended:  # (resends: the request's round trip)
                    self.rtt = 0.7 * self.rtt + 0.3 * max(0.0, heard - e.since)
                e.since, e.unanswered = heard, 0
            end = self.ingress.ends.get((self.worker, seq))
            if end is not None:
                e.ended, e.packets = True, e.packets or end.packets
                e.round_over = e.asked_ended and self.ingress.marked_since(self.worker, seq,
                                                                            e.asked_at)
            t = self.ingress.transfers.get((self.worker, seq))
            if t is not None:
                e.packets = t.packets
            tensor = self.ingress.whole(self.worker, seq, e.numel)
            if tensor is not None:
                del self.expected[seq]
                done.append((seq, tensor))
        return done

    def wait_s(self, e: _Expected) -> float:
        if not e.ended:  # (still streaming, waiting for the other workers' pushes, or
            return MAX_WAIT_S  # its end markers lost)
        if not e.asked_ended or e.round_over:  # (what has not come by its end markers,
            return 0.0                         # or a resend round's, was lost)
        return min(MAX_WAIT_S, max(MIN_WAIT_S, WAIT_RTTS * self.rtt) * 2 ** e.unanswered)

    def due(self) -> float | None:
        """Seconds until the next resend request is due (None: no pull waits)."""
        if not self.expected:
            return None
        now = time.monotonic()
        return max(0.0, min(e.since + self.wait_s(e) - now for e in self.expected.values()))

    def ask_again(self) -> int:
        """Resend requests for every pull quiet for its wait; how many were sent."""
        now, sent = time.monotonic(), 0
        for seq, e in self.expected.items():
            if now < e.since + self.wait_s(e):
                continue
            # (nothing heard yet: counted as float32; a server ignores numbers beyond
            # the pull's packets)
            packets = e.packets or max(1, math.ceil(e.numel / per_datagram(WIRE_CODES[0])))
            missing = self.ingress.missing(self.worker, seq, min(packets, MAX_PACKETS))
            for k in range(0, min(missing.size, NACKS_AT_ONCE * NACK_MOST), NACK_MOST):
                listed = tuple(int(i) for i in missing[k:k + NACK_MOST])
                n = Nack(self.worker, e.shard, self.tag, seq, len(listed), listed)
                try:
                    self.sock.sendto(encode_nack(n, self.key), e.server)
                    sent += 1
                except OSError:
                    pass  # (as if lost on the way: asked again after the next wait)
            e.since, e.unanswered = now, e.unanswered + 1
            e.asked_ended, e.asked_at, e.round_over = e.ended, now, False
        self.counts["pull_nacks"] += sent
        return sent

    def close(self) -> None:
        self.sock.close()


def _address(endpoint: str) -> tuple[str, int]:
    u = urlparse(endpoint)
    if u.scheme != "tcp" or u.hostname is None or u.port is None:
        raise ValueError(f"datagram pulls need tcp:// servers, not {endpoint}")
    return u.hostname, u.port


def _local_address(server: tuple[str, int]) -> str:
    """The address this host's datagrams to ``server`` leave from (a UDP connect sends
    nothing): the one its pull requests come from, where the answer is sent."""
    family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(server)
        return probe.getsockname()[0]
