"""--device-link describes a host's PCIe beside its devices' interconnect: a parameter
server's worker copies its gradients to host memory and the parameters back at that
rate (psring.comm.interconnect.on_host), in the run's device stand-in as in the
simulator's replay and advise."""

from __future__ import annotations

import dataclasses

import pytest

from psring.cluster.spec import Cluster
from psring.comm import interconnect
from psring.errors import ConfigError
from psring.predict.calibration import Calibration
from psring.predict.replay import _with_host_copies
from psring.predict.sim.simulate import simulate
from psring.records.profile import Profile

CAL = Calibration(zmq_alpha=1e-4, zmq_beta=1e-9, dist_alpha=1e-4, dist_beta=1e-9, gamma=1e-10)
M = 8_000_000


def profile() -> Profile:
    return Profile(param_bytes=[M], ready_s=[0.02], forward_s=0.01, backward_s=0.02,
                   update_s=0.0, batch_size=8, threads=1)


def test_a_named_host_copies_at_its_pcie_and_a_rate_at_itself():
    nv = interconnect.host_copy("nvlink")
    assert nv["d2h"] == nv["h2d"] == [interconnect.DEVICE_ALPHA_S, interconnect.PCIE3]
    assert "PCIe 3.0" in nv["source"]
    assert interconnect.parse("nvlink")[1] == 150e9  # (the devices' own link is apart)
    assert interconnect.host_copy("nvlink4")["d2h"][1] == 4 * interconnect.PCIE3
    assert interconnect.host_copy("80mbit")["h2d"][1] == pytest.approx(10e6)
    assert interconnect.host_copy("") is None
    with pytest.raises(ConfigError, match="--device-link nvlink"):
        interconnect.host_copy("nvlinq")


def test_on_host_replaces_the_profiles_copies_and_without_the_flag_keeps_them():
    measured = {"d2h": [1e-5, 20e9], "h2d": [1e-5, 22e9], "source": "a GPU"}
    prof = dataclasses.replace(profile(), host_copy=measured)
    assert interconnect.on_host(prof, "") is prof
    pcie = interconnect.on_host(prof, "pcie")
    assert pcie.host_copy == interconnect.host_copy("pcie")
    assert pcie.copy_s("d2h", M) == pytest.approx(1e-5 + M / interconnect.PCIE3)


def test_the_simulated_ps_step_carries_its_workers_copies_to_the_host():
    """One host of 2 workers and a colocated server, 8 MB of gradients, a 10 MB/s host
    bus: each worker's copy out (0.8 s) and back (0.8 s) are on the step's path."""
    cluster = Cluster.of(hosts=1, workers_per_host=2)
    bare = simulate(profile(), cluster, "ps", CAL, flow_spread=0).step_s
    slow = simulate(interconnect.on_host(profile(), "80mbit"), cluster, "ps", CAL,
                    flow_spread=0).step_s
    assert slow - bare >= 2 * M / 10e6 * 0.99, (bare, slow)


def test_a_replay_takes_the_copies_its_run_made():
    prof = profile()
    cfg = {"device_link": "pcie"}
    real = {"compute": {"mode": "real"}, "config": cfg}
    assert _with_host_copies(prof, real).host_copy is None
    # a device-mode run records its copies; one made before it did, its --device-link's
    before = {"compute": {"mode": "device"}, "config": cfg}
    assert _with_host_copies(prof, before).host_copy == interconnect.host_copy("pcie")
    none = {"compute": {"mode": "device", "host_copy": None}, "config": cfg}
    assert _with_host_copies(prof, none).host_copy is None
    hc = interconnect.host_copy("nvlink4")
    made = {"compute": {"mode": "device", "host_copy": hc}, "config": cfg}
    assert _with_host_copies(prof, made).host_copy == hc
    with pytest.raises(ValueError):
        _with_host_copies(prof, {"compute": {"mode": "device", "host_copy": {"d2h": 1}},
                                 "config": cfg})
