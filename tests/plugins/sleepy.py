"""A test plugin that brings its own cost model (loaded via PSRING_PLUGINS=sleepy).

``sleepy-ring``: allreduce whose every step also waits ``NAP_S`` (a stand-in for any
extra per-step cost a researcher's own strategy has). Its cost model, ``sleepy-ring``,
is the ring's timeline plus that wait; registered here, it is what the simulator, the
replay of a run and ``psring advise`` find through the strategy's ``caps.cost_model``.
"""

import time
from dataclasses import replace

from psring.predict.sim import COST_MODELS, CostModel, Prediction, Sim
from psring.predict.sim.ring import ring_cpu_work, ring_timeline
from psring.strategies import STRATEGIES
from psring.strategies.allreduce import AllReduce

#: the wait every step adds, seconds
NAP_S = 0.05


def sleepy_timeline(sim: Sim) -> Prediction:
    pred = ring_timeline(sim)
    pred.step_s += NAP_S
    pred.phases["comm_s"] += NAP_S
    pred.samples_per_s = sim.cluster.workers * sim.profile.batch_size / pred.step_s
    pred.efficiency = min(1.0, sim.profile.compute_s / pred.step_s)
    return pred


COST_MODELS.register("sleepy-ring")(CostModel(
    "sleepy-ring", sleepy_timeline, transport="dist", collective=False,
    cpu_work=ring_cpu_work))


@STRATEGIES.register("sleepy-ring")
class SleepyRing(AllReduce):
    """allreduce plus a wait of NAP_S at the start of every step."""

    name = "sleepy-ring"
    caps = replace(AllReduce.caps, cost_model="sleepy-ring", supports_compression=False)

    def begin_step(self, step):
        time.sleep(NAP_S)
        return super().begin_step(step)
