"""Bodies for run_pair's measuring processes in tests/multiproc/test_costmodel.py. A
module of their own, importing nothing heavy: a spawned process imports the module its
function comes from, and a test file (torch, psring.strategies) would take seconds of
the deadlines these tests time."""

from __future__ import annotations

import time

from psring.predict import pingpong


def hang(rank: int) -> None:
    time.sleep(120)


def slow_but_moving(rank: int, seconds: float, stall_after: float | None) -> str:
    """Reports progress every 0.1 s for ``seconds`` (then returns), or stops reporting
    after ``stall_after`` s and hangs."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if stall_after is not None and time.monotonic() - t0 > stall_after:
            time.sleep(120)
        pingpong.progress()
        time.sleep(0.1)
    return "done"
