"""Cost models: how the simulator plays out one strategy's step, found by name.

A strategy names its cost model in its capabilities (``Capabilities.cost_model``,
psring.strategies.base); the simulator (psring.predict.sim.simulate), the replay of a
measured run, reports and ``psring advise`` all find it in :data:`COST_MODELS`. The
built-in ones (``ring``, ``hring``: psring.predict.sim.ring; ``ps``, ``ps-async``,
``byteps``: psring.predict.sim.psround) register themselves when the simulator is imported;
a plugin strategy brings its own the same way (tests/plugins/sleepy.py)::

    from psring.predict.sim import COST_MODELS, CostModel, Sim, finish

    def my_timeline(sim: Sim) -> Prediction:       # one step, played out
        D, F, B, U = sim.compute
        return finish(sim, "my-model", period=D + F + B + U + 0.01)

    COST_MODELS.register("my-model")(CostModel("my-model", my_timeline, transport="dist"))

Pure Python, no torch: the vocabulary every cost model shares — what a timeline is
given (:class:`Sim`), what it returns (:class:`Prediction`, built by :func:`finish`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from psring.cluster.spec import Cluster
from psring.predict.calibration import Calibration
from psring.registry import Registry


@dataclass
class Prediction:
    #: the cost model it was played by (a strategy's ``caps.cost_model``); None: no
    #: communication
    cost_model: str | None
    cluster: Cluster
    #: seconds per step (steady state)
    step_s: float
    #: data_s, forward_s, backward_s, comm_s (the wait communication adds), update_s
    phases: dict[str, float]
    samples_per_s: float
    #: throughput / (n x one worker alone at the same per-worker batch)
    efficiency: float
    #: what bounds the step: "compute", "latency", or a resource's name
    bound: str
    #: share of the step each resource was busy (compute included)
    utilization: dict[str, float]
    #: worker 0's last step: bucket (launch, done) seconds from the step's start
    buckets: list[tuple[float, float]] = field(default_factory=list)
    #: bytes of gradients per step (as float32)
    gradient_bytes: int = 0
    #: when worker 0 started each simulated step (the last: when the last one ended)
    starts: list[float] = field(default_factory=list)
    #: the run's settings the simulation used beside the cluster (compress, bucket_mb,
    #: cores)
    settings: dict[str, Any] = field(default_factory=dict)
    #: each draw's step (seconds) where the prediction is the mean of several draws of
    #: the flows' shares (simulate's ``draws``); empty for one
    draws: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        c = self.cluster
        # "comm_model": the key advise.json has always had for the cost model's name
        return {"comm_model": self.cost_model, "step_s": self.step_s, "phases": self.phases,
                "samples_per_s": self.samples_per_s, "efficiency": self.efficiency,
                "bound": self.bound, "utilization": self.utilization,
                "cluster": {"workers": c.workers, "hosts": c.hosts,
                            "workers_per_host": c.workers_per_host, "link_bits": c.link_bits,
                            "delay_s": c.delay_s, "servers": c.servers,
                            "placement": c.placement, **self.settings},
                **({"draws_s": self.draws} if self.draws else {})}


#: TCP's flows through the emulated links never share them evenly; the σ of the lognormal
#: weights that stand for it (psring.predict.sim.engine.Flows), chosen against measured runs
#: of colocated and own-host parameter servers (docs/prediction.md, "Flows")
FLOW_SPREAD = 0.17
#: draws of those shares a replay and advise average (simulate's ``draws``): a
#: synchronous PS whose workers can fall out of step with each other is a random
#: process, and one draw says only when this one fell (docs/prediction.md)
FLOW_DRAWS = 4


@dataclass(frozen=True)
class Sim:
    """What a cost model's timeline is given: one step's inputs, already derived from a
    profile, a cluster and the run's settings by :func:`psring.predict.sim.simulate.simulate`."""

    profile: Any
    cluster: Cluster
    cal: Calibration
    #: (data, forward, backward, update) seconds of one worker's step, stretched by the
    #: shared cores where the cluster is emulated on one machine
    compute: tuple[float, float, float, float]
    #: (float32 bytes, seconds into backward it is ready) per gradient bucket, in launch
    #: order
    buckets: list[tuple[int, float]]
    #: float32 gradient bytes per step
    total: int
    #: bytes on the wire per float32 byte (--compress)
    wire: float
    #: seconds a byte to cast to 16 bits and back (0 without --compress)
    cast: float
    #: steps to play out
    steps: int
    #: --reduce: "sum" or "adasum"
    reduce: str = "sum"
    #: --update-on (byteps): "server" or "worker"
    update_on: str = "server"
    #: (α, β) of a host's own interconnect (--device-link), or None: loopback's
    inside: tuple[float, float] | None = None
    #: how unevenly flows share a link (psring.predict.sim.engine.Flows): the σ of their
    #: lognormal weights; 0 shares evenly, a deterministic fluid
    flow_spread: float = FLOW_SPREAD
    #: the seed of those weights (one draw of TCP's shares; the step a prediction gives
    #: is that draw's)
    flow_seed: int = 0
    #: Horovod's Tensor Fusion for the ring models, (buffer bytes, cycle seconds,
    #: negotiation seconds a cycle); ``buckets`` then holds every gradient, in the order
    #: they become ready (psring.predict.sim.ring.fused). None: buckets at --bucket-mb
    fusion: tuple[float, float, float] | None = None


@dataclass(frozen=True)
class CostModel:
    """How the simulator prices one strategy: a name, the step's timeline, and the facts
    about its messages the simulator and advise read."""

    name: str
    #: plays out ``sim.steps`` steps of every worker and returns the steady state
    timeline: Callable[[Sim], Prediction]
    #: the transport its messages take on this machine, whose calibrated α and β price
    #: them: "dist" (torch.distributed: gloo) or "zmq" (psring's PS protocol)
    transport: Literal["dist", "zmq"]
    #: its messages go to parameter servers: a cluster needs servers >= 1
    servers: bool = False
    #: its workers talk only among themselves: one worker alone sends nothing
    collective: bool = False
    #: steps to play out by default (the step time is the period of the last two)
    steps: int = 4
    #: its timeline draws TCP's uneven shares of the links (engine.Flows), so one
    #: prediction is one draw: simulate(draws=K) gives the mean of K
    draws_flows: bool = False
    #: the Sim settings it reads beyond compress, bucket_mb and cores, recorded in the
    #: prediction's settings (byteps: "update_on")
    settings: tuple[str, ...] = ()
    #: on cores every process shares (a cluster emulated on one machine): seconds of CPU
    #: work a step needs, all processes together; None: no floor from the cores
    cpu_work: Callable[[Sim], float] | None = None
    #: the α-β-γ closed form of a step's communication (n, K, M, cal, cluster) -> seconds
    #: (psring.predict.analytic.predict_comm), or None where it has none
    formula: Callable[[int, int, float, Calibration, Cluster | None], float | None] \
        | None = None
    #: the step in closed form (psring.predict.sim.fluid), where :attr:`timeline` plays
    #: every message and grows with workers x servers; None: the timeline is cheap at any
    #: size (the rings: one collective a bucket)
    fluid: Callable[[Sim], Prediction] | None = None


#: cost models by name; a strategy's ``caps.cost_model`` names one
COST_MODELS: Registry[CostModel] = Registry("cost model")


def finish(sim: Sim, cost_model: str | None, period: float, *,
           local_update: bool = True, util: dict[str, float] | None = None,
           latency: float = 0.0, bucket_times: list[tuple[float, float]] | None = None,
           starts: list[float] | None = None) -> Prediction:
    """A Prediction of a step of ``period`` seconds: phases, throughput, efficiency and
    what bounds the step (compute, the busiest resource of ``util``, or latency)."""
    D, F, B, U = sim.compute
    u = U if local_update else 0.0
    busy = D + F + B + u
    phases = {"data_s": D, "forward_s": F, "backward_s": B,
              "comm_s": max(0.0, period - busy), "update_s": u}
    util = {"compute": busy / period if period else 1.0, **(util or {})}
    # Compute bounds the step when communication adds (almost) nothing to it; else the
    # busiest resource does, unless the α terms on the critical path exceed its busy
    # time (small messages: latency).
    bound = "compute"
    others = {k: v for k, v in util.items() if k != "compute"}
    if others and phases["comm_s"] > 0.05 * period:
        bound, share = max(others.items(), key=lambda kv: kv[1])
        if latency > share * period:
            bound = "latency"
    alone = sim.profile.compute_s
    n = sim.cluster.workers
    return Prediction(cost_model, sim.cluster, period, phases,
                      samples_per_s=n * sim.profile.batch_size / period if period else 0.0,
                      efficiency=min(1.0, alone / period) if period else 1.0, bound=bound,
                      # (as Python floats: numpy's scalars round ten times slower, and
                      # the scaling question rounds millions of them)
                      utilization={k: round(float(v), 4) for k, v in util.items()},
                      buckets=bucket_times or [], gradient_bytes=sim.total,
                      starts=starts or [])
