"""The scaling question (psring.predict.scaling) and its lemmas
(psring.predict.analytic): the closed forms held against the simulator, the fluid
parameter-server round against its events, and the ladder, the flags and the batch."""

import statistics

import numpy as np
import pytest

from psring.cluster.spec import Cluster
from psring.errors import ConfigError
from psring.predict import scaling
from psring.predict.analytic import (
    hidden_window,
    ps_knee,
    ring_allreduce,
    ring_knee,
    server_side,
    servers_needed,
)
from psring.predict.calibration import Calibration
from psring.predict.scaling import (
    EVENTS_DRAWS,
    EVENTS_UP_TO,
    at_batch,
    batch_for,
    check_scaling,
    cluster_at,
    scale,
    worker_counts,
)
from psring.predict.sim.fluid import fair_share
from psring.predict.sim.simulate import simulate
from psring.records.profile import Profile
from psring.strategies import STRATEGIES

#: GPU-like software costs on paper: the links, not the transport, are what scale
CAL = Calibration(zmq_alpha=2e-5, zmq_beta=1e-10, dist_alpha=2e-5, dist_beta=1e-10,
                  gamma=1e-11, host="on paper")
#: 100 MB of gradients in 100 equal parameters, ready evenly through a 150 ms backward
PROF = Profile.on_paper([1_000_000] * 100, forward_s=0.05, backward_s=0.15, update_s=0.0,
                        batch_size=32, source={"model": "paper"})
MB5 = PROF.buckets(5.0)
W = hidden_window(PROF.backward_s, MB5[0][1])


def exposed(n: int, model: str, **cluster) -> float:
    p = simulate(PROF, Cluster.of(**cluster), model, CAL, bucket_mb=5.0, flow_spread=0)
    return p.phases["comm_s"]


def test_the_ring_hides_below_its_knee_and_adds_the_excess_above_it():
    a, beta, _ = CAL.between_hosts("ring", 10e9)
    M = PROF.total_bytes
    knee = ring_knee(M, a, beta, CAL.gamma, W, collectives=len(MB5))
    assert 4 < knee < 8  # (the setting is chosen so that the knee falls inside the sizes)

    def parts(n):
        comm = sum(ring_allreduce(n, m, a, beta, CAL.gamma) for m, _ in MB5)
        return comm, ring_allreduce(n, MB5[-1][0], a, beta, CAL.gamma)

    for n in (2, 3):  # well below: about the last bucket's all-reduce follows backward
        comm, last = parts(n)
        assert comm < W
        assert exposed(n, "ring", hosts=n, link_bits=10e9) <= 1.25 * last
    for n in (12, 16, 32):  # above: the excess over the window, and the last bucket
        comm, last = parts(n)
        got = exposed(n, "ring", hosts=n, link_bits=10e9)
        assert got > 2 * last
        assert got == pytest.approx(comm - W + last, rel=0.3)


def test_a_ps_hides_its_pushes_below_its_knee_whatever_the_servers():
    _, b_link, _ = CAL.between_hosts("ps", 40e9)
    x = server_side(b_link, CAL.zmq_beta, CAL.gamma)
    M, K = PROF.total_bytes, 2
    knee = ps_knee(M, 1, b_link, x, W)
    assert 5 < knee < 8
    for n in (2, 3, 4, 12, 16):
        pull = n * M * x / K  # (follows backward at every size)
        extra = exposed(n, "ps", hosts=n, link_bits=40e9, servers=K,
                        placement="own-hosts") - pull
        if n < knee:
            assert extra <= 2e-3, n
        else:
            assert extra == pytest.approx((n * M * x - W) / K, rel=0.25), n


@pytest.mark.parametrize("fluid", [False, True])
def test_servers_beyond_k_star_buy_nothing(fluid):
    _, b_link, _ = CAL.between_hosts("ps", 10e9)
    k_star = servers_needed(8, 2, b_link, server_side(b_link, CAL.zmq_beta, CAL.gamma))
    assert k_star == pytest.approx(4)  # H: the link is the slowest of a server's parts

    def step(k):
        cl = Cluster.of(hosts=4, workers_per_host=2, link_bits=10e9, servers=k,
                        placement="own-hosts")
        return simulate(PROF, cl, "ps", CAL, bucket_mb=5.0, flow_spread=0,
                        fluid=fluid).step_s

    below, at2, at4 = step(2), step(8), step(16)
    assert below > 1.3 * at2  # server-bound
    assert at4 >= 0.97 * at2  # the workers' links bound it: more servers, same step


def _pairs():
    out = []
    for model in ("ps", "byteps", "ps-async"):
        for hosts, per, k, place, link in [(1, 4, 2, "colocated", None),
                                           (2, 2, 2, "own-hosts", 10e9),
                                           (4, 2, 2, "colocated", 25e9),
                                           (4, 4, 4, "own-hosts", 100e9),
                                           (8, 2, 1, "own-hosts", 10e9)]:
            out.append((model, Cluster.of(hosts=hosts, workers_per_host=per, link_bits=link,
                                          servers=k, placement=place)))
    return out


def test_the_fluid_round_agrees_with_its_events():
    """The fluid is the events with evenly shared links: for the synchronous rounds the
    same step to a few percent; asynchronous workers drift apart in the events, which
    the fluid (every worker in step) does not play."""
    errors: dict[str, list[float]] = {}
    for model, cl in _pairs():
        ev = simulate(PROF, cl, model, CAL, bucket_mb=25.0, flow_spread=0).step_s
        fl = simulate(PROF, cl, model, CAL, bucket_mb=25.0, fluid=True).step_s
        errors.setdefault(model, []).append(abs(fl / ev - 1))
    assert statistics.median(errors["ps"]) <= 0.10, errors
    assert max(errors["ps"]) <= 0.16, errors
    # (byteps's partitions are pulled back while later ones are pushed: the fluid serves
    # its jobs in the order they become ready, as the links do)
    assert max(errors["byteps"]) <= 0.02, errors
    assert max(errors["ps-async"]) <= 0.30, errors


def test_the_fluid_shares_a_senders_link_among_its_servers_as_the_events_do():
    """Servers on hosts of their own, 1 MB buckets queued within a short backward: the
    senders' links carry every server's bytes at once (TCP's flows share them), so the
    shards complete together and the pulls follow the pushes. Served first come, first
    served, the fluid let the first shards' pulls overlap the later pushes: 22% under
    its events here."""
    light = Profile.on_paper([1_000_000] * 10, forward_s=0.005, backward_s=0.015,
                             update_s=0.0, batch_size=32)
    for hosts, servers in ((4, 8), (8, 16)):
        cl = Cluster.of(hosts=hosts, workers_per_host=2, link_bits=1e9, servers=servers,
                        placement="own-hosts")
        for model in ("ps", "ps-async"):
            ev = simulate(light, cl, model, CAL, bucket_mb=1.0, flow_spread=0).step_s
            fl = simulate(light, cl, model, CAL, bucket_mb=1.0, fluid=True).step_s
            assert fl == pytest.approx(ev, rel=0.04), (hosts, model)


def test_fair_share_worked_by_hand():
    # two connections at once: each at half the link, both done at 2 s (first come,
    # first served: 1 and 2); one later: alone, then halves; one connection: in order
    assert list(fair_share([0.0, 0.0], np.array([[1.0, 0], [0, 1.0]]))) == [2.0, 2.0]
    assert list(fair_share([0.0, 0.5], np.array([[1.0, 0], [0, 1.0]]))) == [1.5, 2.0]
    assert list(fair_share([0.0, 0.0], np.array([[1.0, 0], [1.0, 0]]))) == [1.0, 2.0]
    assert list(fair_share([0.0, 3.0], np.array([[1.0, 0], [0, 1.0]]))) == [1.0, 4.0]
    assert list(fair_share([0.0] * 3, np.array([[1.0, 1.0], [0, 1.0], [2.0, 0]]))) \
        == [2.0, 4.0, 5.0]


def test_the_fluid_prices_a_thousand_workers_as_it_prices_sixty_four():
    """A server host per worker host: each host link carries the same bytes at any size,
    so 1024 workers step as 64 do (the fluid's symmetry; its speed is advise's figure,
    docs/prediction.md, not a test's)."""

    def step(hosts):
        cl = Cluster.of(hosts=hosts, workers_per_host=8, link_bits=25e9, servers=hosts,
                        placement="own-hosts")
        return simulate(PROF, cl, "ps", CAL, bucket_mb=5.0, fluid=True)

    p, small = step(128), step(8)
    assert p.step_s == pytest.approx(small.step_s, rel=0.05)
    # 8 workers a host push 8 M through each host link out, and pull it back
    assert "link" in p.bound and "link" in small.bound
    assert p.step_s > 2 * 8 * PROF.total_bytes * CAL.between_hosts("ps", 25e9)[1]


def test_worker_counts_and_the_clusters_they_make():
    assert worker_counts(1) == [1]
    assert worker_counts(24) == [1, 2, 4, 8, 16, 24]
    assert worker_counts(1024)[-1] == 1024 and len(worker_counts(1024)) == 11
    cl = cluster_at(4, 8, 25e9)
    assert (cl.hosts, cl.workers) == (1, 4)  # fewer than a host: one host holds them
    cl = cluster_at(64, 8, 25e9)
    assert (cl.hosts, cl.workers) == (8, 64)


@pytest.mark.parametrize("args,words", [
    ((0, 0.8, 1), "--max-workers 0"), ((70000, 0.8, 1), "65536"),
    ((8, 0.0, 1), "--target-efficiency"), ((8, 1.5, 1), "(0, 1]"),
    ((16, 0.8, 3), "--workers-per-host 3"), ((24, 0.8, 16), "24"),
])
def test_bad_scaling_flags_name_the_fix(args, words):
    with pytest.raises(ConfigError, match=None) as e:
        check_scaling(*args)
    assert words in str(e.value)


def test_scale_answers_for_every_strategy_and_keeps_the_target(monkeypatch):
    # (small clusters' events are their own test's: the fluid everywhere keeps this quick)
    monkeypatch.setattr(scaling, "EVENTS_UP_TO", 0)
    classes = {name: STRATEGIES.get(name) for name in STRATEGIES}
    curves = scale(PROF, CAL, classes, 64, per_host=4, link_bits=10e9)
    assert {"allreduce", "ps", "byteps", "hallreduce", "async-ps"} <= set(curves)
    assert [p.workers for p in curves["single"].points] == [1]
    assert [p.workers for p in curves["hogwild"].points] == [1, 2, 4]  # one host
    ring = curves["allreduce"]
    assert [p.workers for p in ring.points] == worker_counts(64)
    # a ring's efficiency falls with the workers once its bytes outgrow backward
    eff = [p.efficiency for p in ring.points]
    assert eff[0] == 1.0 and eff[-1] < eff[1]
    rec = ring.recommended(0.8)
    assert ring.at(rec).efficiency >= 0.8
    bigger = [p for p in ring.points if p.workers > rec]
    assert all(p.efficiency < 0.8 for p in bigger)
    ps = curves["ps"].points[-1]
    assert ps.servers >= 1 and ps.placement in ("colocated", "own-hosts")
    # fp16 halves the bytes: where the ring's bytes bound the step, it is an option
    # beside the uncompressed answer, never the answer
    big = ring.points[-1]
    assert big.compressed_step_s is not None and big.compressed_step_s < big.step_s
    assert "fp16" not in big.setting
    assert "compressed_step_s" in big.to_dict()
    assert curves["hogwild"].points[-1].compressed_step_s is None  # (nothing to send)


def test_small_clusters_price_the_servers_by_their_events_large_ones_by_the_fluid():
    # the fluid leaves out TCP's uneven shares; where the events are affordable the
    # fluid's best setting of each placement is priced by them (the mean of draws) and
    # the faster kept; beyond, the fluid's stays
    light = Profile.on_paper([1_000_000] * 10, forward_s=0.005, backward_s=0.015,
                             update_s=0.0, batch_size=32)
    classes = {"ps": STRATEGIES.get("ps")}
    curves = scale(light, CAL, classes, 18, per_host=2, link_bits=1e9, sizes=[8, 18])
    kinds = []
    for point in curves["ps"].points:
        c = point.candidate
        events = simulate(light, c.cluster, "ps", CAL, bucket_mb=c.bucket_mb,
                          draws=EVENTS_DRAWS).step_s
        fluid = simulate(light, c.cluster, "ps", CAL, bucket_mb=c.bucket_mb,
                         fluid=True).step_s
        assert events != pytest.approx(fluid, rel=0.01)  # (they differ: which is which?)
        by_fluid = scaling.by_fluid(light, c.cluster, c.bucket_mb)
        kinds.append(by_fluid)
        assert point.step_s == pytest.approx(fluid if by_fluid else events, rel=1e-9)
    assert kinds == [False, True]
    assert 18 > EVENTS_UP_TO


def test_the_events_choose_between_the_fluids_best_of_each_placement():
    """At 16 workers, 2 a host, 1 Gbit/s, the fluid puts a server on each worker host
    (it leaves out TCP's uneven shares, which cost colocated servers, carrying replies
    beside pushes, tens of per cent); the events price its best of each placement and
    keep the faster, servers on hosts of their own, as device-mode runs measure."""
    light = Profile.on_paper([2_500_000] * 4, forward_s=0.005, backward_s=0.015,
                             update_s=0.0, batch_size=32)
    ps = STRATEGIES.get("ps")
    point = scale(light, CAL, {"ps": ps}, 16, per_host=2, link_bits=1e9,
                  sizes=[16])["ps"].points[0]
    assert point.placement == "own-hosts"
    colocated = Cluster.of(hosts=8, workers_per_host=2, link_bits=1e9, servers=16)
    assert simulate(light, colocated, "ps", CAL, bucket_mb=1.0, fluid=True).step_s \
        < point.step_s  # (the fluid alone would have picked it)
    assert simulate(light, colocated, "ps", CAL, bucket_mb=1.0,
                    draws=EVENTS_DRAWS).step_s > point.step_s


def test_the_guidelines_batch_is_the_smallest_that_keeps_the_target():
    classes = {"allreduce": STRATEGIES.get("allreduce")}
    ring = scale(PROF, CAL, classes, 32, per_host=1, link_bits=1e9)["allreduce"]
    last = ring.points[-1]
    assert last.efficiency < 0.8
    found = batch_for(PROF, CAL, classes["allreduce"], last, 0.8)
    assert found is not None
    batch, eff = found
    assert batch > PROF.batch_size and eff >= 0.8
    half = at_batch(PROF, batch // 2)  # the next smaller batch tried falls short
    p = simulate(half, Cluster.of(hosts=32, link_bits=1e9), "ring", CAL,
                 bucket_mb=last.bucket_mb)
    assert p.efficiency < 0.8
    assert at_batch(PROF, 64).backward_s == pytest.approx(2 * PROF.backward_s)
    assert at_batch(PROF, 64).update_s == PROF.update_s


def test_the_check_runs_each_cost_model_once_and_prices_on_the_runs_clock(monkeypatch):
    """--verify with --max-workers (psring.commands.scaling.check): one strategy per cost
    model at every size from 2 to 16, none that device mode cannot emulate (hogwild),
    each priced again at the --time-scale its run took."""
    from psring.commands.scaling import check, scaling_classes

    monkeypatch.setattr(scaling, "EVENTS_UP_TO", 0)  # (as above: quick)
    classes = scaling_classes()
    curves = scale(PROF, CAL, classes, 32, per_host=2, link_bits=10e9)
    runs = []

    def flags_of(c, cls, w):
        return {"strategy": c.strategy, "workers": w}

    def measure(flags):
        runs.append((flags["strategy"], flags["workers"]))
        return 0.5, 3  # (a measured step and the run's time scale)

    out = check(curves, classes, PROF, CAL, None, flags_of, measure)
    models = {classes[s].caps.cost_model for s, _ in runs}
    assert len(models) == len({s for s, _ in runs})  # one strategy a cost model
    assert "hogwild" not in {s for s, _ in runs} and "single" not in {s for s, _ in runs}
    assert {w for _, w in runs} == {2, 4, 8, 16}
    r = next(r for r in out["runs"] if r["strategy"] == "allreduce" and r["workers"] == 8)
    p = curves["allreduce"].at(8).candidate
    again = simulate(PROF, p.cluster, "ring", CAL.faster(3), bucket_mb=p.bucket_mb)
    assert r["predicted_ms"] == pytest.approx(again.step_s * 1e3)
    assert r["error"] == pytest.approx(again.step_s / 0.5 - 1)
    assert out["median_abs_error"] is not None


def test_the_check_prices_a_servers_events_by_the_mean_of_many_draws():
    """A parameter server's small cluster is priced by its events, whose step depends on
    the draw of TCP's shares: the check prices it by VERIFY_DRAWS of them, not the
    table's few, so that its prediction is the events' mean, not one draw's luck."""
    from psring.commands.scaling import VERIFY_DRAWS, check

    prof = Profile.on_paper([1_000_000] * 8, forward_s=0.05, backward_s=0.15,
                            update_s=0.0, batch_size=32)
    classes = {"ps": STRATEGIES.get("ps")}
    curves = scale(prof, CAL, classes, 4, per_host=2, link_bits=1e9)
    out = check(curves, classes, prof, CAL, None, lambda c, cls, w: {}, lambda f: (0.5, 3))
    r = next(r for r in out["runs"] if r["workers"] == 4)
    c = curves["ps"].at(4).candidate
    assert not scaling.by_fluid(prof, c.cluster, c.bucket_mb)

    def events(draws):
        return simulate(prof, c.cluster, "ps", CAL.faster(3), bucket_mb=c.bucket_mb,
                        draws=draws).step_s * 1e3

    assert VERIFY_DRAWS > scaling.EVENTS_DRAWS
    assert r["predicted_ms"] == pytest.approx(events(VERIFY_DRAWS))
    assert r["predicted_ms"] != pytest.approx(events(scaling.EVENTS_DRAWS))


def test_verify_never_picks_a_strategy_device_mode_cannot_run():
    """On one host hogwild (no messages) ranks first, but device mode has no device to
    emulate for it: advise --verify runs the best ones that it can."""
    from psring.predict.advise import candidates, rank, verify_candidates

    classes = {n: STRATEGIES.get(n) for n in ("hogwild", "allreduce", "ps")}
    ranking = rank(candidates(PROF, Cluster.of(hosts=1, workers_per_host=2), CAL, classes))
    assert ranking[0].strategy == "hogwild"
    picked = [c.strategy for c in verify_candidates(ranking, classes)]
    assert "hogwild" not in picked and set(picked) == {"allreduce", "ps"}


def test_a_hosts_own_interconnect_prices_its_workers_traffic_at_every_size():
    """--device-link (``inside``) on one host as on several: the ring among a host's
    workers runs at the device link's pace, not at loopback's."""
    classes = {"allreduce": STRATEGIES.get("allreduce")}
    slow = scale(PROF, CAL, classes, 8, per_host=8, link_bits=10e9)["allreduce"]
    fast = scale(PROF, CAL, classes, 8, per_host=8, link_bits=10e9,
                 inside=(1e-5, 1 / 450e9))["allreduce"]
    assert fast.at(8).efficiency > slow.at(8).efficiency
    assert fast.at(8).step_s < slow.at(8).step_s
