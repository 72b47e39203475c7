"""Hierarchical all-reduce (``--strategy hallreduce``): reduce-scatter in the host,
all-reduce of each shard across the hosts, all-gather in the host. It trains single's
model on one host (the reduce-scatter and all-gather alone) and on 2 emulated hosts of
2 workers (all three levels), and sends what its formula says."""

from __future__ import annotations

import json

import pytest

from psring.strategies.hallreduce import hierarchy_bytes
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
    trained_by_the_tree,
)


def test_hierarchy_bytes():
    m = 8_000_000
    assert hierarchy_bytes(m, 1, 4) == 2 * 3 / 4 * m  # one host: a ring inside it
    assert hierarchy_bytes(m, 4, 1) == 2 * 3 / 4 * m  # one worker a host: a ring across
    # 2 hosts of 4: 2 * 3/4 of M inside, 2 * 1/2 of M/4 across
    assert hierarchy_bytes(m, 2, 4) == 2 * 3 / 4 * m + 2 * 1 / 2 * m / 4


@pytest.mark.untimed  # (parameters compared, nothing timed)
@needs_emulation
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hallreduce_trains_singles_model_on_one_host_and_across_two(tmp_path, small_runs):
    one, two = tmp_path / "one-host", tmp_path / "two-hosts"
    psring_together(
        ["run", "--strategy", "hallreduce", "--workers", 4, *SMALL, "--out", one],
        ["run", "--strategy", "hallreduce", "--workers", 4, "--hosts", 2, "--link", "1gbit",
         *SMALL, "--out", two], timeout=250)
    ref = load_model(small_runs["single"])
    for out, hosts, per_host in ((one, 1, 4), (two, 2, 2)):
        assert max_rel_diff(load_model(out), ref) < 1e-4, out.name
        records = read_steps(out)
        assert len(records) == 4 * 12
        m = json.loads((out / "manifest.json").read_text())
        assert all(r["bytes_sent"] == hierarchy_bytes(m["parameter_bytes"], hosts, per_host)
                   == m["bytes_per_step"]["sent"] for r in records)
        # several buckets (SMALL's --bucket-mb), the first handed to the communication
        # thread while backward ran
        assert all(len(r["bucket_launch_s"]) > 1 and
                   r["bucket_launch_s"][0] < r["backward_end_s"] for r in records)
        assert_no_processes(out)
    assert_cluster_gone(two)


@pytest.mark.untimed  # (parameters compared, nothing timed)
@needs_emulation
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hallreduce_adasum_is_the_tree_over_the_hosts_averages(tmp_path):
    """Horovod's hierarchical Adasum: 2 emulated hosts of 2 workers; each host averages
    its workers' gradients, the hosts' averages combine by Adasum. The run ends with
    SGD on the tree's Adasum of the 2 host averages, computed here in one process."""
    out = tmp_path / "hadasum"
    psring_together(["run", "--strategy", "hallreduce", "--reduce", "adasum", "--workers", 4,
                     "--hosts", 2, "--link", "1gbit", *SMALL, "--out", out], timeout=250)
    assert_no_processes(out)
    assert_cluster_gone(out)
    assert max_rel_diff(load_model(out), trained_by_the_tree(out, per_host=2)) < 1e-4


def test_uneven_hosts_are_refused(tmp_path):
    proc = cli_here("run", "--strategy", "hallreduce", "--workers", 3, "--hosts", 2,
                    "--batch-size", 48, "--out", tmp_path / "r")
    assert proc.returncode == 2 and "these hosts have [2, 1]" in proc.stderr, proc.stderr
