"""Bounded-loss pushes (--loss-tolerance): the datagram format, the server's ingress and
the worker's sender, in one process (the runs are in tests/emulation/test_links.py).

What is checked: datagrams round-trip and every broken one is refused (signed ones
authenticated); a push whose datagrams all arrive is the gradient exactly; one missing
at most its tolerance is summed with the missing elements zero and the rest scaled,
unbiased over random losses; one missing more asks for the fewest packets that bring
it within the bound, and the sender resends a random choice of them; broken or
inconsistent datagrams and lossy_pushes are refused; held datagrams are bounded."""

from __future__ import annotations

import math
import queue
import random
import socket
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psring.comm import buffers, datagrams, ingress, lossy, outbox, protocol, receiving
from psring.comm.datagrams import Datagram
from psring.comm.ingress import Ingress
from psring.comm.protocol import Message, ProtocolError

KEY = b"k" * 32


def packets_of(grad: torch.Tensor, transfer: int = 7, worker: int = 1,
               key: bytes | None = None) -> list[bytes]:
    dtype = protocol.DTYPE_NAMES[grad.dtype]
    per = datagrams.per_datagram(dtype)
    raw = grad.view(torch.uint8).numpy()
    size = grad.element_size()
    count = math.ceil(grad.numel() / per)
    return [datagrams.encode_datagram(Datagram(
        worker, 0, datagrams.run_tag("r"), transfer, i, count, dtype,
        memoryview(raw[i * per * size:min(grad.numel(), (i + 1) * per) * size])), key)
        for i in range(count)]


def lossy_push(grad: torch.Tensor, tolerance: float, transfer: int = 7,
               worker: int = 1) -> Message:
    dtype = protocol.DTYPE_NAMES[grad.dtype]
    return Message({"v": protocol.VERSION, "op": "lossy_push", "run": "r", "worker": worker,
                    "seq": transfer, "shard": 0, "step": 3, "offset": 100,
                    "numel": grad.numel(),
                    "packets": math.ceil(grad.numel() / datagrams.per_datagram(dtype)),
                    "dtype": dtype, "tolerance": tolerance, "transfer": transfer,
                    "tensors": []})


def test_a_datagram_round_trips_and_fits_one_ethernet_frame():
    grad = torch.randn(1000)
    ps = packets_of(grad)
    assert len(ps) == 3 and max(map(len, ps)) <= 1472 - datagrams.DATAGRAM_SIGNATURE
    d = datagrams.decode_datagram(ps[2])
    assert (d.worker, d.transfer, d.index, d.packets, d.dtype) == (1, 7, 2, 3, "float32")
    assert torch.equal(torch.frombuffer(bytearray(d.payload), dtype=torch.float32),
                       grad[704:])
    signed = packets_of(grad, key=KEY)[0]
    assert datagrams.decode_datagram(signed, KEY).index == 0


@pytest.mark.parametrize("breakage", ["short", "magic", "dtype", "length", "index"])
def test_a_broken_datagram_is_refused(breakage):
    good = bytearray(packets_of(torch.randn(500))[0])
    bad = {"short": good[:10], "magic": b"XXXX" + good[4:],
           "dtype": good[:5] + b"\x09" + good[6:], "length": good[:-4],
           "index": good[:22] + (99).to_bytes(4, "little") + good[26:]}[breakage]
    with pytest.raises(ProtocolError):
        datagrams.decode_datagram(bytes(bad))


def test_a_signed_datagram_is_authenticated():
    signed = bytearray(packets_of(torch.randn(500), key=KEY)[0])
    with pytest.raises(protocol.AuthenticationError):
        datagrams.decode_datagram(packets_of(torch.randn(500))[0], KEY)  # unsigned
    signed[40] ^= 1
    with pytest.raises(protocol.AuthenticationError):
        datagrams.decode_datagram(bytes(signed), KEY)
    ing = Ingress(KEY)
    ing.datagram(bytes(signed))
    assert ing.counts["bad_datagrams"] == 1 and not ing.transfers


def test_a_complete_push_is_the_gradient_exactly():
    grad = torch.randn(5000)
    ing = Ingress()
    for p in reversed(packets_of(grad)):  # (in any order)
        ing.datagram(p)
    push = ing.complete(lossy_push(grad, 0.01))
    assert push.op == "push" and push.header["delivered"] == 5000
    assert (push.header["step"], push.header["offset"], push.header["seq"]) == (3, 100, 7)
    assert torch.equal(push.tensors[0], grad)
    assert not ing.transfers and ing.held == 0


def test_a_push_missing_within_its_tolerance_is_scaled_and_zero_where_missing():
    grad = torch.randn(352 * 20)  # 20 full packets
    ing = Ingress()
    for i, p in enumerate(packets_of(grad)):
        if i != 4:
            ing.datagram(p)
    push = ing.complete(lossy_push(grad, 0.05))  # 1 of 20 missing: exactly the bound
    got = push.tensors[0]
    assert push.header["delivered"] == 352 * 19
    assert torch.all(got[4 * 352:5 * 352] == 0)
    assert torch.allclose(got[:4 * 352], grad[:4 * 352] * 20 / 19)


def test_a_finished_pushs_memory_serves_the_next_once_its_tensor_is_gone():
    # the same shard every step: its memory is the last step's, never while in use, and
    # the places of packets lost this time are zero, not last step's values
    ing = Ingress()
    ing.buffers = buffers.Buffers()  # (its own pool: no other test's buffers in it)
    first = torch.randn(352 * 20)
    for p in packets_of(first, transfer=1):
        ing.datagram(p)
    held = ing.complete(lossy_push(first, 0.0, transfer=1)).tensors[0]
    second = torch.randn(352 * 20)
    for i, p in enumerate(packets_of(second, transfer=2)):
        if i != 4:
            ing.datagram(p)
    push = ing.complete(lossy_push(second, 0.05, transfer=2)).tensors[0]
    assert held.data_ptr() != push.data_ptr()  # (the first was still held)
    assert torch.equal(held, first)
    assert torch.all(push[4 * 352:5 * 352] == 0)
    assert torch.allclose(push[:4 * 352], second[:4 * 352] * 20 / 19)
    address = held.data_ptr()
    del held
    third = torch.randn(352 * 20)
    for i, p in enumerate(packets_of(third, transfer=3)):
        if i != 7:
            ing.datagram(p)
    again = ing.complete(lossy_push(third, 0.05, transfer=3)).tensors[0]
    assert again.data_ptr() == address
    assert torch.all(again[7 * 352:8 * 352] == 0)
    assert torch.allclose(again[:7 * 352], third[:7 * 352] * 20 / 19)


def test_buffers_are_kept_up_to_their_bound_and_lent_once():
    kept = buffers.Buffers(most=100)
    a = kept.take(60)
    assert kept.take(60) is not a  # (a is held; the second is used once: over the bound)
    address = a.ctypes.data
    del a
    assert kept.take(60).ctypes.data == address  # free again: the same memory
    # a free buffer of another size stays while there is room, and goes when there is not
    small = kept.take(30).ctypes.data
    assert kept.take(30).ctypes.data == small
    kept.take(90)  # (60 and 30 are free: both go for it)
    assert [b.nbytes for b in kept.kept] == [90]


def test_a_senders_blocks_are_reused_once_sent():
    sent: queue.SimpleQueue = queue.SimpleQueue()
    rx = receiving.receiving_socket("127.0.0.1", 0, 8 << 20)
    sender = lossy.LossySender(f"tcp://127.0.0.1:{rx.getsockname()[1]}", "r", 0,
                               on_sent=sent.put)
    sender.buffers = buffers.Buffers()  # (its own pool: no other test's buffers in it)

    def address(t: lossy.Transfer) -> int:
        return np.frombuffer(t.block, np.uint8).ctypes.data

    try:
        grad = torch.randn(352 * 30)
        first = sender.send(1, 0, grad, token=1)
        sent.get(timeout=10)
        held = sender.send(2, 0, grad, token=2)
        sent.get(timeout=10)
        assert address(held) != address(first)  # (the first still held)
        was = address(first)
        del first
        assert address(sender.send(3, 0, grad, token=3)) == was
        sent.get(timeout=10)
        got = Ingress()
        assert _drain_all(rx, got, 90) == 90  # (the three sends, 30 datagrams each)
        assert torch.equal(got.complete(lossy_push(grad, 0.0, transfer=3, worker=0))
                           .tensors[0], grad)
    finally:
        sender.close()
        rx.close()


def test_a_push_missing_more_asks_for_the_fewest_packets_then_takes_them():
    grad = torch.randn(352 * 20)
    ps = packets_of(grad)
    ing = Ingress()
    for i, p in enumerate(ps):
        if i not in (1, 2, 3, 9):
            ing.datagram(p)
    need, missing = ing.complete(lossy_push(grad, 0.05))
    assert missing == [1, 2, 3, 9] and need == 3  # 4 missing, 1 allowed
    sender = lossy.Transfer(grad, 352, grad.numel(), "float32", len(ps),
                            each=[memoryview(p) for p in ps])
    grad[9 * 352] = 100.0  # packet 9 has the largest norm: resent first
    chosen = sorted(missing, key=lambda i: float(grad[i * 352:(i + 1) * 352].norm()),
                    reverse=True)[:need]
    assert 9 in chosen
    for i in chosen:
        ing.datagram(sender.packet(i))
    assert ing.complete(lossy_push(grad, 0.05)).header["delivered"] == 352 * 19


def test_the_sender_sends_every_datagram_then_says_so_and_resends_at_random():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(5.0)
    done = queue.SimpleQueue()
    sender = lossy.LossySender(f"tcp://127.0.0.1:{rx.getsockname()[1]}", "r", 0,
                               on_sent=done.put)
    grad = torch.zeros(352 * 6)
    grad[352 * 4] = 5.0
    grad[352 * 2] = 3.0
    t = sender.send(9, 0, grad, token="first")
    assert done.get(timeout=5) == "first"
    ing = Ingress()
    for _ in range(6):
        ing.datagram(rx.recv(2048))
    assert torch.equal(ing.complete(lossy_push(grad, 0.0, transfer=9, worker=0)).tensors[0],
                       grad)
    # need 3, and a quarter more for what is lost again: four of the five missing, at
    # random (not by magnitude: what stays missing must be a random part), the same
    # four each time
    chosen = lossy.LossySender.choose(t, [0, 1, 2, 4, 5], need=3)
    assert len(chosen) == 4 and set(chosen) <= {0, 1, 2, 4, 5}
    assert chosen == lossy.LossySender.choose(t, [5, 4, 2, 1, 0], need=3)
    assert lossy.LossySender.choose(t, [0, 9], need=5) == [0]  # (9: no such packet)
    again = lossy.LossySender.choose(t, [0, 2, 4, 5], need=1)
    assert sender.resend(t, [0, 2, 4, 5], need=1, token="again") == len(again) == 2
    assert done.get(timeout=5) == "again"
    got = sorted(datagrams.decode_datagram(rx.recv(2048)).index for _ in range(2))
    assert got == again
    # every packet asked for needed, none to spare (an all-gather's): each goes twice,
    # so that one lost again costs no further round trip
    assert sender.resend(t, [1, 3], need=2, token="both") == 2
    assert done.get(timeout=5) == "both"
    got = sorted(datagrams.decode_datagram(rx.recv(2048)).index for _ in range(4))
    assert got == [1, 1, 3, 3]
    rx.settimeout(0.2)
    with pytest.raises(socket.timeout):  # (nothing more)
        rx.recv(2048)
    sender.close()
    rx.close()
    assert not sender.outbox.thread.is_alive()


def _drain_all(rx: socket.socket, ing: Ingress, count: int, **kw) -> int:
    """Drain (``kw``: drain's) until ``count`` datagrams are in (5 s at most): a
    sender's on_sent comes once its sends return, and a loaded machine may hand
    loopback's datagrams to the socket a moment later. Returns how many came."""
    n, deadline = 0, time.monotonic() + 5
    while n < count and time.monotonic() < deadline:
        n += receiving.drain(rx, ing, **kw)
    return n


def _receive_all(rx: socket.socket, count: int, key: bytes | None = None) -> Ingress:
    ing = Ingress(key)
    for _ in range(count):
        ing.datagram(rx.recv(4096))
    return ing


@pytest.mark.parametrize("key", [None, KEY])
def test_the_sender_batches_datagrams_into_segmented_sends(monkeypatch, key):
    # one sendmsg carries many datagrams (UDP GSO): the kernel cuts them apart, and the
    # receiver gets each one whole, the last shorter
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    rx.settimeout(5.0)
    done = queue.SimpleQueue()
    sender = lossy.LossySender(f"tcp://127.0.0.1:{rx.getsockname()[1]}", "r", 0, key=key,
                               on_sent=done.put)
    calls = {"sendmsg": 0, "sendto": 0}
    monkeypatch.setattr(sender, "sock", _Counting(sender.sock, calls))
    grad = torch.randn(352 * 100 + 17)  # (101 datagrams, the last of 17 floats)
    sender.send(3, 0, grad, token="sent")
    assert done.get(timeout=5) == "sent"
    ing = _receive_all(rx, 101, key)
    assert torch.equal(ing.complete(lossy_push(grad, 0.0, transfer=3, worker=0)).tensors[0],
                       grad)
    assert sender.gso and sender.datagrams == 101
    assert calls["sendmsg"] <= 4 and calls["sendto"] <= 1  # (not one call a datagram)
    sender.close()
    rx.close()


class _Counting:
    """A socket whose sends are counted."""

    def __init__(self, sock, calls):
        self._sock, self._calls = sock, calls

    def __getattr__(self, name):
        attr = getattr(self._sock, name)
        if name in self._calls:
            def counted(*a, **k):
                self._calls[name] += 1
                return attr(*a, **k)
            return counted
        return attr


def test_without_segmentation_the_sender_sends_one_by_one(monkeypatch):
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    rx.settimeout(5.0)
    done = queue.SimpleQueue()
    sender = lossy.LossySender(f"tcp://127.0.0.1:{rx.getsockname()[1]}", "r", 0,
                               on_sent=done.put)

    class NoGso(_Counting):
        def sendmsg(self, *a, **k):
            raise OSError(lossy.errno.EINVAL, "no UDP_SEGMENT here")

    monkeypatch.setattr(sender, "sock", NoGso(sender.sock, {}))
    grad = torch.randn(352 * 20)
    sender.send(4, 0, grad, token="sent")
    assert done.get(timeout=5) == "sent"
    ing = _receive_all(rx, 20)
    assert torch.equal(ing.complete(lossy_push(grad, 0.0, transfer=4, worker=0)).tensors[0],
                       grad)
    assert not sender.gso and sender.batch_limit() == 1
    sender.close()
    rx.close()


def test_runs_are_consecutive_and_within_a_millisecond_of_the_link():
    assert lossy.runs([0, 1, 2, 4, 5, 8, 9], limit=2) == [(0, 2), (2, 3), (4, 6), (8, 10)]
    assert lossy.runs(range(10), limit=64) == [(0, 10)]
    assert lossy.runs([], limit=4) == []
    # a range (a whole transfer, a grant's packets) cut as its numbers listed are
    for which in (range(3, 20), range(0, 1), range(5, 5), range(7, 135)):
        for limit in (1, 4, 64):
            assert lossy.runs(which, limit) == lossy.runs(list(which), limit), (which, limit)
    # paced, a batch is at most a millisecond of the link: 1 Gbit/s carries about 84
    # frames of 1.5 kB a millisecond (GSO's 64 KiB caps it at 44), 10 Mbit/s under one
    fast = lossy.LossySender("tcp://127.0.0.1:9", "r", 0)
    slow = lossy.LossySender("tcp://127.0.0.1:9", "r", 0)
    fast.pace_bits, slow.pace_bits = 1e9, 1e7  # (as to a server across a link)
    assert fast.batch_limit() == lossy.GSO_MAX_BYTES // (datagrams.DATAGRAM_HEADER
                                                         + datagrams.DATAGRAM_PAYLOAD)
    assert slow.batch_limit() == 1
    fast.close()
    slow.close()


def test_a_shallow_ports_senders_keep_their_bursts_within_half_of_it(monkeypatch):
    """Behind a 64 KB port a sender paces so that the port never holds more than half
    of it from this sender: its sends, what it runs ahead of the link and what it
    catches up on after a late wakeup add up to the half, however late it wakes."""
    from psring.cluster.spec import PACING_BURST_S, Cluster

    deep = Cluster.bare(hosts=2, link="1gbit")
    shallow = Cluster.bare(hosts=2, link="1gbit", link_buffer="64kb")
    assert deep.pacing_burst == int(1e9 / 8 * PACING_BURST_S)  # (the default port: deep)
    assert shallow.pacing_burst == 32_768 and Cluster.bare(hosts=2).pacing_burst == 0
    clock, rate = [100.0], 250e6
    late = iter([1e-4, 3e-4, 2e-5, 5e-4] * 1000)  # (each sleep wakes this much late)
    monkeypatch.setattr(lossy.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(lossy.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s
                                                                          + next(late)))
    monkeypatch.setattr(lossy, "pace", lossy._Pacer())
    monkeypatch.setattr(lossy, "same_host", lambda addr: False)  # (as across a link)
    sender = lossy.LossySender("tcp://127.0.0.1:9", "r", 0, pace_bits=rate,
                               burst_bytes=shallow.pacing_burst)
    sends = []
    sender._send = lambda data, k, size, tos=None: sends.append(
        (clock[0], sum(len(d) for d in data) + lossy.FRAME_OVERHEAD * k))
    t = sender._transfer(1, 0, torch.randn(500_000))
    sender._runs(t, range(t.count))
    sender.close()
    queue, at, most = 0.0, sends[0][0], 0.0
    for when, nbytes in sends:  # (the port drains at the link's rate)
        queue = max(0.0, queue - (when - at) * rate / 8) + nbytes
        at, most = when, max(most, queue)
    assert 16_000 < most <= 32_768
    # and the link is kept busy: those late wakeups cost little of its rate
    seconds = sum(n for _, n in sends) * 8 / rate
    assert clock[0] - 100.0 < 1.05 * seconds


def test_a_transfers_runs_are_its_datagrams_end_to_end():
    grad = torch.randn(352 * 5 + 3)
    expected = packets_of(grad, transfer=1, worker=0)
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    done = queue.SimpleQueue()
    sender = lossy.LossySender(f"tcp://127.0.0.1:{rx.getsockname()[1]}", "r", 0,
                               on_sent=done.put)
    t = sender.send(1, 0, grad, token="sent")
    assert done.get(timeout=5) == "sent"
    assert t.count == 6 and [bytes(t.packet(i)) for i in range(6)] == expected
    assert b"".join(t.run(2, 6)) == b"".join(expected[2:6])
    sender.close()
    rx.close()


def coalesced(packets: list[bytes]) -> tuple[bytes, int]:
    """What one receive with UDP GRO hands over: the datagrams end to end, and their
    size (the last may be shorter)."""
    return b"".join(packets), len(packets[0])


def test_a_coalesced_receive_is_kept_at_once_and_is_the_gradient():
    grad = torch.randn(352 * 40 + 5)
    ing = Ingress()
    data, size = coalesced(packets_of(grad, transfer=2))
    ing.datagrams(data, size)
    assert ing.counts == {"datagrams": 41, "bad_datagrams": 0, "evicted": 0, "late": 0}
    assert torch.equal(ing.complete(lossy_push(grad, 0.0, transfer=2)).tensors[0], grad)


def test_a_coalesced_receive_with_bad_datagrams_keeps_the_good_ones():
    grad = torch.randn(352 * 10)
    packets = packets_of(grad)
    broken = bytearray(packets[4])
    broken[:4] = b"XXXX"  # (not a psring datagram)
    twice = packets[:4] + [bytes(broken)] + packets[5:] + [packets[0]]  # (0 twice)
    ing = Ingress()
    ing.datagrams(*coalesced(twice))
    # (the broken one never decodes; the second packet 0 decodes, then is refused)
    assert ing.counts["datagrams"] == 10 and ing.counts["bad_datagrams"] == 2
    # packet 4 is missing: within a tenth, the rest scaled up; beyond, asked for
    assert ing.complete(lossy_push(grad, 0.0)) == (1, [4])
    kept = ing.complete(lossy_push(grad, 0.15)).tensors[0]
    assert torch.equal(kept[352 * 4:352 * 5], torch.zeros(352))
    assert torch.allclose(kept[:352], grad[:352] * 10 / 9)


def test_coalesced_receives_out_of_order_or_seen_before_keep_each_packet_once():
    # (the fast path takes a receive whole: in order, or each number once; a run whose
    # packets came before goes one by one, where each one seen is refused)
    grad = torch.randn(352 * 12 + 7)
    packets = packets_of(grad)
    ing = Ingress()
    order = [5, 0, 9, 2, 11, 7]
    ing.datagrams(*coalesced([packets[i] for i in order]))
    assert ing.counts == {"datagrams": 6, "bad_datagrams": 0, "evicted": 0, "late": 0}
    # (counted as datagrams when they decode, as bad when refused)
    ing.datagrams(*coalesced(packets[:4]))  # (0 and 2 again: 1 and 3 kept)
    assert ing.counts["datagrams"] == 10 and ing.counts["bad_datagrams"] == 2
    ing.datagrams(*coalesced([packets[i] for i in (3, 4, 6, 8, 10, 12)]))  # (3 again)
    assert ing.counts["datagrams"] == 16 and ing.counts["bad_datagrams"] == 3
    assert torch.equal(ing.complete(lossy_push(grad, 0.0)).tensors[0], grad)


def test_end_markers_follow_a_transfer_and_late_datagrams_are_not_held():
    # (the transpose all-reduce's senders end each part with markers; its receivers
    # wait for them, and drop what comes of a part after it was completed)
    rx = receiving.receiving_socket("127.0.0.1", 0, 1 << 24)
    done = queue.SimpleQueue()
    sender = lossy.LossySender(f"tcp://127.0.0.1:{rx.getsockname()[1]}", "r", 1,
                               on_sent=done.put, ends=True)
    grad = torch.randn(352 * 30)
    sender.send(7, 0, grad, token="sent")
    assert done.get(timeout=5) == "sent"
    ing = Ingress()
    assert not ing.ended(1, 7)
    deadline = time.monotonic() + 5
    while not ing.ended(1, 7) and time.monotonic() < deadline:
        receiving.drain(rx, ing)
    assert ing.ended(1, 7) and ing.ends[(1, 7)].packets == 30
    assert ing.heard(1, 7) is not None and ing.counts["bad_datagrams"] == 0
    assert torch.equal(ing.complete(lossy_push(grad, 0.0, transfer=7)).tensors[0], grad)
    assert not ing.ended(1, 7) and ing.heard(1, 7) is None
    for p in packets_of(grad, transfer=7)[:3]:  # (come late: dropped, not held)
        ing.datagram(p)
    ing.datagram(datagrams.encode_end(datagrams.End(1, 0, datagrams.run_tag("r"), 7, 30)))
    assert ing.counts["late"] == 3 and not ing.transfers and ing.held == 0
    assert not ing.ended(1, 7)
    sender.close()
    rx.close()


def test_a_resend_round_of_a_transfer_that_has_left_ends_with_markers():
    # (the transpose's owner asks again as they come, not after its idle timeout; a
    # resend jumping ahead of the transfer itself is no round's end)
    rx = receiving.receiving_socket("127.0.0.1", 0, 1 << 24)
    done = queue.SimpleQueue()
    sender = lossy.LossySender(f"tcp://127.0.0.1:{rx.getsockname()[1]}", "r", 1,
                               on_sent=done.put, ends=True)
    ing = Ingress()

    def markers_after(t0: float, seconds: float = 5.0) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            receiving.drain(rx, ing)
            if ing.marked_since(1, 7, t0):
                return True
        return False

    held = torch.randn(352 * 30)
    early = sender._transfer(7, 0, held)  # (not sent: as if queued behind others)
    t0 = time.monotonic()
    sender.resend(early, [2, 5], 2, token="early")
    # (the job's markers would have left before on_sent: on loopback, here at once)
    assert done.get(timeout=5) == "early" and not markers_after(t0, 0.2)
    t = sender.send(7, 0, torch.randn(352 * 30), token="sent")
    assert done.get(timeout=5) == "sent" and markers_after(t0)
    t1 = time.monotonic()
    sender.resend(t, [2, 5], 2, token="resent")
    assert done.get(timeout=5) == "resent" and markers_after(t1)
    sender.close()
    rx.close()


def test_a_datagram_claiming_more_than_may_be_held_is_refused(monkeypatch):
    monkeypatch.setattr(ingress, "MAX_HELD_BYTES", 10_000)
    ing = Ingress()
    for p in packets_of(torch.randn(352 * 10))[:2]:  # (10 packets: 14 kB)
        ing.datagram(p)
    assert ing.counts["bad_datagrams"] == 2 and ing.held == 0 and not ing.transfers


def test_senders_sharing_an_outbox_send_on_one_thread_in_the_order_queued():
    # (the transpose all-reduce's peers: one thread for all of them, each shard whole)
    rxs = [receiving.receiving_socket("127.0.0.1", 0, 1 << 22) for _ in range(2)]
    done = queue.SimpleQueue()
    box = outbox.Outbox("test-send")
    senders = [lossy.LossySender(f"tcp://127.0.0.1:{rx.getsockname()[1]}", "r", 0,
                                 on_sent=lambda token: done.put(
                                     (token, threading.get_ident())), outbox=box)
               for rx in rxs]
    try:
        grads = [torch.randn(352 * 40), torch.randn(352 * 7)]
        for k in range(3):  # (interleaved: 0, 1, 0, 1, 0, 1)
            for w, (s, g) in enumerate(zip(senders, grads)):
                s.send(k, 0, g, token=(k, w))
        got = [done.get(timeout=5) for _ in range(6)]
        assert [token for token, _ in got] == [(k, w) for k in range(3) for w in (0, 1)]
        assert {ident for _, ident in got} == {box.thread.ident}
        for rx, g in zip(rxs, grads):
            ing = Ingress()
            packets = -(-g.numel() // 352)
            assert _drain_all(rx, ing, 3 * packets) == 3 * packets
            for k in range(3):
                assert torch.equal(ing.complete(lossy_push(g, 0.0, transfer=k, worker=0))
                                   .tensors[0], g)
    finally:
        for s in senders:
            s.close()  # (a shared outbox is its owner's to close: still running)
        assert box.thread.is_alive()
        box.close()
        assert not box.thread.is_alive()
        for rx in rxs:
            rx.close()


def test_segmented_sends_arrive_coalesced_and_whole():
    # the sender's UDP GSO and the receiver's UDP GRO, end to end on loopback
    rx = receiving.receiving_socket("127.0.0.1", 0, 1 << 24)
    done = queue.SimpleQueue()
    sender = lossy.LossySender(f"tcp://127.0.0.1:{rx.getsockname()[1]}", "r", 0,
                               on_sent=done.put)
    grad = torch.randn(352 * 300 + 9)
    sender.send(5, 0, grad, token="sent")
    assert done.get(timeout=5) == "sent"
    ing = Ingress()
    assert _drain_all(rx, ing, 301) == 301
    assert ing.counts["datagrams"] == 301
    assert torch.equal(ing.complete(lossy_push(grad, 0.0, transfer=5, worker=0)).tensors[0],
                       grad)
    sender.close()
    rx.close()


def test_interleaved_transfers_beyond_the_arena_are_each_kept_whole():
    # two workers' pushes at once, 2.6 MB in all (the drain's arena holds 1 MB): runs of
    # one transfer's receives are kept together, a receive of the other ends a run, a
    # datagram sent twice is kept once, and both pushes are their gradients exactly
    rx = receiving.receiving_socket("127.0.0.1", 0, 1 << 24)
    done = queue.SimpleQueue()
    port = rx.getsockname()[1]
    senders = [lossy.LossySender(f"tcp://127.0.0.1:{port}", "r", w, on_sent=done.put)
               for w in (0, 1)]
    grads = [torch.randn(352 * 900 + 5), torch.randn(352 * 950)]
    try:
        sent = [s.send(9, 0, g, token=w) for w, (s, g) in enumerate(zip(senders, grads))]
        assert {done.get(timeout=5), done.get(timeout=5)} == {0, 1}
        senders[1].resend(sent[1], list(range(40, 80)), 40, token="again")
        assert done.get(timeout=5) == "again"
        ing = Ingress()
        assert _drain_all(rx, ing, 901 + 950 + 40) == 901 + 950 + 40  # (all 40 asked)
        assert ing.counts["bad_datagrams"] == 40  # (the second copies, kept once)
        for w, g in enumerate(grads):
            push = ing.complete(lossy_push(g, 0.0, transfer=9, worker=w))
            assert torch.equal(push.tensors[0], g)
    finally:
        for s in senders:
            s.close()
        rx.close()


def test_a_run_with_a_packet_seen_before_keeps_its_other_receives_at_once(monkeypatch):
    # drain's run of three receives, the second with a packet kept already (a resend's):
    # only that receive is kept one by one, and every packet once
    grad = torch.randn(352 * 30)
    packets = packets_of(grad)
    ing = Ingress()
    ing.datagram(packets[12])
    one_by_one = []
    keep = Ingress.datagram
    monkeypatch.setattr(Ingress, "datagram",
                        lambda self, d: (one_by_one.append(1), keep(self, d))[1])
    ing.datagrams(b"".join(packets), len(packets[0]), [10 * len(packets[0]) * (i + 1)
                                                        for i in range(3)])
    assert len(one_by_one) == 10 and ing.counts["bad_datagrams"] == 1
    assert torch.equal(ing.complete(lossy_push(grad, 0.0)).tensors[0], grad)


def test_the_ingress_is_unbiased_over_random_losses():
    grad = torch.randn(352 * 10)
    rng = random.Random(0)
    total = torch.zeros_like(grad)
    trials = 3000
    ps = packets_of(grad)
    for _ in range(trials):
        ing = Ingress()
        kept = [p for p in ps if rng.random() > 0.2]
        for p in kept or ps[:1]:
            ing.datagram(p)
        total += ing.complete(lossy_push(grad, 0.99)).tensors[0]
    mean = total / trials
    # each packet arrives w.p. 0.8; the mean of the scaled pushes is the gradient
    assert float((mean - grad).abs().mean()) < 0.05 * float(grad.abs().mean()) + 0.03


def test_a_lossy_push_its_datagrams_contradict_is_refused():
    grad = torch.randn(1000)
    ing = Ingress()
    for p in packets_of(grad):
        ing.datagram(p)
    bad = lossy_push(grad, 0.0)
    bad.header["packets"] = 4
    with pytest.raises(ProtocolError):
        ing.complete(bad)
    bad = lossy_push(grad, 1.5)
    with pytest.raises(ProtocolError):
        ing.complete(bad)


def test_datagrams_held_are_bounded(monkeypatch):
    monkeypatch.setattr(ingress, "MAX_HELD_BYTES", 10_000)
    ing = Ingress()
    for transfer in range(20):  # pushes whose lossy_push never comes
        for p in packets_of(torch.randn(1000), transfer=transfer)[:2]:
            ing.datagram(p)
    assert ing.held <= 10_000 + 1408 and ing.counts["evicted"] > 0


def test_a_push_without_tolerance_is_todays_reliable_push(monkeypatch):
    from psring.comm.psclient import PSClient

    client = PSClient(["tcp://127.0.0.1:9"], "r", 0, timeout=1)
    calls = []
    monkeypatch.setattr(client, "send", lambda *a: calls.append(a) or (0, 1))
    monkeypatch.setattr(client, "send_lossy", lambda *a: calls.append(("lossy", *a)))
    grad = torch.ones(4)
    client.push(0, {"step": 2, "offset": 0}, grad, 0.0)
    client.push(0, {"step": 2, "offset": 0}, grad, 0.01)
    assert calls[0] == (0, "push", {"step": 2, "offset": 0}, [grad])
    assert calls[1][0] == "lossy" and calls[1][-1] == 0.01
    client.close()


def test_a_timeout_behind_resends_names_the_datagrams_not_the_server():
    # a push the server keeps asking for again is no unreachable server: the error
    # names the datagrams that do not get through and the flags that help
    from psring.comm.psclient import PSClient
    from psring.errors import PsringError

    client = PSClient(["tcp://127.0.0.1:9"], "r", 0, timeout=1)
    key = (0, 7)
    client.pending.add(key)
    with pytest.raises(PsringError, match="no shared secret"):
        client.wait([key], "a push", timeout=0.05)
    client._lossy[key] = [None, {}]
    client.resent = 12
    with pytest.raises(PsringError, match=r"after it sent 12 datagrams again.*--credit-window"):
        client.wait([key], "a push", timeout=0.05)
    client.close()


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=1600), flip=st.integers(0, 1599))
def test_any_bytes_decode_to_a_datagram_or_a_protocol_error(data, flip):
    good = bytearray(packets_of(torch.randn(400))[0])
    good[flip % len(good)] ^= 0xFF
    for raw in (data, bytes(good)):
        try:
            d = datagrams.decode_datagram(raw)
        except ProtocolError:
            continue
        assert d.index < d.packets and len(d.payload) > 0


def test_datagrams_and_lossy_pushes_that_disagree_are_refused():
    grad = torch.randn(1000)
    ing = Ingress()
    short = datagrams.encode_datagram(Datagram(1, 0, datagrams.run_tag("r"), 7, 0, 3,
                                              "float32", memoryview(bytes(400))))
    ing.datagram(short)  # packet 0 of 3 carrying 100 elements, not 352
    other_run = packets_of(grad)[1][:10] + datagrams.run_tag("x").to_bytes(4, "little") + \
        packets_of(grad)[1][14:]
    for p in packets_of(grad):
        ing.datagram(p)
    ing.datagram(other_run)  # a second copy of packet 1, of another run: refused too
    assert ing.counts["bad_datagrams"] == 2
    for field, value in (("run", "x"), ("shard", 3), ("packets", datagrams.MAX_PACKETS + 1),
                         ("numel", 10**12)):
        bad = lossy_push(grad, 0.0)
        bad.header[field] = value
        with pytest.raises(ProtocolError):
            ing.complete(bad)
    assert torch.equal(ing.complete(lossy_push(grad, 0.0)).tensors[0], grad)


def test_the_pacer_keeps_the_link_rate_through_late_wakeups(monkeypatch):
    """Each sleep wakes 0.2 ms late (as a loaded machine's do); the frames still leave
    at the link's rate, not slower by the oversleeps."""
    clock = [100.0]
    monkeypatch.setattr(lossy.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(lossy.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s + 2e-4))
    pacer, rate, frame = lossy._Pacer(), 1e8, 1450
    for _ in range(1000):
        pacer(rate, frame)
    ideal = 1000 * frame * 8 / rate  # 0.116 s
    assert clock[0] - 100.0 == pytest.approx(ideal, rel=0.02)


def test_datagrams_to_this_host_are_not_paced():
    """Only a link crossing takes the link's time: an address of this namespace is
    reached without one (a UDP connect sends nothing)."""
    assert lossy.same_host(("127.0.0.1", 9))
    sender = lossy.LossySender("tcp://127.0.0.1:9", "run", 0, pace_bits=1e8)
    try:
        assert sender.pace_bits is None
    finally:
        sender.close()


# -- DLCP's priority marks (--switch priority) --------------------------------------------

def test_marks_rank_front_layers_and_large_gradients_higher():
    per = datagrams.per_datagram("float32")
    g = torch.full((4 * per,), 1e-3)
    g[per:2 * per] = 1.0  # packet 1 loud
    g[3 * per:] = 1.0  # packet 3 loud
    marks = lossy.Marks(model_numel=16 * per)
    # the push is the model's front: levels 2 (quiet) and 3 (loud)
    assert marks.levels(g, 0, per).tolist() == [2, 3, 2, 3]
    # the same push at the model's back half: levels 0 and 1
    assert marks.levels(g, 8 * per, per).tolist() == [0, 1, 0, 1]
    # straddling the middle: the packets before it are front ones
    assert marks.levels(g, 6 * per, per).tolist() == [2, 3, 0, 1]


def test_runs_of_one_send_keep_to_one_level():
    levels = np.array([3, 3, 2, 2, 2, 3], np.uint8)
    assert lossy.runs(range(6), 64, levels) == [(0, 2), (2, 5), (5, 6)]
    assert lossy.runs([0, 1, 3, 4], 64, levels) == [(0, 2), (3, 5)]


def test_marked_datagrams_leave_with_their_levels_tos():
    recv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    recv.bind(("127.0.0.1", 0))
    recv.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
    recv.settimeout(5)
    per = datagrams.per_datagram("float32")
    g = torch.randn(40 * per)
    sender = lossy.LossySender(f"tcp://127.0.0.1:{recv.getsockname()[1]}", "r", 0,
                               marks=lossy.Marks(model_numel=80 * per))
    try:
        t = sender.send(1, 0, g, offset=20 * per)  # packets 0-19 front, 20-39 back
        got = {}
        for _ in range(t.count):
            data, anc, _, _ = recv.recvmsg(4096, 64)
            got[datagrams.decode_datagram(data).index] = anc[0][2][0]
    finally:
        sender.close()
        recv.close()
    want = {i: lossy.PRIORITY_TOS[int(lv)] for i, lv in enumerate(t.levels)}
    assert got == want and set(got.values()) == set(lossy.PRIORITY_TOS)


@pytest.mark.timeout(60)
def test_a_pull_goes_behind_the_lossy_pushes_to_its_server():
    """A pull made while a lossy push's datagrams are still leaving waits for its
    lossy_push, as a pull follows the pushes on a TCP connection: sent first, the server
    would stream the parameters of the buckets already in ahead of that push's ack.
    Its answer, in pieces under the seq it was sent with, completes the pull's key."""
    import threading

    import zmq

    from psring.comm.protocol import decode, encode
    from psring.comm.psclient import PSClient

    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    addr = f"tcp://127.0.0.1:{fake.bind_to_random_port('tcp://127.0.0.1')}"
    ops: list[str] = []

    def serve() -> None:  # (the datagrams go to a UDP port nobody reads: ignored)
        for _ in range(2):
            peer, *frames = fake.recv_multipart()
            msg = decode(frames)
            ops.append(msg.op)
            head = {"run": "r", "worker": 0, "seq": msg.header["seq"], "shard": 0}
            if msg.op == "lossy_push":
                fake.send_multipart([peer, *encode("ack", {**head, "version": 1,
                                                           "staleness": 0, "delivered": 4000})])
            else:
                for offset in (0, 2000):
                    fake.send_multipart([peer, *encode(
                        "params", {**head, "version": 1, "offset": offset},
                        [torch.full((2000,), float(offset))])])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = PSClient([addr], run="r", worker=0, timeout=10, pace_bits=1e8)
    pieces = []
    try:
        push = client.send_lossy(0, {"step": 0, "offset": 0}, torch.ones(4000), 0.05)
        pull = client.pull(0, 1, 4000, pieces.append)
        client.wait([push, pull], "a push and a pull")
    finally:
        client.close()
        thread.join(5)
        fake.close(linger=0)
        ctx.term()
    assert ops == ["lossy_push", "pull"]
    assert [p.header["offset"] for p in pieces] == [0, 2000]


def test_single_datagrams_of_interleaved_transfers_are_kept_in_batches(monkeypatch):
    # (where the kernel coalesces nothing, as through the emulation's TAP links, each
    # receive is one datagram and several sources' interleave: drain still keeps them
    # a transfer at a time with numpy, one by one only a transfer's short last one)
    a, b = torch.randn(352 * 40 + 5), torch.randn(352 * 40 + 9)
    pa, pb = packets_of(a, transfer=7, worker=1), packets_of(b, transfer=9, worker=2)
    rx = receiving.receiving_socket("127.0.0.1", 0, 1 << 24)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    ing, alone = Ingress(), []
    real = Ingress.datagram
    monkeypatch.setattr(Ingress, "datagram", lambda self, d: (alone.append(len(d)),
                                                              real(self, d))[1])
    try:
        for x, y in zip(pa, pb):  # (packet by packet, taking turns)
            tx.sendto(x, rx.getsockname())
            tx.sendto(y, rx.getsockname())
        assert _drain_all(rx, ing, len(pa) + len(pb)) == len(pa) + len(pb)
        assert torch.equal(ing.complete(lossy_push(a, 0.0, transfer=7, worker=1))
                           .tensors[0], a)
        assert torch.equal(ing.complete(lossy_push(b, 0.0, transfer=9, worker=2))
                           .tensors[0], b)
        assert sorted(alone) == [34 + 5 * 4, 34 + 9 * 4]  # (the two short last ones)
        assert ing.counts == {"datagrams": 82, "bad_datagrams": 0, "evicted": 0, "late": 0}
    finally:
        tx.close()
        rx.close()
