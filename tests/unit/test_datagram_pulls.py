"""Pulls answered as datagrams (psring.comm.egress, the server's side; psring.comm.pulls,
the worker's), over loopback: a pull arrives whole and exact, range by range as the
server answers it, whatever is lost on the way (resend requests); nothing of it is
taken before all of it is there; datagrams nobody asked for are not held."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import torch

from psring.comm import pulls as pulls_mod
from psring.comm.datagrams import encode_block, per_datagram, run_tag
from psring.comm.egress import Egress
from psring.comm.ingress import Ingress
from psring.comm.pulls import DatagramPulls
from psring.comm.receiving import drain, receiving_socket

RUN = "pulls-test"


class Pair:
    """A server's egress and UDP port, and a worker's DatagramPulls, on loopback."""

    def __init__(self, key: bytes | None = None, drop: float = 0.0, seed: int = 0):
        self.key = key
        self.server_sock = receiving_socket("127.0.0.1", 0, 8 << 20)
        self.server_ingress = Ingress(key)  # (the server's: it hears resend requests)
        port = self.server_sock.getsockname()[1]
        self.pulls = DatagramPulls([f"tcp://127.0.0.1:{port}"], RUN, worker=3, key=key)
        self.egress = Egress(key)
        self.egress.learn(RUN, 3, "127.0.0.1", self.pulls.port, pace_bits=0)
        self.dropped = 0
        if drop:
            self._lossy(self.egress.senders[(run_tag(RUN), 3)], drop, random.Random(seed))

    def _lossy(self, sender, drop: float, rng: random.Random) -> None:
        """Each datagram the sender sends lost with probability ``drop``."""
        send = sender._send

        def lossy_send(data, k, size, tos=None):
            whole = b"".join(bytes(d) for d in data)
            for m in range(k):
                if rng.random() < drop:
                    self.dropped += 1
                    continue
                send([memoryview(whole[m * size:(m + 1) * size])], 1, size, tos)

        sender._send = lossy_send

    def header(self, seq: int, shard: int = 0) -> dict:
        return {"run": RUN, "worker": 3, "seq": seq, "shard": shard}

    def serve(self) -> None:
        """The server's part of a poll: resend requests heard, answered."""
        drain(self.server_sock, self.server_ingress)
        for nack in self.server_ingress.take_nacks():
            self.egress.nacked(nack)

    def until_done(self, seconds: float = 10.0) -> dict[int, torch.Tensor]:
        got, deadline = {}, time.monotonic() + seconds
        while self.pulls.expected and time.monotonic() < deadline:
            time.sleep(0.0005)
            got.update(self.pulls.receive())
            if self.pulls.due() == 0:
                self.pulls.ask_again()
            self.serve()
        return got

    def close(self) -> None:
        self.egress.close()
        self.pulls.close()
        self.server_sock.close()


@pytest.fixture
def pair_of():
    made = []

    def make(**kw) -> Pair:
        made.append(Pair(**kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def ranges(numel: int, cuts: list[int]) -> list[tuple[int, int]]:
    edges = [0, *cuts, numel]
    return list(zip(edges[:-1], edges[1:]))


@pytest.mark.parametrize("key", [None, b"k" * 32])
def test_a_pull_arrives_whole_and_exact_range_by_range(pair_of, key):
    p = pair_of(key=key)
    values = torch.randn(100_003)
    p.pulls.expect(seq=41, shard=0, numel=values.numel())
    # ranges that cut packets apart, answered out of order: a packet leaves once whole
    parts = ranges(values.numel(), [1_000, 35_511, 35_512, 77_777])
    for i, (a, b) in enumerate(reversed(parts)):
        p.egress.piece(p.header(41), values.numel(), a, values[a:b])
        time.sleep(0.01)
        if i < len(parts) - 1:
            assert p.pulls.receive() == []  # (not taken before all of it is there)
    got = p.until_done()
    assert list(got) == [41] and torch.equal(got[41], values)
    assert p.egress.counts["pulled_datagrams"] == -(-values.numel() * 4 // 1408)


def test_what_is_lost_is_asked_for_until_the_pull_is_exact(pair_of):
    p = pair_of(drop=0.1, seed=5)
    values = torch.randn(60_000)
    p.pulls.expect(seq=7, shard=0, numel=values.numel())
    for a, b in ranges(values.numel(), [20_000, 40_001]):
        p.egress.piece(p.header(7), values.numel(), a, values[a:b])
    got = p.until_done()
    assert p.dropped > 0 and p.pulls.counts["pull_nacks"] > 0
    assert p.egress.counts["pull_resends"] > 0
    assert torch.equal(got[7], values)


def test_a_pull_not_yet_answered_asks_seldom_and_gets_nothing_twice(pair_of):
    # the server still waits for the other workers: nothing of the pull was sent, so
    # its requests, seldom, are answered with nothing
    p = pair_of()
    p.pulls.expect(seq=9, shard=0, numel=5_000)
    # (a pull not heard of asks once a MAX_WAIT_S: the gaps between its requests are
    # checked, not how many fit a span of wall time a loaded machine stretches)
    asks, deadline = [], time.monotonic() + 5
    while len(asks) < 4 and time.monotonic() < deadline:
        p.pulls.receive()
        if p.pulls.due() == 0 and p.pulls.ask_again():
            asks.append(time.monotonic())
        p.serve()
        time.sleep(0.0005)
    assert len(asks) == 4 and p.pulls.counts["pull_nacks"] == 4
    # (less 10%: the times are taken after ask_again returns, and a late return after
    # one ask shortens the gap to the next as this loop sees it)
    assert min(b - a for a, b in zip(asks, asks[1:])) >= 0.9 * pulls_mod.MAX_WAIT_S
    assert p.egress.counts["pull_resends"] == 0
    values = torch.randn(5_000)
    p.egress.piece(p.header(9), 5_000, 0, values)
    assert torch.equal(p.until_done()[9], values)


def _drop_packet(p: Pair, *index: int) -> None:
    """The ``index``-th datagrams the server's sender sends (counted from 0, its end
    markers among them) lost."""
    sender = p.egress.senders[(run_tag(RUN), 3)]
    send, count = sender._send, [0]

    def dropping(data, k, size, tos=None):
        whole = b"".join(bytes(d) for d in data)
        for m in range(k):
            if count[0] not in index:
                send([memoryview(whole[m * size:(m + 1) * size])], 1, size, tos)
            count[0] += 1

    sender._send = dropping


def test_a_pull_asks_at_once_when_its_end_markers_say_the_rest_was_lost(pair_of,
                                                                        monkeypatch):
    # its last packet lost: the end markers behind it say so, the worker asks at once
    # (not after its round trips: a second here) and the server, its markers gone,
    # sends the packet again however lately it left (not after CROSSED_S: 10 s here)
    monkeypatch.setattr("psring.comm.egress.CROSSED_S", 10.0)
    p = pair_of()
    p.pulls.rtt = 1.0
    values = torch.randn(30_000)
    packets = -(-values.numel() * 4 // 1408)
    _drop_packet(p, packets - 1)
    p.pulls.expect(seq=3, shard=0, numel=values.numel())
    p.egress.piece(p.header(3), values.numel(), 0, values)
    deadline = time.monotonic() + 5  # (until the end markers are in, however loaded)
    while not p.pulls.expected[3].ended and time.monotonic() < deadline:
        assert p.pulls.receive() == []
        time.sleep(0.002)
    assert p.pulls.receive() == [] and p.pulls.due() == 0
    assert p.pulls.ask_again() == 1
    time.sleep(0.005)
    p.serve()
    assert p.egress.counts["pull_resends"] == 1
    assert torch.equal(p.until_done()[3], values)


def _until_ended(p: Pair, seq: int) -> None:
    deadline = time.monotonic() + 5  # (until the end markers are in, however loaded)
    while not p.pulls.expected[seq].ended and time.monotonic() < deadline:
        assert p.pulls.receive() == []
        time.sleep(0.002)


def test_a_resend_rounds_end_markers_say_what_it_did_not_bring_was_lost(pair_of,
                                                                         monkeypatch):
    # its last packet lost, and the resend of it (both copies: a resend of packets all
    # needed sends each twice, psring.comm.lossy.TWICE_MOST): the server ends each round of
    # resends with markers, and the worker asks again as they come, not after its
    # round trips (ten seconds here, longer than the test waits)
    monkeypatch.setattr(pulls_mod, "MAX_WAIT_S", 10.0)
    p = pair_of()
    p.pulls.rtt = 10.0
    values = torch.randn(30_000)
    packets = -(-values.numel() * 4 // 1408)
    markers = 3  # (psring.comm.lossy.END_COPIES, back to back after the last packet)
    _drop_packet(p, packets - 1, packets + markers, packets + markers + 1)
    p.pulls.expect(seq=5, shard=0, numel=values.numel())
    p.egress.piece(p.header(5), values.numel(), 0, values)
    _until_ended(p, 5)
    asks, deadline = 0, time.monotonic() + 5
    while 5 in p.pulls.expected and time.monotonic() < deadline:
        done = p.pulls.receive()
        if p.pulls.due() == 0:
            asks += p.pulls.ask_again()
        p.serve()
        time.sleep(0.002)
    assert asks == 2 and p.egress.counts["pull_resends"] == 2
    assert torch.equal(done[0][1], values)


def test_a_resend_before_the_pull_has_left_whole_is_not_followed_by_markers(pair_of):
    # (markers say every packet has left: after a resend mid-stream they would not)
    p = pair_of()
    values = torch.randn(30_000)
    _drop_packet(p, 0)
    p.pulls.expect(seq=8, shard=0, numel=values.numel())
    p.egress.piece(p.header(8), values.numel(), 0, values[:10_000])
    time.sleep(0.01)
    p.pulls.receive()
    p.pulls.expected[8].since -= 1.0  # (quiet long enough: it asks, mid-stream)
    assert p.pulls.ask_again() == 1
    deadline = time.monotonic() + 5
    while p.egress.counts["pull_resends"] == 0 and time.monotonic() < deadline:
        p.serve()
        time.sleep(0.002)
    time.sleep(0.02)
    assert p.pulls.receive() == [] and not p.pulls.expected[8].ended
    p.egress.piece(p.header(8), values.numel(), 10_000, values[10_000:])
    assert torch.equal(p.until_done()[8], values)


def test_a_pull_of_one_packet_lost_whole_asks_by_its_end_markers(pair_of):
    # (the markers say how many packets when none came: asked for, not a crash)
    p = pair_of()
    values = torch.randn(100)
    _drop_packet(p, 0)
    p.pulls.expect(seq=6, shard=0, numel=values.numel())
    p.egress.piece(p.header(6), values.numel(), 0, values)
    _until_ended(p, 6)
    assert p.pulls.expected[6].packets == 1 and p.pulls.due() == 0
    assert torch.equal(p.until_done()[6], values)


def test_only_requests_after_the_end_markers_time_a_round_trip(pair_of):
    # Karn's rule: a request made while the server streams (or waits for the other
    # workers) is followed by packets it did not cause; they time nothing
    p = pair_of()
    values = torch.randn(30_000)
    p.pulls.expect(seq=4, shard=0, numel=values.numel())
    p.egress.piece(p.header(4), values.numel(), 0, values[:10_000])
    time.sleep(0.01)
    p.pulls.receive()
    first = p.pulls.rtt
    p.pulls.expected[4].since -= 1.0  # (quiet long enough: it asks, mid-stream)
    assert p.pulls.due() == 0 and p.pulls.ask_again() == 1
    time.sleep(0.06)  # (the rest comes much later than any round trip)
    p.egress.piece(p.header(4), values.numel(), 10_000, values[10_000:])
    got, deadline = {}, time.monotonic() + 5  # (receives only: no request times anything)
    while 4 not in got and time.monotonic() < deadline:
        got.update(p.pulls.receive())
        time.sleep(0.002)
    assert torch.equal(got[4], values)
    assert p.pulls.rtt == first


def test_datagrams_of_a_pull_not_asked_for_are_not_held(pair_of):
    p = pair_of()
    p.pulls.expect(seq=5, shard=0, numel=1_000)
    for transfer, shard, worker in ((6, 0, 3), (5, 1, 3), (5, 0, 4)):  # not this pull's
        buf, _ = encode_block(worker, shard, run_tag(RUN), transfer, "float32",
                              torch.ones(1_000).view(torch.uint8).numpy())
        p.pulls.sock.sendto(bytes(buf[0]), ("127.0.0.1", p.pulls.port))
    wrong = torch.ones(2_000)  # a transfer of another size under the pull's seq
    buf, _ = encode_block(3, 0, run_tag(RUN), 5, "float32", wrong.view(torch.uint8).numpy())
    p.pulls.sock.sendto(bytes(buf[0]), ("127.0.0.1", p.pulls.port))
    time.sleep(0.05)
    assert p.pulls.receive() == [] and p.pulls.ingress.transfers == {}


# -- through a server: the handler's ranges, the server's egress, the client's wait ----

def test_a_servers_sync_pull_comes_back_as_datagrams_to_the_client():
    from psring.comm.psclient import PSClient, Replies
    from tests.helpers.servers import LiveServer, RawClient

    params = torch.randn(50_000)
    with LiveServer() as server:
        with RawClient(server.endpoint, run="dg") as raw:
            raw.init(n=params.numel(), workers=1, params=params)
        client = PSClient([server.endpoint], run="dg", worker=0, timeout=20,
                          datagram_pulls=True)
        try:
            got = []
            key = client.pull(0, 0, params.numel(), got.append, at=0)
            Replies(client, [key], "a pull").wait()
        finally:
            client.close()
        assert len(got) == 1 and got[0].header["offset"] == 0
        assert torch.equal(got[0].tensors[0], params)
        assert server.stats["pulled_datagrams"] == -(-params.numel() * 4 // 1408)


@pytest.mark.parametrize("port,pace", [(70_000, 0), (-1, 0), (5_000, -1)])
def test_a_pull_naming_an_impossible_port_or_pace_is_refused(port, pace):
    from tests.helpers.servers import LiveServer, RawClient

    with LiveServer() as server, RawClient(server.endpoint, run="dg") as raw:
        raw.init(n=8)
        reply = raw.request("pull", min_version=0, datagrams=port, pace=pace)
        assert reply.op == "error" and "datagram port" in reply.header["message"]
        assert raw.pull().numel() == 8  # (and it serves on, over TCP)


def test_a_pull_whose_datagrams_never_arrive_fails_naming_them(monkeypatch):
    from psring.comm.lossy import LossySender
    from psring.comm.psclient import PSClient, Replies
    from psring.errors import PsringError
    from tests.helpers.servers import LiveServer, RawClient

    monkeypatch.setattr(LossySender, "_send", lambda *a, **k: None)  # (all lost)
    with LiveServer() as server:
        with RawClient(server.endpoint, run="dg") as raw:
            raw.init(n=5_000, workers=1)
        client = PSClient([server.endpoint], run="dg", worker=0, timeout=1.5,
                          datagram_pulls=True)
        try:
            key = client.pull(0, 0, 5_000, lambda m: None, at=0)
            with pytest.raises(PsringError, match="datagrams .* are not getting through"):
                Replies(client, [key], "a pull").wait()
            assert client.pulls.counts["pull_nacks"] > 0
        finally:
            client.close()


def test_a_servers_pulls_leave_its_link_one_at_a_time(monkeypatch):
    """Two workers' pulls answered together leave the server's (paced) link one after
    the other, in the order answered: the first has all of its parameters before the
    second's first packet leaves, instead of both sharing the link to its end
    (psring.comm.turns)."""
    from psring.comm import lossy

    monkeypatch.setattr(lossy, "same_host", lambda addr: False)  # (as across a link)
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    for s in socks:  # (plain sockets, no GRO: a receive a datagram)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        s.bind(("127.0.0.1", 0))
    arrivals: list[list[float]] = [[], []]

    def listen(i: int) -> None:
        socks[i].settimeout(0.5)
        try:
            while True:
                socks[i].recv(65536)
                arrivals[i].append(time.monotonic())
        except OSError:
            return  # (quiet for half a second, or closed: done)

    threads = [threading.Thread(target=listen, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    egress = Egress()
    try:
        values = torch.randn(60_000)  # (240 KB: some 40 ms at 50 Mbit/s)
        for w in range(2):
            egress.learn(RUN, w, "127.0.0.1", socks[w].getsockname()[1], pace_bits=50e6)
        # the order is read where the datagrams leave (the senders' threads), not from
        # the listeners' clocks: a listener late by a millisecond on a loaded machine
        # says nothing about the link
        left: list[tuple[int, int]] = []
        for (_, w), sender in egress.senders.items():
            def send(data, k, size, tos=None, w=w, real=sender._send):
                left.append((w, k))
                real(data, k, size, tos)
            sender._send = send
        for w in range(2):
            egress.piece({"run": RUN, "worker": w, "seq": 1, "shard": 0}, values.numel(), 0,
                         values)
        for th in threads:
            th.join(timeout=15)
    finally:
        egress.close()
        for s in socks:
            s.close()
    packets = -(-values.numel() // per_datagram("float32"))
    assert len(arrivals[0]) >= packets and len(arrivals[1]) >= packets
    # every packet of the first left before the second's first (its end markers, sent
    # after its packets, may follow that)
    second = next(i for i, (w, _) in enumerate(left) if w == 1)
    assert sum(k for w, k in left[:second] if w == 0) >= packets, left[:second + 3]
