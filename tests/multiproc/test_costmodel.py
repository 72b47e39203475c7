"""The α-β-γ cost model: formulas against hand-worked numbers, the crossover, the
calibration file, and `python -m psring.commands.calibrate --quick` end to end."""

from __future__ import annotations

import json
import math
import operator
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from psring.commands.calibrate import main as calibrate_main
from psring.errors import ConfigError, PsringError
from psring.predict import analytic, pingpong
from psring.predict import calibration as calib
from psring.predict.analytic import crossover_bytes, predict_comm
from psring.predict.calibration import (
    LOSS_RTT_PER_SEGMENT,
    MSS,
    Calibration,
    tcp_under_loss,
)
from psring.predict.measure import fit, fit_collectives
from psring.predict.pingpong import run_pair
from psring.strategies import STRATEGIES
from tests.helpers import assert_no_processes, live_processes
from tests.multiproc import pair_bodies

# The worked example: n = 4 workers, M = 1e6 bytes, α = 1e-5 s, β = 1e-9 s/B, γ = 2e-10 s/B.
N, M, A, B, G = 4, 1e6, 1e-5, 1e-9, 2e-10


def close(x: float, y: float) -> bool:
    return math.isclose(x, y, rel_tol=1e-12, abs_tol=0.0)


def test_ring_allreduce_by_hand():
    # 2(n-1)α        = 2·3·1e-5          = 6e-5
    # 2(n-1)/n·M·β   = 2·(3/4)·1e6·1e-9  = 1.5e-3
    # (n-1)/n·M·γ    = (3/4)·1e6·2e-10   = 1.5e-4
    # total                              = 1.71e-3
    assert close(analytic.ring_allreduce(N, M, A, B, G), 1.71e-3)
    # n = 2: 2·1e-5 + 1·1e6·1e-9 + (1/2)·1e6·2e-10 = 2e-5 + 1e-3 + 1e-4 = 1.12e-3
    assert close(analytic.ring_allreduce(2, M, A, B, G), 1.12e-3)


def test_ring_with_one_rank_costs_nothing():
    assert analytic.ring_allreduce(1, M, A, B, G) == 0.0


def test_ps_sync_by_hand():
    # K = 1: 2α = 2e-5; 2n·M·β = 2·4·1e6·1e-9 = 8e-3; (n-1)·M·γ = 3·1e6·2e-10 = 6e-4
    #        total 8.62e-3
    assert close(analytic.ps_sync(N, M, 1, A, B, G), 8.62e-3)
    # K = 2 halves the server terms: 2e-5 + 4e-3 + 3e-4 = 4.32e-3
    assert close(analytic.ps_sync(N, M, 2, A, B, G), 4.32e-3)
    # n = 1 still talks to its server: 2e-5 + 2·1e6·1e-9 + 0 = 2.02e-3
    assert close(analytic.ps_sync(1, M, 1, A, B, G), 2.02e-3)


def test_byteps_by_hand():
    # 2 hosts of G = 4 (n = 8), K = 2 servers on hosts of their own, β_link = 8e-9:
    # inside: 2·3·α + 2·(3/4)·M·β + (3/4)·M·γ = 6e-5 + 1.5e-3 + 1.5e-4 = 1.71e-3
    # each host pushes M once (cross = 1: M/2 to each of 2 servers on other hosts);
    # phase = max(1·M·8e-9, 2·M·β/2) = 8e-3; 2α + 2·phase + (2-1)·M·γ/2 = 1.601e-2 + 1e-4
    inside = analytic.host_reduce(4, M, (A, B + G), (A, B))
    assert close(inside, 1.71e-3)
    t = analytic.byteps_sync(2, M, 2, A, 8e-9, B, G, 1.0, inside)
    assert close(t, 1.71e-3 + 2e-5 + 1.6e-2 + 1e-4)
    # one worker a host: nothing inside, it is ps_sync_placed with n = hosts
    assert analytic.host_reduce(1, M, (A, B + G), (A, B)) == 0.0
    assert close(analytic.byteps_sync(2, M, 2, A, 8e-9, B, G, 1.0, 0.0),
                 analytic.ps_sync_placed(2, M, 2, A, 8e-9, B, G, 1.0))
    # through predict_comm, on that cluster: the same formula with the cluster's cross
    from psring.cluster.spec import Cluster
    cal = Calibration(zmq_alpha=A, zmq_beta=B, dist_alpha=A, dist_beta=B, gamma=G,
                      links={"1gbit": {"zmq_alpha": A, "zmq_beta": 8e-9, "dist_alpha": A,
                                       "dist_beta": 8e-9}})
    topo = Cluster.of(hosts=2, workers_per_host=4, link_bits=1e9, servers=2,
                      placement="own-hosts")
    assert close(predict_comm("byteps", 8, 2, M, cal, topo), t)
    assert predict_comm("byteps", 8, 2, M, cal, topo) < predict_comm("ps", 8, 2, M, cal, topo)


def test_ps_async_by_hand():
    # K = 1: 2e-5 + 8e-3 + M·γ (its own push applied) 2e-4 = 8.22e-3
    assert close(analytic.ps_async(N, M, 1, A, B, G), 8.22e-3)
    # K = 2: 2e-5 + 4e-3 + 1e-4 = 4.12e-3
    assert close(analytic.ps_async(N, M, 2, A, B, G), 4.12e-3)
    # n = 1: 2e-5 + 2·1e6·1e-9 + 1e6·2e-10 = 2.22e-3 (its push is still applied)
    assert close(analytic.ps_async(1, M, 1, A, B, G), 2.22e-3)


@pytest.mark.parametrize("formula", [analytic.ps_sync, analytic.ps_async])
@pytest.mark.parametrize("K", [2, 3, 4])
def test_shards_divide_the_server_terms(formula, K):
    one = formula(N, M, 1, A, B, G) - 2 * A
    assert math.isclose(formula(N, M, K, A, B, G) - 2 * A, one / K, rel_tol=1e-12)


def cal(**over) -> Calibration:
    values = dict(zmq_alpha=1e-5, zmq_beta=1e-9, dist_alpha=1e-4, dist_beta=1e-9,
                  gamma=2e-10)
    return Calibration(**{**values, **over})


def test_a_time_scaled_runs_clock_divides_this_machines_costs():
    c = cal(cast=4e-11, links={"1gbit": {"zmq_alpha": 1e-4, "zmq_beta": 8e-9,
                                         "dist_alpha": 1e-4, "dist_beta": 8e-9}})
    assert c.faster(1) is c
    f = c.faster(20)
    assert (f.zmq_alpha, f.zmq_beta, f.dist_alpha, f.dist_beta, f.gamma, f.cast) == \
        pytest.approx((5e-7, 5e-11, 5e-6, 5e-11, 1e-11, 2e-12))
    # the links are priced at the described rate: 20 Gbit/s's payload, no longer
    # loopback's slower β as at time scale 1
    assert f.links == {}
    assert f.between_hosts("ring", 20e9)[1] < c.between_hosts("ring", 20e9)[1]


def test_gloo_collectives_are_priced_as_measured_where_measured():
    # without fitted collectives a ring step is the send/recv ping-pong's, plus γ where
    # it adds: the ring formula exactly
    c = cal(dist_beta=2e-9)
    assert c.gloo_step("all_reduce") == (1e-4, 2e-9 + 1e-10)
    assert c.gloo_step("reduce_scatter") == (1e-4, 2e-9 + 2e-10)
    assert c.gloo_step("all_gather") == (1e-4, 2e-9)
    # fitted (psring calibrate measures gloo's own collectives): those, sums included
    f = replace(c, collectives={"all_reduce": [3e-4, 6e-9], "reduce_scatter": [2e-4, 9e-9],
                                "all_gather": [1e-4, 5e-9]})
    assert f.gloo_step("reduce_scatter") == (2e-4, 9e-9)
    assert predict_comm("ring", N, 1, M, f) == \
        pytest.approx(analytic.ring_allreduce(N, M, 3e-4, 6e-9, 0.0))
    assert predict_comm("ring", N, 1, M, f) > 2 * predict_comm("ring", N, 1, M, c)
    # hallreduce on one host of 4: a reduce-scatter and an all-gather of M/4 chunks
    assert predict_comm("hring", 4, 1, M, f) == \
        pytest.approx(3 * (2e-4 + M / 4 * 9e-9) + 3 * (1e-4 + M / 4 * 5e-9))
    # time-scaled runs see them 1/S as long, as every software cost
    assert f.faster(10).gloo_step("all_gather") == pytest.approx((1e-5, 5e-10))
    with pytest.raises(ValueError, match="collectives"):
        replace(c, collectives={"broadcast": [1e-4, 1e-9]})
    with pytest.raises(ValueError, match="alpha"):
        replace(c, collectives={"all_reduce": [-1.0, 1e-9]})
    with pytest.raises(ValueError, match="op 'gather'"):
        c.gloo_step("gather")


def test_predict_comm_picks_the_transport():
    c = cal(dist_beta=2e-9)
    assert predict_comm("ring", N, 1, M, c) == \
        pytest.approx(analytic.ring_allreduce(N, M, 1e-4, 2e-9, 2e-10))
    assert predict_comm("ps", N, 2, M, c) == analytic.ps_sync(N, M, 2, 1e-5, 1e-9, 2e-10)
    assert predict_comm("ps-async", N, 2, M, c) == analytic.ps_async(N, M, 2, 1e-5, 1e-9, 2e-10)
    assert predict_comm(None, N, 1, M, c) is None
    with pytest.raises(ValueError, match="unknown cost model 'tree'"):
        predict_comm("tree", N, 1, M, c)


def test_strategies_name_their_model():
    expect = {"single": None, "hogwild": None, "allreduce": "ring", "ddp": "ring",
              "ps": "ps", "async-ps": "ps-async"}
    for name, model in expect.items():
        assert STRATEGIES.get(name).caps.cost_model == model, name
    for name in STRATEGIES.names():
        assert STRATEGIES.get(name).caps.cost_model in analytic.FORMULAS, name
    # every built-in formula's messages take a transport the calibration measured
    assert set(analytic.FORMULAS[1:]) == set(calib.TRANSPORT)


def test_crossover_by_hand():
    # n = 2, K = 1, dist_alpha = 1e-4, zmq_alpha = 1e-5, both β = 1e-9, γ = 2e-10:
    # ring: 2·1·1e-4 = 2e-4 fixed; 2·(1/2)·1e-9 + (1/2)·2e-10 = 1.1e-9 per byte
    # ps:   2·1e-5   = 2e-5 fixed; 2·2·1e-9   + 1·2e-10       = 4.2e-9 per byte
    # equal at M = (2e-4 - 2e-5) / (4.2e-9 - 1.1e-9) = 1.8e-4 / 3.1e-9 = 58064.516... bytes
    c = cal()
    m = crossover_bytes("ring", "ps", 2, 1, c)
    assert m is not None and math.isclose(m, 1.8e-4 / 3.1e-9, rel_tol=1e-9)
    assert math.isclose(predict_comm("ring", 2, 1, m, c), predict_comm("ps", 2, 1, m, c),
                        rel_tol=1e-9)
    assert math.isclose(crossover_bytes("ps", "ring", 2, 1, c), m, rel_tol=1e-12)
    # below it ps (smaller fixed cost) wins, above it ring (smaller per-byte cost)
    assert predict_comm("ps", 2, 1, m / 2, c) < predict_comm("ring", 2, 1, m / 2, c)
    assert predict_comm("ring", 2, 1, m * 2, c) < predict_comm("ps", 2, 1, m * 2, c)


def test_crossover_none_when_lines_do_not_meet_at_positive_size():
    # ring cheaper in both fixed cost (2e-6 < 2e-5) and per byte: they meet at M < 0
    assert crossover_bytes("ring", "ps", 2, 1, cal(dist_alpha=1e-6)) is None
    # n = 2: sync sums (n-1) = 1 gradient, async applies its 1 push: the same line
    assert crossover_bytes("ps", "ps-async", 2, 1, cal()) is None
    assert crossover_bytes("ring", "ring", 4, 1, cal()) is None
    # a strategy without messages has no line to cross
    assert crossover_bytes("ring", None, 2, 1, cal()) is None


def test_crossover_with_shards():
    # ps with K = 4, n = 2: fixed 2e-5, per byte (4e-9 + 2e-10)/4 = 1.05e-9 < ring's 1.1e-9
    # and a smaller fixed cost: ps is cheaper everywhere, no crossover
    assert crossover_bytes("ring", "ps", 2, 4, cal()) is None
    # with a slower ZeroMQ link they cross: zmq_beta = 2e-9 gives ps (8e-9 + 2e-10)/4 =
    # 2.05e-9 per byte; M = (2e-4 - 2e-5) / (2.05e-9 - 1.1e-9) = 1.8e-4 / 9.5e-10
    m = crossover_bytes("ring", "ps", 2, 4, cal(zmq_beta=2e-9))
    assert m is not None and math.isclose(m, 1.8e-4 / 9.5e-10, rel_tol=1e-9)


# -- the calibration file ------------------------------------------------------------------

def test_save_load_round_trip(tmp_path):
    c = cal(host="h", time="t", cores=2, versions={"torch": "x"}, sizes=[1024, 2048],
            gamma_bytes=64, quick=True, measurements={"zmq": [[1024, 1e-5]]})
    path = c.save(tmp_path / "sub" / "cal.json")
    assert path.exists() and not list(path.parent.glob(".*.tmp"))
    assert Calibration.load(path) == c
    assert json.loads(path.read_text())["format"] == calib.FORMAT


@pytest.mark.parametrize("content,why", [
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    (None, "zmq_beta is -1"),
    ("nan", "not a positive finite number"),
    ("true", "not a number"),
    ("missing", "lacks zmq_beta"),
    ("format", "format 99"),
])
def test_load_refuses_bad_files(tmp_path, content, why):
    path = tmp_path / "calibration.json"
    good = cal().to_dict()
    if content is None:
        good["zmq_beta"] = -1
        content = json.dumps(good)
    elif content == "nan":
        good["gamma"] = float("nan")
        content = json.dumps(good)
    elif content == "true":
        good["dist_alpha"] = True
        content = json.dumps(good)
    elif content == "missing":
        del good["zmq_beta"]
        content = json.dumps(good)
    elif content == "format":
        good["format"] = 99
        content = json.dumps(good)
    path.write_text(content)
    with pytest.raises(ConfigError) as e:
        Calibration.load(path)
    msg = str(e.value)
    assert str(path) in msg and "psring calibrate" in msg and why in msg


def test_load_missing_file_says_how_to_make_one(tmp_path):
    with pytest.raises(ConfigError, match="no calibration file.*psring calibrate"):
        Calibration.load(tmp_path / "nope.json")


def test_calibration_refuses_nonpositive_values():
    with pytest.raises(ValueError, match="gamma"):
        cal(gamma=0.0)


def test_default_path_and_find(tmp_path, monkeypatch):
    monkeypatch.setenv("PSRING_CALIBRATION", str(tmp_path / "machine.json"))
    assert calib.default_path() == tmp_path / "machine.json"
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    run_a.mkdir()
    run_b.mkdir()
    assert calib.find_calibration(run_a, run_b) is None
    cal().save(tmp_path / "machine.json")
    assert calib.find_calibration(run_a, run_b) == tmp_path / "machine.json"
    cal().save(run_b / "calibration.json")
    assert calib.find_calibration(run_a, run_b) == run_b / "calibration.json"
    monkeypatch.delenv("PSRING_CALIBRATION")
    assert calib.default_path() == Path.home() / ".cache" / "psring" / "calibration.json"


# -- the fit ---------------------------------------------------------------------------------

def test_fit_recovers_a_line():
    sizes = [2**k for k in range(10, 25, 2)]
    alpha, beta = fit([[m, 1e-5 + m * 1e-10] for m in sizes])
    # α is the smallest message's time (it includes that message's M·β) ...
    assert math.isclose(alpha, 1e-5 + 1024 * 1e-10, rel_tol=1e-12)
    # ... and β the slope through it: off by about M_min / M_max
    assert math.isclose(beta, 1e-10, rel_tol=1e-3)


def test_collectives_are_fitted_per_ring_step():
    # on 2 ranks an all-reduce is 2 steps on halves, a reduce-scatter or an all-gather 1
    sizes = [2**k for k in range(10, 25, 2)]
    timed = {"dist_allreduce": [[m, 2 * (2e-4 + m / 2 * 7e-10)] for m in sizes],
             "dist_reduce_scatter": [[m, 4e-4 + m / 2 * 2e-9] for m in sizes],
             "dist_all_gather": [[m, 3e-4] for m in sizes]}  # (flat: no line to fit)
    got = fit_collectives(timed)
    assert set(got) == {"all_reduce", "reduce_scatter"}  # all_gather: from the ping-pong
    assert got["all_reduce"] == pytest.approx([2e-4, 7e-10], rel=1e-2)
    assert got["reduce_scatter"] == pytest.approx([4e-4, 2e-9], rel=1e-2)
    assert fit_collectives({}) == {}


def test_fit_refuses_times_that_do_not_grow():
    with pytest.raises(PsringError, match="do not grow"):
        fit([[1024, 1e-3], [4096, 1e-4], [16384, 1e-4]])


# -- the measuring processes ------------------------------------------------------------------

def _spawned_children() -> list[int]:
    """Live multiprocessing children of this process."""
    return [pid for pid, stat, cmd in live_processes()
            if int(stat[1]) == os.getpid() and "spawn_main" in cmd]


@pytest.mark.timeout(60)
def test_run_pair_kills_overrunning_processes():
    t0 = time.monotonic()
    with pytest.raises(PsringError, match="made no progress for 3 s"):
        run_pair(pair_bodies.hang, (), 3.0, "test")
    assert time.monotonic() - t0 < 30
    assert _spawned_children() == []


@pytest.mark.timeout(120)
def test_run_pair_gives_a_pair_that_makes_progress_more_time_not_a_stalled_one(monkeypatch):
    # a loaded machine slows every round trip of a ladder: progress keeps a pair alive
    # past one deadline (4 s), up to PAIR_DEADLINES of them (3 here: 12 s). Three pairs
    # at once: one finishing at 6 s, one stalling at 2 s, one never done
    monkeypatch.setattr(pingpong, "PAIR_DEADLINES", 3)

    def pair(seconds: float, stall_after: float | None) -> Any:
        try:
            return run_pair(pair_bodies.slow_but_moving, (seconds, stall_after), 4.0, "test")
        except PsringError as e:
            return str(e)

    with ThreadPoolExecutor(3) as pool:
        done, stalled, endless = pool.map(lambda a: pair(*a),
                                          [(6.0, None), (60.0, 2.0), (60.0, None)])
    assert done == ["done", "done"]
    assert "made no progress for 4 s" in stalled, stalled
    assert "did not finish within 12 s, though it kept making progress" in endless, endless
    assert _spawned_children() == []


@pytest.mark.timeout(60)
def test_run_pair_reports_a_failing_process():
    with pytest.raises(PsringError, match="ZeroDivisionError"):
        run_pair(operator.truediv, (0,), 30.0, "test")
    assert _spawned_children() == []


def test_out_must_not_be_a_directory(tmp_path, capsys):
    assert calibrate_main(["--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def _in_session(sid: int) -> list[tuple[int, str]]:
    # (the fields after the command's name: state ppid pgrp session)
    return [(pid, cmd) for pid, stat, cmd in live_processes() if int(stat[3]) == sid]


@pytest.mark.timeout(90)
def test_calibrate_quick_end_to_end(tmp_path):
    out = tmp_path / "cal.json"
    # its own session: every process it starts is found by session id afterwards
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "psring.commands.calibrate", "--quick",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, stdout + stderr
    assert time.monotonic() - t0 < 40  # ~20 s budget on 2 cores, with slack for load
    assert f"saved to {out}" in stdout and "µs" in stdout and "GB/s" in stdout
    c = Calibration.load(out)  # validates: positive, finite
    for name in ("zmq_alpha", "zmq_beta", "dist_alpha", "dist_beta", "gamma"):
        v = getattr(c, name)
        assert math.isfinite(v) and v > 0, name
    assert c.quick and c.cores and c.sizes and c.versions["torch"]
    assert len(c.measurements["zmq"]) == len(c.sizes) == len(c.measurements["dist"])
    # psring's own PS round (its server among this session's processes, reaped below)
    assert "PS round" in stdout
    (m1, t1), (m2, t2) = c.measurements["ps_round"]
    assert m1 < m2 and 0 < t1 < t2, c.measurements["ps_round"]
    assert c.ps_round[0] > 0 and c.ps_round[1] > 0
    assert_no_processes(tmp_path)
    deadline = time.monotonic() + 10
    while _in_session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _in_session(proc.pid) == []


# -- emulated clusters: traffic between hosts at the link's β, inside a host loopback's --

def test_ps_link_load_by_hand():
    # 2 workers on hosts 0, 1; one server on host 0: only worker 1's push crosses
    assert analytic.ps_link_load([0, 1], [0]) == 1.0
    # 4 workers on 4 hosts, K servers on hosts of their own: each server's host receives
    # 4 · M/K; each worker's host sends M
    assert analytic.ps_link_load([0, 1, 2, 3], [4]) == 4.0
    assert analytic.ps_link_load([0, 1, 2, 3], [4, 5]) == 2.0
    assert analytic.ps_link_load([0, 1, 2, 3], [4, 5, 6, 7]) == 1.0
    # colocated K = 4 on the 4 worker hosts: 3 remote workers' quarters in, 3 quarters out
    assert analytic.ps_link_load([0, 1, 2, 3], [0, 1, 2, 3]) == 0.75
    # everything on one host: no link
    assert analytic.ps_link_load([0, 0], [0]) == 0.0


def test_links_cost_their_rate_unless_calibrated():
    from psring.units import payload_beta

    c = cal()
    # on paper: loopback's α plus two link delays, the rate's payload β
    a, b, src = c.between_hosts("ps", 1e9, delay_s=1e-3)
    assert (a, b, src) == (1e-5 + 2e-3, payload_beta(1e9), "nominal rate")
    # a calibrated rate wins; β never below loopback's (10 Gbit/s is faster than it here)
    c = cal(links={"1gbit": {"zmq_alpha": 5e-5, "zmq_beta": 9e-9, "dist_alpha": 6e-5,
                             "dist_beta": 8.5e-9}})
    assert c.between_hosts("ring", 1e9) == (6e-5, 8.5e-9, "calibrated 1gbit")
    assert c.between_hosts("ps", 1e11)[1] == 1e-9
    assert c.between_hosts("ps", None) == (1e-5, 1e-9, "loopback")
    # a delay: a calibration measured with it is taken as it is; one without gets the
    # two links' delay added to its α
    both = cal(links={"1gbit": {"zmq_alpha": 5e-5, "zmq_beta": 9e-9, "dist_alpha": 6e-5,
                                "dist_beta": 8.5e-9},
                      "1gbit+1000us": {"zmq_alpha": 2.1e-3, "zmq_beta": 9e-9,
                                       "dist_alpha": 2.2e-3, "dist_beta": 8.5e-9}})
    assert both.between_hosts("ps", 1e9, 1e-3)[:2] == (2.1e-3, 9e-9)
    assert both.between_hosts("ps", 1e9, 2e-3)[0] == pytest.approx(5e-5 + 4e-3)
    with pytest.raises(ValueError, match="links"):
        cal(links={"1gbit": {"zmq_alpha": 1e-5}})


def test_loss_on_the_links_prices_tcps_recovery():
    c = cal()
    clean = c.between_hosts("ps", 1e8, delay_s=1e-3)
    assert c.between_hosts("ps", 1e8, 1e-3, loss=0.0) == clean
    a1, b1, src = c.between_hosts("ps", 1e8, 1e-3, loss=0.01)
    a5, b5, _ = c.between_hosts("ps", 1e8, 1e-3, loss=0.05)
    assert clean[1] < b1 < b5 and a1 == a5 == clean[0] and "TCP under 0.01 loss" in src
    # each segment lost on either of two directions costs a share of a round trip (2α)
    p = 1 - 0.95 ** 2
    assert b5 == pytest.approx(clean[1] + p * LOSS_RTT_PER_SEGMENT * 2 * clean[0] / MSS)
    assert tcp_under_loss(1e-3, 1e-9, 0.0) == (1e-3, 1e-9)


def test_predictions_on_an_emulated_cluster_by_hand():
    from psring.cluster.spec import Cluster
    from psring.units import payload_beta

    c = cal()
    bl = payload_beta(1e8)  # 100 Mbit/s
    # ring across 2 hosts: the ring formula at the link's α and β
    topo = Cluster(workers=2, hosts=2, link="100mbit")
    assert predict_comm("ring", 2, 1, M, c, topo) == analytic.ring_allreduce(2, M, 1e-4, bl, 2e-10)
    # the same ring on one host: loopback
    assert predict_comm("ring", 2, 1, M, c, Cluster(workers=2)) == \
        analytic.ring_allreduce(2, M, 1e-4, 1e-9, 2e-10)
    # ps, 4 workers on 4 hosts, 2 servers of their own: push then pull, 2M each over a
    # server's link: 2α + 2·(2·M·β_link) + 3·M·γ/2
    topo = Cluster(workers=4, hosts=4, servers=2, placement="own-hosts", link="100mbit")
    expect = 2 * 1e-5 + 2 * (2 * M * bl) + 3 * M * 2e-10 / 2
    assert math.isclose(predict_comm("ps", 4, 2, M, c, topo), expect, rel_tol=1e-12)
    # K = 2 on own hosts moves half of K = 1's link time
    one = topo.replace(servers=1)
    t1 = predict_comm("ps", 4, 1, M, c, one) - 2e-5 - 3 * M * 2e-10
    t2 = predict_comm("ps", 4, 2, M, c, topo) - 2e-5 - 3 * M * 2e-10 / 2
    assert math.isclose(t2 / t1, 0.5, rel_tol=1e-12)
    # one host: the one-host formula, whatever the link
    assert predict_comm("ps", 2, 1, M, c, Cluster(workers=2, servers=1)) == \
        analytic.ps_sync(2, M, 1, 1e-5, 1e-9, 2e-10)


def test_the_cluster_of_a_run_config():
    from psring.config import RunConfig, cluster_of

    topo = cluster_of(RunConfig(strategy="ps", workers=4, hosts=4, servers=2,
                                server_placement="own-hosts", link="1gbit"))
    assert (topo.worker_host, topo.server_host, topo.link_bits, topo.delay_s) == \
        ((0, 1, 2, 3), (4, 5), 1e9, 0.0)
    # a manifest's config from before emulated clusters: one host, no servers for allreduce
    old = cluster_of({"strategy": "allreduce", "workers": 2, "servers": 1})
    assert (old.worker_host, old.server_host, old.link_bits, old.multi_host) == \
        ((0, 0), (), None, False)
