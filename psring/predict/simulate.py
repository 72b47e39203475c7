"""The step-time simulator: a whole training step of each strategy, predicted from a
profile of the model (psring.predict.profile) and a cluster, without running anything.

    from psring.predict.costmodel import Calibration, find_calibration
    from psring.predict.profile import Profile
    from psring.cluster.spec import Cluster
    from psring.predict.simulate import simulate

    prof = Profile.load("runs/prof-r18")          # psring profile --model resnet18 ...
    cal = Calibration.load(find_calibration())    # psring calibrate
    p = simulate(prof, Cluster.of(hosts=4, workers_per_host=1, link_bits=10e9), "ring", cal)
    print(p.step_s, p.phases, p.bound)

Pure Python, no processes, no torch. Each worker's step is played out as a timeline of
events in time order (as dPRO replays a profiled trace, Hu et al., MLSys 2022):

- compute: data, forward, then backward, during which each gradient bucket becomes ready
  at the profile's time (buckets formed at ``bucket_mb`` by the strategies' own rule and
  launched in order, as psring.strategies.buckets does);
- a launched bucket's communication, by the strategy's ``comm_model``:

  - ``ring`` (allreduce, ddp): collectives run one at a time in launch order; each is
    the ring's 2(n−1) steps, every step sending an M/n chunk over every edge at once,
    so a step lasts as long as its slowest edge (a host link where the ring crosses
    hosts, else loopback): α + (M/n)·β, plus (M/n)·γ to add it in the reduce-scatter's
    n−1 steps (psring.predict.costmodel.ring_allreduce, step by step);
  - ``ps`` (synchronous): the bucket is pushed in pieces to the K servers whose ranges
    it overlaps. A message occupies every *resource* on its path at once (cut-through:
    each resource serves its messages first come first served), for bytes·β of that
    resource: the sender's transport, the sender host's outgoing link and the receiver
    host's incoming link when it crosses hosts (full duplex: one resource per
    direction), the receiver's transport; it arrives α after the slowest is done.
    Messages one process sends at the same moment (a bucket's pieces to K servers, a
    server's answers to every held pull) share their resources fairly, as separate
    connections do. A server adds each piece on arrival (bytes·γ on its CPU); once all
    n workers' pieces of the step are in, it applies the update (the profile's
    optimizer time per byte) and answers the pulls, each pull another message back.
    The next step starts when every shard's parameters are in;
  - ``hring`` (hallreduce): the ring's timeline, each bucket's collective being three:
    a ring reduce-scatter among the host's G workers (loopback), G rings of H ranks
    across the hosts on a 1/G slice each, in parallel, so a host link carries M/H a
    step (2(H−1) steps at the link's α and β), and an all-gather in the host;
  - with ``reduce="adasum"`` (``--reduce adasum``), the ring (or hring's rings across
    hosts) is Adasum's vector halving, distance doubling instead: log2 n levels, level i
    swapping M/2^(i+1) each way, adding up its per-tensor sums over a block of 2^(i+1)
    ranks (a small all-reduce: 2(i+1) α) and making three passes over its half (dot
    products and norms, then the combination: 4 γ a byte), then log2 n swaps back;
  - ``byteps`` (per-host aggregation): ``ps``'s resources with groups. A host's G
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
never shorter than its whole CPU work over the cores (compute, each message's α and β,
the servers' adds and updates). A real cluster gives each worker its own device
(``cores`` None). The CPU that communication takes from backward while both run is not
modelled (docs/prediction.md: the error on this machine).

Several steps are played (the first starts every worker at once; steady state follows)
and the step time is the slowest worker's period over its last two. The prediction
names what bounds the step: compute, a link, a server's transport or CPU, a worker's
transport, the shared cores, or latency (α terms dominate).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from psring.cluster.spec import Cluster
from psring.predict.costmodel import COMM_MODELS, Calibration
# (the engine's names are re-exported: tests and scripts import them from here)
from psring.predict.engine import (
    Events,
    Resource,
    adasum_steps,
    column_pieces,
    group_size,
    launches,
    ring_steps,
    send_together,
    server_update_per_byte,
    shard_pieces,
)

#: bytes on the wire per float32 byte of gradient, for each of psring.comm.compress's choices
#: (kept here so the simulator needs no torch; a test checks it against
#: psring.comm.compress.wire_bytes)
WIRE = {"none": 1.0, "fp16": 0.5, "bf16": 0.5}
#: byteps's largest push, bytes (psring.strategies.byteps.PARTITION_ELEMENTS x 4; kept
#: here so the simulator needs no torch; a test checks the two agree)
PARTITION_BYTES = 4_096_000


@dataclass
class Prediction:
    comm_model: str | None
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

    def to_dict(self) -> dict[str, Any]:
        c = self.cluster
        return {"comm_model": self.comm_model, "step_s": self.step_s, "phases": self.phases,
                "samples_per_s": self.samples_per_s, "efficiency": self.efficiency,
                "bound": self.bound, "utilization": self.utilization,
                "cluster": {"workers": c.workers, "hosts": c.hosts,
                            "workers_per_host": c.workers_per_host, "link_bits": c.link_bits,
                            "delay_s": c.delay_s, "servers": c.servers,
                            "placement": c.placement, **self.settings}}


# -- the simulation -------------------------------------------------------------------------

def simulate(profile: Any, cluster: Cluster, comm_model: str | None, cal: Calibration,
             steps: int = 0, *, compress: str = "none", bucket_mb: float = 25.0,
             cores: int | None = None, update_on: str = "server",
             reduce: str = "sum", inside: tuple[float, float] | None = None) -> Prediction:
    """Predict one steady-state step of every worker (see the module docstring) on
    ``cluster`` (psring.cluster.spec), with the run's ``compress`` and ``bucket_mb``;
    ``cores``: the cores every process shares (a cluster emulated on one machine),
    None: each worker computes on a device of its own; ``update_on`` (byteps): where
    the optimizer runs, "server" or "worker"; ``reduce`` (ring, hring): "sum" or
    "adasum"; ``inside``: (α, β) of a host's own interconnect for byteps's and
    hring's collectives inside a host (default: loopback's gloo figures, this machine's;
    e.g. NVLink's on paper, whose sums run on the devices: no host γ)."""
    if comm_model not in COMM_MODELS:
        raise ValueError(f"comm_model {comm_model!r}: one of {COMM_MODELS}")
    if compress not in WIRE:
        raise ValueError(f"compress {compress!r}: choose one of {', '.join(WIRE)}")
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be positive, not {bucket_mb!r}")
    if cores is not None and cores < 1:
        raise ValueError(f"cores must be at least 1, not {cores!r}")
    if comm_model in ("ps", "ps-async", "byteps") and cluster.servers < 1:
        raise ValueError("a parameter-server cluster needs servers >= 1")
    if steps and steps < 2:
        raise ValueError(f"steps must be at least 2 (the step time is a period), not {steps}")
    n = cluster.workers
    threads = max(1, profile.threads or 1)
    stretch = max(1.0, n * threads / cores) if cores else 1.0
    D, F, B = (profile.data_s * stretch, profile.forward_s * stretch,
               profile.backward_s * stretch)
    U = profile.update_s * stretch
    buckets = [(m, r * stretch) for m, r in profile.buckets(bucket_mb)]
    wire = WIRE[compress]
    # --compress casts every message to 16 bits and back: the calibration's measured
    # cost, else γ (one pass over the bytes; psring calibrate measures it)
    cast = 0.0 if wire == 1.0 else (cal.cast or cal.gamma)
    total = sum(m for m, _ in buckets)
    steps = steps or (8 if comm_model == "ps-async" else 4)
    rings = ("ring", "hring")
    if comm_model is None or n == 1 and comm_model in rings or total == 0:
        pred = _no_messages(profile, cluster, comm_model, (D, F, B, U), buckets, total)
    elif comm_model in rings:
        pred = _ring(profile, cluster, (D, F, B, U), buckets, total, wire, cast, cal, steps,
                     hier=comm_model == "hring", adasum=reduce == "adasum", inside=inside)
    else:
        pred = _ps(profile, cluster, comm_model, (D, F, B, U), buckets, total, wire, cast,
                   cal, steps, local_update=comm_model == "byteps" and update_on == "worker",
                   inside=inside)
    if cores and pred.comm_model is not None and total and not (n == 1 and comm_model in rings):
        _cores_floor(pred, profile, cluster, cores, comm_model, buckets, total, wire, cast,
                     cal, update_on=update_on)
    pred.settings = {"compress": compress, "bucket_mb": bucket_mb, "cores": cores}
    if reduce != "sum":
        pred.settings["reduce"] = reduce
    if comm_model == "byteps":
        pred.settings["update_on"] = update_on
    return pred


def _cores_floor(pred: Prediction, profile: Any, cluster: Cluster, cores: int,
                 comm_model: str,
                 buckets: list[tuple[int, float]], total: int, wire: float, cast: float,
                 cal: Calibration, update_on: str = "server") -> None:
    """On shared cores a step cannot take less than the CPU work it needs divided by the
    cores (work conservation): every worker's compute, and its messages' software cost —
    α per message and loopback's β per byte, the transport's own work, which on one
    machine is CPU — and the servers' adds and updates. Where that floor is above the
    timeline's step, the step is the floor and the bound is the cores. (Many small
    messages among more processes than cores: the timeline alone has them in flight at
    once, as if each process had a core.)"""
    n, K = cluster.workers, cluster.servers
    alpha, beta = cal.link(comm_model)
    threads = max(1, profile.threads or 1)
    on_workers = comm_model in ("ring", "hring") or comm_model == "byteps" and \
        update_on == "worker"  # (the optimizer's work is the workers')
    compute = profile.compute_s - (0.0 if on_workers else profile.update_s)
    if comm_model in ("ring", "hring"):  # (about the same bytes a rank)
        g = group_size(cluster) if comm_model == "hring" else 1
        hops = 2 * (g - 1) + 2 * (n // g - 1)  # sends per worker (each also received)
        msgs = hops * len(buckets)
        sent = sum(2 * (n - 1) / n * m * wire for m, _ in buckets)
        server = 0.0
    else:
        pieces, shards = shard_pieces(buckets, K)
        # pushes and their acks, pulls and their parameters
        msgs = 2 * sum(len(p) for p in pieces) + 2 * len(shards)
        sent = 2 * total * wire
        g = group_size(cluster) if comm_model == "byteps" else 1
        if g > 1:  # a 1/G part each, plus the host's reduce-scatters and all-gathers
            a_r, b_r = cal.link("ring")
            sent = sent / g + 2 * (g - 1) / g * total * b_r / beta  # (in loopback-zmq bytes)
            msgs += 2 * (g - 1) * len(buckets) * a_r / alpha
        apply = server_update_per_byte(profile, cal)
        if comm_model == "ps-async":  # every push applied, and a cast for its pull
            server = n * total * (cal.gamma + apply + 2 * cast)
        elif comm_model == "byteps":  # one push per host added (and the update)
            server = n // g * total * cal.gamma + (0.0 if on_workers else total * apply)
        else:  # every push added, one update and one cast per version
            server = n * total * (cal.gamma + cast) + total * (apply + cast)
    work = n * (compute * threads + msgs * alpha + sent * beta + 2 * total * cast) + server
    floor = work / cores
    if floor > pred.step_s:
        busy = pred.step_s - pred.phases["comm_s"]
        pred.samples_per_s *= pred.step_s / floor
        pred.step_s = floor
        pred.phases["comm_s"] = floor - busy
        pred.efficiency = min(1.0, profile.compute_s / floor)
        pred.bound = "cores (shared)"
    pred.utilization["cores (shared)"] = round(work / cores / pred.step_s, 4)


def _finish(profile: Any, cluster: Cluster, comm_model: str | None, period: float,
            compute: tuple[float, float, float, float], local_update: bool,
            util: dict[str, float], latency: float, bucket_times: list[tuple[float, float]],
            total: int, starts: list[float] | None = None) -> Prediction:
    D, F, B, U = compute
    u = U if local_update else 0.0
    busy = D + F + B + u
    phases = {"data_s": D, "forward_s": F, "backward_s": B,
              "comm_s": max(0.0, period - busy), "update_s": u}
    util = {"compute": busy / period if period else 1.0, **util}
    # Compute bounds the step when communication adds (almost) nothing to it; else the
    # busiest resource does, unless the α terms on the critical path exceed its busy
    # time (small messages: latency).
    bound = "compute"
    others = {k: v for k, v in util.items() if k != "compute"}
    if others and phases["comm_s"] > 0.05 * period:
        bound, share = max(others.items(), key=lambda kv: kv[1])
        if latency > share * period:
            bound = "latency"
    alone = profile.compute_s
    n = cluster.workers
    return Prediction(comm_model, cluster, period, phases,
                      samples_per_s=n * profile.batch_size / period if period else 0.0,
                      efficiency=min(1.0, alone / period) if period else 1.0, bound=bound,
                      utilization={k: round(v, 4) for k, v in util.items()},
                      buckets=bucket_times, gradient_bytes=total, starts=starts or [])


def _no_messages(profile, cluster, comm_model, compute, buckets, total) -> Prediction:
    D, F, B, U = compute
    return _finish(profile, cluster, comm_model, D + F + B + U, compute, True, {}, 0.0,
                   [], total)


def _ring(profile, cluster: Cluster, compute, buckets, total, wire, cast, cal,
          steps, hier: bool = False, adasum: bool = False,
          inside: tuple[float, float] | None = None) -> Prediction:
    n = cluster.workers
    D, F, B, U = compute
    alpha, beta = cal.link("ring")
    # inside a host (hring's reduce-scatter and all-gather)
    a_in, b_in, g_in = (*inside, 0.0) if inside else (alpha, beta, cal.gamma)  # (γ: host sums)
    hosts = len(set(cluster.worker_host))
    G = n // hosts if hier else 1
    across = hosts if hier else n  # the ranks of the ring (or rings) across hosts
    edge = "ring edges (loopback)"
    if cluster.hosts > 1:
        a_link, b_link, _ = cal.between_hosts("ring", cluster.link_bits, cluster.delay_s)
        # a step lasts as long as its slowest edge: the link the ring crosses hosts on
        # (never faster than loopback: between_hosts keeps β at least loopback's)
        alpha, beta, edge = max(a_link, alpha), b_link, "host links (ring)"
    # Every rank runs the same timeline (they launch the same buckets at the same
    # moments and each collective ends for all at once): play rank 0's.
    stream = Resource(edge, beta)
    starts, bucket_times, latency_in, spans_bw = [0.0], [], 0.0, []
    t = 0.0
    for s in range(steps):
        launched = launches(t, compute, buckets)
        done = t
        times = []
        for (m, _), at in zip(buckets, launched):
            begin = max(at, stream.free)
            dur = 2 * m * cast  # to 16 bits before, back after
            lat = 0.0
            if G > 1:  # hring: reduce-scatter and all-gather among the host's G workers
                c = m / G
                dur += (G - 1) * (2 * a_in + 2 * c * b_in + c * g_in)
                lat += 2 * (G - 1) * a_in
            # across: the flat ring of n, or hring's G rings of H on 1/G each (a host
            # link carries all G of them: M/H a step)
            if adasum:
                d, la = adasum_steps(across, m * wire / G, alpha, beta * G, cal.gamma)
                dur, lat = dur + d, lat + la
            elif across > 1:
                dur += sum(ring_steps(across, m * wire, alpha, beta, cal.gamma / wire / G))
                lat += 2 * (across - 1) * alpha
            stream.occupy(begin, dur)
            done = stream.free
            times.append((at - t, done - t))
            if s == steps - 1:
                latency_in += lat
                spans_bw.append(dur - lat)
        t = max(t + D + F + B, done) + U
        starts.append(t)
        bucket_times = times
    period = (starts[-1] - starts[-3]) / 2
    window = (starts[-2], starts[-1])
    util = {edge: stream.busy_between(*window) / (window[1] - window[0])}
    bw_busy = sum(spans_bw)
    return _finish(profile, cluster, "hring" if hier else "ring", period, compute, True,
                   {edge: min(util[edge], bw_busy / period) if period else 0.0},
                   latency_in, bucket_times, total, starts)


def _ps(profile, cluster: Cluster, mode: str, compute, buckets, total, wire, cast, cal,
        steps, local_update: bool = False,
        inside: tuple[float, float] | None = None) -> Prediction:
    n, K = cluster.workers, cluster.servers
    D, F, B, U = compute
    sync = mode in ("ps", "byteps")
    # byteps: G workers a host aggregate first; each pushes and pulls 1/G
    G = group_size(cluster) if mode == "byteps" else 1
    # the host's collectives (gloo on loopback here, unless given)
    a_in, b_in, g_in = (*inside, 0.0) if inside else (*cal.link("ring"), cal.gamma)
    inside = {h: Resource(f"host {h} inside (reduce-scatter, all-gather)", b_in)
              for h in sorted(set(cluster.worker_host))}
    rs_done: dict[tuple[int, int, int], float] = {}  # (host, s, bucket) -> its parts ready
    gathered: dict[tuple[int, int], list[int]] = {}  # (host, s) -> workers with their pulls
    a_loc, b_loc = cal.link(mode)
    a_link, b_link = a_loc, b_loc
    if cluster.hosts > 1 or cluster.placement == "own-hosts":
        a_link, b_link, _ = cal.between_hosts(mode, cluster.link_bits, cluster.delay_s)
    # a message costs the most of its path's β: the link's figure is the transport's
    # between hosts (calibrated, or the rate's on paper), never below loopback's
    link_beta = b_link
    whost, shost = cluster.worker_host, cluster.server_host
    w_io = [Resource(f"worker {w} transport", b_loc) for w in range(n)]
    s_io = [Resource(f"server {k} transport", b_loc) for k in range(K)]
    s_cpu = [Resource(f"server {k} CPU", cal.gamma) for k in range(K)]
    hosts = sorted({*whost, *shost})
    out = {h: Resource(f"host {h} link out", link_beta) for h in hosts}
    inn = {h: Resource(f"host {h} link in", link_beta) for h in hosts}
    # summing servers (byteps updating on the workers) only add
    apply_per_byte = 0.0 if local_update else server_update_per_byte(profile, cal)

    def path(src_io: Resource, h_src: int, h_dst: int, dst_io: Resource) -> tuple:
        if h_src == h_dst:
            return [src_io, dst_io], a_loc
        return [src_io, out[h_src], inn[h_dst], dst_io], a_link

    # each bucket's pieces: (shard, float32 bytes) by the servers' element ranges, as
    # psring.strategies.ps splits them (float32 elements: 4 bytes)
    pieces, shard_bytes = shard_pieces(buckets, K)
    K = len(shard_bytes)

    ev = Events()
    starts = [[0.0] for _ in range(n)]
    bw_end: dict[tuple[int, int], float] = {}  # (w, s) -> when w's backward ended
    got = {}            # (k, s) -> float32 bytes received (sync)
    own = {}            # (k, w, s) -> bytes of w's pushes applied (async)
    pull_req = {}       # (k, w, s) -> when w's pull reached server k
    ready_v = {}        # (k, s) -> when version s+1 is ready (sync)
    pulled = {}         # (w, s) -> shards whose parameters arrived
    pull_done = {}      # (w, s) -> when the last shard's arrived
    bucket_times: list[tuple[float, float]] = []
    last_push = {}      # (w, s, k) -> when w's last piece reached server k
    own_done = {}       # (k, w, s) -> when the server applied w's last piece (async)
    answered = set()    # (k, w, s) pulls answered (async)
    # the α on a step's critical path: a push, then a pull
    crossing = any(h != hk for h in whost for hk in shost)
    latency = 2 * (a_link if crossing else a_loc) + 2 * (G - 1) * a_in

    def step_start(w: int, s: int, t: float) -> None:
        # async workers that are ahead keep going until the slowest has played its
        # steps, so every worker's last steps meet the others' traffic
        if s >= steps and (sync or min(len(st) for st in starts) > steps):
            return
        for i, at in enumerate(launches(t, compute, buckets)):
            ev.at(at, lambda tt, w=w, s=s, i=i: launch(w, s, i, tt))
        end = t + D + F + B
        bw_end[(w, s)] = end
        ev.at(end, lambda tt, w=w, s=s: send_pulls(w, s, tt))

    def launch(w: int, s: int, i: int, t: float) -> None:
        parts = [(k, m / G) for k, m in pieces[i]]
        if G > 1:  # the host's reduce-scatter of the bucket, one collective at a time
            key = (whost[w], s, i)
            if key not in rs_done:
                c = buckets[i][0] / G
                rs_done[key] = inside[whost[w]].occupy(
                    t, (G - 1) * (a_in + c * b_in + c * g_in))
            t = rs_done[key]
        if mode == "byteps":
            push_partitions(w, s, i, t, parts)
            return
        msgs = [(m * wire, *path(w_io[w], whost[w], shost[k], s_io[k])) for k, m in parts]
        if cast:  # the worker casts the bucket before it goes out
            t = w_io[w].occupy(t, sum(m for _, m in parts) * cast)
        arrivals = send_together(t, msgs)
        for (k, m), arrive in zip(parts, arrivals):
            last_push[(w, s, k)] = max(last_push.get((w, s, k), 0.0), arrive)
            ev.at(arrive, lambda tt, k=k, w=w, s=s, m=m: push_arrives(k, w, s, m, tt))
        if w == 0 and s == steps - 1:
            bucket_times.append((t - starts[0][-1], max(arrivals) - starts[0][-1]))

    def push_arrives(k: int, w: int, s: int, m: float, t: float) -> None:
        if sync:
            done = s_cpu[k].occupy(t, m * (cal.gamma + cast))
            got[(k, s)] = got.get((k, s), 0) + m
            # every worker's push (ps), one per host (byteps: G parts of 1/G)
            if got[(k, s)] >= n / G * shard_bytes[k] * (1 - 1e-9):
                # the update, and the new version cast once for every pull of it
                done = s_cpu[k].occupy(done, shard_bytes[k] * (apply_per_byte + cast))
                ready_v[(k, s)] = done
                # the pulls held for this version are answered together; one that
                # arrives later, on its own
                held = [ww for ww in range(n)
                        if (k, ww, s) in pull_req and pull_req[(k, ww, s)] <= done]
                if held:
                    ev.at(done, lambda tt, k=k, held=held, s=s: answer_all(k, held, s, tt))
                for ww in range(n):
                    if (k, ww, s) in pull_req and ww not in held:
                        ev.at(pull_req[(k, ww, s)],
                              lambda tt, k=k, ww=ww, s=s: answer(k, ww, s, tt))
        else:
            # async: applied on arrival; its pull gets a cast of the parameters then
            own_done[(k, w, s)] = s_cpu[k].occupy(t, m * (cal.gamma + apply_per_byte
                                                          + 2 * cast))
            own[(k, w, s)] = own.get((k, w, s), 0) + m
            maybe_answer_async(k, w, s)

    # byteps: the servers hold the flat vector in columns (psring.strategies.byteps):
    # local rank l's part of every bucket, then l + 1's; local rank l pushes part l of
    # bucket i to the servers holding it, in `nparts` partitions of c bytes, one after
    # another on its connection. Unit (l, i, k, j) is partition j of that piece, complete
    # when every host's is in; (s, unit) -> bytes in; (w, s) -> units pulled.
    local = {x: sorted(y for y in range(n) if whost[y] == whost[x]).index(x) for x in range(n)}
    col = column_pieces(buckets, G, K) if mode == "byteps" else {}
    chunks = {(lr, i, k): (max(1, -(-int(m) // PARTITION_BYTES)), m)
              for (lr, i), p in col.items() for k, m in p}
    units = {lr: sum(c[0] for key, c in chunks.items() if key[0] == lr) for lr in range(G)}
    got_i: dict[tuple, float] = {}
    pushed: set[tuple[int, int]] = set()

    def push_partitions(w: int, s: int, i: int, t: float, parts) -> None:
        """Every worker pushes its part of bucket i (the first to get here plays all n: a
        synchronous step launches a bucket on every host at once), partition j of all of
        them side by side, sharing links and transports fairly, partitions one after
        another on each connection."""
        if (s, i) in pushed:
            return
        pushed.add((s, i))
        sends_of = [(x, k, *chunks[(local[x], i, k)]) for x in range(n)
                    for k, _ in col[(local[x], i)]]
        for j in range(max((c[2] for c in sends_of), default=0)):
            sends = [(k, x, m / nparts) for x, k, nparts, m in sends_of if j < nparts]
            msgs = [(c * wire, *path(w_io[x], whost[x], shost[k], s_io[k]))
                    for k, x, c in sends]
            for (k, x, c), arrive in zip(sends, send_together(t, msgs)):
                ev.at(arrive, lambda tt, k=k, x=x, u=(local[x], i, k, j), c=c:
                      piece_arrives(k, x, s, u, c, tt))
                if x == 0 and s == steps - 1:
                    bucket_times.append((t - starts[0][-1], arrive - starts[0][-1]))

    def piece_arrives(k: int, w: int, s: int, unit: tuple, c: float, t: float) -> None:
        """byteps: a partition of a worker's part (its pull already in); once every
        host's is in, it is summed (and updated) and streamed to the workers of that
        local rank."""
        done = s_cpu[k].occupy(t, c * cal.gamma)
        got_i[(s, unit)] = got_i.get((s, unit), 0.0) + c
        if got_i[(s, unit)] < n / G * c * (1 - 1e-9):
            return
        done = s_cpu[k].occupy(done, c * apply_per_byte)
        mates = [x for x in range(n) if local[x] == unit[0]]
        msgs = [(c * wire, *path(s_io[k], shost[k], whost[x], w_io[x])) for x in mates]
        for x, arrive in zip(mates, send_together(done, msgs)):
            ev.at(arrive, lambda tt, x=x: piece_pulled(x, s, tt))

    def piece_pulled(w: int, s: int, t: float) -> None:
        pulled[(w, s)] = pulled.get((w, s), 0) + 1
        pull_done[(w, s)] = max(pull_done.get((w, s), 0.0), t)
        if pulled[(w, s)] == units[local[w]]:
            pulls_complete(w, s)

    def send_pulls(w: int, s: int, t: float) -> None:
        if mode == "byteps":
            return  # sent with each push (piece_arrives)
        for k in range(K):
            a = a_loc if whost[w] == shost[k] else a_link
            # behind this worker's pushes on the same connection
            req = max(t + a, last_push.get((w, s, k), 0.0))
            pull_req[(k, w, s)] = req
            if sync:
                if (k, s) in ready_v:
                    ev.at(max(req, ready_v[(k, s)]),
                          lambda tt, k=k, w=w, s=s: answer(k, w, s, tt))
            else:
                maybe_answer_async(k, w, s)

    def maybe_answer_async(k: int, w: int, s: int) -> None:
        """Once w's pull is in and its pushes of step s are applied (the same
        connection: the server sees the pull behind them)."""
        if (k, w, s) in pull_req and own.get((k, w, s), 0) >= shard_bytes[k] and \
                (k, w, s) not in answered:
            answered.add((k, w, s))
            ev.at(max(pull_req[(k, w, s)], own_done[(k, w, s)]),
                  lambda tt, k=k, w=w, s=s: answer(k, w, s, tt))

    def answer(k: int, w: int, s: int, t: float) -> None:
        answer_all(k, [w], s, t)

    def answer_all(k: int, ws: list[int], s: int, t: float) -> None:
        msgs = [(shard_bytes[k] / G * wire, *path(s_io[k], shost[k], whost[w], w_io[w]))
                for w in ws]
        for w, arrive in zip(ws, send_together(t, msgs)):
            ev.at(arrive, lambda tt, k=k, w=w, s=s: pull_arrives(k, w, s, tt))

    def pull_arrives(k: int, w: int, s: int, t: float) -> None:
        pulled[(w, s)] = pulled.get((w, s), 0) + 1
        if cast:  # back to 32 bits on the worker
            t = w_io[w].occupy(t, shard_bytes[k] / G * cast)
        pull_done[(w, s)] = max(pull_done.get((w, s), 0.0), t)
        if pulled[(w, s)] == K:
            pulls_complete(w, s)

    def pulls_complete(w: int, s: int) -> None:
        if G == 1:
            nxt = max(pull_done[(w, s)], bw_end[(w, s)]) + (U if local_update else 0.0)
            starts[w].append(nxt)
            step_start(w, s + 1, nxt)
            return
        # byteps: once the host's G workers have their parts, it all-gathers every bucket
        ready = gathered.setdefault((whost[w], s), [])
        ready.append(w)
        if len(ready) < G:
            return
        t = max(pull_done[(x, s)] for x in ready)
        t = inside[whost[w]].occupy(t, sum((G - 1) * (a_in + m / G * b_in)
                                           for m, _ in buckets))
        for x in ready:
            nxt = max(t, bw_end[(x, s)]) + (U if local_update else 0.0)
            starts[x].append(nxt)
            step_start(x, s + 1, nxt)

    for w in range(n):
        step_start(w, 0, 0.0)
    ev.run()
    if any(len(st) < 3 for st in starts):  # a bug, not an input: say so plainly
        raise RuntimeError(f"the simulated {mode} round did not complete; steps per worker: "
                           f"{[len(st) - 1 for st in starts]}")
    periods = [(st[-1] - st[-3]) / 2 for st in starts]
    # the step time is the slowest worker's (a synchronous step's, for every worker; an
    # asynchronous run's slowest worker, as a sweep report's step time is the slowest
    # worker's), and the throughput every worker's
    period = max(periods)
    rate = sum(profile.batch_size / p for p in periods if p > 0)
    w0 = periods.index(period)
    window = (starts[w0][-2], starts[w0][-1])
    width = max(1e-12, window[1] - window[0])
    util = {}
    for r in [*w_io, *s_io, *s_cpu, *out.values(), *inn.values(), *inside.values()]:
        if r.beta > 0:
            util[r.name] = r.busy_between(*window) / width
    # per-step view of the busiest one in steady state (a shared resource's busy time
    # over worker 0's window stands for every worker's)
    pred = _finish(profile, cluster, mode, period, compute, local_update, util, latency,
                   bucket_times, total, starts[0])
    # throughput is every worker's; efficiency is that against n workers alone
    pred.samples_per_s = rate
    if profile.batch_size:
        pred.efficiency = min(1.0, rate * profile.compute_s / (n * profile.batch_size))
    return pred

