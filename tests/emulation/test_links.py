"""Emulated links under pressure (psring.cluster.link): loss and delay in user space.

What is checked: the loss model's long-run rate and bursts, and that a seed fixes its
decisions; the refusals of bad --loss/--delay/--loss-burst/--link-buffer (exit 2, one
paragraph, nothing started); on a built cluster, the delay and loss as set within stated
tolerances and the drop traces exactly the seeded model's; a TCP run under loss and
delay finishing with single's parameters, its links' records written, nothing left."""

from __future__ import annotations

import json
import re
import statistics as st

import pytest

from psring.cluster import link, linkcheck
from psring.config import RunConfig, validate
from psring.errors import ConfigError
from tests.emulation.test_emulate import assert_paragraph
from tests.helpers import (
    SMALL,
    assert_cluster_gone,
    assert_no_processes,
    cli_here,
    load_model,
    max_rel_diff,
    needs_emulation,
    psring,
)


def decisions(rate: float, burst: float, seed: str, n: int) -> list[bool]:
    d = link.LossModel(rate, burst).dropper(seed)
    return [d.drop() for _ in range(n)]


def test_independent_losses_have_the_rate_and_no_memory():
    got = decisions(0.05, 1, "a", 100_000)
    assert abs(sum(got) / len(got) - 0.05) < 0.004
    # P(drop | previous dropped) is the rate itself
    after = [b for a, b in zip(got, got[1:]) if a]
    assert abs(sum(after) / len(after) - 0.05) < 0.02


def test_bursty_losses_have_the_rate_and_the_mean_burst():
    got = decisions(0.02, 4, "b", 200_000)
    assert abs(sum(got) / len(got) - 0.02) < 0.004
    runs, n = [], 0
    for x in got:
        if x:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    assert 3.4 < st.mean(runs) < 4.6


def test_a_burst_is_a_spell_of_the_link_not_of_one_senders_packets():
    # a sender in backoff: one packet a second on a link whose frame takes 0.1 ms; its
    # packets meet the long-run rate, not bursts that outlast its timeouts
    d = link.LossModel(0.01, 4, slot_s=1e-4).dropper("c")
    sparse = [d.drop(float(t)) for t in range(20_000)]
    assert abs(sum(sparse) / len(sparse) - 0.01) < 0.004
    runs = "".join("x" if x else "." for x in sparse).split(".")
    assert max(map(len, runs)) <= 3  # independent: no run of four at 1%
    # back to back (the link busy), the bursts are there
    d = link.LossModel(0.01, 4, slot_s=1e-4).dropper("c")
    dense = [d.drop(i * 1e-4) for i in range(200_000)]
    lost = "".join("x" if x else "." for x in dense).split(".")
    assert 3.4 < st.mean(len(r) for r in lost if r) < 4.6


def test_a_seed_fixes_each_directions_decisions():
    s = link.link_seed(3, "host-0", "up")
    assert decisions(0.1, 1, s, 500) == decisions(0.1, 1, s, 500)
    assert decisions(0.1, 1, s, 500) != decisions(0.1, 1, link.link_seed(3, "host-0",
                                                                          "down"), 500)
    assert decisions(0.1, 1, s, 500) != decisions(0.1, 1, link.link_seed(4, "host-0",
                                                                          "up"), 500)
    assert not any(decisions(0.0, 1, s, 500))


@pytest.mark.parametrize("kw, needle", [
    (dict(loss=1.0), "in [0, 1)"),
    (dict(loss=-0.1), "in [0, 1)"),
    (dict(loss=0.01, loss_burst=0.5), ">= 1"),
    (dict(loss_burst=3.0), "give --loss too"),
    (dict(delay="fast"), "is not a time"),
    (dict(link_buffer="64kb"), "give --link RATE too"),
    (dict(link="1gbit", link_buffer="lots"), "is not a size"),
    (dict(link="1gbit", link_buffer="1kb"), "at least two full-size frames"),
    (dict(strategy="ps", loss_tolerance=1.0), "in [0, 1)"),
    (dict(strategy="ps", loss_tolerance=-0.5), "in [0, 1)"),
    (dict(strategy="ddp", loss_tolerance=0.01), "'ddp' has none"),
    (dict(loss_tolerance=0.01, reduce="adasum"), "transpose all-reduce"),
    (dict(strategy="ps", hosts=1, transport="ipc", loss_tolerance=0.01), "UDP datagrams"),
])
def test_bad_link_settings_are_refused(kw, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        validate(RunConfig(**{"strategy": "allreduce", "workers": 2, "hosts": 2, **kw}))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, needle", [
    (["--loss", "0.01"], "nothing crosses one"),
    (["--delay", "2ms"], "nothing crosses one"),
    (["--hosts", "2", "--loss", "1.5"], "drops, in [0, 1)"),
    (["--hosts", "2", "--delay", "2 parsecs"], "is not a time"),
    (["--loss-tolerance", "0.01", "--strategy", "hallreduce"], "'hallreduce' has none"),
])
def test_bad_link_flags_exit_2_in_one_paragraph(tmp_path, args, needle):
    proc = cli_here("run", "--strategy", "allreduce", "--workers", "2", *args,
                    "--out", tmp_path / "r")
    assert_paragraph(proc, needle)
    assert not (tmp_path / "r").exists()


@needs_emulation
@pytest.mark.timeout(120)
def test_a_links_delay_and_loss_are_as_set_and_its_drops_the_seeds(tmp_path):
    res = linkcheck.measure(link="100mbit", delay="5ms", loss=0.05, seed=7, pings=40,
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
    out = tmp_path / "lossy-ps"
    psring("run", "--strategy", "ps", "--workers", "2", "--hosts", "2", "--link", "1gbit",
           "--loss", "0.03", "--loss-tolerance", "0.02", *SMALL, "--out", out, timeout=200)
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    far = [r["delivered"] for r in steps if r["worker"] == 1]  # across two links
    near = {r["delivered"] for r in steps if r["worker"] == 0}  # the server's host
    assert len(far) == 12 and near == {1.0}
    assert all(0.98 <= d <= 1.0 for d in far) and min(far) < 1.0, far
    first, last = (statistics_of(steps, s) for s in (0, 11))
    assert last < first  # it trains on what arrived
    server = [json.loads(x) for x in (out / "servers.jsonl").read_text().splitlines()]
    assert any(r["op"] == "resend" for r in server)  # ~6% lost: more than the bound
    assert server[-1]["op"] == "stats" and server[-1]["datagrams"] > 0
    assert_cluster_gone(out)
    assert_no_processes(out)


def statistics_of(steps: list[dict], step: int) -> float:
    return st.mean(r["loss"] for r in steps if r["step"] == step)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ps", "allreduce"])
def test_bounded_loss_without_loss_trains_singles_model(tmp_path, small_runs, strategy):
    # (loopback loses nothing: every datagram arrives, the sums are exact)
    out = tmp_path / f"lossless-{strategy}"
    psring("run", "--strategy", strategy, "--workers", "2", "--loss-tolerance", "0.05",
           *SMALL, "--out", out, timeout=100)
    assert max_rel_diff(load_model(out), load_model(small_runs["single"])) < 1e-4
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert {r["delivered"] for r in steps} == {1.0}
    assert_no_processes(out)


@needs_emulation
@pytest.mark.timeout(240)
def test_a_transpose_all_reduce_under_loss_keeps_its_bound_and_its_replicas_equal(tmp_path):
    from psring.predict.profile import Profile
    from psring.train.workload import meta_model

    model, _ = meta_model(RunConfig(model="mlp", width=256, depth=2, features=64))  # SMALL
    Profile.on_paper([p.numel() * 4 for p in model.parameters()], 0.01, 0.02, 0.002,
                     batch_size=16, source={"model": "mlp"}).save(tmp_path / "profile")
    out = tmp_path / "lossy-ring"
    psring("run", "--strategy", "allreduce", "--workers", "2", "--hosts", "2", "--link",
           "1gbit", "--loss", "0.03", "--loss-tolerance", "0.02", *SMALL, "--compute",
           "device", "--device-profile", tmp_path / "profile", "--out", out, timeout=200)
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    got = [r["delivered"] for r in steps]
    assert len(got) == 24 and all(0.98 <= d <= 1.0 for d in got) and min(got) < 1.0, got
    # what was lost differs by rank, yet every replica applied the same all-gathered
    # average: the reduced gradients' digests agree, step by step
    by_step: dict[int, list] = {}
    for r in steps:
        by_step.setdefault(r["step"], []).append(r["device_digest"][1])
    assert all(d[0] == pytest.approx(d[1], rel=1e-6) for d in by_step.values())
    assert_cluster_gone(out)
    assert_no_processes(out)
