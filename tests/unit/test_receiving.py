"""psring.comm.receiving: what the drain hands the ingress from a real socket: signed
datagrams, coalesced receives after single ones, cut ones, and who sent each."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

from psring.comm import receiving
from psring.comm.datagrams import DATAGRAM_DTYPE
from psring.comm.ingress import Ingress
from tests.unit.test_lossy import _drain_all, lossy_push, packets_of

#: bytes of a whole unsigned datagram (float32: 352 elements)
WHOLE = receiving.WHOLE
#: UDP_SEGMENT (Linux): a send cut into datagrams of this size by the kernel (UDP GSO)
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)


@pytest.fixture
def pair():
    rx = receiving.receiving_socket("127.0.0.1", 0, 1 << 24)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.bind(("127.0.0.1", 0))
    yield rx, tx
    tx.close()
    rx.close()


def test_signed_datagrams_arrive_whole(pair):
    # (a signed datagram is 16 bytes longer than an unsigned one: never in a run)
    rx, tx = pair
    key = b"k" * 32
    grad = torch.randn(352 * 70 + 3)
    packets = packets_of(grad, key=key)
    assert len(packets[0]) == WHOLE + 16
    for p in packets:
        tx.sendto(p, rx.getsockname())
    ing = Ingress(key)
    assert _drain_all(rx, ing, len(packets)) == len(packets)
    assert ing.counts["datagrams"] == len(packets) and ing.counts["bad_datagrams"] == 0
    assert torch.equal(ing.complete(lossy_push(grad, 0.0)).tensors[0], grad)


def test_a_coalesced_receive_after_single_ones_is_kept_whole(pair):
    # (single datagrams first, then a segmented send (UDP GSO) the kernel hands over
    # coalesced (UDP GRO): a run of another size; every packet kept once)
    rx, tx = pair
    first, second = torch.randn(352 * 80), torch.randn(352 * 120 + 7)
    for p in packets_of(first, transfer=1):
        tx.sendto(p, rx.getsockname())
    ing = Ingress()
    assert _drain_all(rx, ing, 80) == 80
    packets = packets_of(second, transfer=2)
    try:
        tx.setsockopt(socket.SOL_UDP, UDP_SEGMENT, WHOLE)
    except OSError:
        pytest.skip("no UDP GSO on this kernel")
    joined = b"".join(packets)
    tx.connect(rx.getsockname())
    for at in range(0, len(joined), 40 * WHOLE):  # (40 datagrams a send)
        tx.send(joined[at:at + 40 * WHOLE])
    assert _drain_all(rx, ing, len(packets)) == len(packets)
    assert ing.counts["datagrams"] == 80 + len(packets) and ing.counts["bad_datagrams"] == 0
    # one send whose last datagram is short (a transfer's last receive): its whole
    # datagrams join the run, the short one is kept on its own
    third = torch.randn(352 * 30 + 5)
    tx.send(b"".join(packets_of(third, transfer=3)))
    assert _drain_all(rx, ing, 31) == 31
    assert ing.counts["datagrams"] == 80 + len(packets) + 31
    assert ing.counts["bad_datagrams"] == 0
    for grad, transfer in ((first, 1), (second, 2), (third, 3)):
        assert torch.equal(ing.complete(lossy_push(grad, 0.0, transfer=transfer))
                           .tensors[0], grad)


def test_each_receive_is_heard_with_its_sender(pair):
    # (the credits' granter answers each sender at the address its datagrams came from)
    rx, tx = pair
    other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    other.bind(("127.0.0.1", 0))
    try:
        grad = torch.randn(352 * 10)
        for i, p in enumerate(packets_of(grad)):
            (tx if i % 2 else other).sendto(p, rx.getsockname())
        heard = []
        ing = Ingress()
        assert _drain_all(rx, ing, 10, heard=lambda a, h, k: heard.append((a, h, k))) == 10
        assert [a for a, _, _ in heard] == [other.getsockname(), tx.getsockname()] * 5
        indices = [int(np.frombuffer(h, DATAGRAM_DTYPE)[0]["index"])
                   for _, h, _ in heard]
        assert indices == list(range(10)) and {k for _, _, k in heard} == {1}
    finally:
        other.close()


def test_a_datagram_longer_than_a_receive_holds_is_counted_bad(pair, monkeypatch):
    # (nothing psring sends is longer than a receive's 64 KiB; were one cut short, it
    # is counted bad, never kept in part)
    rx, tx = pair
    monkeypatch.setattr(receiving, "RECEIVE_MOST", WHOLE + 64)
    grad = torch.randn(352 * 4)
    packets = packets_of(grad)
    tx.sendto(packets[0], rx.getsockname())
    tx.sendto(packets[1] + b"x" * 200, rx.getsockname())
    tx.sendto(packets[2], rx.getsockname())
    ing = Ingress()
    assert _drain_all(rx, ing, 3) == 3
    assert ing.counts["datagrams"] == 2 and ing.counts["bad_datagrams"] == 1
