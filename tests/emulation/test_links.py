"""Emulated links under pressure (psring.cluster.link): loss and delay in user space, and
bounded-loss gradients across them.

What is checked, on built clusters: the delay and loss as set within stated tolerances
and the drop traces exactly the seeded model's; a TCP run under loss and delay ending
with the lossless run's parameters, its links' records and TCP counters written;
bounded-loss pushes (ps) and the transpose all-reduce within their bound, the delivered
fraction logged, the all-reduce's replicas equal; nothing left behind. (The loss model
and the refusals: tests/unit/test_link_model.py.)"""

from __future__ import annotations

import json
import statistics as st
import subprocess
from pathlib import Path

import pytest

from psring.cluster import link, linkcheck
from psring.cluster.emulate import standalone
from psring.config import RunConfig
from tests.helpers import (
    SMALL,
    assert_cluster_gone,
    assert_no_processes,
    load_model,
    max_rel_diff,
    needs_emulation,
    psring,
    psring_together,
)
from tests.unit.test_link_model import decisions


@needs_emulation
@pytest.mark.timeout(120)
def test_a_links_delay_and_loss_are_as_set_and_its_drops_the_seeds(tmp_path):
    res = linkcheck.measure(link="100mbit", delay="5ms", loss=0.05, seed=7, pings=30,
                            datagrams=1500, seconds=0, log_dir=tmp_path)
    # a round trip crosses four directions of 5 ms; the forwarder and the echo add little
    assert 20.0 <= res["rtt_p50_ms"] < 23.0, res
    # each datagram crosses two directions: (1 - 0.05)^2 = 0.9025 arrive; 1500 of them
    # have a binomial spread of 0.8 points, the bound is five of them
    assert abs(res["delivered_seen"] - res["delivered_set"]) < 0.04, res
    records = res["forwarders"]
    assert set(records) == {"host-0", "host-1"}
    for host, rec in records.items():
        for way in link.DIRECTIONS:
            got = link.read_trace(tmp_path / "links" / f"{host}.{way}.drops")
            want = [i for i, d in enumerate(decisions(0.05, 1, link.link_seed(7, host, way),
                                                      rec[way]["packets"])) if d]
            assert got == want, (host, way)
            assert rec[way]["dropped"] == len(got) and rec[way]["delay_s"] == 0.005
    up = records["host-0"]["up"]
    assert up["packets"] >= 1500 and 0.03 < up["dropped"] / up["packets"] < 0.07
    assert_cluster_gone(tmp_path)
    assert_no_processes(tmp_path)  # the probes on the hosts, the agent, the forwarders


@needs_emulation
@pytest.mark.timeout(120)
def test_the_kernel_drops_loss_in_kernel_without_forwarders(tmp_path):
    res = linkcheck.measure(link="1gbit", loss=0.05, pings=0, datagrams=1500, seconds=0,
                            log_dir=tmp_path, loss_in="kernel")
    # as the forwarder's: two directions of 5% each, 0.8 points of binomial spread
    assert abs(res["delivered_seen"] - res["delivered_set"]) < 0.04, res
    state = json.loads((tmp_path / "cluster.json").read_text())
    assert not any("forwarder_pid" in h for h in state["hosts"])  # nothing in user space
    records = res["forwarders"]
    assert set(records) == {"host-0", "host-1"}
    up = records["host-0"]["up"]  # what host-0 sent, counted where the switch got it
    assert records["host-0"]["loss_in"] == "kernel"
    assert up["packets"] >= 1500 and 0.03 < up["dropped"] / up["packets"] < 0.07, up
    assert records["host-1"]["down"]["dropped"] > 0
    assert_cluster_gone(tmp_path)
    assert_no_processes(tmp_path)


@needs_emulation
@pytest.mark.timeout(60)
def test_tcp_rto_min_is_each_hosts_own(tmp_path):
    with standalone(2, "1gbit", log_dir=tmp_path, tcp_rto_min="5ms") as cluster:
        for host in ("host-0", "host-1"):
            floor = subprocess.run(
                cluster.command(host, ["cat", "/proc/sys/net/ipv4/tcp_rto_min_us"]),
                capture_output=True, text=True, timeout=30, check=True).stdout
            assert int(floor) == 5000
    assert Path("/proc/sys/net/ipv4/tcp_rto_min_us").read_text().strip() != "5000"
    assert_cluster_gone(tmp_path)
    assert_no_processes(tmp_path)


@pytest.mark.untimed  # (parameters compared, nothing timed)
@needs_emulation
@pytest.mark.timeout(240)
def test_a_tcp_run_under_loss_and_delay_trains_singles_model(tmp_path, small_runs):
    out = tmp_path / "lossy"
    psring("run", "--strategy", "allreduce", "--workers", "2", "--hosts", "2", "--link",
           "1gbit", "--delay", "1ms", "--loss", "0.02", "--loss-burst", "2", *SMALL,
           "--out", out, timeout=200)
    assert max_rel_diff(load_model(out), load_model(small_runs["allreduce"])) < 1e-4
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["cluster"]["loss"], manifest["cluster"]["loss_burst"]) == (0.02, 2.0)
    records = link.read_links(out)
    assert set(records) == {"host-0", "host-1"}
    sent = sum(r[w]["packets"] for r in records.values() for w in link.DIRECTIONS)
    lost = sum(r[w]["dropped"] for r in records.values() for w in link.DIRECTIONS)
    assert sent > 100 and lost > 0
    state = assert_cluster_gone(out)
    assert sum(t.get("RetransSegs", 0) for t in state["tcp"].values()) > 0  # TCP saw it
    assert_no_processes(out)


@needs_emulation
@pytest.mark.timeout(240)
def test_bounded_loss_pushes_respect_their_bound_and_log_what_arrived(tmp_path):
    # (through DLCP's switch: the datagrams marked, the TCP pulls' losses moved onto them)
    out = tmp_path / "lossy-ps"
    psring("run", "--strategy", "ps", "--workers", "2", "--hosts", "2", "--link", "1gbit",
           "--loss", "0.03", "--loss-tolerance", "0.02", "--switch", "priority", *SMALL,
           "--steps", "6", "--out", out, timeout=200)
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    far = [r["delivered"] for r in steps if r["worker"] == 1]  # across two links
    near = {r["delivered"] for r in steps if r["worker"] == 0}  # the server's host
    assert len(far) == 6 and near == {1.0}
    assert all(0.98 <= d <= 1.0 for d in far) and min(far) < 1.0, far
    first, last = (statistics_of(steps, s) for s in (0, 5))
    assert last < first  # it trains on what arrived
    server = [json.loads(x) for x in (out / "servers.jsonl").read_text().splitlines()]
    assert any(r["op"] == "resend" for r in server)  # ~6% lost: more than the bound
    assert server[-1]["op"] == "stats" and server[-1]["datagrams"] > 0
    ways = [w for rec in link.read_links(out).values() for w in (rec["up"], rec["down"])]
    assert sum(w["moved"] for w in ways) > 0
    assert json.loads((out / "manifest.json").read_text())["cluster"]["switch"] == "priority"
    assert_cluster_gone(out)
    assert_no_processes(out)


def statistics_of(steps: list[dict], step: int) -> float:
    return st.mean(r["loss"] for r in steps if r["step"] == step)


@pytest.mark.untimed  # (the bound and the replicas' digests checked, nothing timed)
@needs_emulation
@pytest.mark.timeout(240)
def test_a_transpose_all_reduce_under_loss_keeps_its_bound_and_its_replicas_equal(tmp_path):
    from psring.records.profile import Profile
    from psring.train.workload import meta_model

    model, _ = meta_model(RunConfig(model="mlp", width=256, depth=2, features=64))  # SMALL
    Profile.on_paper([p.numel() * 4 for p in model.parameters()], 0.01, 0.02, 0.002,
                     batch_size=16, source={"model": "mlp"}).save(tmp_path / "profile")
    out = tmp_path / "lossy-ring"
    psring("run", "--strategy", "allreduce", "--workers", "2", "--hosts", "2", "--link",
           "1gbit", "--loss", "0.03", "--loss-tolerance", "0.1", *SMALL, "--steps", "6",
           "--compute",
           "device", "--device-profile", tmp_path / "profile", "--out", out, timeout=200)
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    got = [r["delivered"] for r in steps]
    # (a bound of several packets of a shard: a lost packet or two stays missing)
    assert len(got) == 12 and all(0.9 <= d <= 1.0 for d in got) and min(got) < 1.0, got
    # what was lost differs by rank, yet every replica applied the same all-gathered
    # average: the reduced gradients' digests agree, step by step
    by_step: dict[int, list] = {}
    for r in steps:
        by_step.setdefault(r["step"], []).append(r["device_digest"][1])
    assert all(d[0] == pytest.approx(d[1], rel=1e-6) for d in by_step.values())
    assert_cluster_gone(out)
    assert_no_processes(out)


@pytest.mark.untimed  # (the resends checked, nothing timed)
@needs_emulation
@pytest.mark.timeout(240)
def test_pulls_as_datagrams_across_a_lossy_link_complete_by_asking_again(tmp_path):
    # (ps's; byteps's pulls take the same path: tests/multiproc/test_lossy_runs.py. That
    # a pull arrives exact whatever is lost: tests/unit/test_datagram_pulls.py)
    out = tmp_path / "lossy-ps"
    psring("run", "--strategy", "ps", "--workers", "2", "--hosts", "2", "--link", "1gbit",
           "--loss", "0.03", "--loss-tolerance", "0.1", *SMALL, "--steps", "6", "--out", out,
           timeout=200)
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert sorted((r["step"], r["worker"]) for r in steps) == [
        (s, w) for s in range(6) for w in (0, 1)]
    assert min(r["delivered"] for r in steps if r["worker"] == 1) < 1.0  # (pushes lost)
    stats = [json.loads(x) for x in (out / "servers.jsonl").read_text().splitlines()
             if '"stats"' in x]
    # worker 1's pulls crossed two lossy links: what was lost was asked for and sent again
    assert stats[-1]["pulled_datagrams"] > 0 and stats[-1]["pull_resends"] > 0
    assert_cluster_gone(out)
    assert_no_processes(out)


# -- DLCP's priority-aware switch (--switch priority) --------------------------------------

LOW, HIGH = 0x20, 0x80  # (psring.comm.lossy.PRIORITY_TOS: level 0 and level 3)


@needs_emulation
@pytest.mark.timeout(120)
def test_a_priority_switch_loses_the_lowest_marks_first():
    # 5% loss each way: priority moves the losses of the high marks and of unmarked
    # (TCP's class) onto the low ones, the total what two links losing 5% deliver,
    # (1 - 0.05) ** 2 of each mark (fifo: tests/unit/test_link_model.py, and the
    # congested port below)
    prio = linkcheck.marks_delivered(loss=0.05, switch="priority", count=4500, gap_s=1e-4)
    assert prio[HIGH] > 0.97 and prio[0] > 0.97, prio
    assert prio[LOW] < 0.8, prio  # a third of the traffic takes all the losses
    assert abs(sum(prio.values()) - 3 * 0.95 ** 2) < 0.06, prio


@needs_emulation
@pytest.mark.timeout(120)
def test_a_congested_priority_port_serves_high_marks_and_drops_low_ones():
    # two marks, each offered at about 3/4 of the link's rate (a datagram every 385 µs
    # on a schedule, so a busy machine offers the same load) into 64 KB ports: strict
    # priority carries the high mark whole and the low one gets what is left; fifo drops
    # both alike
    kw = dict(link="20mbit", link_buffer="64kb", count=2400, gap_s=3.85e-4,
              marks=(LOW, HIGH))
    prio = linkcheck.marks_delivered(switch="priority", **kw)
    fifo = linkcheck.marks_delivered(switch="fifo", **kw)
    assert prio[HIGH] > 0.95 and prio[LOW] < 0.85 * prio[HIGH], prio
    assert abs(fifo[HIGH] - fifo[LOW]) < 0.1, fifo


# -- receiver-driven pacing (--credit-window) ----------------------------------------------

@needs_emulation
@pytest.mark.timeout(240)
def test_credits_keep_an_incast_of_pushes_within_the_servers_port(tmp_path):
    # four workers' bounded-loss pushes into one server host's 64 KB port: paced only to
    # their own links they overflow it (resends); granted by the server, they do not.
    # Ten steps: how many pushes collide varies from run to run (6 steps once saw only 6)
    common = ["--strategy", "ps", "--workers", "4", "--hosts", "4", "--server-placement",
              "own-hosts", "--link", "200mbit", "--link-buffer", "64kb",
              "--loss-tolerance", "0.02", "--model", "mlp", "--width", "512", "--depth", "2",
              "--features", "256", "--batch-size", "64", "--steps", "10", "--eval-every", "0"]
    psring_together(["run", *common, "--out", tmp_path / "paced"],
                    ["run", *common, "--credit-window", "64kb", "--out", tmp_path / "credited"],
                    timeout=200)

    def server(run):
        rows = [json.loads(x) for x in (tmp_path / run / "servers.jsonl").read_text()
                .splitlines()]
        return sum(r["op"] == "resend" for r in rows), rows[-1]

    (paced, _), (credited, stats) = server("paced"), server("credited")
    assert paced >= 10, paced  # (the port overflows without grants)
    assert credited <= paced // 5 and stats["grants"] > 0, (credited, stats)
    steps = [json.loads(x) for x in (tmp_path / "credited" / "steps.jsonl").read_text()
             .splitlines()]
    assert len(steps) == 40 and min(r["delivered"] for r in steps) >= 0.98
    assert_cluster_gone(tmp_path / "paced")
    assert_cluster_gone(tmp_path / "credited")
    assert_no_processes(tmp_path)
