"""What a strategy can do is one frozen Capabilities per strategy (psring.strategies.base):
derived strategies state what differs, config-dependent choices are methods, and a
strategy written for the old class flags is refused instead of silently defaulted."""

import dataclasses

import pytest

from psring.strategies import STRATEGIES, Capabilities, Strategy


def test_every_strategy_declares_frozen_capabilities():
    for name in STRATEGIES:
        caps = STRATEGIES.get(name).caps
        assert isinstance(caps, Capabilities), name
        with pytest.raises(dataclasses.FrozenInstanceError):
            caps.max_workers = 3


def test_derived_strategies_state_what_differs():
    allreduce, hallreduce = STRATEGIES.get("allreduce").caps, STRATEGIES.get("hallreduce").caps
    assert hallreduce.reductions == allreduce.reductions and hallreduce.uses_process_group
    assert (hallreduce.cost_model, allreduce.cost_model) == ("hring", "ring")
    assert STRATEGIES.get("async-ps").caps.uses_servers
    assert not STRATEGIES.get("async-ps").caps.synchronous


def test_where_the_optimizer_runs_follows_update_on():
    byteps, ps = STRATEGIES.get("byteps").caps, STRATEGIES.get("ps").caps
    assert not byteps.local_optimizer("") and byteps.local_optimizer("worker")
    assert not ps.local_optimizer("") and STRATEGIES.get("allreduce").caps.local_optimizer("")


@pytest.mark.parametrize("flag", ["uses_servers", "comm_model", "local_optimizer"])
def test_a_strategy_setting_the_old_class_flags_is_refused(flag):
    with pytest.raises(TypeError, match=f"sets {flag} on the class.*Capabilities"):
        type("Old", (Strategy,), {flag: True})


def test_device_link_applies_where_a_strategy_has_traffic_inside_a_host_to_time():
    """One rule (psring.comm.interconnect.not_timed) for psring run's check, sweeps and
    advise --verify: '' where --device-link applies, else why not, with the fix."""
    from psring.comm.interconnect import not_timed
    from psring.strategies import STRATEGIES

    timed = {n for n in STRATEGIES.names() if not not_timed(STRATEGIES.get(n).caps)}
    assert {"allreduce", "ddp", "byteps", "hallreduce", "ps", "async-ps"} <= timed
    assert not timed & {"single", "hogwild"}
    why = not_timed(STRATEGIES.get("single").caps)
    named = set(why.split("Use ")[1].split(", or drop")[0].replace(" or ", ", ").split(", "))
    assert named == timed, why  # the fix names every strategy it applies to
    assert "--strategy hallreduce --reduce adasum" in \
        not_timed(STRATEGIES.get("allreduce").caps, "adasum")
    assert not_timed(STRATEGIES.get("hallreduce").caps, "adasum") == ""
