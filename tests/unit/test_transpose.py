"""The transpose all-reduce's adaptive idle timeouts (psring.comm.transpose.Timeouts);
its runs under loss, and its replicas kept equal, are tests/emulation/test_links.py."""

from __future__ import annotations

import pytest

from psring.comm.transpose import IDLE_MAX_S, IDLE_MIN_S, Timeouts


def _steady_loss(timeouts: Timeouts, parts: int, gap: float, rtt: float) -> list[float]:
    """Source 1 streams each part's packets ``gap`` apart, and some are lost each time,
    their resends too: the owner waits out the idle timeout, asks, and a resend comes
    ``rtt`` later, three times a part (as _collect sees it). The idle timeout after
    each part."""
    now, seen = 0.0, []
    for _ in range(parts):
        before = None
        for _ in range(4):
            now += gap
            if before is not None:
                timeouts.heard(1, before, now, None)
            before = now
        for _ in range(3):
            asked = now + timeouts.idle(1)  # (quiet that long: asked again)
            now = asked + rtt
            timeouts.heard(1, before, now, asked)
            before = now
        seen.append(timeouts.idle(1))
    return seen


def test_a_wait_of_ones_own_does_not_lengthen_the_next():
    # (a quiet spell ended by a request was counted as a gap: each timeout lengthened
    # the next by half again, and a transpose run at 5% loss took steps of tens of s)
    seen = _steady_loss(Timeouts([1]), parts=60, gap=0.001, rtt=0.01)
    assert max(seen) <= 4 * 0.01 * 1.01
    assert seen[-1] == pytest.approx(seen[10])  # (settled: the round trip's)


def test_the_idle_timeout_follows_the_gaps_and_round_trips_within_its_bounds():
    t = Timeouts([1, 2])
    assert t.idle(1) == IDLE_MIN_S  # (nothing measured yet)
    t.heard(1, 0.0, 0.05, None)  # a paced source: a 50 ms gap
    assert t.idle(1) == 4 * 0.05 and t.idle(2) == IDLE_MIN_S
    t.heard(2, 0.0, 1.0, 0.2)  # a request's answer after 0.8 s: the round trip
    assert t.gaps[2] == 0.0 and t.idle(2) == IDLE_MAX_S  # (bounded, whatever measured)
    t.heard(1, 10.0, 20.0, None)  # one long pause moves the gap a fifth of the way
    assert t.gaps[1] == 0.8 * 0.05 + 0.2 * 10.0
