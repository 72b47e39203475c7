"""The terms a published cluster adds to the simulator (psring.predict.published) and
Horovod's Tensor Fusion in the ring's timeline (psring.predict.sim.ring.fused):
experiments/published.py predicts the published scaling points with them."""

from __future__ import annotations

import math

import pytest

from psring.cluster.spec import Cluster
from psring.predict.calibration import Calibration
from psring.predict.published import (
    expected_max_normal,
    nccl_ring_latency,
    negotiation_s,
    straggler_factor,
)
from psring.predict.sim.simulate import simulate
from psring.records.profile import Profile

CAL = Calibration(zmq_alpha=1e-5, zmq_beta=1e-10, dist_alpha=1e-5, dist_beta=1e-10,
                  gamma=2e-12, host="on paper")
MB = 2**20


def twenty_layers(backward_s: float = 0.2) -> Profile:
    """Twenty 4 MiB gradients ready evenly through backward (the last parameter first)."""
    return Profile.on_paper([4 * MB] * 20, 0.1, backward_s, 0.0, 32)


def collectives(link_bits: float, fusion) -> list[tuple[float, float]]:
    cl = Cluster.of(hosts=4, workers_per_host=1, link_bits=link_bits)
    return simulate(twenty_layers(), cl, "ring", CAL, steps=3, fusion=fusion).buckets


def test_fusion_makes_fewer_larger_collectives_when_each_is_slow():
    # Horovod's cycle waits for the last cycle's collectives: on a slow link the
    # gradients pile up meanwhile and go out together
    fast = collectives(100e9, (64 * MB, 5e-3, 0.0))
    slow = collectives(1e9, (64 * MB, 5e-3, 0.0))
    assert len(slow) < len(fast)
    assert len(fast) >= 10  # (every cycle finds a gradient or two: 10 ms apart)


def test_fusion_keeps_to_the_buffer_and_sends_every_byte():
    fusion = (10 * MB, 5e-3, 0.0)
    cl = Cluster.of(hosts=4, workers_per_host=1, link_bits=1e9)
    pred = simulate(twenty_layers(), cl, "ring", CAL, steps=3, fusion=fusion)
    # (two 4 MiB gradients fit a 10 MiB buffer, three do not)
    assert len(pred.buckets) >= 10
    assert pred.gradient_bytes == 20 * 4 * MB


def test_a_longer_cycle_waits_longer():
    step = {cycle: simulate(twenty_layers(), Cluster.of(hosts=4, workers_per_host=1,
                                                        link_bits=100e9),
                            "ring", CAL, steps=3, fusion=(64 * MB, cycle, 0.0)).step_s
            for cycle in (1e-3, 45e-3)}
    # the last gradient, ready 200 ms into backward, goes at the cycle's tick of 225 ms
    assert step[45e-3] == pytest.approx(step[1e-3] + 0.025, abs=0.003)


@pytest.mark.parametrize("fusion", [(0, 5e-3, 0.0), (64 * MB, 0.0, 0.0),
                                    (64 * MB, 5e-3, -1.0)])
def test_fusion_refuses_nonsense(fusion):
    with pytest.raises(ValueError, match="fusion"):
        simulate(twenty_layers(), Cluster.of(hosts=2, link_bits=1e9), "ring", CAL,
                 fusion=fusion)


def test_fusion_is_the_rings_only():
    cl = Cluster.of(hosts=2, link_bits=1e9, servers=1)
    with pytest.raises(ValueError, match="ring models"):
        simulate(twenty_layers(), cl, "ps", CAL, fusion=(64 * MB, 5e-3, 0.0))


def test_nccl_ring_latency_is_its_tuning_models():
    # tuning.cc's arithmetic by hand: 2 hosts of 8 over NVLink, a large message:
    # (8.4 + (30 - 2) x 3.4 + 2 x 9.6) µs, x 1.9 across hosts
    assert nccl_ring_latency(8, 2, "nvlink") == pytest.approx(
        (8.4 + 28 * 3.4 + 2 * 9.6) * 1.9e-6)
    # a small message skips the plateau; one host has no network steps
    assert nccl_ring_latency(8, 2, "nvlink", nbytes=1000) == pytest.approx(
        (8.4 + 28 * 3.4 + 2 * 9.6) * 1e-6)
    assert nccl_ring_latency(4, 1, "pci") == pytest.approx((8.4 + 6 * 5.7) * 1e-6)
    assert negotiation_s(512) == pytest.approx(2 * 9 * 9.6e-6)


def test_the_slowest_of_n():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-4)
    assert 3.0 < expected_max_normal(512) < 3.1  # (the order statistic's tables: 3.04)
    assert straggler_factor(512, 0.01) == pytest.approx(1 + 0.01 * expected_max_normal(512))
    assert straggler_factor(1, 0.5) == 1.0
