"""The servers' side of byteps: per-host groups (init's `group`), summation-only servers
(`update` "sum") and pulls of a part of the shard (`lo`, `hi`), through the request
handler alone (no sockets)."""

from __future__ import annotations

import torch

from psring.comm.protocol import decode
from psring.servers.handler import Handler
from tests.helpers import ops, req


def init(h, workers, group, update="sgd", n=8, mode="sync", lr=1.0):
    out = h.handle(b"w0", req("init", lo=0, hi=n, workers=workers, mode=mode, lr=lr,
                              momentum=0.0, weight_decay=0.0, max_staleness=-1,
                              group=group, update=update, tensors=[torch.zeros(n)]))
    return [decode(r.frames) for r in out]


def start(h, workers):
    """Every worker's first pull (held until all have asked), then nothing pending."""
    for w in range(workers):
        h.handle(b"w%d" % w, req("pull", worker=w, seq=100, min_version=0))
    assert h.deferred == []


def push(h, worker, offset, values, step=0, seq=None):
    return h.handle(b"w%d" % worker, req("push", worker=worker, seq=seq or 10 + offset,
                                         step=step, offset=offset,
                                         tensors=[torch.tensor(values, dtype=torch.float32)]))


def test_a_group_pushes_each_range_once_and_ranges_complete_with_one_push_per_group():
    """4 workers on 2 hosts (group 2): local rank 0 of each host pushes [0, 4), local
    rank 1 pushes [4, 8); a range is complete with 2 pushes, not 4."""
    h = Handler()
    assert init(h, workers=4, group=2)[0].op == "ok"
    start(h, 4)
    push(h, 2, 0, [1.0] * 4)  # host 1's first: held until host 0's (summed in host order)
    assert h.state.store.params[0].item() == 0.0
    push(h, 0, 0, [2.0] * 4)
    assert torch.equal(h.state.store.params[:4], -3 * torch.ones(4))  # lr 1, sum 1 + 2
    assert h.state.version == 0  # [4, 8) is still open
    # worker 1 is in host 0's group, which has pushed [0, 4): refused, nothing changes
    (r,) = push(h, 1, 0, [5.0] * 4)
    assert "group 0 (workers 0..1)" in decode(r.frames).header["message"]
    push(h, 1, 4, [1.0] * 4)
    push(h, 3, 4, [1.0] * 4)
    assert h.state.version == 1
    assert torch.equal(h.state.store.params, torch.tensor([-3.0] * 4 + [-2.0] * 4))


def test_a_pull_of_a_part_gets_only_that_part_as_it_is_finished():
    h = Handler()
    init(h, workers=4, group=2)
    start(h, 4)
    assert h.handle(b"w1", req("pull", worker=1, seq=200, min_version=1, lo=4, hi=8)) == []
    push(h, 0, 0, [1.0] * 4)
    out = push(h, 2, 0, [1.0] * 4)  # [0, 4) is done: not worker 1's part, nothing sent
    assert ops(out) == [(b"w2", "ack")]
    push(h, 1, 4, [1.0] * 4)
    out = push(h, 3, 4, [3.0] * 4)
    assert ops(out) == [(b"w3", "ack"), (b"w1", "params")]
    piece = decode(out[1].frames)
    assert piece.header["offset"] == 4 and torch.equal(piece.tensors[0], -4 * torch.ones(4))
    # a part across ranges of a finished version: its own elements only, at once
    (r,) = h.handle(b"w0", req("pull", worker=0, seq=201, min_version=1, lo=2, hi=6))
    assert decode(r.frames).header["offset"] == 2
    assert decode(r.frames).tensors[0].tolist() == [-2.0, -2.0, -4.0, -4.0]


def test_a_summing_server_returns_the_sum_and_keeps_it_while_the_next_step_adds():
    """update 'sum': the parameters are not touched, a pull of version s + 1 returns step
    s's sum; step s + 1's pushes go into the other sum, so a pull of version s + 1 still
    being answered is not changed under it."""
    h = Handler()
    init(h, workers=2, group=1, update="sum", n=4)
    start(h, 2)
    push(h, 0, 0, [1.0, 2.0, 3.0, 4.0])
    push(h, 1, 0, [1.0, 1.0, 1.0, 1.0])
    assert h.state.version == 1 and torch.equal(h.state.store.params, torch.zeros(4))
    (r,) = h.handle(b"w0", req("pull", worker=0, seq=300, min_version=1))
    assert torch.equal(decode(r.frames).tensors[0], torch.tensor([2.0, 3.0, 4.0, 5.0]))
    sent = decode(r.frames).tensors[0]
    push(h, 0, 0, [9.0] * 4, step=1, seq=400)  # step 1 begins while the reply may be in flight
    assert torch.equal(h.state.store.sendable(1), torch.tensor([2.0, 3.0, 4.0, 5.0]))
    assert torch.equal(sent, torch.tensor([2.0, 3.0, 4.0, 5.0]))
    (r,) = h.handle(b"w1", req("pull", worker=1, seq=301, min_version=1))
    assert torch.equal(decode(r.frames).tensors[0], torch.tensor([2.0, 3.0, 4.0, 5.0]))
    push(h, 1, 0, [1.0] * 4, step=1, seq=401)
    (r,) = h.handle(b"w1", req("pull", worker=1, seq=302, min_version=2))
    assert torch.equal(decode(r.frames).tensors[0], 10 * torch.ones(4))


def test_bad_groups_updates_and_parts_are_refused():
    h = Handler()
    assert "group 3 must be >= 1 and divide the 4 workers" in \
        init(h, workers=4, group=3)[0].header["message"]
    assert "a group > 1 needs mode 'sync'" in \
        init(h, workers=4, group=2, mode="async")[0].header["message"]
    assert "'sum' needs mode 'sync'" in \
        init(h, workers=2, group=1, update="sum", mode="async")[0].header["message"]
    assert "must be one of" in init(h, workers=2, group=1, update="adam")[0].header["message"]
    assert init(h, workers=2, group=1, n=8)[0].op == "ok"
    for lo, hi in ((4, 12), (6, 6), (-1, 3)):
        (r,) = h.handle(b"w0", req("pull", seq=500 + lo, min_version=0, lo=lo, hi=hi))
        assert "not inside this shard [0, 8)" in decode(r.frames).header["message"]
    assert h.deferred == []


def test_partitions_cut_at_servers_and_at_the_partition_size():
    from psring.strategies.byteps import PARTITION_ELEMENTS as P
    from psring.strategies.byteps import partitions

    ranges = [(0, 3 * P), (3 * P, 5 * P)]
    got = partitions(P // 2, 4 * P, ranges)
    assert got == [(0, P // 2, P // 2 + P), (0, P // 2 + P, P // 2 + 2 * P),
                   (0, P // 2 + 2 * P, 3 * P), (1, 3 * P, 4 * P)]
    assert partitions(5, 5, ranges) == []
