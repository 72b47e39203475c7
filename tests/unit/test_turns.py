"""Turns (psring.comm.turns): senders sharing a link send first come, first served,
whatever order their threads wake in, a pull's later parts ahead of the pulls begun
after it, and a turn that never comes costs a bounded wait."""

from __future__ import annotations

import threading
import time

from psring.comm import turns as turns_mod
from psring.comm.turns import Turns


def test_jobs_are_sent_in_the_order_they_were_queued_whatever_their_threads_do():
    turns, sent = Turns(), []
    tickets = [turns.take() for _ in range(4)]

    def job(ticket: int, delay: float) -> None:
        time.sleep(delay)  # (the later tickets' threads are ready first)
        turns.wait(ticket)
        sent.append(ticket)
        turns.release(ticket)

    threads = [threading.Thread(target=job, args=(t, 0.02 * (4 - t))) for t in tickets]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=10)
    assert sent == tickets


def test_a_groups_later_tickets_go_ahead_of_the_groups_begun_after_it():
    """A synchronous server answers each pull range by range: the second range's parts
    are queued after every worker's first. Grouped by pull, each worker's pull is sent
    whole before the next worker's (the first has its parameters after 1/N of the
    pull phase), not range by range among them all (every pull ending near the end)."""
    turns, sent = Turns(), []
    first = {w: turns.take(("pull", w)) for w in range(3)}   # the first range's parts
    second = {w: turns.take(("pull", w)) for w in range(3)}  # then the second's
    alone = turns.take()  # (no group: behind every group begun before it)
    late = turns.take(("pull", 0))  # (a group's part queued later still goes first)
    while (t := turns.turn()) is not None:
        sent.append(t)
        turns.release(t)
    assert sent == [first[0], second[0], late, first[1], second[1], first[2], second[2],
                    alone]


def test_a_lanes_jobs_have_their_turns_in_the_order_it_runs_them(monkeypatch):
    """byteps pulls bucket by bucket: a sender may queue a job of its second pull
    before a later range of its first arrives. The later range's group is older, but
    the sender's thread runs its jobs in order: the turn must not go to a job queued
    behind the one its thread waits on (it waited out STILL_S for the link to go
    still, a second or more a step)."""
    monkeypatch.setattr(turns_mod, "STILL_S", 5.0)  # (a fallback would fail the test)
    turns = Turns()
    queued = {"a": [], "b": []}  # each lane's jobs, run in order by one thread
    for lane, group in (("a", "a-x"), ("b", "b-x"), ("a", "a-y"), ("b", "b-y"),
                        ("a", "a-x"), ("b", "b-x")):  # (the last two: x's later ranges)
        queued[lane].append(turns.take(group, lane=lane))
    sent, fell_back = [], []

    def run(lane: str) -> None:
        for ticket in queued[lane]:
            if not turns.wait(ticket):
                fell_back.append(ticket)
            sent.append(ticket)
            turns.release(ticket)

    threads = [threading.Thread(target=run, args=(lane,)) for lane in queued]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert not fell_back and time.monotonic() - t0 < 2.0
    assert sorted(sent) == sorted(queued["a"] + queued["b"])
    for lane in queued:  # (each lane's in its own order)
        assert [t for t in sent if t in queued[lane]] == queued[lane]


def test_a_turn_that_never_comes_costs_a_bounded_wait(monkeypatch):
    monkeypatch.setattr(turns_mod, "STILL_S", 0.05)
    turns = Turns()
    stuck, mine = turns.take(), turns.take()  # (the first never sends nor releases)
    t0 = time.monotonic()
    assert turns.wait(mine) is False
    assert 0.04 < time.monotonic() - t0 < 2.0
    turns.release(mine)  # (out of order: the one before it keeps the turn)
    assert turns.turn() == stuck
    turns.release(stuck)
    assert turns.turn() is None


def test_a_link_still_moving_keeps_the_later_jobs_waiting(monkeypatch):
    """A long job (a big pull at a slow rate) holds its turn for longer than STILL_S;
    the ones behind it wait as long as it sends."""
    # (STILL_S well above a loaded machine's scheduling stalls: only a link that
    # really stops may let the second job go)
    monkeypatch.setattr(turns_mod, "STILL_S", 0.3)
    turns = Turns()
    first, second = turns.take(), turns.take()
    done = threading.Event()

    def long_job() -> None:
        turns.wait(first)
        for _ in range(50):  # (0.5 s of sending, longer than STILL_S)
            time.sleep(0.01)
            turns.moving()
        done.set()
        turns.release(first)

    th = threading.Thread(target=long_job)
    th.start()
    assert turns.wait(second) is True and done.is_set()
    th.join(timeout=10)
