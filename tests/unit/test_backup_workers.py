"""Backup workers in the parameter server's handler (init's ``backups`` b): a step takes
the first N - b workers to commit, the same workers on every range and shard, sums
their pushes in worker order and drops the others'; b = 0 is the plain synchronous
server. Without sockets (psring.servers.handler)."""

import pytest
import torch

from psring.comm.protocol import decode
from psring.servers.handler import Handler
from tests.helpers import ops, req

N = 8


def init(h, workers=3, backups=1, shard=0, lo=0):
    out = h.handle(b"w0", req("init", lo=lo, hi=lo + N, workers=workers, mode="sync",
                              lr=1.0, momentum=0.0, weight_decay=0.0, max_staleness=-1,
                              backups=backups, shard=shard, tensors=[torch.zeros(N)]))
    assert ops(out) == [(b"w0", "ok")], decode(out[0].frames).header


def push(h, w, step=0, seq=None, value=None, offset=0, n=N, shard=0):
    g = torch.full((n,), float(w + 1) if value is None else value)
    out = h.handle(f"w{w}".encode(), req("push", worker=w, seq=seq or 10 * step + 1 + offset,
                                         step=step, offset=offset, shard=shard, tensors=[g]))
    return decode(out[0].frames)


def commit(h, w, step=0, seq=None):
    return h.handle(f"w{w}".encode(), req("commit", worker=w, seq=seq or 10 * step + 9,
                                          step=step))


def test_a_step_takes_the_first_workers_to_commit_and_drops_the_late_one():
    h = Handler()
    init(h)
    for w in (0, 1, 2):
        assert push(h, w).op == "ack"
    assert h.state.version == 0 and torch.equal(h.state.store.params, torch.zeros(N))
    assert commit(h, 2) == []  # held: one of the two the step takes
    out = commit(h, 0)
    replies = {r.peer: decode(r.frames) for r in out}
    assert set(replies) == {b"w0", b"w2"}
    assert all(m.op == "chosen" and m.header["workers"] == [0, 2] and m.header["taken"]
               for m in replies.values())
    # the step is the sum of workers 0 and 2 (gradients 1 and 3), not worker 1's 2
    assert h.state.version == 1
    assert torch.equal(h.state.store.params, -4 * torch.ones(N))
    late = decode(commit(h, 1)[0].frames)
    assert late.op == "chosen" and not late.header["taken"]
    # a push of a finished step is thrown away, acknowledged as dropped
    ack = push(h, 1, seq=50)
    assert ack.op == "ack" and ack.header["dropped"]
    assert torch.equal(h.state.store.params, -4 * torch.ones(N))


def test_once_chosen_a_late_workers_push_is_dropped_and_a_lost_worker_is_not_waited_for():
    h = Handler()
    init(h, workers=4, backups=2)
    push(h, 0)
    push(h, 3)
    commit(h, 3)
    commit(h, 0)  # chosen: 0 and 3; workers 1 and 2 never come (dead, or slow)
    assert h.state.version == 1 and torch.equal(h.state.store.params, -5 * torch.ones(N))
    # the next step goes on with whoever commits first
    push(h, 1, step=1)
    push(h, 2, step=1)
    commit(h, 2, step=1)
    commit(h, 1, step=1)
    assert h.state.version == 2 and torch.equal(h.state.store.params, -10 * torch.ones(N))


def test_other_shards_learn_the_choice_from_a_chosen_worker():
    h = Handler()
    init(h, shard=1, lo=N)
    for w in (0, 1, 2):
        push(h, w, offset=N, shard=1)
    assert h.state.version == 0  # held until the step's workers are known
    (ok,) = h.handle(b"w1", req("choose", worker=1, seq=30, step=0, workers=[1, 2], shard=1))
    assert decode(ok.frames).op == "ok"
    assert h.state.version == 1 and torch.equal(h.state.store.params, -5 * torch.ones(N))
    # a second chosen worker's choose of the finished step is answered, and nothing moves
    (ok,) = h.handle(b"w2", req("choose", worker=2, seq=31, step=0, workers=[1, 2], shard=1))
    assert decode(ok.frames).op == "ok"
    # a choice that is not one is refused
    for bad in ([1, 1], [0, 7], [2, 1], [0]):
        (r,) = h.handle(b"w0", req("choose", worker=0, seq=40 + len(bad), step=1,
                                   workers=bad, shard=1))
        assert decode(r.frames).op == "error", bad


def test_the_sum_is_in_worker_order_whatever_the_arrival_order():
    sums = []
    for arrival in ((2, 0, 1), (0, 1, 2)):
        h = Handler()
        init(h, workers=3, backups=1)
        for w in arrival:
            push(h, w, value=[0.1, 1e8, 0.3][w])
        commit(h, 2)
        commit(h, 0)
        sums.append(h.state.store.params.clone())
    assert torch.equal(sums[0], sums[1])


@pytest.mark.parametrize("fields, words", [
    ({"backups": 3}, "backups 3 must be 0..workers - 1"),
    ({"backups": 1, "mode": "async"}, "need mode 'sync'"),
])
def test_init_refuses_backups_it_cannot_run(fields, words):
    h = Handler()
    args = dict(lo=0, hi=N, workers=3, mode="sync", lr=1.0, momentum=0.0, weight_decay=0.0,
                max_staleness=-1, tensors=[torch.zeros(N)])
    (r,) = h.handle(b"w0", req("init", **{**args, **fields}))
    assert words in decode(r.frames).header["message"]


def test_without_backups_commits_are_refused_and_acks_unchanged():
    h = Handler()
    init(h, workers=1, backups=0)
    ack = push(h, 0)
    assert ack.op == "ack" and ack.header["dropped"] is False  # (the field's default)
    (r,) = commit(h, 0, step=1)
    assert "backup workers" in decode(r.frames).header["message"]


def test_with_backups_the_last_copies_are_kept_and_the_newest_served_on_request():
    """Worker 0 may trail servers that go on without it: it asks every shard for its
    newest copy (SNAPSHOT_NEWEST; held until there is one), then for the oldest of
    those, which a shard a few versions on still keeps (BACKUP_COPIES)."""
    from psring.comm.protocol import SNAPSHOT_NEWEST
    from psring.servers.snapshots import BACKUP_COPIES

    h = Handler()
    h.handle(b"w0", req("init", lo=0, hi=N, workers=2, mode="sync", lr=1.0, momentum=0.0,
                        weight_decay=0.0, max_staleness=-1, backups=1, snapshot_every=1,
                        snapshot_last=9, tensors=[torch.zeros(N)]))
    assert h.handle(b"w0", req("snapshot", seq=500, version=SNAPSHOT_NEWEST)) == []  # held
    for step in range(6):  # worker 1 alone: each step takes the first commit
        push(h, 1, step=step)
        out = commit(h, 1, step=step)
        if step == 0:  # version 1, the first copy: the held request is answered
            (first,) = [decode(r.frames) for r in out if decode(r.frames).op == "state"]
            assert first.header["version"] == 1
    assert sorted(h.state.snapshots) == list(range(7 - BACKUP_COPIES, 7))
    (r,) = h.handle(b"w0", req("snapshot", seq=501, version=SNAPSHOT_NEWEST))
    newest = decode(r.frames)
    assert newest.header["version"] == 6
    assert torch.equal(newest.tensors[0], torch.full((N,), -12.0))
    (r,) = h.handle(b"w0", req("snapshot", seq=502, version=3))
    assert torch.equal(decode(r.frames).tensors[0], torch.full((N,), -6.0))
    (r,) = h.handle(b"w0", req("snapshot", seq=503, version=2))  # dropped
    assert "keeps [3, 4, 5, 6]" in decode(r.frames).header["message"]
