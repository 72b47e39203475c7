"""Receiver-driven pacing of bounded-loss pushes (--credit-window, psring.comm.credits):
the grant on the wire, the server's granter keeping its window over all senders, and a
credited sender against a granting receiver on loopback — every datagram arrives, at
most a window of them in flight, a lost grant costing a bounded wait."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from psring.comm import credits, datagrams, lossy
from psring.comm.datagrams import End, Grant, Nack
from psring.comm.ingress import Ingress
from psring.comm.protocol import ProtocolError
from psring.comm.receiving import drain, receiving_socket

KEY = b"k" * 32


@pytest.mark.parametrize("kind", ["grant", "end"])
def test_a_control_datagram_round_trips_and_a_broken_one_is_refused(kind):
    # grants (--credit-window) and end markers (the transpose all-reduce): one layout
    make, encode, decode = {"grant": (Grant, datagrams.encode_grant, datagrams.decode_grant),
                            "end": (End, datagrams.encode_end, datagrams.decode_end)}[kind]
    g = make(3, 1, 77, 9, 12)
    for key in (None, KEY):
        assert decode(encode(g, key), key) == g
    wire = encode(g)
    for bad in (wire[:-1], b"XXXX" + wire[4:], encode(make(3, 1, 77, 9, 0))):
        with pytest.raises(ProtocolError):
            decode(bad)
    with pytest.raises(ProtocolError):  # unsigned where a secret is set, or forged
        decode(wire, KEY)
    with pytest.raises(ProtocolError):
        decode(encode(g, b"x" * 32), KEY)
    other = datagrams.encode_end if kind == "grant" else datagrams.encode_grant
    with pytest.raises(ProtocolError):  # (the other kind's magic)
        decode(other(g))


def test_a_resend_request_round_trips_and_a_broken_one_is_refused():
    # (the transpose all-reduce's: some of the missing packets' numbers, and how many)
    n = Nack(worker=2, shard=2, run_tag=77, transfer=9, need=3, missing=(4, 8, 15, 16))
    for key in (None, KEY):
        assert datagrams.decode_nack(datagrams.encode_nack(n, key), key) == n
    wire = datagrams.encode_nack(n)
    most = n._replace(missing=tuple(range(datagrams.NACK_MOST)))
    assert len(datagrams.encode_nack(most, KEY)) + 28 <= 1500  # (one Ethernet frame)
    for bad in (wire[:-1], b"XXXX" + wire[4:], wire[:-16],  # (cut; not one; no numbers)
                datagrams.encode_nack(n._replace(need=0)),
                datagrams.encode_nack(n._replace(missing=(datagrams.MAX_PACKETS,))),
                datagrams.encode_nack(n._replace(missing=tuple(range(datagrams.NACK_MOST + 1))))):
        with pytest.raises(ProtocolError):
            datagrams.decode_nack(bad)
    with pytest.raises(ProtocolError):  # unsigned where a secret is set
        datagrams.decode_nack(wire, KEY)
    ing = Ingress(KEY)  # (kept for the receiving thread to answer; forged ones dropped)
    ing.datagram(datagrams.encode_nack(n, KEY))
    ing.datagram(datagrams.encode_nack(n, b"x" * 32))
    assert ing.take_nacks() == [n] and ing.take_nacks() == []
    assert ing.counts["bad_datagrams"] == 1


def _head(worker: int, transfer: int, packets: int, index: int = 0) -> bytes:
    """Packet ``index``'s datagram header (what the granter reads of a receive)."""
    buf, _ = datagrams.encode_block(worker, 0, 5, transfer, "float32",
                                   torch.zeros(352 * packets).view(torch.uint8).numpy())
    return bytes(buf[index, :datagrams.DATAGRAM_HEADER])


class _Grants:
    """A socket the granter writes to; what each address was granted."""

    def __init__(self):
        self.sent: list[tuple[bytes, tuple]] = []

    def sendto(self, data, addr):
        self.sent.append((data, addr))

    def last(self) -> dict[tuple, int]:
        out = {}
        for data, addr in self.sent:
            out[addr] = datagrams.decode_grant(data).upto
        return out


def test_the_granter_keeps_its_window_over_all_senders_round_robin():
    sock = _Grants()
    g = credits.Granter(sock, window_bytes=16 * credits.WIRE_BYTES)
    a, b = ("198.18.0.2", 1), ("198.18.0.3", 2)
    # two transfers of 100 packets each announce themselves (their unscheduled first)
    g.heard(a, _head(0, 1, 100), 2)
    assert g.outstanding() == g.window == 16  # (alone: the whole window)
    g.heard(b, _head(1, 1, 100), 2)
    g.heard(a, _head(0, 1, 100, 2), 8)  # (a's arrivals free room: b's share goes to b)
    first = sock.last()
    assert set(first) == {a, b} and first[b] - 2 >= credits.CHUNK
    assert g.outstanding() <= g.window
    # as packets arrive, grants follow one for one: never more than the window owed
    at = {0: 10, 1: 2}
    for _ in range(40):
        for w, addr in ((0, a), (1, b)):
            g.heard(addr, _head(w, 1, 100, at[w]), 1)
            at[w] += 1
        assert g.outstanding() <= g.window
    assert sock.last()[a] > first[a] and sock.last()[b] > first[b]
    # a flow written off and heard again resumes where its sender is, not at 0
    del g.flows[(1, 1)]
    g.heard(b, _head(1, 1, 100, 60), 1)
    assert g.flows[(1, 1)].granted > 61 and sock.last()[b] > 61
    # a whole transfer leaves the round (a late resend of its is no new flow); a quiet
    # one is written off after EXPIRE_S
    g.done((0, 1))
    g.heard(a, _head(0, 1, 100, 5), 3)
    assert (0, 1) not in g.flows
    g.expire(time.monotonic() + credits.EXPIRE_S + 1)
    assert not g.flows and g.counts["expired"] == 1


def _receiver(window: int, drop_grants: int = 0):
    """A UDP receiver on loopback that grants (dropping the first ``drop_grants``
    grants, as a lossy link would) and records the most datagrams owed at once."""
    sock = receiving_socket("127.0.0.1", 0, 8 << 20)
    ing = Ingress()
    g = credits.Granter(sock, window)
    lost = [drop_grants]
    real = g._send

    def send(key, flow):
        if lost[0] > 0:
            lost[0] -= 1
            return
        real(key, flow)

    g._send = send
    state = {"most": 0, "stop": False}

    def loop():
        while not state["stop"]:
            drain(sock, ing, heard=g.heard)
            state["most"] = max(state["most"], g.outstanding())
            g.expire()
            time.sleep(2e-4)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return sock, ing, g, state, t


@pytest.mark.timeout(30)
@pytest.mark.parametrize("drop_grants", [0, 3])
def test_a_credited_sender_sends_what_it_is_granted_and_gets_through(drop_grants,
                                                                     monkeypatch):
    # (a grant's bounded wait long enough that a loaded machine's late receiving thread
    # does not look like a lost grant; a lost one still costs a probe)
    monkeypatch.setattr(lossy, "GRANT_WAIT_S", 0.05)
    window = 8 * credits.WIRE_BYTES
    sock, ing, g, state, t = _receiver(window, drop_grants)
    done = queue.SimpleQueue()
    sender = lossy.LossySender(f"tcp://127.0.0.1:{sock.getsockname()[1]}", "r", 0,
                               on_sent=done.put, credits=True)
    try:
        grad = torch.randn(352 * 200)
        tr = sender.send(7, 0, grad, token="sent")
        assert done.get(timeout=20) == "sent"
        deadline = time.monotonic() + 5  # (the receiving thread, however loaded)
        while time.monotonic() < deadline and not (
                (0, 7) in ing.transfers and ing.transfers[(0, 7)].got.all()):
            time.sleep(0.002)
        got = ing.transfers[(0, 7)].got
        assert got.all(), f"{int(got.sum())} of {tr.count}"
        assert state["most"] <= g.window + credits.UNSCHEDULED
        assert g.counts["grants"] > 0
        # a lost grant is made good by the sender's bounded wait (one packet on its own);
        # without losses the grants carry the transfer (a grant late on a loaded machine
        # may still cost a probe, so the bound is loose, but a sender that ignored its
        # grants would probe for nearly every packet)
        if drop_grants:
            assert sender.probes > 0
        assert sender.probes < tr.count // 4, f"{sender.probes} probes of {tr.count}"
    finally:
        state["stop"] = True
        t.join(timeout=5)
        sender.close()
        sock.close()
