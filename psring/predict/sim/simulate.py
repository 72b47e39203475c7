"""The step-time simulator: a whole training step of each strategy, predicted from a
profile of the model (psring.records.profile) and a cluster, without running anything.

    from psring.predict.calibration import Calibration, find_calibration
    from psring.records.profile import Profile
    from psring.cluster.spec import Cluster
    from psring.predict.sim.simulate import simulate

    prof = Profile.load("runs/prof-r18")          # psring profile --model resnet18 ...
    cal = Calibration.load(find_calibration())    # psring calibrate
    p = simulate(prof, Cluster.of(hosts=4, workers_per_host=1, link_bits=10e9), "ring", cal)
    print(p.step_s, p.phases, p.bound)

Pure Python, no processes, no torch. Each worker's step is played out as a timeline of
events in time order (as dPRO replays a profiled trace, Hu et al., MLSys 2022):

- compute: data, forward, then backward, during which each gradient bucket becomes ready
  at the profile's time (buckets formed at ``bucket_mb`` by the strategies' own rule and
  launched in order, as psring.strategies.buckets does);
- a launched bucket's communication, by the strategy's cost model
  (``caps.cost_model``, found in psring.predict.sim.cost_models.COST_MODELS; the built-in ones
  are psring.predict.sim.ring's and psring.predict.sim.psround's):

  - ``ring`` (allreduce, ddp): collectives run one at a time in launch order; each is
    the ring's 2(n−1) steps, every step sending an M/n chunk over every edge at once,
    so a step lasts as long as its slowest edge (a host link where the ring crosses
    hosts, else loopback): α + (M/n)·β, plus (M/n)·γ to add it in the reduce-scatter's
    n−1 steps (psring.predict.analytic.ring_allreduce, step by step). On one host a
    step is gloo's all_reduce as ``psring calibrate`` measured it
    (Calibration.gloo_step, its adds included), as are a host's reduce-scatters and
    all-gathers (hring's, byteps's);
  - ``ps`` (synchronous): the bucket is pushed in pieces to the K servers whose ranges
    it overlaps. Every message travels on its connection, one direction of a worker's
    TCP connection to a server: a FIFO byte stream (its pull goes out behind its
    pushes). The connections with bytes queued share their *links* at once, as TCP's
    flows do (psring.predict.sim.engine.Flows: weighted max-min shares, the weights drawn
    unevenly per burst, ``flow_spread``): the sender's transport, the sender host's
    outgoing link and the receiver host's incoming link when it crosses hosts (full
    duplex: one link per direction), the receiver's transport; a message arrives α
    after its last byte is carried. A server adds each piece on arrival (bytes·γ on its
    CPU); once all n workers' pieces of a range are in, it updates the range (the
    profile's optimizer time per byte) and streams it to the pulls held. The next step
    starts when the whole model's parameters are in;
  - ``hring`` (hallreduce): the ring's timeline, each bucket's collective being three:
    a ring reduce-scatter among the host's G workers (loopback), G rings of H ranks
    across the hosts on a 1/G slice each, in parallel, so a host link carries M/H a
    step (2(H−1) steps at the link's α and β), and an all-gather in the host;
  - with ``reduce="adasum"`` (``--reduce adasum``), the ring (or hring's rings across
    hosts) is Adasum's vector halving, distance doubling instead: log2 n levels, level i
    swapping M/2^(i+1) each way, adding up its per-tensor sums over a block of 2^(i+1)
    ranks (a small all-reduce: 2(i+1) α) and making three passes over its half (dot
    products and norms, then the combination: 4 γ a byte), then log2 n swaps back;
  - ``byteps`` (per-host aggregation): ``ps``'s connections with groups. A host's G
    workers first reduce-scatter each bucket among themselves (a ring of G on the host's
    own interconnect, loopback's gloo α and β here, one collective at a time per host),
    then local rank l pushes its part l to the servers holding it (the runtime's
    columns), in 4 MB partitions one after another on each connection; a partition is
    complete with one push per host, and is then summed (updated) and streamed back to
    the workers of local rank l while later ones are still pushed; once a host's G
    workers have every piece, the host all-gathers every bucket. With
    ``update_on="worker"`` the servers only add and each worker runs the optimizer
    after the all-gather;
  - ``ps-async`` (Downpour): a server applies each worker's piece on arrival and answers
    that worker's pull once its own pushes are applied: no worker waits for another.
    (Staleness, async's price in accuracy, is measured by runs, not predicted here.)
  - None (single, hogwild): no messages; the step is the compute.

- the update: the local optimizer after the last collective (ring, none); nothing on a
  PS worker (the server applied it).

Cores: a cluster emulated on one machine (``cores`` set) shares that machine's cores
between every worker, so compute stretches by max(1, n·threads/cores), and a step is
never shorter than its whole CPU work over the cores: compute, each collective as long
as it runs on loopback in every rank, each message's α and β at both ends, the
servers' adds and updates. A real cluster gives each worker its own device (``cores``
None). A replayed run (psring.predict.replay) keeps its own compute, measured sharing
the cores (``stretch=False``), and is bounded by the same CPU work: on 2 cores the
communication of 2 workers has no core of its own to overlap backward on.

Several steps are played (the first starts every worker at once; steady state follows)
and the step time is the slowest worker's period: over its last two steps for the rings,
and the mean after the first two for the parameter servers, whose flows' shares vary
from step to step. The prediction
names what bounds the step: compute, a link, a server's transport or CPU, a worker's
transport, the shared cores, or latency (α terms dominate).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any, Callable

from psring.cluster.spec import Cluster
from psring.predict.calibration import Calibration

# (importing them registers the built-in cost models)
from psring.predict.sim import psround, ring  # noqa: F401 - ring: registration only
from psring.predict.sim.cost_models import (
    COST_MODELS,
    FLOW_DRAWS,
    FLOW_SPREAD,
    CostModel,
    Prediction,
    Sim,
    finish,
)

# (names tests and scripts import from here)
from psring.predict.sim.engine import column_pieces, ring_steps  # noqa: F401 - re-exported

#: bytes on the wire per float32 byte of gradient, for each of psring.comm.compress's choices
#: (kept here so the simulator needs no torch; a test checks it against
#: psring.comm.compress.wire_bytes)
WIRE = {"none": 1.0, "fp16": 0.5, "bf16": 0.5}
PARTITION_BYTES = psround.PARTITION_BYTES
__all__ = ["COST_MODELS", "CostModel", "FLOW_DRAWS", "Prediction", "WIRE", "PARTITION_BYTES",
           "is_costed", "comm_seconds", "mean_of", "simulate"]


def is_costed(name: str | None) -> bool:
    """Whether the simulator can price a strategy declaring cost model ``name`` (None:
    it sends no messages, its step is its compute)."""
    return name is None or name in COST_MODELS


def comm_seconds(name: str | None, n: int, K: int, M: float, cal: Calibration,
                 topo: Cluster | None = None) -> float | None:
    """The α-β-γ closed form of a step's communication under cost model ``name``
    (psring.predict.analytic); None where it sends nothing or has no closed form."""
    if name is None or name not in COST_MODELS or COST_MODELS.get(name).formula is None:
        return None
    return COST_MODELS.get(name).formula(n, K, M, cal, topo)


def simulate(profile: Any, cluster: Cluster, cost_model: str | None, cal: Calibration,
             steps: int = 0, *, compress: str = "none", bucket_mb: float = 25.0,
             cores: int | None = None, update_on: str = "server",
             reduce: str = "sum", inside: tuple[float, float] | None = None,
             stretch: bool = True, flow_spread: float = FLOW_SPREAD,
             flow_seed: int = 0, draws: int = 1, fluid: bool = False,
             fusion: tuple[float, float, float] | None = None) -> Prediction:
    """Predict one steady-state step of every worker (see the module docstring) on
    ``cluster`` (psring.cluster.spec) under cost model ``cost_model`` (a name in
    COST_MODELS; None: no messages), with the run's ``compress`` and ``bucket_mb``;
    ``cores``: the cores every process shares (a cluster emulated on one machine),
    None: each worker computes on a device of its own; ``update_on`` (byteps): where
    the optimizer runs, "server" or "worker"; ``reduce`` (ring, hring): "sum" or
    "adasum"; ``inside``: (α, β) of a host's own interconnect for byteps's and
    hring's collectives inside a host (default: loopback's gloo figures, this machine's;
    e.g. NVLink's on paper, whose sums run on the devices: no host γ); ``stretch``:
    whether ``cores`` stretch the profile's compute (False: it was measured sharing
    them, as a replayed run's own is: the cores only bound the step's CPU work);
    ``flow_spread``: how unevenly TCP's flows share a link (costs.FLOW_SPREAD; 0: evenly,
    a deterministic fluid), ``flow_seed`` the seed of that draw; ``draws``: for a cost
    model that draws them (``draws_flows``), the mean of that many draws (seeds
    flow_seed, flow_seed + 1, ...), each draw's step in the prediction's ``draws``;
    ``fusion`` (the ring models): Horovod's Tensor Fusion in place of buckets, as
    (buffer bytes, cycle seconds, negotiation seconds a cycle)."""
    model = _check(cluster, cost_model, steps, compress, bucket_mb, cores, fusion)
    if draws < 1:
        raise ValueError(f"draws must be at least 1, not {draws!r}")
    sim = replace(_inputs(profile, cluster, model, cal, steps, compress, bucket_mb,
                          cores if stretch else None, update_on, reduce, inside,
                          flow_spread, fusion), flow_seed=flow_seed)
    if fluid and model is not None and model.fluid is not None:
        pred = _play(sim, model, cost_model, cores, model.fluid)
    elif draws > 1 and model is not None and model.draws_flows and flow_spread:
        pred = mean_of([_play(replace(sim, flow_seed=flow_seed + i), model, cost_model, cores)
                        for i in range(draws)])
    else:
        pred = _play(sim, model, cost_model, cores)
    pred.settings = {"compress": compress, "bucket_mb": bucket_mb, "cores": cores}
    if reduce != "sum":
        pred.settings["reduce"] = reduce
    for name in model.settings if model else ():
        pred.settings[name] = getattr(sim, name)
    return pred


def _play(sim: Sim, model: CostModel | None, cost_model: str | None,
          cores: int | None, timeline: Callable[[Sim], Prediction] | None = None
          ) -> Prediction:
    """One draw of the step: the cost model's timeline (or ``timeline``: its fluid),
    bounded by the shared cores."""
    if model is None or sim.cluster.workers == 1 and model.collective or sim.total == 0:
        return finish(sim, cost_model, sum(sim.compute))
    pred = (timeline or model.timeline)(sim)
    pred.cost_model = cost_model  # (the name it was found by, whatever it says)
    if cores and model.cpu_work is not None:
        _cores_floor(pred, sim, cores, model.cpu_work(sim))
    return pred


def mean_of(preds: list[Prediction]) -> Prediction:
    """Several draws as one prediction: the mean step, phases, throughput, efficiency
    and utilization (the throughput is the draws' mean, the expected samples a second,
    so not quite n·B over the mean step when the draws differ); what bounds it, the
    buckets and the starts are those of the draw nearest the mean; ``draws`` lists
    every draw's step."""
    mean = statistics.fmean(p.step_s for p in preds)
    near = min(preds, key=lambda p: abs(p.step_s - mean))
    avg = statistics.fmean
    return replace(
        near, step_s=mean, samples_per_s=avg(p.samples_per_s for p in preds),
        efficiency=avg(p.efficiency for p in preds),
        phases={k: avg(p.phases[k] for p in preds) for k in near.phases},
        utilization={k: round(avg(p.utilization.get(k, 0.0) for p in preds), 4)
                     for k in near.utilization},
        draws=[p.step_s for p in preds])


def _check(cluster: Cluster, cost_model: str | None, steps: int, compress: str,
           bucket_mb: float, cores: int | None,
           fusion: tuple[float, float, float] | None = None) -> CostModel | None:
    if cost_model is not None and cost_model not in COST_MODELS:
        raise ValueError(f"cost_model {cost_model!r}: one of None, "
                         f"{', '.join(COST_MODELS.names())}")
    model = COST_MODELS.get(cost_model) if cost_model is not None else None
    if compress not in WIRE:
        raise ValueError(f"compress {compress!r}: choose one of {', '.join(WIRE)}")
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be positive, not {bucket_mb!r}")
    if cores is not None and cores < 1:
        raise ValueError(f"cores must be at least 1, not {cores!r}")
    if model is not None and model.servers and cluster.servers < 1:
        raise ValueError("a parameter-server cluster needs servers >= 1")
    if steps and steps < 2:
        raise ValueError(f"steps must be at least 2 (the step time is a period), not {steps}")
    if fusion is not None:
        if cost_model not in ("ring", "hring"):
            raise ValueError(f"fusion is Horovod's, for the ring models, not {cost_model!r}")
        buffer, cycle, negotiation = fusion
        if not (buffer > 0 and cycle > 0 and negotiation >= 0):
            raise ValueError(f"fusion (buffer bytes, cycle s, negotiation s): buffer and "
                             f"cycle positive, negotiation at least 0, not {fusion!r}")
    return model


def _inputs(profile: Any, cluster: Cluster, model: CostModel | None, cal: Calibration,
            steps: int, compress: str, bucket_mb: float, cores: int | None,
            update_on: str, reduce: str, inside: tuple[float, float] | None,
            flow_spread: float, fusion: tuple[float, float, float] | None = None) -> Sim:
    """The timeline's inputs: compute stretched by the shared cores, the buckets (with
    ``fusion``, every gradient on its own, in the order they become ready)."""
    threads = max(1, profile.threads or 1)
    stretch = max(1.0, cluster.workers * threads / cores) if cores else 1.0
    compute = (profile.data_s * stretch, profile.forward_s * stretch,
               profile.backward_s * stretch, profile.update_s * stretch)
    buckets = ([(m, r * stretch) for m, r in profile.buckets(bucket_mb)] if fusion is None
               else sorted(((m, r * stretch) for m, r in
                            zip(profile.param_bytes, profile.ready_s)), key=lambda b: b[1]))
    wire = WIRE[compress]
    # --compress casts every message to 16 bits and back: the calibration's measured
    # cost, else γ (one pass over the bytes; psring calibrate measures it)
    cast = 0.0 if wire == 1.0 else (cal.cast or cal.gamma)
    return Sim(profile, cluster, cal, compute, buckets, total=sum(m for m, _ in buckets),
               wire=wire, cast=cast, steps=steps or (model.steps if model else 4),
               reduce=reduce, update_on=update_on, inside=inside, flow_spread=flow_spread,
               fusion=fusion)


def _cores_floor(pred: Prediction, sim: Sim, cores: int, work: float) -> None:
    """On shared cores a step cannot take less than the CPU work it needs divided by the
    cores (work conservation): every worker's compute, and its messages' software cost —
    α per message and loopback's β per byte, the transport's own work, which on one
    machine is CPU — and the servers' adds and updates (the cost model's ``cpu_work``).
    Where that floor is above the timeline's step, the step is the floor and the bound
    is the cores. (Many small messages among more processes than cores: the timeline
    alone has them in flight at once, as if each process had a core.)"""
    floor = work / cores
    if floor > pred.step_s:
        busy = pred.step_s - pred.phases["comm_s"]
        pred.samples_per_s *= pred.step_s / floor
        pred.step_s = floor
        pred.phases["comm_s"] = floor - busy
        pred.efficiency = min(1.0, sim.profile.compute_s / floor)
        pred.bound = "cores (shared)"
    pred.utilization["cores (shared)"] = round(work / cores / pred.step_s, 4)
