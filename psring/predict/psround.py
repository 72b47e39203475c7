"""The parameter servers' cost models: ``ps`` (synchronous), ``ps-async`` (Downpour)
and ``byteps`` (per-host aggregation, summation servers).

A bucket is pushed in pieces to the K servers whose ranges it overlaps. A message
occupies every *resource* on its path at once (cut-through, each resource first come
first served) for bytes·β of that resource: the sender's transport, the sender host's
outgoing link and the receiver host's incoming link when it crosses hosts, the
receiver's transport; it arrives α after the slowest is done. A server adds each piece
on arrival (bytes·γ on its CPU), applies the update once a version is complete (sync)
or each push on arrival (async), and answers the pulls. byteps first reduce-scatters
each bucket among a host's G workers, pushes a 1/G part per worker in 4 MB partitions
and all-gathers once every part is pulled. (psring.predict.simulate's docstring has the
whole picture.)
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from psring.predict.costmodel import host_reduce, predict_comm
from psring.predict.costs import COST_MODELS, CostModel, Prediction, Sim, finish
from psring.predict.engine import (
    Events,
    Resource,
    column_pieces,
    group_size,
    host_steps,
    launches,
    send_together,
    server_update_per_byte,
    shard_pieces,
)

#: byteps's largest push, bytes (psring.strategies.byteps.PARTITION_ELEMENTS x 4; kept
#: here so the simulator needs no torch; a test checks the two agree)
PARTITION_BYTES = 4_096_000


class PSRound:
    """Every worker's and server's steps of one PS cost model, played as events: the
    methods are the events (a bucket launched, a push arriving, a pull answered...)."""

    def __init__(self, sim: Sim, mode: str):
        self.sim, self.mode, self.cal = sim, mode, sim.cal
        cluster = sim.cluster
        self.n, self.K = cluster.workers, cluster.servers
        self.sync = mode in ("ps", "byteps")
        # byteps: G workers a host aggregate first; each pushes and pulls 1/G
        self.G = group_size(cluster) if mode == "byteps" else 1
        self.local_update = mode == "byteps" and sim.update_on == "worker"
        # summing servers (byteps updating on the workers) only add
        self.apply_per_byte = 0.0 if self.local_update else \
            server_update_per_byte(sim.profile, self.cal)
        self.whost, self.shost = cluster.worker_host, cluster.server_host
        self._links()
        self._resources()
        # each bucket's pieces: (shard, float32 bytes) by the servers' element ranges, as
        # psring.strategies.ps splits them (float32 elements: 4 bytes)
        self.pieces, self.shard_bytes = shard_pieces(sim.buckets, self.K)
        self.K = len(self.shard_bytes)
        self._state()
        if mode == "byteps":
            self._columns()

    def _links(self) -> None:
        cal, cluster, sim = self.cal, self.sim.cluster, self.sim
        # the host's collectives: a step of its reduce-scatter, of its all-gather
        self.rs, self.ag = host_steps(sim)
        self.a_loc, self.b_loc = cal.link(self.mode)
        self.a_link, self.b_link = self.a_loc, self.b_loc
        if cluster.hosts > 1 or cluster.placement == "own-hosts":
            self.a_link, self.b_link, _ = cal.between_hosts(self.mode, cluster.link_bits,
                                                            cluster.delay_s)
        # the α on a step's critical path: a push, then a pull
        crossing = any(h != hk for h in self.whost for hk in self.shost)
        self.latency = 2 * (self.a_link if crossing else self.a_loc) + \
            (self.G - 1) * (self.rs[0] + self.ag[0])

    def _resources(self) -> None:
        n, K, b_loc = self.n, self.K, self.b_loc
        self.inside = {h: Resource(f"host {h} inside (reduce-scatter, all-gather)", self.rs[1])
                       for h in sorted(set(self.whost))}
        self.w_io = [Resource(f"worker {w} transport", b_loc) for w in range(n)]
        self.s_io = [Resource(f"server {k} transport", b_loc) for k in range(K)]
        self.s_cpu = [Resource(f"server {k} CPU", self.cal.gamma) for k in range(K)]
        # a message costs the most of its path's β: the link's figure is the transport's
        # between hosts (calibrated, or the rate's on paper), never below loopback's
        hosts = sorted({*self.whost, *self.shost})
        self.out = {h: Resource(f"host {h} link out", self.b_link) for h in hosts}
        self.inn = {h: Resource(f"host {h} link in", self.b_link) for h in hosts}
        # a GPU worker's copy engines, one each way (the profile's host_copy): gradients
        # out to pinned memory before a push, parameters back after a pull
        self.copy_engine = {d: [Resource(f"worker {w} {d}", 0.0) for w in range(n)]
                            for d in ("d2h", "h2d")}

    def copied(self, w: int, direction: str, nbytes: float, t: float) -> float:
        """When worker w's copy of ``nbytes`` ("d2h" or "h2d"), ready at t, is done."""
        seconds = self.sim.profile.copy_s(direction, nbytes)  # (0 without host_copy)
        return self.copy_engine[direction][w].occupy(t, seconds) if seconds else t

    def _state(self) -> None:
        self.ev = Events()
        self.starts = [[0.0] for _ in range(self.n)]
        self.bw_end: dict[tuple[int, int], float] = {}  # (w, s) -> when w's backward ended
        self.got: dict = {}        # (k, s) -> float32 bytes received (sync)
        self.own: dict = {}        # (k, w, s) -> bytes of w's pushes applied (async)
        self.pull_req: dict = {}   # (k, w, s) -> when w's pull reached server k
        self.ready_v: dict = {}    # (k, s) -> when version s+1 is ready (sync)
        self.pulled: dict = {}     # (w, s) -> shards whose parameters arrived
        self.pull_done: dict = {}  # (w, s) -> when the last shard's arrived
        self.bucket_times: list[tuple[float, float]] = []
        self.last_push: dict = {}  # (w, s, k) -> when w's last piece reached server k
        self.own_done: dict = {}   # (k, w, s) -> when the server applied w's last piece
        self.answered: set = set()  # (k, w, s) pulls answered (async)
        # byteps: (host, s, bucket) -> its parts reduce-scattered; (host, s) -> workers
        # with their pulls in
        self.rs_done: dict[tuple[int, int, int], float] = {}
        self.gathered: dict[tuple[int, int], list[int]] = {}

    def _columns(self) -> None:
        """byteps: the servers hold the flat vector in columns (psring.strategies.byteps):
        local rank l's part of every bucket, then l + 1's; local rank l pushes part l of
        bucket i to the servers holding it, in partitions of at most PARTITION_BYTES,
        one after another on its connection. Unit (l, i, k, j) is partition j of that
        piece, complete when every host's is in."""
        n, G, whost = self.n, self.G, self.whost
        self.local = {x: sorted(y for y in range(n) if whost[y] == whost[x]).index(x)
                      for x in range(n)}
        self.col = column_pieces(self.sim.buckets, G, self.K)
        self.chunks = {(lr, i, k): (max(1, -(-int(m) // PARTITION_BYTES)), m)
                       for (lr, i), p in self.col.items() for k, m in p}
        self.units = {lr: sum(c[0] for key, c in self.chunks.items() if key[0] == lr)
                      for lr in range(G)}
        self.got_i: dict[tuple, float] = {}   # (s, unit) -> bytes in
        self.pushed: set[tuple[int, int]] = set()

    def at(self, t: float, event: Callable[..., None], *args) -> None:
        """``event(*args, t)`` at time t."""
        self.ev.at(t, lambda tt: event(*args, tt))

    def path(self, src_io: Resource, h_src: int, h_dst: int, dst_io: Resource) -> tuple:
        if h_src == h_dst:
            return [src_io, dst_io], self.a_loc
        return [src_io, self.out[h_src], self.inn[h_dst], dst_io], self.a_link

    # -- a worker's step ------------------------------------------------------------------

    def step_start(self, w: int, s: int, t: float) -> None:
        sim = self.sim
        # async workers that are ahead keep going until the slowest has played its
        # steps, so every worker's last steps meet the others' traffic
        if s >= sim.steps and (self.sync or min(len(st) for st in self.starts) > sim.steps):
            return
        for i, at in enumerate(launches(t, sim.compute, sim.buckets)):
            self.at(at, self.launch, w, s, i)
        D, F, B, _ = sim.compute
        end = t + D + F + B
        self.bw_end[(w, s)] = end
        self.at(end, self.send_pulls, w, s)

    def launch(self, w: int, s: int, i: int, t: float) -> None:
        G, sim = self.G, self.sim
        parts = [(k, m / G) for k, m in self.pieces[i]]
        if G > 1:  # the host's reduce-scatter of the bucket, one collective at a time
            key = (self.whost[w], s, i)
            if key not in self.rs_done:
                c = sim.buckets[i][0] / G
                self.rs_done[key] = self.inside[self.whost[w]].occupy(
                    t, (G - 1) * (self.rs[0] + c * self.rs[1]))
            t = self.rs_done[key]
        t = self.copied(w, "d2h", sum(m for _, m in parts), t)  # (a GPU's: to the host)
        if self.mode == "byteps":
            self.push_partitions(s, i, t)
            return
        msgs = [(m * sim.wire, *self.path(self.w_io[w], self.whost[w], self.shost[k],
                                          self.s_io[k])) for k, m in parts]
        if sim.cast:  # the worker casts the bucket before it goes out
            t = self.w_io[w].occupy(t, sum(m for _, m in parts) * sim.cast)
        arrivals = send_together(t, msgs)
        for (k, m), arrive in zip(parts, arrivals):
            self.last_push[(w, s, k)] = max(self.last_push.get((w, s, k), 0.0), arrive)
            self.at(arrive, self.push_arrives, k, w, s, m)
        if w == 0 and s == sim.steps - 1:
            first = self.starts[0][-1]
            self.bucket_times.append((t - first, max(arrivals) - first))

    def send_pulls(self, w: int, s: int, t: float) -> None:
        if self.mode == "byteps":
            return  # sent with each push (piece_arrives)
        for k in range(self.K):
            a = self.a_loc if self.whost[w] == self.shost[k] else self.a_link
            # behind this worker's pushes on the same connection
            req = max(t + a, self.last_push.get((w, s, k), 0.0))
            self.pull_req[(k, w, s)] = req
            if not self.sync:
                self.maybe_answer_async(k, w, s)
            elif (k, s) in self.ready_v:
                self.at(max(req, self.ready_v[(k, s)]), self.answer_all, k, [w], s)

    # -- a server ---------------------------------------------------------------------

    def push_arrives(self, k: int, w: int, s: int, m: float, t: float) -> None:
        cal, cast = self.cal, self.sim.cast
        if not self.sync:
            # async: applied on arrival; its pull gets a cast of the parameters then
            self.own_done[(k, w, s)] = self.s_cpu[k].occupy(
                t, m * (cal.gamma + self.apply_per_byte + 2 * cast))
            self.own[(k, w, s)] = self.own.get((k, w, s), 0) + m
            self.maybe_answer_async(k, w, s)
            return
        done = self.s_cpu[k].occupy(t, m * (cal.gamma + cast))
        self.got[(k, s)] = self.got.get((k, s), 0) + m
        # every worker's push (ps), one per host (byteps: G parts of 1/G)
        if self.got[(k, s)] >= self.n / self.G * self.shard_bytes[k] * (1 - 1e-9):
            # the update, and the new version cast once for every pull of it
            done = self.s_cpu[k].occupy(done, self.shard_bytes[k]
                                        * (self.apply_per_byte + cast))
            self.version_ready(k, s, done)

    def version_ready(self, k: int, s: int, done: float) -> None:
        """The pulls held for this version are answered together; one that arrives
        later, on its own."""
        self.ready_v[(k, s)] = done
        asked = [w for w in range(self.n) if (k, w, s) in self.pull_req]
        held = [w for w in asked if self.pull_req[(k, w, s)] <= done]
        if held:
            self.at(done, self.answer_all, k, held, s)
        for w in asked:
            if w not in held:
                self.at(self.pull_req[(k, w, s)], self.answer_all, k, [w], s)

    def maybe_answer_async(self, k: int, w: int, s: int) -> None:
        """Once w's pull is in and its pushes of step s are applied (the same
        connection: the server sees the pull behind them)."""
        key = (k, w, s)
        if key in self.pull_req and self.own.get(key, 0) >= self.shard_bytes[k] and \
                key not in self.answered:
            self.answered.add(key)
            self.at(max(self.pull_req[key], self.own_done[key]), self.answer_all,
                    k, [w], s)

    def answer_all(self, k: int, ws: list[int], s: int, t: float) -> None:
        wire, G = self.sim.wire, self.G
        msgs = [(self.shard_bytes[k] / G * wire,
                 *self.path(self.s_io[k], self.shost[k], self.whost[w], self.w_io[w]))
                for w in ws]
        for w, arrive in zip(ws, send_together(t, msgs)):
            self.at(arrive, self.pull_arrives, k, w, s)

    def pull_arrives(self, k: int, w: int, s: int, t: float) -> None:
        self.pulled[(w, s)] = self.pulled.get((w, s), 0) + 1
        if self.sim.cast:  # back to 32 bits on the worker
            t = self.w_io[w].occupy(t, self.shard_bytes[k] / self.G * self.sim.cast)
        t = self.copied(w, "h2d", self.shard_bytes[k] / self.G, t)  # (a GPU's parameters)
        self.pull_done[(w, s)] = max(self.pull_done.get((w, s), 0.0), t)
        if self.pulled[(w, s)] == self.K:
            self.pulls_complete(w, s)

    def pulls_complete(self, w: int, s: int) -> None:
        U = self.sim.compute[3] if self.local_update else 0.0
        if self.G == 1:
            self.next_step(w, s, max(self.pull_done[(w, s)], self.bw_end[(w, s)]) + U)
            return
        # byteps: once the host's G workers have their parts, it all-gathers every bucket
        ready = self.gathered.setdefault((self.whost[w], s), [])
        ready.append(w)
        if len(ready) < self.G:
            return
        t = max(self.pull_done[(x, s)] for x in ready)
        G = self.G
        t = self.inside[self.whost[w]].occupy(t, sum(
            (G - 1) * (self.ag[0] + m / G * self.ag[1]) for m, _ in self.sim.buckets))
        for x in ready:
            self.next_step(x, s, max(t, self.bw_end[(x, s)]) + U)

    def next_step(self, w: int, s: int, t: float) -> None:
        self.starts[w].append(t)
        self.step_start(w, s + 1, t)

    # -- byteps's partitions -------------------------------------------------------------

    def push_partitions(self, s: int, i: int, t: float) -> None:
        """Every worker pushes its part of bucket i (the first to get here plays all n: a
        synchronous step launches a bucket on every host at once), partition j of all of
        them side by side, sharing links and transports fairly, partitions one after
        another on each connection."""
        if (s, i) in self.pushed:
            return
        self.pushed.add((s, i))
        local, wire = self.local, self.sim.wire
        sends_of = [(x, k, *self.chunks[(local[x], i, k)]) for x in range(self.n)
                    for k, _ in self.col[(local[x], i)]]
        for j in range(max((c[2] for c in sends_of), default=0)):
            sends = [(k, x, m / nparts) for x, k, nparts, m in sends_of if j < nparts]
            msgs = [(c * wire, *self.path(self.w_io[x], self.whost[x], self.shost[k],
                                          self.s_io[k])) for k, x, c in sends]
            for (k, x, c), arrive in zip(sends, send_together(t, msgs)):
                self.at(arrive, self.piece_arrives, k, s, (local[x], i, k, j), c)
                if x == 0 and s == self.sim.steps - 1:
                    first = self.starts[0][-1]
                    self.bucket_times.append((t - first, arrive - first))

    def piece_arrives(self, k: int, s: int, unit: tuple, c: float, t: float) -> None:
        """A partition of a worker's part (its pull already in); once every host's is
        in, it is summed (and updated) and streamed to the workers of that local rank."""
        done = self.s_cpu[k].occupy(t, c * self.cal.gamma)
        self.got_i[(s, unit)] = self.got_i.get((s, unit), 0.0) + c
        if self.got_i[(s, unit)] < self.n / self.G * c * (1 - 1e-9):
            return
        done = self.s_cpu[k].occupy(done, c * self.apply_per_byte)
        mates = [x for x in range(self.n) if self.local[x] == unit[0]]
        msgs = [(c * self.sim.wire, *self.path(self.s_io[k], self.shost[k], self.whost[x],
                                               self.w_io[x])) for x in mates]
        for x, arrive in zip(mates, send_together(done, msgs)):
            self.at(arrive, self.piece_pulled, x, s, c)

    def piece_pulled(self, w: int, s: int, c: float, t: float) -> None:
        self.pulled[(w, s)] = self.pulled.get((w, s), 0) + 1
        t = self.copied(w, "h2d", c, t)  # (a GPU's: back to the device)
        self.pull_done[(w, s)] = max(self.pull_done.get((w, s), 0.0), t)
        if self.pulled[(w, s)] == self.units[self.local[w]]:
            self.pulls_complete(w, s)

    # -- the result -----------------------------------------------------------------------

    def run(self) -> Prediction:
        for w in range(self.n):
            self.step_start(w, 0, 0.0)
        self.ev.run()
        if any(len(st) < 3 for st in self.starts):  # a bug, not an input: say so plainly
            raise RuntimeError(f"the simulated {self.mode} round did not complete; steps "
                               f"per worker: {[len(st) - 1 for st in self.starts]}")
        return self.prediction()

    def prediction(self) -> Prediction:
        sim, starts = self.sim, self.starts
        periods = [(st[-1] - st[-3]) / 2 for st in starts]
        # the step time is the slowest worker's (a synchronous step's, for every worker;
        # an asynchronous run's slowest worker, as a sweep report's step time is the
        # slowest worker's), and the throughput every worker's
        period = max(periods)
        rate = sum(sim.profile.batch_size / p for p in periods if p > 0)
        w0 = periods.index(period)
        window = (starts[w0][-2], starts[w0][-1])
        width = max(1e-12, window[1] - window[0])
        util = {}
        for r in [*self.w_io, *self.s_io, *self.s_cpu, *self.out.values(),
                  *self.inn.values(), *self.inside.values()]:
            if r.beta > 0:
                util[r.name] = r.busy_between(*window) / width
        # per-step view of the busiest one in steady state (a shared resource's busy time
        # over worker 0's window stands for every worker's)
        pred = finish(sim, self.mode, period, local_update=self.local_update, util=util,
                      latency=self.latency, bucket_times=self.bucket_times,
                      starts=starts[0])
        # throughput is every worker's; efficiency is that against n workers alone
        pred.samples_per_s = rate
        if sim.profile.batch_size:
            pred.efficiency = min(1.0, rate * sim.profile.compute_s
                                  / (self.n * sim.profile.batch_size))
        return pred


def ps_timeline(sim: Sim, mode: str) -> Prediction:
    return PSRound(sim, mode).run()


def ps_cpu_work(sim: Sim, mode: str) -> float:
    """A step's CPU work on shared cores: the workers' compute (less the update a server
    applies), their messages' α and loopback β — pushes and their acks, pulls and their
    parameters — byteps's host collectives as gloo's cost on loopback, and the servers'
    adds and updates."""
    cluster, cal, profile = sim.cluster, sim.cal, sim.profile
    n, K, total, wire, cast = cluster.workers, cluster.servers, sim.total, sim.wire, sim.cast
    alpha, beta = cal.link(mode)
    threads = max(1, profile.threads or 1)
    on_workers = mode == "byteps" and sim.update_on == "worker"  # (the optimizer's work)
    compute = profile.compute_s - (0.0 if on_workers else profile.update_s)
    pieces, shards = shard_pieces(sim.buckets, K)
    msgs = 2 * sum(len(p) for p in pieces) + 2 * len(shards)
    sent = 2 * total * wire
    g = group_size(cluster) if mode == "byteps" else 1
    inside = 0.0
    if g > 1:  # a 1/G part each, plus the host's reduce-scatters and all-gathers
        sent /= g
        inside = sum(host_reduce(g, m, *cal.host_steps()) for m, _ in sim.buckets)
    apply = server_update_per_byte(profile, cal)
    if mode == "ps-async":  # every push applied, and a cast for its pull
        server = n * total * (cal.gamma + apply + 2 * cast)
    elif mode == "byteps":  # one push per host added (and the update)
        server = n // g * total * cal.gamma + (0.0 if on_workers else total * apply)
    else:  # every push added, one update and one cast per version
        server = n * total * (cal.gamma + cast) + total * (apply + cast)
    return n * (compute * threads + msgs * alpha + sent * beta + inside
                + 2 * total * cast) + server


def _register(name: str, **kw) -> None:
    COST_MODELS.register(name)(CostModel(
        name, partial(ps_timeline, mode=name), transport="zmq", servers=True,
        cpu_work=partial(ps_cpu_work, mode=name), formula=partial(predict_comm, name), **kw))


_register("ps")
_register("ps-async", steps=8)  # (workers drift apart: more steps to a steady state)
_register("byteps", settings=("update_on",))
