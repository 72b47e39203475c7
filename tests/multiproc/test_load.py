"""Load: 16 workers on 2 shards account for every push; a straggler slows a synchronous
run (the others wait for it) without anything dropped and with bounded server memory."""

import json
import statistics as st

import pytest

from tests.helpers import assert_no_processes, psring, read_steps

TINY = ("--model", "mlp", "--width", "32", "--depth", "1", "--features", "16")


def server_log(run_dir):
    return [json.loads(line) for line in (run_dir / "servers.jsonl").read_text().splitlines()]


def check_accounted(run_dir, workers: int, steps: int, servers: int) -> list[dict]:
    records = read_steps(run_dir)
    assert sorted((r["worker"], r["step"]) for r in records) == \
        [(w, s) for w in range(workers) for s in range(steps)]
    log = server_log(run_dir)
    assert not [r for r in log if r.get("error")], "a request was refused"
    pushes = [r for r in log if r["op"] == "push"]
    # sent = applied: every byte the workers pushed reached a server and was applied
    assert sum(r["bytes_sent"] for r in records) == sum(r["bytes_in"] for r in pushes)
    assert {(r["server"], r["worker"], r["step"]) for r in pushes} == \
        {(f"server-{k}", w, s) for k in range(servers) for w in range(workers)
         for s in range(steps)}
    stats = [r for r in log if r["op"] == "stats"]
    assert len(stats) == servers
    for s in stats:
        assert s["errors"] == 0 and s["invalid"] == 0 and s["retries"] == 0
    return stats


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_sixteen_workers_on_two_shards_account_for_every_push(tmp_path):
    out = tmp_path / "load"
    psring("run", "--strategy", "ps", "--workers", 16, "--servers", 2, *TINY,
           "--batch-size", 64, "--steps", 20, "--out", out, timeout=240)
    assert_no_processes(out)
    stats = check_accounted(out, 16, 20, 2)
    for s in stats:
        assert s["max_rss_mb"] < 1024  # a tiny model: the server stays small


@pytest.mark.timeout(300)
def test_a_straggler_slows_a_sync_run_without_dropping_anything(tmp_path):
    out = tmp_path / "slow"
    psring("run", "--strategy", "ps", "--workers", 4, "--servers", 2, *TINY,
           "--batch-size", 64, "--steps", 30, "--slow-worker", "1:6", "--out", out,
           timeout=240)
    assert_no_processes(out)
    stats = check_accounted(out, 4, 30, 2)
    records = [r for r in read_steps(out) if r["step"] >= 3]
    waited = {w: st.median(r["comm_s"] for r in records if r["worker"] == w) for w in range(4)}
    # the others wait for the straggler every step; it never waits for them
    assert all(waited[w] > waited[1] for w in (0, 2, 3)), waited
    for s in stats:
        assert s["max_rss_mb"] < 1024
