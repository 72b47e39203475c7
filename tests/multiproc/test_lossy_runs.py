"""Bounded-loss gradients (--loss-tolerance) on this machine's loopback, where nothing is
lost: every datagram arrives, so ps, byteps (their pulls as datagrams too) and the
transpose all-reduce train single's model.
(Under loss, on emulated hosts: tests/emulation/test_links.py.)"""

from __future__ import annotations

import json

import pytest

from tests.helpers import SMALL, assert_no_processes, load_model, max_rel_diff, psring


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,extra", [
    ("ps", []), ("byteps", []), ("allreduce", []),
    # receiver-driven: each transpose rank grants what may be sent (ps's servers grant
    # in tests/emulation/test_links.py's incast)
    ("allreduce", ["--credit-window", "16kb"])])
def test_bounded_loss_without_loss_trains_singles_model(tmp_path, small_runs, strategy,
                                                        extra):
    # (loopback loses nothing: every datagram arrives, the sums are exact. The bound is
    # below one datagram a part, so a receiver that a loaded machine leaves quiet for a
    # spell asks again rather than scaling up a part that is still on its way)
    out = tmp_path / f"lossless-{strategy}"
    psring("run", "--strategy", strategy, "--workers", "2", "--loss-tolerance", "0.0001",
           *extra, *SMALL, "--out", out, timeout=100)
    assert max_rel_diff(load_model(out), load_model(small_runs["single"])) < 1e-4
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert {r["delivered"] for r in steps} == {1.0}
    if strategy != "allreduce":  # (a sync run's pulls came back as datagrams, all of them)
        stats = [json.loads(x) for x in (out / "servers.jsonl").read_text().splitlines()
                 if '"stats"' in x]
        assert stats and all(s["pulled_datagrams"] > 0 for s in stats)
    assert_no_processes(out)
