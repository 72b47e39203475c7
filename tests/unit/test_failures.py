"""psring.predict.failures: the first-order cost of failures, by hand."""

from types import SimpleNamespace

import pytest

from psring.predict.failures import Failures, with_failures

RING = SimpleNamespace(survives_lost_workers=False)
ASYNC = SimpleNamespace(survives_lost_workers=True)
HOUR = 3600.0


def test_a_restarting_strategy_loses_a_restart_and_half_an_interval_per_failure():
    # 10 processes, each failing every 1000 h: a failure every 100 h, each costing
    # 120 s + 30 min / 2 = 1020 s: 1020 / 360000 = 0.283% more time per step
    f = Failures(mtbf_s=1000 * HOUR, checkpoint_s=1800, restart_s=120)
    step, why = with_failures(0.5, RING, workers=8, servers=2, f=f)
    assert step == pytest.approx(0.5 * (1 + 10 / (1000 * HOUR) * 1020))
    assert "restarts a day" in why and "rough" not in why


def test_going_on_without_a_worker_trains_short_and_only_servers_restart_it():
    # async-ps, 8 workers each failing every 1000 h over a 100 h job: workers 1..7 each
    # lost for a tenth of it, on average 1 - 7/8 x 0.1 / 2 = 95.6% of them at work;
    # the 2 servers and worker 0 (it writes the model) restart it
    f = Failures(mtbf_s=1000 * HOUR, checkpoint_s=1800, restart_s=120, job_s=100 * HOUR)
    step, why = with_failures(0.5, ASYNC, workers=8, servers=2, f=f)
    alive = 1 - 7 / 8 * 0.1 / 2
    assert step == pytest.approx(0.5 * (1 + 3 / (1000 * HOUR) * 1020) / alive)
    assert "96% of its workers" in why
    alone, _ = with_failures(0.5, ASYNC, workers=8, servers=0, f=f)
    assert alone == pytest.approx(0.5 * (1 + 1 / (1000 * HOUR) * 1020) / alive)


def test_frequent_failures_say_the_figure_is_rough_and_bad_values_are_refused():
    f = Failures(mtbf_s=10 * HOUR, checkpoint_s=3600, restart_s=600)
    assert "rough" in with_failures(1.0, RING, workers=16, servers=0, f=f)[1]
    for bad in ({"mtbf_s": 0}, {"mtbf_s": 1.0, "checkpoint_s": -1},
                {"mtbf_s": 1.0, "restart_s": -1}):
        with pytest.raises(ValueError):
            Failures(**bad)
