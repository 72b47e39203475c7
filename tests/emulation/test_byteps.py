"""``--strategy byteps``: per-host aggregation before the parameter servers. It trains
single's model with the update on the servers (one host of 4 workers, 2 servers) and on
the workers (2 emulated hosts of 2, servers on their own hosts), each host pushing the
gradients once, whatever its number of workers."""

from __future__ import annotations

import json

import pytest

from tests.helpers import (
    SMALL,
    assert_cluster_gone,
    assert_no_processes,
    cli_here,
    load_model,
    max_rel_diff,
    needs_emulation,
    psring_together,
    read_steps,
)


@pytest.mark.untimed  # (parameters compared, nothing timed)
@needs_emulation
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_byteps_trains_singles_model_updating_on_servers_or_workers(tmp_path, small_runs):
    one, two, quiet = tmp_path / "one-host", tmp_path / "two-hosts", tmp_path / "no-evals"
    psring_together(
        ["run", "--strategy", "byteps", "--workers", 4, "--servers", 2, *SMALL, "--out", one],
        # no evaluation gathers the parameters on every worker: the last step must
        # (rank 0 alone saves the model)
        ["run", "--strategy", "byteps", "--workers", 2, *SMALL, "--eval-samples", 0,
         "--out", quiet],
        # (held-out rows change the synthetic set: single without them is the reference)
        ["run", "--strategy", "single", *SMALL, "--eval-samples", 0, "--out", tmp_path / "s"],
        ["run", "--strategy", "byteps", "--workers", 4, "--hosts", 2, "--link", "1gbit",
         "--servers", 2, "--server-placement", "own-hosts", "--update-on", "worker",
         *SMALL, "--out", two], timeout=250)
    ref = load_model(small_runs["single"])
    assert max_rel_diff(load_model(quiet), load_model(tmp_path / "s")) < 1e-4
    assert_no_processes(quiet)
    for out, hosts in ((one, 1), (two, 2)):
        assert max_rel_diff(load_model(out), ref) < 1e-4, out.name
        records = read_steps(out)
        assert len(records) == 4 * 12
        m = json.loads((out / "manifest.json").read_text())
        for step in range(1, 12):
            rows = [r for r in records if r["step"] == step]
            # each host's workers push one part each: the host's gradients once
            assert sum(r["bytes_sent"] for r in rows) == hosts * m["parameter_bytes"]
            assert all(0 < r["bytes_sent"] < m["parameter_bytes"] for r in rows)
            if out == two:  # updating on the workers: a step pulls its own sums back
                assert sum(r["bytes_recv"] for r in rows) == hosts * m["parameter_bytes"]
            # the manifest's per-worker figure is a part (1/G) of the gradients, each way
            assert all(abs(r["bytes_sent"] - m["bytes_per_step"]["sent"]) < 1024
                       for r in rows)
        # several buckets, the first on its way (the host's reduce-scatter) during backward
        assert all(len(r["bucket_launch_s"]) > 1 and
                   r["bucket_launch_s"][0] < r["backward_end_s"] for r in records)
        served = [json.loads(x) for x in (out / "servers.jsonl").read_text().splitlines()]
        assert {r["server"] for r in served if r["op"] == "push"} and \
            {r["worker"] for r in served if r["op"] == "push"} == {0, 1, 2, 3}
        assert_no_processes(out)
    # measured by the kernel on the emulated links: host-1's 2 workers sent its
    # gradients once a step (12 steps of M bytes, plus a little of set-up and acks), not
    # once per worker (24 M under ps)
    m = json.loads((two / "manifest.json").read_text())["parameter_bytes"]
    links = json.loads((two / "cluster.json").read_text())["link_bytes"]
    # every host's link, read before the hosts went (2 of workers, 2 of servers)
    assert set(links) == {"host-0", "host-1", "host-2", "host-3"}
    sent = links["host-1"]["from_host"]
    assert 12 * m <= sent < 13 * m, (sent, m)
    assert_cluster_gone(two)


@pytest.mark.parametrize("flags, expected", [
    (["--strategy", "async-ps", "--update-on", "worker"], "updates on the servers only"),
    (["--strategy", "ps", "--update-on", "worker"], "--strategy byteps --update-on worker"),
    (["--strategy", "byteps", "--update-on", "gpu"], "must be server or worker"),
    (["--strategy", "byteps", "--hosts", 2], "these hosts have [2, 1]"),
    (["--strategy", "byteps", "--compress", "fp16"], "--compress applies to"),
    (["--strategy", "byteps", "--checkpoint-every", 2], "cannot checkpoint"),
])
def test_bad_byteps_settings_are_refused(tmp_path, flags, expected):
    proc = cli_here("run", "--workers", 3, "--batch-size", 48, *flags, "--out", tmp_path / "r")
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
