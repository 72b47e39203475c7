"""The ring's cost models: ``ring`` (allreduce, ddp) and ``hring`` (hallreduce).

Collectives run one at a time in launch order; each is the ring's 2(n−1) steps, every
step sending an M/n chunk over every edge at once, so a step lasts as long as its
slowest edge (a host link where the ring crosses hosts, else loopback, or the device
link of ``inside``, where the ring's sums run on the devices). ``hring``'s
collective is three: a reduce-scatter among a host's G workers, G rings of H ranks
across the hosts on a 1/G slice each, an all-gather in the host. With ``--reduce
adasum`` the ring (or hring's rings across hosts) is Adasum's vector halving, distance
doubling. With ``fusion`` the collectives are Horovod's Tensor Fusion's (:func:`fused`)
instead of buckets launched as they fill. (psring.predict.sim.simulate's docstring has
the whole picture.)
"""

from __future__ import annotations

import math
from functools import partial
from typing import Iterator

from psring.predict.analytic import host_reduce, predict_comm
from psring.predict.sim.cost_models import COST_MODELS, CostModel, Prediction, Sim, finish
from psring.predict.sim.engine import (
    Resource,
    adasum_steps,
    group_size,
    host_steps,
    launches,
    ring_seconds,
)


def ring_timeline(sim: Sim, hier: bool = False) -> Prediction:
    """Every rank runs the same timeline (they launch the same buckets at the same
    moments and each collective ends for all at once): play rank 0's."""
    cluster = sim.cluster
    D, F, B, U = sim.compute
    n = cluster.workers
    hosts = len(set(cluster.worker_host))
    G = n // hosts if hier else 1
    across = hosts if hier else n  # the ranks of the ring (or rings) across hosts
    alpha, beta, gamma, edge = _ring_edge(sim, G)
    collective = partial(_collective, sim, G, across, alpha, beta, gamma)
    stream = Resource(edge, beta)
    starts, bucket_times, latency_in, spans_bw = [0.0], [], 0.0, []
    t = 0.0
    for s in range(sim.steps):
        done, times = t, []
        launched = (fused(sim, t, stream) if sim.fusion else
                    zip((m for m, _ in sim.buckets), launches(t, sim.compute, sim.buckets)))
        for m, at in launched:
            dur, lat = collective(m)
            stream.occupy(max(at, stream.free), dur)
            done = stream.free
            times.append((at - t, done - t))
            if s == sim.steps - 1:
                latency_in += lat
                spans_bw.append(dur - lat)
        t = max(t + D + F + B, done) + U
        starts.append(t)
        bucket_times = times
    period = (starts[-1] - starts[-3]) / 2
    window = (starts[-2], starts[-1])
    util = stream.busy_between(*window) / (window[1] - window[0])
    bw_busy = sum(spans_bw)
    return finish(sim, "hring" if hier else "ring", period,
                  util={edge: min(util, bw_busy / period) if period else 0.0},
                  latency=latency_in, bucket_times=bucket_times, starts=starts)


def fused(sim: Sim, t: float, stream: Resource) -> Iterator[tuple[float, float]]:
    """(bytes, launch time) of each collective of the step that starts at ``t`` under
    Horovod's Tensor Fusion (horovod docs/tensor-fusion.rst): a background loop whose
    cycle, every ``cycle`` seconds, negotiates the gradients ready on every rank by its
    start (through rank 0: ``negotiation`` seconds), fuses them in the order they became
    ready into collectives of at most ``buffer`` bytes (a larger one alone) and runs
    those before the next cycle, which starts a cycle after this one's start or when its
    collectives end, whichever is later: slow collectives make fewer, larger ones.
    ``stream`` is the collectives' queue, occupied by the caller between yields."""
    D, F, _, _ = sim.compute
    buffer, cycle, negotiation = sim.fusion
    ready = [(t + D + F + r, m) for m, r in sim.buckets]  # (in the order they are ready)
    start, k = t + D + F, 0  # (the loop's phase against backward: a cycle's start there)
    while k < len(ready):
        start = max(start + cycle, stream.free)
        if ready[k][0] > start:  # idle cycles until the next gradient is ready
            start += math.ceil((ready[k][0] - start) / cycle) * cycle
        group = 0.0
        while k < len(ready) and ready[k][0] <= start:
            m = ready[k][1]
            if group and group + m > buffer:
                yield group, start + negotiation
                group = 0.0
            group += m
            k += 1
        yield group, start + negotiation


def _ring_edge(sim: Sim, G: int) -> tuple[float, float, float, str]:
    """(α, β, γ, name) of one step of the flat ring (or of hring's rings across hosts):
    as long as its slowest edge."""
    cluster, cal = sim.cluster, sim.cal
    if sim.inside and G == 1:  # a flat ring's hops inside a host: the device link's,
        (alpha, beta), gamma, edge = sim.inside, 0.0, "ring edges (device link)"
    elif cluster.hosts == 1 and sim.reduce == "sum":  # gloo's all_reduce as measured
        (alpha, beta), gamma, edge = cal.gloo_step("all_reduce"), 0.0, "ring edges (loopback)"
    else:  # send/recv figures, the adds apart (gloo's rings across hosts; Adasum's swaps)
        (alpha, beta), gamma = cal.link("ring"), cal.gamma / sim.wire / G
        edge = "ring edges (loopback)"
    if cluster.hosts > 1:
        # a step lasts as long as its slowest edge: the link the ring crosses hosts on
        # (never faster than loopback: between_hosts keeps β at least loopback's)
        # (and never faster than a device link slower than the host link)
        a_link, b_link, _ = cal.between_hosts("ring", cluster.link_bits, cluster.delay_s,
                                            cluster.loss)
        alpha, beta, edge = max(a_link, alpha), max(b_link, beta), "host links (ring)"
    return alpha, beta, gamma, edge


def _collective(sim: Sim, G: int, across: int, alpha: float, beta: float, gamma: float,
                m: float) -> tuple[float, float]:
    """(seconds, of which α) of one bucket's collective of ``m`` float32 bytes; α, β, γ:
    one step of the ring (or rings) across hosts."""
    cal, wire = sim.cal, sim.wire
    dur, lat = 2 * m * sim.cast, 0.0  # to 16 bits before, back after
    if G > 1:  # hring: reduce-scatter and all-gather among the host's G workers
        rs, ag = host_steps(sim)
        dur += host_reduce(G, m, rs, ag)
        lat += (G - 1) * (rs[0] + ag[0])
    # across: the flat ring of n, or hring's G rings of H on 1/G each (a host link
    # carries all G of them: M/H a step)
    if sim.reduce == "adasum":
        d, la = adasum_steps(across, m * wire / G, alpha, beta * G, cal.gamma)
        dur, lat = dur + d, lat + la
    elif across > 1:
        dur += ring_seconds(across, m * wire, alpha, beta, gamma)
        lat += 2 * (across - 1) * alpha
    return dur, lat



def ring_cpu_work(sim: Sim, hier: bool = False) -> float:
    """A step's CPU work on shared cores: every worker's compute (its own update too),
    and its collectives as they cost on loopback (gloo's measured collectives occupy
    the cores of every rank for as long as they run; across emulated links only their
    loopback share is CPU, the rest is waiting)."""
    cluster, n = sim.cluster, sim.cluster.workers
    threads = max(1, sim.profile.threads or 1)
    G = group_size(cluster) if hier else 1
    ar, (rs, ag) = sim.cal.gloo_step("all_reduce"), sim.cal.host_steps()
    comm = sum(host_reduce(G, m, rs, ag)  # (0 with one worker a host)
               + ring_seconds(n // G, m * sim.wire / G, *ar, 0.0)  # (a 1/G slice)
               for m, _ in sim.buckets)
    return n * (sim.profile.compute_s * threads + comm + 2 * sim.total * sim.cast)


COST_MODELS.register("ring")(CostModel(
    "ring", ring_timeline, transport="dist", collective=True, cpu_work=ring_cpu_work,
    formula=partial(predict_comm, "ring")))
COST_MODELS.register("hring")(CostModel(
    "hring", partial(ring_timeline, hier=True), transport="dist", collective=True,
    cpu_work=partial(ring_cpu_work, hier=True), formula=partial(predict_comm, "hring")))
