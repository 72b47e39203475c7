"""The parameter server's rules, without sockets: store math, sync aggregation,
async staleness and its bound, partitioning."""

import pytest
import torch

from psring.comm.partition import even_split, overlaps
from psring.comm.protocol import decode, encode
from psring.records.runlog import usable_cores
from psring.servers.handler import Handler
from psring.servers.store import ShardStore
from tests.helpers import ops, req


@pytest.mark.parametrize("momentum,weight_decay", [(0.9, 0.01), (0.0, 0.01), (0.9, 0.0)])
def test_store_applies_exactly_torch_sgd(momentum, weight_decay):
    torch.manual_seed(0)
    p0 = torch.randn(1000)
    grads = [torch.randn(1000) for _ in range(4)]
    ref = p0.clone().requires_grad_()
    opt = torch.optim.SGD([ref], lr=0.1, momentum=momentum, weight_decay=weight_decay)
    store = ShardStore(0, 1000, p0, lr=0.1, momentum=momentum, weight_decay=weight_decay)
    for g in grads:
        ref.grad = g.clone()
        opt.step()
        store.apply(g[:600], 0)  # in two slices, as pushes arrive
        store.apply(g[600:], 600)
    assert torch.equal(store.params, ref.detach())


@pytest.mark.parametrize("momentum,weight_decay", [(0.9, 0.01), (0.0, 0.0)])
def test_store_sums_pushes_into_the_update(momentum, weight_decay):
    """begin/add/finish (3 workers' pushes summed into the momentum buffer as they
    arrive) is SGD on the summed gradient, to float rounding."""
    torch.manual_seed(1)
    p0 = torch.randn(1000)
    ref = p0.clone().requires_grad_()
    opt = torch.optim.SGD([ref], lr=0.1, momentum=momentum, weight_decay=weight_decay)
    store = ShardStore(0, 1000, p0, lr=0.1, momentum=momentum, weight_decay=weight_decay)
    for step in range(5):
        g = [torch.randn(1000) for _ in range(3)]
        ref.grad = g[0] + g[1] + g[2]
        before = None if store.buf is None else store.buf.clone()
        opt.step()
        for a, b in ((0, 300), (300, 1000)):  # two ranges, each pushed by all three
            store.begin(g[0][a:b], a)
            store.add(g[1][a:b], a)
            if before is not None:  # the version's momentum stays what it was meanwhile
                assert torch.equal(store.buf, before)
            store.finish(g[2][a:b], a)
        store.new_step(step + 1)  # (the handler, at the step's end)
        if momentum:  # then the buffer is the new version's: torch's momentum
            assert torch.allclose(store.buf, opt.state[ref]["momentum_buffer"], atol=1e-5)
    diff = (store.params - ref.detach()).abs().max() / ref.detach().abs().max()
    assert 0 <= diff < 1e-6
    assert not torch.equal(store.params, p0)


def test_even_split_and_overlaps():
    assert even_split(10, 3) == [(0, 4), (4, 7), (7, 10)]
    r = even_split(100, 2)
    assert overlaps(40, 60, r) == [(0, 40, 50), (1, 50, 60)]
    assert overlaps(0, 10, r) == [(0, 0, 10)]


def init(h, workers, mode="sync", max_staleness=-1, n=4, shard=0, released=()):
    out = h.handle(b"w0", req("init", lo=0, hi=n, workers=workers, mode=mode, lr=1.0,
                              momentum=0.0, weight_decay=0.0, max_staleness=max_staleness,
                              shard=shard, tensors=[torch.zeros(n)]))
    assert ops(out) == [(b"w0", "ok"), *released]


def test_sync_answers_pulls_only_when_all_workers_pushed():
    h = Handler()
    assert h.handle(b"w1", req("pull", worker=1, min_version=0)) == []  # before init: held
    init(h, workers=2)  # still held: workers start together, and worker 0 has not asked
    out = h.handle(b"w0", req("pull", min_version=0))
    assert sorted(ops(out)) == [(b"w0", "params"), (b"w1", "params")]
    h.handle(b"w0", req("push", step=0, offset=0, tensors=[torch.ones(4)]))
    assert h.handle(b"w0", req("pull", seq=3, min_version=1)) == []  # waits for worker 1
    out = h.handle(b"w1", req("push", worker=1, step=0, offset=0, tensors=[3 * torch.ones(4)]))
    assert ops(out) == [(b"w1", "ack"), (b"w0", "params")]
    params = decode(out[1].frames)
    assert params.header["version"] == 1
    assert torch.equal(params.tensors[0], -4 * torch.ones(4))  # lr 1, summed gradient 1 + 3


def test_sync_refuses_bad_pushes_and_keeps_serving():
    h = Handler()
    init(h, workers=1)
    for bad in (req("push", step=5, offset=0, tensors=[torch.ones(4)]),
                req("push", step=0, offset=3, tensors=[torch.ones(4)]),
                req("push", worker=7, step=0, offset=0, tensors=[torch.ones(4)])):
        (r,) = h.handle(b"w0", bad)
        assert decode(r.frames).op == "error"
    assert h.counts["errors"] == 3
    (r,) = h.handle(b"w0", req("push", step=0, offset=0, tensors=[torch.ones(4)]))
    assert decode(r.frames).op == "ack"


def test_sync_refuses_a_duplicate_push_of_a_range():
    h = Handler()
    init(h, workers=2, n=8)
    h.handle(b"w0", req("push", step=0, offset=0, tensors=[torch.ones(4)]))
    # the same range again: as many elements as the shard holds, yet not its gradient
    (r,) = h.handle(b"w0", req("push", seq=2, step=0, offset=0, tensors=[torch.ones(4)]))
    assert "twice" in decode(r.frames).header["message"]
    h.handle(b"w0", req("push", seq=3, step=0, offset=4, tensors=[torch.ones(4)]))
    for offset in (0, 4):
        h.handle(b"w1", req("push", worker=1, seq=1 + offset, step=0, offset=offset,
                            tensors=[torch.ones(4)]))
    assert h.state.version == 1 and torch.equal(h.state.store.params, -2 * torch.ones(8))


def _async_round(h, worker, seq):
    out = h.handle(f"w{worker}".encode(), req("push", worker=worker, seq=seq, step=0, offset=0,
                                              tensors=[torch.ones(4)]))
    return decode(out[0].frames).header["staleness"], out


def test_async_staleness_counts_updates_since_the_pull():
    h = Handler()
    init(h, workers=2, mode="async")
    h.handle(b"w0", req("pull", worker=0, min_version=0))
    h.handle(b"w1", req("pull", worker=1, min_version=0))
    s0, _ = _async_round(h, 0, 2)
    s1, _ = _async_round(h, 1, 2)
    assert (s0, s1) == (0, 1)  # worker 1 computed on parameters one update old


def test_async_bound_holds_back_pulls_and_leave_releases_them():
    h = Handler()
    init(h, workers=2, mode="async", max_staleness=0)
    # workers start together: the first pull waits until every worker has asked
    assert h.handle(b"w0", req("pull", worker=0, min_version=0)) == []
    # then worker 0 goes; with S = 0 a second worker in flight could see worker 0's
    # update: worker 1 is held back
    assert ops(h.handle(b"w1", req("pull", worker=1, min_version=0))) == [(b"w0", "params")]
    s0, out = _async_round(h, 0, 2)
    assert s0 == 0 and ops(out) == [(b"w0", "ack"), (b"w1", "params")]
    assert h.handle(b"w0", req("pull", worker=0, seq=3, min_version=0)) == []
    out = h.handle(b"w1", req("leave", worker=1, seq=3))
    assert ops(out) == [(b"w1", "ok"), (b"w0", "params")]


def test_async_workers_start_together():
    h = Handler()
    init(h, workers=3, mode="async")
    assert h.handle(b"w0", req("pull", worker=0, min_version=0)) == []
    assert h.handle(b"w2", req("pull", worker=2, min_version=0)) == []
    out = h.handle(b"w1", req("pull", worker=1, min_version=0))
    assert sorted(ops(out)) == [(b"w0", "params"), (b"w1", "params"), (b"w2", "params")]
    # from then on a pull is answered at once
    _, out = _async_round(h, 0, 3)
    assert (b"w0", "ack") in ops(out)
    assert ops(h.handle(b"w0", req("pull", worker=0, seq=9, min_version=0))) == \
        [(b"w0", "params")]


def test_init_replaces_a_previous_run():
    h = Handler()
    init(h, workers=1)
    h.handle(b"old", req("pull", min_version=5))  # held: version 5 never comes
    out = h.handle(b"w0", decode(encode("init", {
        "run": "run-2", "worker": 0, "seq": 1, "shard": 0, "lo": 0, "hi": 4, "workers": 1,
        "mode": "sync", "lr": 1.0, "momentum": 0.0, "weight_decay": 0.0,
        "max_staleness": -1}, [torch.zeros(4)])))
    # the old run's held pull can never be answered now: it is refused, not kept
    assert ops(out) == [(b"old", "error"), (b"w0", "ok")]
    assert h.deferred == []


def test_a_pull_held_before_init_from_an_unknown_worker_is_refused():
    h = Handler()
    h.handle(b"w9", req("pull", worker=9, min_version=0))
    init(h, workers=2, released=[(b"w9", "error")])
    assert h.deferred == []


def test_sync_pulls_are_answered_range_by_range_as_ranges_are_updated():
    h = Handler()
    init(h, workers=2, n=8)
    for offset in (0, 4):
        h.handle(b"w0", req("push", seq=1 + offset, step=0, offset=offset,
                            tensors=[torch.ones(4)]))
    assert h.handle(b"w0", req("pull", seq=9, min_version=1)) == []
    out = h.handle(b"w1", req("push", worker=1, step=0, offset=0, tensors=[torch.ones(4)]))
    # range [0, 4) is final for version 1: worker 0 gets it while [4, 8) is still open
    assert ops(out) == [(b"w1", "ack"), (b"w0", "params")]
    piece = decode(out[1].frames)
    assert piece.header["offset"] == 0 and piece.header["version"] == 1
    assert torch.equal(piece.tensors[0], -2 * torch.ones(4))
    # worker 1's own pull arrives in between: it gets the finished range at once
    out = h.handle(b"w1", req("pull", worker=1, seq=2, min_version=1))
    assert [decode(r.frames).header["offset"] for r in out] == [0]
    out = h.handle(b"w1", req("push", worker=1, seq=3, step=0, offset=4,
                              tensors=[torch.ones(4)]))
    assert sorted(ops(out)) == [(b"w0", "params"), (b"w1", "ack"), (b"w1", "params")]
    assert {decode(r.frames).header["offset"] for r in out if r.peer != b"w1" or
            decode(r.frames).op == "params"} == {4}
    assert h.deferred == [] and h.state.version == 1


def test_snapshots_are_taken_at_the_version_boundary_and_served():
    """A sync server with snapshot_every 2 copies its shard when the version becomes 2;
    a snapshot request for version 2 sent early is held, then answered with that copy
    even though the next step's first push has already changed the momentum."""
    h = Handler()
    n = 6
    h.handle(b"w0", req("init", lo=0, hi=n, workers=2, mode="sync", lr=0.5, momentum=0.9,
                        weight_decay=0.0, max_staleness=-1, snapshot_every=2,
                        snapshot_last=5, tensors=[torch.zeros(n)]))
    seq = iter(range(10, 1000))
    assert h.handle(b"w0", req("snapshot", seq=next(seq), version=2)) == []  # held
    ref = None
    for step in range(3):
        for w in (0, 1):
            out = h.handle(b"w%d" % w, req("push", worker=w, seq=next(seq), step=step,
                                           offset=0, tensors=[torch.ones(n)]))
            if step == 1 and w == 1:  # version 2 reached: the held request is answered
                state = [r for r in out if r.frames and decode(r.frames).op == "state"]
                assert len(state) == 1
                ref = decode(state[0].frames)
                assert ref.header["version"] == 2
                params, buf = ref.tensors
                # two SGD steps of lr 0.5 on a summed gradient of 2 with momentum 0.9
                assert torch.allclose(buf, torch.full((n,), 2 + 0.9 * 2))
                assert torch.allclose(params, torch.full((n,), -0.5 * 2 - 0.5 * 3.8))
    # the server moved on (version 3), the copy of version 2 is still what it serves
    (r,) = h.handle(b"w0", req("snapshot", seq=next(seq), version=2))
    again = decode(r.frames)
    assert torch.equal(again.tensors[0], ref.tensors[0])
    assert not torch.equal(h.state.store.params, ref.tensors[0])
    # a version no copy was kept of is an error, not a wait
    (r,) = h.handle(b"w0", req("snapshot", seq=next(seq), version=1))
    assert decode(r.frames).op == "error"


def test_init_from_a_checkpoint_sets_version_and_momentum():
    h = Handler()
    h.handle(b"w0", req("init", lo=0, hi=4, workers=1, mode="sync", lr=0.1, momentum=0.9,
                        weight_decay=0.0, max_staleness=-1, version=7,
                        tensors=[torch.ones(4), torch.full((4,), 3.0)]))
    assert h.state.version == 7 and torch.equal(h.state.store.buf, torch.full((4,), 3.0))
    (r,) = h.handle(b"w0", req("push", seq=5, step=7, offset=0, tensors=[torch.zeros(4)]))
    assert decode(r.frames).header["version"] == 8
    # buf = 0.9 * 3 + 0; p = 1 - 0.1 * 2.7
    assert torch.allclose(h.state.store.params, torch.full((4,), 1 - 0.27))


def test_server_copies_connections_on_one_io_thread_per_core():

    import zmq

    from psring.errors import ConfigError
    from psring.servers.server import MAX_IO_THREADS, Server

    server = Server("tcp://127.0.0.1:0")
    try:
        assert server.ctx.get(zmq.IO_THREADS) == min(MAX_IO_THREADS, usable_cores())
    finally:
        server.close()
    server = Server("tcp://127.0.0.1:0", io_threads=3)
    try:
        assert server.ctx.get(zmq.IO_THREADS) == 3
    finally:
        server.close()
    with pytest.raises(ConfigError, match="--io-threads must be >= 0"):
        Server("tcp://127.0.0.1:0", io_threads=-1)
    with pytest.raises(ConfigError, match="--control-rto-min-us is microseconds"):
        Server("tcp://127.0.0.1:0", rto_min_us=-1)
