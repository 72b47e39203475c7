"""Updates applied exactly once: a push is (worker, seq); the same push again (a retry
after a timeout) is answered with the ack the first one got and not applied twice, in
the handler and through a live server; a different seq re-pushing a range is still a
client bug; the acks remembered for this are bounded."""

import pytest
import torch

from psring.comm.protocol import decode, encode
from psring.servers import acks as acks_mod
from psring.servers.handler import Handler
from tests.helpers import LiveServer, RawClient

RUN = "run-1"


def req(op, worker=0, seq=1, tensors=(), **fields):
    return decode(encode(op, {"run": RUN, "worker": worker, "seq": seq, "shard": 0, **fields},
                         list(tensors)))


def init(h, workers, n=4, mode="sync"):
    (r,) = h.handle(b"w0", req("init", lo=0, hi=n, workers=workers, mode=mode, lr=1.0,
                               momentum=0.0, weight_decay=0.0, max_staleness=-1,
                               tensors=[torch.zeros(n)]))
    assert decode(r.frames).op == "ok"


def push(h, worker, seq, step, offset=0, g=None, n=4):
    g = torch.ones(n) if g is None else g
    return h.handle(f"w{worker}".encode(), req("push", worker=worker, seq=seq, step=step,
                                               offset=offset, tensors=[g]))


def op_of(reply):
    return decode(reply.frames).op


def test_sync_retry_gets_the_same_ack_and_is_not_applied_twice():
    h = Handler()
    init(h, workers=2)
    (ack,) = push(h, 0, seq=10, step=0)
    (again,) = push(h, 0, seq=10, step=0)  # the retry: same worker, same seq, same data
    assert op_of(ack) == "ack" and again.frames == ack.frames and again.record["op"] == "retry"
    assert h.counts == {"requests": 3, "errors": 0, "replays": 0, "retries": 1}
    assert h.state.version == 0  # worker 0's share counted once: still waiting for worker 1
    replies = push(h, 1, seq=7, step=0, g=3 * torch.ones(4))
    assert [op_of(r) for r in replies] == ["ack"]
    assert h.state.version == 1
    assert torch.equal(h.state.store.params, -4 * torch.ones(4))  # 1 + 3, not 1 + 1 + 3
    # a retry arriving after its step completed still gets its ack, and changes nothing
    (late,) = push(h, 1, seq=7, step=0, g=3 * torch.ones(4))
    assert late.frames == replies[0].frames
    assert h.state.version == 1 and torch.equal(h.state.store.params, -4 * torch.ones(4))


def test_retry_of_a_piece_in_the_middle_of_a_step():
    h = Handler()
    init(h, workers=2, n=8)
    for seq, offset in ((1, 0), (2, 4)):
        push(h, 0, seq=seq, step=0, offset=offset)
    (first,) = push(h, 1, seq=1, step=0, offset=0)
    (retry,) = push(h, 1, seq=1, step=0, offset=0)
    assert retry.frames == first.frames
    push(h, 1, seq=2, step=0, offset=4)
    assert h.state.version == 1 and torch.equal(h.state.store.params, -2 * torch.ones(8))


def test_async_retry_is_not_applied_twice():
    h = Handler()
    init(h, workers=2, mode="async")
    (a,) = push(h, 0, seq=5, step=0)
    (b,) = push(h, 0, seq=5, step=0)
    assert b.frames == a.frames
    assert h.state.version == 1 and torch.equal(h.state.store.params, -torch.ones(4))


def test_a_different_seq_re_pushing_a_range_is_still_refused():
    h = Handler()
    init(h, workers=2, n=8)
    push(h, 0, seq=1, step=0)
    (r,) = push(h, 0, seq=2, step=0)  # a client bug, not a retry
    assert op_of(r) == "error" and "twice" in decode(r.frames).header["message"]
    # and the same seq for other data is a client bug too
    (r,) = push(h, 0, seq=1, step=0, offset=4)
    assert op_of(r) == "error" and "reused seq 1" in decode(r.frames).header["message"]
    assert h.counts["errors"] == 2 and h.counts["retries"] == 0
    assert torch.equal(h.state.store._sum[:4], torch.ones(4))  # worker 0's push, once
    assert h.state.received == {0: 4}


def test_acks_are_remembered_for_two_steps_then_a_retry_is_refused():
    h = Handler()
    init(h, workers=1)
    for step in range(5):
        push(h, 0, seq=100 + step, step=step)
        assert len(h.state.acks[0]) <= 2  # this step's and the last one's
    assert h.state.version == 5
    (r,) = push(h, 0, seq=104, step=4)  # the last step's retry: answered
    assert op_of(r) == "ack"
    (r,) = push(h, 0, seq=101, step=1)  # too old to be remembered: refused, not applied
    assert op_of(r) == "error" and "not above its last acknowledged" in \
        decode(r.frames).header["message"]
    assert h.state.version == 5 and torch.equal(h.state.store.params, -5 * torch.ones(4))


def test_acks_remembered_per_worker_are_capped(monkeypatch):
    monkeypatch.setattr(acks_mod, "MAX_ACKS", 3)
    h = Handler()
    init(h, workers=1, n=8)
    for i in range(8):  # eight one-element pushes in one step
        push(h, 0, seq=1 + i, step=0, offset=i, g=torch.ones(1), n=1)
    assert list(h.state.acks[0]) == [6, 7, 8]
    assert h.state.version == 1


def test_a_new_run_forgets_the_old_runs_acks():
    h = Handler()
    init(h, workers=1)
    push(h, 0, seq=1, step=0)
    init(h, workers=1)  # worker 0 starts the run again (same id: a fresh initialization)
    assert h.state.acks == {}
    (r,) = push(h, 0, seq=1, step=0)
    assert op_of(r) == "ack" and torch.equal(h.state.store.params, -torch.ones(4))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", [None, b"k" * 32], ids=["unsigned", "signed"])
def test_live_server_answers_a_resent_push_once(tmp_path, key):
    """A raw client sends the very same push frames twice: two identical acks, one update."""
    with LiveServer(tmp_path / "servers.jsonl", secret=key) as server, \
            RawClient(server.endpoint, key) as c:
        c.init(n=6, workers=1, lr=0.5, params=torch.ones(6))
        frames = c.frames("push", [torch.arange(6, dtype=torch.float32)], step=0, offset=0)
        c.send(frames)
        c.send(frames)
        first, second = c.recv(), c.recv()
        assert first is not None and first == second
        assert decode(first, key=key).header["version"] == 1
        assert c.recv(timeout_ms=200) is None  # nothing more
        assert torch.equal(c.pull(1), torch.ones(6) - 0.5 * torch.arange(6.0))
        assert server.stats["retries"] == 1 and server.stats["errors"] == 0
