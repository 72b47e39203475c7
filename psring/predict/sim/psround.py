"""The parameter servers' cost models: ``ps`` (synchronous), ``ps-async`` (Downpour)
and ``byteps`` (per-host aggregation, summation servers).

A bucket is pushed in pieces to the K servers whose ranges it overlaps. Every message
travels on its connection (one direction of the TCP connection between a worker and a
server, a FIFO byte stream: a worker's pull goes out behind its pushes), and the
connections with bytes queued share their *links* at once, as TCP's flows do
(psring.predict.sim.engine.Flows): the sender's transport, the sender host's outgoing link
and the receiver host's incoming link when it crosses hosts, the receiver's transport;
a message arrives α after its last byte is carried. A server adds each piece
on arrival (bytes·γ on its CPU); synchronous, it updates a range (a bucket's part of its
shard) once every worker's piece of it is in and streams it to the pulls held, as
servers/handler.py does; asynchronous, it applies each push on arrival and answers that
worker's pull. byteps first reduce-scatters
each bucket among a host's G workers, pushes a 1/G part per worker in 4 MB partitions
and all-gathers once every part is pulled. (psring.predict.sim.simulate's docstring has the
whole picture.)
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from psring.predict.analytic import host_reduce, predict_comm
from psring.predict.sim.cost_models import COST_MODELS, CostModel, Prediction, Sim, finish
from psring.predict.sim.engine import (
    PARTITION_BYTES,
    Connection,
    Events,
    Flows,
    Link,
    Resource,
    column_pieces,
    group_size,
    host_steps,
    launches,
    server_update_per_byte,
    shard_pieces,
)
from psring.predict.sim.fluid import fluid_timeline


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
        self.ev = Events()
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
                                                            cluster.delay_s, cluster.loss)
        # the α on a step's critical path: a push, then a pull
        crossing = any(h != hk for h in self.whost for hk in self.shost)
        self.latency = 2 * (self.a_link if crossing else self.a_loc) + \
            (self.G - 1) * (self.rs[0] + self.ag[0])

    def _resources(self) -> None:
        n, K, b_loc = self.n, self.K, self.b_loc
        self.inside = {h: Resource(f"host {h} inside (reduce-scatter, all-gather)", self.rs[1])
                       for h in sorted(set(self.whost))}
        self.w_io = [Link(f"worker {w} transport", b_loc) for w in range(n)]
        self.s_io = [Link(f"server {k} transport", b_loc) for k in range(K)]
        self.s_cpu = [Resource(f"server {k} CPU", self.cal.gamma) for k in range(K)]
        self.w_cast = [Resource(f"worker {w} casts", self.sim.cast) for w in range(n)]
        # a message costs the most of its path's β: the link's figure is the transport's
        # between hosts (calibrated, or the rate's on paper), never below loopback's
        hosts = sorted({*self.whost, *self.shost})
        self.out = {h: Link(f"host {h} link out", self.b_link) for h in hosts}
        self.inn = {h: Link(f"host {h} link in", self.b_link) for h in hosts}
        self.flows = Flows(self.ev, self.sim.flow_spread, self.sim.flow_seed)
        self.conns: dict[tuple[int, int, bool], Connection] = {}
        # a GPU worker's copy engines, one each way (the profile's host_copy): gradients
        # out to pinned memory before a push, parameters back after a pull
        self.copy_engine = {d: [Resource(f"worker {w} {d}", 0.0) for w in range(n)]
                            for d in ("d2h", "h2d")}

    def conn(self, w: int, k: int, up: bool) -> Connection:
        """Worker w's connection to server k, one direction: ``up`` to the server."""
        key = (w, k, up)
        if key not in self.conns:
            hw, hk = self.whost[w], self.shost[k]
            src, dst = (self.w_io[w], self.s_io[k]) if up else (self.s_io[k], self.w_io[w])
            h_src, h_dst = (hw, hk) if up else (hk, hw)
            if h_src == h_dst:
                self.conns[key] = self.flows.connection([src, dst], self.a_loc)
            else:
                self.conns[key] = self.flows.connection(
                    [src, self.out[h_src], self.inn[h_dst], dst], self.a_link)
        return self.conns[key]

    def copied(self, w: int, direction: str, nbytes: float, t: float) -> float:
        """When worker w's copy of ``nbytes`` ("d2h" or "h2d"), ready at t, is done."""
        seconds = self.sim.profile.copy_s(direction, nbytes)  # (0 without host_copy)
        return self.copy_engine[direction][w].occupy(t, seconds) if seconds else t

    def _state(self) -> None:
        self.starts = [[0.0] for _ in range(self.n)]
        self.bw_end: dict[tuple[int, int], float] = {}  # (w, s) -> when w's backward ended
        self.got: dict = {}        # (k, s, bucket) -> float32 bytes received (sync)
        self.own: dict = {}        # (k, w, s) -> bytes of w's pushes applied (async)
        self.pull_req: dict = {}   # (k, w, s) -> when w's pull reached server k
        self.ready_r: dict = {}    # (k, s) -> bytes of each range of version s+1 updated (sync)
        self.pulled: dict = {}     # (w, s) -> bytes of parameters arrived (byteps: pieces)
        self.pull_done: dict = {}  # (w, s) -> when the last shard's arrived
        self.bucket_times: list[list[float]] = []  # worker 0's last step: [launch, done]
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
        self.pushed_buckets: set[tuple[int, int, int]] = set()

    def at(self, t: float, event: Callable[..., None], *args) -> None:
        """``event(*args, t)`` at time t."""
        self.ev.at(t, lambda tt: event(*args, tt))

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
            self.at(t, self.push_partitions, self.whost[w], s, i)
            return
        if sim.cast:  # the worker casts the bucket before it goes out
            t = self.w_cast[w].occupy(t, sum(m for _, m in parts) * sim.cast)
        self.at(t, self.push_parts, w, s, i, parts)

    def timed(self, s: int, t: float) -> list[float] | None:
        """Worker 0's bucket launched at t in the last step: its [launch, done] from the
        step's start (done moves with every piece that arrives: arrived)."""
        if s != self.sim.steps - 1:
            return None
        self.bucket_times.append([t - self.starts[0][-1]] * 2)
        return self.bucket_times[-1]

    def arrived(self, timed: list[float] | None, t: float) -> None:
        if timed is not None:
            timed[1] = max(timed[1], t - self.starts[0][-1])

    def push_parts(self, w: int, s: int, i: int, parts: list, t: float) -> None:
        timed = self.timed(s, t) if w == 0 else None
        for k, m in parts:
            self.conn(w, k, True).send(t, m * self.sim.wire,
                                       partial(self.pushed, k, w, s, i, m, timed))

    def pushed(self, k: int, w: int, s: int, i: int, m: float, timed: list | None,
               t: float) -> None:
        self.arrived(timed, t)
        self.push_arrives(k, w, s, i, m, t)

    def send_pulls(self, w: int, s: int, t: float) -> None:
        if self.mode == "byteps":
            return  # sent with each push (piece_arrives)
        for k in range(self.K):
            # behind this worker's pushes on the same connection
            self.conn(w, k, True).send(t, 0.0, partial(self.pull_in, k, w, s))

    def pull_in(self, k: int, w: int, s: int, t: float) -> None:
        """Worker w's pull reached server k: async, answered once its pushes are applied;
        sync, the ranges of the new version updated so far go at once, the others as
        they are updated (range_ready)."""
        self.pull_req[(k, w, s)] = t
        if not self.sync:
            self.maybe_answer_async(k, w, s)
            return
        for m in self.ready_r.get((k, s), ()):
            self.answer(k, w, s, m, t)

    # -- a server ---------------------------------------------------------------------

    def push_arrives(self, k: int, w: int, s: int, i: int, m: float, t: float) -> None:
        cal, cast = self.cal, self.sim.cast
        if not self.sync:
            # async: applied on arrival; its pull gets a cast of the parameters then
            self.own_done[(k, w, s)] = self.s_cpu[k].occupy(
                t, m * (cal.gamma + self.apply_per_byte + 2 * cast))
            self.own[(k, w, s)] = self.own.get((k, w, s), 0) + m
            self.maybe_answer_async(k, w, s)
            return
        done = self.s_cpu[k].occupy(t, m * (cal.gamma + cast))
        self.got[(k, s, i)] = self.got.get((k, s, i), 0) + m
        if self.got[(k, s, i)] >= self.n * m * (1 - 1e-9):
            # every worker's piece is in: the range is updated and cast once for every
            # pull of it, then streamed to the pulls already held (servers/handler.py)
            done = self.s_cpu[k].occupy(done, m * (self.apply_per_byte + cast))
            self.at(done, self.range_ready, k, s, m)

    def range_ready(self, k: int, s: int, m: float, t: float) -> None:
        self.ready_r.setdefault((k, s), []).append(m)
        for w in range(self.n):
            if (k, w, s) in self.pull_req:
                self.answer(k, w, s, m, t)

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
        for w in ws:
            self.answer(k, w, s, self.shard_bytes[k] / self.G, t)

    def answer(self, k: int, w: int, s: int, m: float, t: float) -> None:
        """Server k sends ``m`` float32 bytes of its parameters to worker w's pull."""
        self.conn(w, k, False).send(t, m * self.sim.wire,
                                    partial(self.pull_arrives, k, w, s, m))

    def pull_arrives(self, k: int, w: int, s: int, m: float, t: float) -> None:
        """``m`` float32 bytes of server k's parameters reached worker w."""
        self.pulled[(w, s)] = self.pulled.get((w, s), 0) + m
        if self.sim.cast:  # back to 32 bits on the worker
            t = self.w_cast[w].occupy(t, m * self.sim.cast)
        t = self.copied(w, "h2d", m, t)  # (a GPU's parameters)
        self.pull_done[(w, s)] = max(self.pull_done.get((w, s), 0.0), t)
        if self.pulled[(w, s)] >= sum(self.shard_bytes) / self.G * (1 - 1e-9):
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
        self.at(t, self.flows.mark)  # what the links carried by then (utilization)
        self.step_start(w, s + 1, t)

    # -- byteps's partitions -------------------------------------------------------------

    def push_partitions(self, host: int, s: int, i: int, t: float) -> None:
        """The workers of ``host`` push their parts of bucket i (the first of them to get
        here plays the host's G: they reduce-scattered it together) to the servers
        holding them, in partitions, one after another on each connection. Each host
        pushes when its own backward has the bucket: a host behind pushes late."""
        if (host, s, i) in self.pushed_buckets:
            return
        self.pushed_buckets.add((host, s, i))
        local, wire = self.local, self.sim.wire
        timed = self.timed(s, t) if host == self.whost[0] else None
        for x in range(self.n):
            if self.whost[x] != host:
                continue
            for k, _ in self.col[(local[x], i)]:
                nparts, m = self.chunks[(local[x], i, k)]
                for j in range(nparts):
                    self.conn(x, k, True).send(t, m / nparts * wire, partial(
                        self.piece_arrives, k, s, (local[x], i, k, j), m / nparts,
                        timed if x == 0 else None))

    def piece_arrives(self, k: int, s: int, unit: tuple, c: float, timed: list | None,
                      t: float) -> None:
        """A partition of a worker's part (its pull already in); once every host's is
        in, it is summed (and updated) and streamed to the workers of that local rank."""
        self.arrived(timed, t)
        done = self.s_cpu[k].occupy(t, c * self.cal.gamma)
        self.got_i[(s, unit)] = self.got_i.get((s, unit), 0.0) + c
        if self.got_i[(s, unit)] < self.n / self.G * c * (1 - 1e-9):
            return
        done = self.s_cpu[k].occupy(done, c * self.apply_per_byte)
        self.at(done, self.piece_answer, k, s, unit[0], c)

    def piece_answer(self, k: int, s: int, lr: int, c: float, t: float) -> None:
        for x in range(self.n):
            if self.local[x] == lr:
                self.conn(x, k, False).send(t, c * self.sim.wire,
                                            partial(self.piece_pulled, x, s, c))

    def piece_pulled(self, w: int, s: int, c: float, t: float) -> None:
        self.pulled[(w, s)] = self.pulled.get((w, s), 0) + 1
        t = self.copied(w, "h2d", c, t)  # (a GPU's: back to the device)
        self.pull_done[(w, s)] = max(self.pull_done.get((w, s), 0.0), t)
        if self.pulled[(w, s)] == self.units[self.local[w]]:
            self.pulls_complete(w, s)

    # -- the result -----------------------------------------------------------------------

    def run(self) -> Prediction:
        self.flows.mark(0.0)
        for w in range(self.n):
            self.step_start(w, 0, 0.0)
        self.ev.run()
        if any(len(st) < 3 for st in self.starts):  # a bug, not an input: say so plainly
            raise RuntimeError(f"the simulated {self.mode} round did not complete; steps "
                               f"per worker: {[len(st) - 1 for st in self.starts]}")
        return self.prediction()

    def prediction(self) -> Prediction:
        sim, starts = self.sim, self.starts
        # the steady state: every step after the first two (the flows' shares vary from
        # burst to burst, so a step's time is a mean over several)
        first = min(2, len(starts[0]) - 3)
        periods = [(st[-1] - st[first]) / (len(st) - 1 - first) for st in starts]
        # the step time is the slowest worker's (a synchronous step's, for every worker;
        # an asynchronous run's slowest worker, as a sweep report's step time is the
        # slowest worker's), and the throughput every worker's
        period = max(periods)
        rate = sum(sim.profile.batch_size / p for p in periods if p > 0)
        w0 = periods.index(period)
        window = (starts[w0][first], starts[w0][-1])
        width = max(1e-12, window[1] - window[0])
        util = {}
        for link in [*self.w_io, *self.s_io, *self.out.values(), *self.inn.values()]:
            if link.beta > 0:
                util[link.name] = self.flows.busy(link, *window) / width
        for r in [*self.s_cpu, *self.inside.values()]:
            if r.beta > 0:
                util[r.name] = r.busy_between(*window) / width
        if sim.profile.host_copy:  # a GPU worker's copies: worker 0's engines stand for all
            for r in (self.copy_engine["d2h"][0], self.copy_engine["h2d"][0]):
                util[r.name] = r.busy_between(*window) / width
        # per-step view of the busiest one in steady state (a shared resource's busy time
        # over worker 0's window stands for every worker's)
        pred = finish(sim, self.mode, period, local_update=self.local_update, util=util,
                      latency=self.latency,
                      bucket_times=[(a, b) for a, b in self.bucket_times],
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
    # the ping-pong's CPU cost of a message, not the measured PS round's
    # (Calibration.ps_transport): that round is wall time on these same shared cores,
    # their contention already in it
    alpha, beta = cal.zmq_alpha, cal.zmq_beta
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
        name, partial(ps_timeline, mode=name), transport="zmq", servers=True, draws_flows=True,
        cpu_work=partial(ps_cpu_work, mode=name), formula=partial(predict_comm, name),
        fluid=partial(fluid_timeline, mode=name), **kw))


# (the step time is a mean over all steps but the first two: see prediction())
_register("ps", steps=10)
_register("ps-async", steps=12)  # (workers drift apart: more steps to a steady state)
_register("byteps", steps=8, settings=("update_on",))
