"""The measured parameter-server round (psring.predict.psprobe) and how the cost models
read it (Calibration.ps_transport): a calibration's round, played back through the
simulator with no compute, comes out as the round that was measured."""

import dataclasses

import pytest

from psring.cluster.spec import Cluster
from psring.errors import PsringError
from psring.predict import psprobe
from psring.predict.calibration import Calibration
from psring.predict.sim.simulate import simulate
from psring.records.profile import Profile

MB = 1 << 20
# a ping-pong of 10 µs and 10 GB/s, γ of 50 GB/s: far faster than the round below
CAL = Calibration(zmq_alpha=1e-5, zmq_beta=1e-10, dist_alpha=1e-5, dist_beta=1e-10,
                  gamma=2e-11)
# a round of 2 workers x M bytes: 1 ms + M / (0.5 GB/s), the kind of round a server
# with one Python thread gives whatever the cores
ROUND = [1e-3, 2e-9]


def _round_trip(cal: Calibration, M: int, fluid: bool) -> float:
    """The simulator's ps step for 2 workers and one server on one host, its compute
    next to nothing: the round alone."""
    tiny = 1e-7
    prof = Profile(param_bytes=[M], ready_s=[tiny], forward_s=tiny, backward_s=tiny,
                   update_s=tiny, batch_size=8, threads=1)
    p = simulate(prof, Cluster.of(hosts=1, workers_per_host=2), "ps", cal, fluid=fluid)
    return p.step_s


@pytest.mark.parametrize("fluid", [False, True], ids=["events", "fluid"])
@pytest.mark.parametrize("M", [4 * MB, 16 * MB])
def test_the_simulator_plays_the_measured_round_back(M, fluid):
    cal = dataclasses.replace(CAL, ps_round=list(ROUND))
    measured = ROUND[0] + M * ROUND[1]
    assert _round_trip(cal, M, fluid) == pytest.approx(measured, rel=0.1)
    # without it, the ping-pong's figures price the round several times faster
    assert _round_trip(CAL, M, fluid) < 0.5 * measured


def test_the_round_only_ever_slows_the_transport():
    assert CAL.link("ps") == (CAL.zmq_alpha, CAL.zmq_beta)
    slow = dataclasses.replace(CAL, ps_round=list(ROUND))
    assert slow.link("ps") == pytest.approx((ROUND[0] / 2, ROUND[1] / 4))
    assert slow.link("byteps") == slow.link("ps") == slow.link("zmq")
    assert slow.link("ring") == (CAL.dist_alpha, CAL.dist_beta)  # gloo's is its own
    # a round faster than the ping-pong allows (a fit's noise) leaves the ping-pong's
    fast = dataclasses.replace(CAL, ps_round=[1e-6, 1e-12])
    assert fast.link("ps") == (CAL.zmq_alpha, CAL.zmq_beta)
    # a slowed clock (--time-scale) slows the round with everything else
    assert slow.faster(4).ps_round == pytest.approx([ROUND[0] / 4, ROUND[1] / 4])


def test_a_bad_round_is_refused_when_loaded():
    for bad in ([1e-3], [0.0, 1e-9], [1e-3, -1.0]):
        with pytest.raises(ValueError, match="ps_round"):
            dataclasses.replace(CAL, ps_round=bad)


def test_fit_round_recovers_a_line_and_refuses_a_flat_one():
    pts = [[m, 3e-4 + m * 1.5e-9] for m in (MB, 4 * MB, 16 * MB)]
    assert psprobe.fit_round(pts) == pytest.approx((3e-4, 1.5e-9))
    with pytest.raises(PsringError, match="did not grow"):
        psprobe.fit_round([[MB, 2e-3], [8 * MB, 2e-3]])
    # an intercept fitted below zero (noise) is kept at a microsecond
    assert psprobe.fit_round([[MB, 1e-3], [2 * MB, 3e-3]])[0] == pytest.approx(1e-6)


@pytest.mark.parametrize("cores,threads", [(2, 1), (4, 2), (16, 14), (1, 1)])
def test_the_probe_server_gets_a_runs_threads_for_the_cores(monkeypatch, cores, threads):
    # (as psring.runs.launch gives a run's one server beside 2 workers)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    assert psprobe.probe_threads() == threads


# -- a calibration from another machine ---------------------------------------------------

def test_a_calibration_from_another_machine_is_named(capsys, tmp_path):
    cal = dataclasses.replace(CAL, host="gpu-box", cores=16)
    assert cal.elsewhere("gpu-box", 16) is None
    assert cal.elsewhere("vm", 16) == "host 'gpu-box', not 'vm'"
    assert cal.elsewhere("gpu-box", 2) == "16 cores, not 2"
    # (a calibration that recorded neither, or a run that did not say, is not judged)
    assert CAL.elsewhere("vm", 2) is None and cal.elsewhere("", 0) is None
    cal.warn_if_elsewhere(tmp_path / "calibration.json", "vm", 2)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another machine (host 'gpu-box', not 'vm'; 16 cores, " \
        "not 2)" in err and "psring calibrate" in err
    cal.warn_if_elsewhere(tmp_path / "calibration.json", "gpu-box", 16)
    assert capsys.readouterr().err == ""
