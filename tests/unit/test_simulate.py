"""The step-time simulator (psring.predict.sim.simulate) against timelines worked out by hand.

Every case uses round numbers: α = 1 ms, β = 1 ns/byte (1 GB/s) on loopback, 2 ms and
8 ns/byte between hosts, γ = 0.1 ns/byte; the model's compute is forward 10 ms,
backward 20 ms, update 4 ms. The arithmetic is written out beside each expectation.
"""

import dataclasses

import pytest

from psring.cluster.spec import Cluster
from psring.errors import ConfigError
from psring.predict.analytic import ring_allreduce
from psring.predict.calibration import Calibration
from psring.predict.sim.simulate import ring_steps, simulate
from psring.records.profile import Profile

A, BETA, GAMMA = 1e-3, 1e-9, 1e-10
A_LINK, B_LINK = 2e-3, 8e-9
F, B, U = 0.010, 0.020, 0.004
MiB = 1024 * 1024

CAL = Calibration(zmq_alpha=A, zmq_beta=BETA, dist_alpha=A, dist_beta=BETA, gamma=GAMMA,
                  links={"1gbit": {"zmq_alpha": A_LINK, "zmq_beta": B_LINK,
                                   "dist_alpha": A_LINK, "dist_beta": B_LINK}})


def profile(sizes, ready, update=U):
    return Profile(param_bytes=sizes, ready_s=ready, forward_s=F, backward_s=B,
                   update_s=update, batch_size=8, threads=1)


def test_one_bucket_on_one_link():
    # One 1e6-byte gradient (under the 1 MiB first bucket: one bucket), ready when
    # backward ends (t = F + B = 30 ms). Two hosts, one worker each: the ring's two steps
    # cross the link. Reduce-scatter step: α + (M/2)β + (M/2)γ; all-gather step:
    # α + (M/2)β. T = 2·2 ms + 1e6·8e-9 s + 0.5e6·1e-10 s = 4 + 8 + 0.05 ms = 12.05 ms.
    M = 1_000_000
    p = simulate(profile([M], [B]), Cluster.of(hosts=2, link_bits=1e9), "ring", CAL)
    T = 2 * A_LINK + M * B_LINK + M / 2 * GAMMA
    assert T == pytest.approx(0.01205)
    assert p.step_s == pytest.approx(F + B + T + U)
    assert p.phases["comm_s"] == pytest.approx(T)
    assert p.buckets == [pytest.approx((F + B, F + B + T))]
    assert p.bound == "host links (ring)"
    assert p.efficiency == pytest.approx((F + B + U) / (F + B + T + U))


def test_two_buckets_overlap_backward():
    # Two 1 MiB gradients, bucketed at 1 MB: one bucket each. The last-registered one is
    # ready 5 ms into backward (t = 15 ms) and its all-reduce (2 ranks on loopback:
    # 2α + Mβ + Mγ/2 = 3.101 ms) ends at 18.1 ms, under backward; the other is ready when
    # backward ends (30 ms) and ends at 33.1 ms. Only the second is waited for.
    T = 2 * A + MiB * BETA + MiB / 2 * GAMMA
    p = simulate(profile([MiB, MiB], [B, 0.005]), Cluster.of(hosts=1, workers_per_host=2),
                 "ring", CAL, bucket_mb=1.0)
    assert p.buckets == [pytest.approx((0.015, 0.015 + T)), pytest.approx((0.030, 0.030 + T))]
    assert p.step_s == pytest.approx(F + B + T + U)
    assert p.phases["comm_s"] == pytest.approx(T)
    # ready 1 ms before backward ends instead: the first all-reduce is still running
    # when the second is launched, which queues behind it
    p = simulate(profile([MiB, MiB], [B, B - 0.001]), Cluster.of(hosts=1, workers_per_host=2),
                 "ring", CAL, bucket_mb=1.0)
    first_done = F + B - 0.001 + T
    assert p.buckets[1] == pytest.approx((F + B, first_done + T))
    assert p.step_s == pytest.approx(first_done + T + U)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_at_n_workers_is_its_2n_minus_2_steps(n):
    M = 3 * 4 * 250_000  # divisible by 2, 3, 4
    steps = ring_steps(n, M, A, BETA, GAMMA)
    assert len(steps) == 2 * (n - 1)
    # reduce-scatter steps add the received chunk, all-gather steps do not
    assert steps[0] == pytest.approx(A + M / n * BETA + M / n * GAMMA)
    assert steps[-1] == pytest.approx(A + M / n * BETA)
    T = 2 * (n - 1) * A + 2 * (n - 1) / n * M * BETA + (n - 1) / n * M * GAMMA
    assert sum(steps) == pytest.approx(T)
    assert sum(steps) == pytest.approx(ring_allreduce(n, M, A, BETA, GAMMA))
    p = simulate(profile([M], [B]), Cluster.of(hosts=1, workers_per_host=n), "ring", CAL)
    assert p.step_s == pytest.approx(F + B + T + U)
    assert p.samples_per_s == pytest.approx(n * 8 / (F + B + T + U))


@pytest.mark.parametrize("K,expected", [
    # K = 1: the 8e6-byte push leaves at 30 ms through the worker's and the server's
    # transports (8 ms, both), arrives at 39 ms (+α); the server adds it (8e6·γ =
    # 0.8 ms) and applies the update (the profile's 4 ms per 8e6 bytes): 43.8 ms; the
    # pull's answer takes 8 ms through both transports and α: 52.8 ms.
    (1, 0.0528),
    # K = 2: two 4e6-byte pieces sent together share the worker's transport (8e6 bytes:
    # 30-38 ms) and arrive together at 39 ms. Each server adds its piece (0.4 ms) and
    # applies (the profile's 0.5 ns per byte: 2 ms): 41.4 ms, and answers. The two
    # answers share the worker's transport (8e6 bytes: 41.4-49.4 ms) and arrive at
    # 50.4 ms: the next step starts then.
    (2, 0.0504),
])
def test_a_ps_round_with_k_shards(K, expected):
    M = 8_000_000
    p = simulate(profile([M], [B]), Cluster.of(hosts=1, workers_per_host=1, servers=K), "ps",
                 CAL, flow_spread=0)
    assert p.step_s == pytest.approx(expected)
    assert p.starts[1] == pytest.approx(expected)
    assert p.phases["update_s"] == 0  # the server applied it
    assert p.phases["comm_s"] == pytest.approx(expected - F - B)


def test_an_async_step_does_not_wait_for_the_other_worker():
    # Two workers, one server, 8e6 bytes. Both push at 30 ms, sharing the server's
    # transport (16e6 bytes: 30-46 ms): both arrive at 47 ms, the pulls right behind.
    M = 8_000_000
    cl = Cluster.of(hosts=1, workers_per_host=2, servers=1)
    # ps (sync): the server applies once both are in: adds at 47-47.8 and 47.8-48.6 ms,
    # update 4 ms -> 52.6 ms; it answers both held pulls together, sharing its transport
    # (16e6 bytes: 52.6-68.6 ms): both arrive at 69.6 ms.
    sync = simulate(profile([M], [B]), cl, "ps", CAL, flow_spread=0)
    assert sync.starts[1] == pytest.approx(0.0696)
    # async-ps: worker 0's push is applied on arrival (add + update: 4.8 ms -> 51.8 ms)
    # and its pull answered at once, alone on the server's transport until worker 1's
    # answer joins it at 56.6 ms (4.8e6 bytes carried), then at half the rate: 3.2e6
    # bytes take 6.4 ms, done at 63 ms, arriving at 64 ms.
    asyn = simulate(profile([M], [B]), cl, "ps-async", CAL, flow_spread=0)
    assert asyn.starts[1] == pytest.approx(0.064)
    assert asyn.phases["update_s"] == 0


def test_flows_share_links_unevenly_by_default_and_the_step_is_a_mean():
    # The same cluster with TCP's uneven shares (costs.FLOW_SPREAD): the answers
    # finish apart, the workers drift out of step, and the step time moves off the even
    # fluid's, by a few percent here; a fixed seed keeps it a function of its inputs.
    M = 8_000_000
    cl = Cluster.of(hosts=2, workers_per_host=2, link_bits=1e9, servers=2)
    even = simulate(profile([M], [B]), cl, "ps", CAL, flow_spread=0)
    uneven = simulate(profile([M], [B]), cl, "ps", CAL)
    again = simulate(profile([M], [B]), cl, "ps", CAL)
    assert uneven.step_s == again.step_s
    assert uneven.step_s != pytest.approx(even.step_s, rel=1e-3)
    assert 0.8 * even.step_s < uneven.step_s < 1.5 * even.step_s


def test_draws_average_the_flows_shares_and_leave_the_rings_alone():
    # A parameter server's step is a random process (the flows' shares): draws=K is the
    # mean of the draws with seeds 0..K-1, each draw's step kept; a ring draws nothing
    M = 8_000_000
    cl = Cluster.of(hosts=2, workers_per_host=2, link_bits=1e9, servers=2)
    one = [simulate(profile([M], [B]), cl, "ps", CAL, flow_seed=s).step_s for s in range(3)]
    mean = simulate(profile([M], [B]), cl, "ps", CAL, draws=3)
    assert mean.draws == one and len(set(one)) == 3
    assert mean.step_s == pytest.approx(sum(one) / 3)
    assert mean.samples_per_s == pytest.approx(sum(
        simulate(profile([M], [B]), cl, "ps", CAL, flow_seed=s).samples_per_s
        for s in range(3)) / 3)
    ring = simulate(profile([M], [B]), cl, "ring", CAL, draws=3)
    assert ring.draws == [] and ring.step_s == simulate(profile([M], [B]), cl, "ring",
                                                        CAL).step_s
    with pytest.raises(ValueError, match="draws"):
        simulate(profile([M], [B]), cl, "ps", CAL, draws=0)


def test_no_messages_and_shared_cores():
    prof = profile([MiB], [B])
    p = simulate(prof, Cluster.of(hosts=1, workers_per_host=1), None, CAL)
    assert p.step_s == pytest.approx(F + B + U)
    assert p.bound == "compute" and p.efficiency == 1.0
    # four one-thread workers emulated on two cores compute at half speed
    p = simulate(prof, Cluster.of(hosts=1, workers_per_host=4), None, CAL, cores=2)
    assert p.step_s == pytest.approx(2 * (F + B + U))


def test_shared_cores_cap_a_step_at_its_cpu_work():
    # Eight workers on two cores, each pushing one 1 KB gradient to one server: the
    # timeline has every message in flight at once, but the machine must do the work.
    # Per worker: compute (F + B, no local update) + 4 messages (push, ack, pull,
    # parameters) x α + 2 KB x β; the server: 8 adds + one update of 1 KB.
    M = 1024
    cl = Cluster.of(hosts=1, workers_per_host=8)
    p = simulate(profile([M], [B], update=1e-6), cl, "ps", CAL, cores=2)
    apply = max(1e-6 / M, 2 * GAMMA)
    work = 8 * (F + B + 4 * A + 2 * M * BETA) + 8 * M * GAMMA + M * apply
    assert p.step_s == pytest.approx(work / 2)
    assert p.bound == "cores (shared)"
    # the same cluster with a core per worker: no floor, the timeline's step
    free = simulate(profile([M], [B], update=1e-6), Cluster.of(hosts=1, workers_per_host=8),
                    "ps", CAL)
    assert free.step_s < p.step_s and free.bound != "cores (shared)"
    # a replayed run's compute was measured sharing the cores: not stretched again, but
    # its CPU work still bounds the step
    cl2 = Cluster.of(hosts=1, workers_per_host=4)
    stretched = simulate(profile([M], [B]), cl2, "ring", CAL, cores=2)
    kept = simulate(profile([M], [B]), cl2, "ring", CAL, cores=2, stretch=False)
    assert kept.phases["backward_s"] == pytest.approx(B)
    assert stretched.phases["backward_s"] == pytest.approx(2 * B)
    # (four on two cores: the same CPU work bounds both)
    assert kept.bound == "cores (shared)" and kept.step_s == pytest.approx(stretched.step_s)


def test_a_ring_on_shared_cores_costs_its_collectives_cpu_in_every_rank():
    # 2 workers on 2 cores, one M-byte bucket at the end of backward: gloo's all-reduce
    # (fitted: 2 steps of α + M/2·β) keeps both ranks' cores busy while it runs, so the
    # step is never below compute + the collective: no overlap is left to gain
    M = 4_000_000
    fitted = dataclasses.replace(CAL, collectives={"all_reduce": [2e-4, 7e-10],
                                                   "reduce_scatter": [4e-4, 2e-9],
                                                   "all_gather": [3e-4, 1.4e-9]})
    coll = 2 * (2e-4 + M / 2 * 7e-10)
    prof = profile([M // 2, M // 2], [B / 2, B])
    p = simulate(prof, Cluster.of(hosts=1, workers_per_host=2), "ring", fitted, cores=2,
                 stretch=False)
    assert p.step_s == pytest.approx(prof.compute_s + 2 * 2 * (2e-4 + M / 4 * 7e-10))
    assert p.step_s >= prof.compute_s + coll - 1e-12
    free = simulate(prof, Cluster.of(hosts=1, workers_per_host=2), "ring", fitted)
    assert free.step_s < p.step_s  # with a core each, the first bucket overlaps backward

def test_compression_halves_the_bytes_on_the_link():
    M = 1_000_000
    full = simulate(profile([M], [B]), Cluster.of(hosts=2, link_bits=1e9), "ring", CAL)
    half = simulate(profile([M], [B]), Cluster.of(hosts=2, link_bits=1e9), "ring", CAL,
                    compress="fp16")
    # T = 2α + (M/2)·β_link + (M/4)·2γ (the same adds, on half the bytes' worth of
    # elements) + 2·M·cast (to 16 bits before, back after; a calibration without a cast
    # figure takes γ per byte, one pass over them)
    assert half.phases["comm_s"] == pytest.approx(
        2 * A_LINK + M / 2 * B_LINK + M / 2 * GAMMA + 2 * M * GAMMA)
    assert half.step_s < full.step_s
    # a measured cast cost replaces the estimate
    slow = dataclasses.replace(CAL, cast=1e-8)
    p = simulate(profile([M], [B]), Cluster.of(hosts=2, link_bits=1e9), "ring", slow,
                 compress="fp16")
    assert p.phases["comm_s"] == pytest.approx(
        2 * A_LINK + M / 2 * B_LINK + M / 2 * GAMMA + 2 * M * 1e-8)
    assert p.step_s > full.step_s  # a cast that slow does not pay


def test_the_busiest_link_bounds_a_ps_on_a_slow_link():
    M = 8_000_000
    p = simulate(profile([M], [B]), Cluster.of(hosts=2, link_bits=1e9, servers=1), "ps", CAL)
    # worker 1's push and pull cross host 1's link: 8e6·8 ns = 64 ms each way
    assert p.bound in ("host 1 link out", "host 1 link in", "host 0 link out",
                       "host 0 link in")
    assert p.step_s > F + B + 2 * M * B_LINK


@pytest.mark.parametrize("bad", [dict(hosts=0), dict(placement="elsewhere"),
                                 dict(link_bits=-1.0), dict(workers_per_host=0)])
def test_a_bad_cluster_is_refused(bad):
    with pytest.raises(ConfigError):
        Cluster.of(**bad)


@pytest.mark.parametrize("bad", [dict(compress="zip"), dict(bucket_mb=0), dict(cores=0)])
def test_bad_run_settings_are_refused(bad):
    with pytest.raises(ValueError):
        simulate(profile([4], [B]), Cluster.of(), "ring", CAL, **bad)


@pytest.mark.parametrize("mode", ["ps", "ps-async"])
def test_more_servers_than_elements_and_odd_sizes_still_play_out(mode):
    # one float32 element and two servers: the second holds nothing, as the strategy's
    # would; buckets whose bytes are not whole elements; a model with no gradient bytes
    one = simulate(profile([4], [B]), Cluster.of(hosts=2, link_bits=1e9, servers=2), mode, CAL)
    assert one.step_s > F + B
    odd = simulate(profile([MiB + 2, MiB + 2], [B, 0.005]),
                   Cluster.of(hosts=2, link_bits=1e9, servers=3), mode, CAL, bucket_mb=1.0)
    assert odd.step_s > F + B
    empty = simulate(profile([0], [B]), Cluster.of(hosts=2, link_bits=1e9), mode, CAL)
    assert empty.step_s == pytest.approx(F + B + U)


def test_a_profile_with_non_finite_times_is_refused():
    with pytest.raises(ValueError):
        profile([4], [float("nan")])
    with pytest.raises(ValueError):
        Profile(param_bytes=[4], ready_s=[0.0], forward_s=float("inf"), backward_s=B,
                update_s=U)
    with pytest.raises(ValueError):
        simulate(profile([4], [B]), Cluster.of(), "ring", CAL, steps=1)


def test_the_simulators_wire_fractions_are_psring_compress_s():
    from psring.comm.compress import CHOICES, wire_bytes
    from psring.predict.sim.simulate import WIRE

    assert set(WIRE) == set(CHOICES)
    for choice in CHOICES:
        assert WIRE[choice] * 4096 == wire_bytes(4096, choice)


def test_byteps_aggregates_in_the_host_then_pushes_a_part_each():
    # One host of G = 2 workers, one server, one 8e6-byte bucket ready when backward ends
    # (30 ms). The host's reduce-scatter (a ring of 2: one step of α + (M/2)β + (M/2)γ =
    # 1 + 4 + 0.4 ms) ends at 35.4 ms; both workers push their 4e6 bytes (one partition
    # each, under 4.096 MB) side by side, sharing the server's transport (8e6 bytes:
    # 8 ms): both arrive at 35.4 + 8 + 1 = 44.4 ms. Each worker's part is its own range,
    # complete with its one host's push: the server adds worker 0's (44.4-44.8), updates
    # it (4e6 x 0.5 ns = 2 ms: 46.8) and sends it back, alone on its transport until
    # 49.2 (2.4e6 bytes), when worker 1's (add 46.8-47.2, update to 49.2) joins it; at
    # half the rate each, worker 0's last 1.6e6 bytes are done at 52.4 (arrival 53.4),
    # worker 1's 4e6 at 54.8 (arrival 55.8). The host all-gathers (α + (M/2)β = 5 ms):
    # the next step starts at 60.8 ms.
    M = 8_000_000
    cl = Cluster.of(hosts=1, workers_per_host=2, servers=1)
    p = simulate(profile([M], [B]), cl, "byteps", CAL, flow_spread=0)
    assert p.starts[1] == pytest.approx(0.0608)
    assert p.step_s == pytest.approx(0.0608)
    assert p.phases["update_s"] == 0
    # updating on the workers, the server only adds: worker 0's part goes back from 44.8,
    # worker 1's from 45.2, sharing the transport: done at 52.4 and 52.8 (arrivals 53.4,
    # 53.8); all-gather to 58.8, and each worker's own update (4 ms): 62.8 ms
    w = simulate(profile([M], [B]), cl, "byteps", CAL, update_on="worker", flow_spread=0)
    assert w.starts[1] == pytest.approx(0.0628)
    assert w.phases["update_s"] == pytest.approx(U)
    assert w.settings["update_on"] == "worker"


def test_byteps_pipelines_partitions_push_and_pull():
    # 2 hosts of 1 worker, a server on a third host, one 40.96e6-byte bucket: 10
    # partitions of 4.096e6 bytes. The server's link carries both hosts' pushes in
    # (2 x 40.96e6 x 8 ns = 655 ms) and their pulls out as much; partition j comes back
    # while j + 1.. are pushed, so the step's communication is about one direction (655
    # ms) plus a partition's round (~66 ms), not push then pull (1311 ms).
    M = 40_960_000
    cl = Cluster.of(hosts=2, workers_per_host=1, link_bits=1e9, servers=1,
                    placement="own-hosts")
    p = simulate(profile([M], [B]), cl, "byteps", CAL, flow_spread=0)
    one_way = 2 * M * B_LINK
    assert one_way < p.phases["comm_s"] < 1.15 * one_way
    from psring.predict.sim.simulate import PARTITION_BYTES
    from psring.strategies.byteps import PARTITION_ELEMENTS
    assert PARTITION_BYTES == PARTITION_ELEMENTS * 4


def test_byteps_with_one_worker_a_host_is_ps_and_a_host_link_carries_m_once():
    M = 8_000_000
    single = Cluster.of(hosts=2, workers_per_host=1, link_bits=1e9, servers=2,
                        placement="own-hosts")
    assert simulate(profile([M], [B]), single, "byteps", CAL, flow_spread=0).step_s == \
        pytest.approx(simulate(profile([M], [B]), single, "ps", CAL, flow_spread=0).step_s)
    # 2 hosts of 4 workers, servers on their own hosts: under ps a worker host's link
    # carries its 4 workers' pushes (4 M), under byteps the host's once (M)
    four = Cluster.of(hosts=2, workers_per_host=4, link_bits=1e9, servers=2,
                      placement="own-hosts")
    ps = simulate(profile([M], [B]), four, "ps", CAL, flow_spread=0)
    bp = simulate(profile([M], [B]), four, "byteps", CAL, flow_spread=0)
    busy = lambda p: p.utilization["host 0 link out"] * p.step_s  # noqa: E731
    assert busy(ps) == pytest.approx(4 * M * B_LINK, rel=1e-3)
    assert busy(bp) == pytest.approx(M * B_LINK, rel=1e-3)
    assert bp.step_s < ps.step_s


def test_hallreduce_is_three_collectives_and_its_links_carry_m_over_h():
    # 2 hosts of 2 workers, one 8e6-byte bucket ready when backward ends (30 ms), 1 Gbit/s
    # links (α 2 ms, β 8 ns/byte). hring: the host's reduce-scatter and all-gather (a
    # ring of 2 on loopback on 4e6-byte halves: 2α + 2·4e6·β + 4e6·γ = 2 + 8 + 0.4 ms),
    # then 2 rings of 2 across the hosts on 4e6-byte slices, both over each host link:
    # 2 steps of α + (M/2)·β_link (+ (M/2)·γ/2 in the reduce-scatter) = 34.2 + 34 ms.
    # 78.6 ms of communication; with the update, a 112.6 ms step.
    M = 8_000_000
    cl = Cluster.of(hosts=2, workers_per_host=2, link_bits=1e9)
    h = simulate(profile([M], [B]), cl, "hring", CAL)
    assert h.phases["comm_s"] == pytest.approx(0.0786)
    assert h.step_s == pytest.approx(F + B + 0.0786 + U)
    # the flat ring of 4 crosses each host link 6 times with M/4: 3 x (2 + 16 + 0.2) +
    # 3 x (2 + 16) = 108.6 ms; its links carry 1.5 M each way, hring's M
    flat = simulate(profile([M], [B]), cl, "ring", CAL)
    assert flat.phases["comm_s"] == pytest.approx(0.1086)
    from psring.predict.analytic import host_reduce, hring_allreduce
    inside = host_reduce(2, M, (A, BETA + GAMMA), (A, BETA))
    assert inside == pytest.approx(0.0104)
    assert hring_allreduce(2, 2, M, A_LINK, B_LINK, GAMMA, inside) == pytest.approx(0.0786)


def test_adasum_is_vector_halving_with_its_sums_and_passes():
    # 2 workers on one host, one 8e6-byte bucket: one level: swap 4e6 each way (α +
    # 4e6·β = 5 ms), sum 3 numbers a tensor over the pair (2α = 2 ms), four passes over
    # the 4e6-byte half (1.6 ms), swap back (5 ms): 13.6 ms, against the ring's 2α + Mβ +
    # (M/2)γ = 10.4 ms
    M = 8_000_000
    cl = Cluster.of(hosts=1, workers_per_host=2)
    a = simulate(profile([M], [B]), cl, "ring", CAL, reduce="adasum")
    assert a.phases["comm_s"] == pytest.approx(0.0136)
    assert a.settings["reduce"] == "adasum"
    assert simulate(profile([M], [B]), cl, "ring", CAL).phases["comm_s"] == \
        pytest.approx(0.0104)


def test_byteps_columns_send_each_local_ranks_part_to_the_servers_holding_it():
    from psring.predict.sim.simulate import column_pieces

    # one 16-byte bucket (4 elements) on hosts of 2 workers, 2 servers: the columns are
    # [part 0 | part 1], so local rank 0 pushes only to server 0 and local rank 1 to 1
    assert column_pieces([(16, 0.0)], 2, 2) == {(0, 0): [(0, 8.0)], (1, 0): [(1, 8.0)]}
    # two buckets of 8 and 4 elements: column 0 = [b0 0..3, b1 0..1], column 1 = [b0
    # 4..7, b1 2..3]; 12 elements over 2 servers, 6 each
    got = column_pieces([(32, 0.0), (16, 0.0)], 2, 2)
    assert got == {(0, 0): [(0, 16.0)], (0, 1): [(0, 8.0)],
                   (1, 0): [(1, 16.0)], (1, 1): [(1, 8.0)]}


def test_a_device_runs_gradients_are_ready_when_its_profile_said(tmp_path):
    """A device-mode run that records no bucket launches (ddp) is replayed with its
    device profile's ready times, scaled to the run's backward; a real run is not."""
    from psring.records.profile import Profile, _ready_from_device

    Profile.on_paper([400, 100, 500], 0.1, 0.2, shares=[0.9, 0.5, 0.1]).save(tmp_path)
    device = {"compute": "device", "device_profile": str(tmp_path)}
    ready = _ready_from_device(device, [400, 100, 500], backward_s=0.4)
    assert ready == pytest.approx([0.36, 0.2, 0.04])
    assert _ready_from_device({"compute": "real"}, [400, 100, 500], 0.4) is None
    assert _ready_from_device(device, [400, 100], 0.4) is None  # another model's profile
    assert _ready_from_device({**device, "device_profile": str(tmp_path / "no")},
                              [400, 100, 500], 0.4) is None


def test_a_replayed_run_shares_the_cores_only_where_it_computed_on_them():
    from psring.predict.replay import shared_cores

    local = {"host": {"cores": 2}, "launch": {"launcher": "psring run"},
             "compute": {"mode": "real"}, "device": "cpu"}
    assert shared_cores(local) == 2
    # device mode's compute is a wait, not CPU; torchrun's hosts each have their own
    # cores; a GPU worker computes on its device; an unknown machine shares nothing known
    assert shared_cores({**local, "compute": {"mode": "device"}}) is None
    assert shared_cores({**local, "launch": {"launcher": "torchrun"}}) is None
    assert shared_cores({**local, "device": "cuda"}) is None
    assert shared_cores({**local, "host": {}}) is None


def test_a_gpu_workers_host_copies_sit_on_a_parameter_servers_step():
    # One worker, one server, one bucket: its copy to the host comes before its push and
    # the pulled parameters' copy back before the next step, both on the step's path
    M = 8_000_000
    hc = {"d2h": [1e-5, 5e10], "h2d": [2e-5, 4e10], "source": "test"}
    cpu, gpu = profile([M], [B]), dataclasses.replace(profile([M], [B]), host_copy=hc)
    one = Cluster.of(hosts=1, workers_per_host=1, servers=1)
    extra = simulate(gpu, one, "ps", CAL).step_s - simulate(cpu, one, "ps", CAL).step_s
    assert extra == pytest.approx(1e-5 + M / 5e10 + 2e-5 + M / 4e10)
    # byteps copies its part, 1/G of each bucket, each way
    two = Cluster.of(hosts=1, workers_per_host=2, servers=1)
    extra = simulate(gpu, two, "byteps", CAL).step_s - simulate(cpu, two, "byteps", CAL).step_s
    assert 1e-5 + M / 2 / 5e10 + 2e-5 + M / 2 / 4e10 <= extra + 1e-12
    # a ring all-reduce moves gradients device to device: no host copies
    ring = Cluster.of(hosts=2, link_bits=1e9)
    assert simulate(gpu, ring, "ring", CAL).step_s == simulate(cpu, ring, "ring", CAL).step_s


def test_host_copies_are_kept_by_a_profile_and_read_from_gpu_copy_output(tmp_path):
    import json

    from psring.records.profile import load_host_copy
    from tests.helpers.layout import ROOT

    hc = load_host_copy(ROOT / "experiments/profiles/h100/copy_rates.json")
    assert "H100" in hc["source"] and hc["d2h"][1] > 1e10 and hc["h2d"][1] > 1e10
    p = dataclasses.replace(profile([4_000_000], [B]), host_copy=hc)
    assert Profile.load(p.save(tmp_path)).host_copy == json.loads(json.dumps(hc))
    assert p.scaled(2.0).host_copy == hc  # a faster chip, the same bus
    assert p.copy_s("d2h", 4e6) == pytest.approx(hc["d2h"][0] + 4e6 / hc["d2h"][1])
    with pytest.raises(ValueError, match="host_copy"):
        dataclasses.replace(p, host_copy={"d2h": [0.0, 0.0], "h2d": [0.0, 1e9]})
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a copy-rate file"):
        load_host_copy(tmp_path / "bad.json")


def test_advise_refines_each_strategys_best_settings_to_means_of_draws():
    from psring.predict.advise import Candidate, candidates, preference, rank, refine
    from psring.strategies import STRATEGIES

    classes = {n: STRATEGIES.get(n) for n in ("allreduce", "ps", "async-ps")}
    cl = Cluster.of(hosts=2, workers_per_host=2, link_bits=1e9)
    cands = candidates(profile([4_000_000, 4_000_000], [B / 2, B]), cl, CAL, classes)
    assert all((c.play is None) == (c.strategy == "allreduce") for c in cands)
    assert not any(c.prediction.draws for c in cands)
    refine(cands, draws=3)
    for name in ("ps", "async-ps"):
        group = [c for c in cands if c.strategy == name and c.compress == "none"]
        best = min(group, key=preference)
        assert len(best.prediction.draws) == 3  # the best is a mean, not a lucky draw
        assert best.prediction.step_s == pytest.approx(sum(best.prediction.draws) / 3)
        assert any(not c.prediction.draws for c in group)  # the rest stay one draw
    assert {c.strategy for c in rank(cands)} == {"allreduce", "ps"}  # (async: an option)
    assert isinstance(cands[0], Candidate)


def test_byteps_hosts_push_when_their_own_backward_has_the_bucket():
    """Each host pushes its parts when its own backward has the bucket, so TCP's uneven
    shares can leave one host behind the other and a server's reply waits for the
    host behind (device-mode runs: two hosts 32-244 ms apart). Launched on every host
    at once, the hosts stayed in step whatever the shares: the spread cost nothing."""
    # an MLP 1024x3's layers (9.5 MB) and when backward has their gradients
    prof = Profile(param_bytes=[1048576, 4096, 4194304, 4096, 4194304, 4096, 40960, 40],
                   ready_s=[0.00258, 0.00257, 0.00235, 0.00234, 0.0013, 0.00129, 0.00025,
                            0.00024], forward_s=0.0017, backward_s=0.0027, update_s=0.001,
                   batch_size=32, threads=1)
    cal = Calibration(zmq_alpha=2e-5, zmq_beta=1e-10, dist_alpha=2e-5, dist_beta=1e-10,
                      gamma=1e-11)
    cl = Cluster.of(hosts=2, workers_per_host=2, link_bits=1e9, servers=2)

    def step(spread: float) -> float:
        return simulate(prof, cl, "byteps", cal, bucket_mb=25.0, flow_spread=spread,
                        draws=4 if spread else 1).step_s

    assert step(0.17) > 1.05 * step(0.0)
