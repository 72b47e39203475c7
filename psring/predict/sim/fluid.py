"""The parameter servers' step as a fluid: each resource's load per byte, the buckets
pipelined through the busiest one — the same resources as psring.predict.sim.psround's
events, priced in closed form, so a round of a thousand workers costs what a round of
two does.

psround plays every message on its connection, which grows as workers × servers
(seconds of Python at 64 workers, minutes at 256); the scaling question
(psring.predict.scaling) asks about 1 to 65536. Here every sender is alike (a
cluster's hosts hold the same number of workers) and links are shared evenly, so a
bucket's push is one job that loads each resource it crosses for its bytes' time:

- each host link, one direction, at the link's β (every sender's bytes to the servers
  on other hosts cross its host's link out; a server host's link in takes its servers'
  share from the senders elsewhere);
- each server's transport (loopback's β, both directions) and CPU (γ a byte to add,
  the profile's update per byte once a range is complete, every push under
  ``ps-async``);
- each sender's transport: its own bytes (byteps: a worker's 1/G part).

The resources serve the jobs first come, first served, each at its own pace (a job is
done when its last resource is), but for a sender host's link out where no server lives
on it: its connections to the servers share it evenly (:func:`fair_share`), as TCP's
flows do, so a sender's pushes to all its servers progress together. A bucket is pushed
once it is ready (after the host's reduce-scatter under byteps, its device-to-host copy
and its cast, each a stage of its own); byteps pulls each partition back once summed,
while later ones are pushed; a ps worker pulls a server's shard once its pushes to it
are in and backward has ended, after its pushes; then the copy back, the cast and
byteps's all-gather. A step starts when the previous one's parameters are in, so one
step is the period. What the events have and this does not: TCP's uneven shares
(FLOW_SPREAD; the fluid is the events' ``flow_spread=0``) and the per-message α of every
piece but the last.
tests/unit/test_scaling.py holds the two against each other where both run.
"""

from __future__ import annotations

import functools
import heapq
from collections import Counter

import numpy as np

from psring.predict.sim.cost_models import Prediction, Sim, finish
from psring.predict.sim.engine import (
    PARTITION_BYTES,
    column_pieces,
    group_size,
    host_steps,
    launches,
    server_update_per_byte,
    shard_pieces,
)


class _Resources:
    """The round's resources as one vector, and each job's seconds on them: server k's
    transport and CPU, each host's link out and in, a sender's transport."""

    def __init__(self, sim: Sim, mode: str, senders: list[int]) -> None:
        cl, cal = sim.cluster, sim.cal
        self.K = cl.servers
        self.shost = np.asarray(cl.server_host[:self.K])
        hosts = sorted({*senders, *cl.server_host})
        self.hosts = hosts
        H = len(hosts)
        self.R = 2 * self.K + 2 * H + 1  # transports, CPUs, links out, links in, sender
        index = {h: i for i, h in enumerate(hosts)}
        on = Counter(senders)
        S = len(senders)
        self.S = S
        a_loc, self.b_loc = cal.link(mode)
        self.a_link, self.b_link = a_loc, self.b_loc
        if cl.hosts > 1 or cl.placement == "own-hosts":
            self.a_link, self.b_link, _ = cal.between_hosts(mode, cl.link_bits,
                                                            cl.delay_s, cl.loss)
        # each server's host (as an index), and each host's senders
        self.col = np.asarray([index[h] for h in self.shost])
        self.on = np.asarray([on[h] for h in hosts], dtype=float)
        crossing = any(on[h] < S for h in self.shost) or bool(set(on) - set(self.shost))
        self.alpha = self.a_link if crossing else a_loc
        self.names = ([f"server {k} transport" for k in range(self.K)]
                      + [f"server {k} CPU" for k in range(self.K)]
                      + [f"host {h} link out" for h in hosts]
                      + [f"host {h} link in" for h in hosts] + ["worker transport"])

    def jobs(self, pieces: np.ndarray, wire: float, cpu: np.ndarray,
             per_sender: np.ndarray, up: bool) -> np.ndarray:
        """Seconds each of m jobs loads each resource, (m, R): ``pieces`` (m, K)
        float32 bytes each sender sends to (``up``) or gets from each server, ``cpu``
        (m, K) seconds on each server's CPU, ``per_sender`` (m,) a sender's
        transport's bytes."""
        K, S, H = self.K, self.S, len(self.hosts)
        load = np.empty((len(pieces), self.R))
        load[:, :K] = S * pieces * wire * self.b_loc
        load[:, K:2 * K] = cpu
        # a host's servers' share, q: its senders send the rest across its link (out,
        # for a push), the senders elsewhere send q across it (in)
        q = np.zeros((len(pieces), H))
        np.add.at(q, (slice(None), self.col), pieces)
        links_a = self.on * (pieces.sum(axis=1, keepdims=True) - q) * wire \
            * self.b_link                                             # senders' side
        links_b = q * (S - self.on) * wire * self.b_link             # servers' side
        out, inn = (links_a, links_b) if up else (links_b, links_a)
        load[:, 2 * K:2 * K + H] = out
        load[:, 2 * K + H:2 * K + 2 * H] = inn
        load[:, -1] = per_sender * wire * self.b_loc
        return load


def fluid_timeline(sim: Sim, mode: str) -> Prediction:
    """One steady-state step of ``mode`` ("ps", "ps-async" or "byteps") as a fluid (the
    module docstring)."""
    return _Round(sim, mode).prediction()


class _Round:
    """One worker's step through the shared resources: its jobs, served first come,
    first served."""

    def __init__(self, sim: Sim, mode: str) -> None:
        self.sim, self.mode = sim, mode
        cl, cal = sim.cluster, sim.cal
        self.byteps = mode == "byteps"
        self.G = group_size(cl) if self.byteps else 1
        self.local_update = self.byteps and sim.update_on == "worker"
        # who pushes whole models: every worker, or (byteps) every host through its G
        # workers
        senders = sorted(set(cl.worker_host)) if self.byteps else list(cl.worker_host)
        self.res = _Resources(sim, mode, senders)
        # (buckets, K): a sender's float32 bytes to each server
        self.pieces = _pieces(sim, self.G, self.byteps)
        self.apply = 0.0 if self.local_update else server_update_per_byte(sim.profile, cal)
        self.per_push = cal.gamma + (self.apply if mode == "ps-async" else 0.0)
        self.rs, self.ag = host_steps(sim) if self.G > 1 else ((0.0, 0.0), (0.0, 0.0))
        self.free = np.zeros(self.res.R)
        self.busy = np.zeros(self.res.R)

    def loads(self, pieces: list[np.ndarray], up: bool) -> list[tuple[np.ndarray, np.ndarray]]:
        """Pushes (``up``) or pulls of each of ``pieces``: the resources each loads
        (their indices) and its seconds on each. (All of a round's at once: a job's own
        handful of vector operations would cost more than its arithmetic.)"""
        if not pieces:
            return []
        P = np.stack(pieces)
        # a server adds every push (and under ps-async applies it); synchronous, it
        # updates each range once
        cpu = np.zeros_like(P)
        if up:
            cpu = self.res.S * P * self.per_push \
                + (0.0 if self.mode == "ps-async" else P * self.apply)
        L = self.res.jobs(P, self.sim.wire, cpu, P.sum(axis=1) / self.G, up=up)
        out = []
        for row in L:
            on = np.flatnonzero(row > 0)
            out.append((on, row[on]))
        return out

    def run(self, job: tuple[np.ndarray, np.ndarray], start: float) -> float:
        """A job (:meth:`loads`) ready at ``start``, served by each resource it loads
        once that resource is free: when its last one is done."""
        on, load = job
        if not len(on):
            return start
        end = np.maximum(self.free[on], start) + load
        self.free[on] = end
        self.busy[on] += load
        return max(float(end.max()), start)

    def pushes(self) -> list[tuple[float, int, bool, np.ndarray]]:
        """Each bucket's push, ready once its stages are done (the host's reduce-scatter,
        the copy to the host, the cast), as a heap of (ready, order, push?, pieces);
        byteps's in partitions of at most PARTITION_BYTES a worker."""
        sim, G, rs, prof = self.sim, self.G, self.rs, self.sim.profile
        stage = {"inside": 0.0, "d2h": 0.0, "cast": 0.0}
        jobs: list[tuple[float, int, bool, np.ndarray]] = []
        for i, ((m, _), at) in enumerate(zip(sim.buckets, launches(0.0, sim.compute,
                                                                   sim.buckets))):
            t = at
            for name, secs in (("inside", (G - 1) * (rs[0] + m / G * rs[1]) if G > 1
                                else 0.0),
                               ("d2h", prof.copy_s("d2h", m / G) if prof.host_copy else 0.0),
                               ("cast", m / G * sim.cast)):
                stage[name] = t = max(t, stage[name]) + secs
            parts = -(-int(m) // (G * PARTITION_BYTES)) if self.byteps else 1
            for _ in range(parts):
                heapq.heappush(jobs, (t, len(jobs), True, self.pieces[i] / parts))
        return jobs

    def shared_out(self, jobs: list[tuple[float, int, bool, np.ndarray]]) -> dict[int, float]:
        """When each push (by its order) has left a sender host that holds no server, if
        its link out is shared evenly among its connections to the servers, as TCP's
        flows share it (:func:`fair_share`), rather than served first come, first
        served: a sender queues a bucket to every server within backward, so the
        servers' shards complete together at the end of its pushes, not one after
        another (the events agree; a host that holds a server also carries its replies
        out, which the first-come order already puts behind the pushes). Every such host
        is alike: played once."""
        res = self.res
        serving = set(res.col.tolist())
        on = next((on for h, on in enumerate(res.on) if on and h not in serving), 0)
        if not on:
            return {}
        work = np.stack([j[3] for j in jobs]) * on * self.sim.wire * res.b_link
        return {j[1]: float(t) for j, t in zip(jobs, fair_share([j[0] for j in jobs], work))}

    def serve(self) -> float:
        """Every job in the order it becomes ready: when the last parameters are in.
        byteps pulls each partition once summed; a ps worker pulls a server's shard
        once its last push to it is in and backward has ended, after all its pushes (a
        pull served first come, first served would hold back the pushes behind it,
        which TCP interleaves with it: the events agree within a few percent this
        way)."""
        D, F, B, _ = self.sim.compute
        jobs, alpha = self.pushes(), self.res.alpha
        shared = self.shared_out(sorted(jobs))
        shard = self.pieces.sum(axis=0)
        left = (self.pieces > 0).sum(axis=0)  # pushes still to come to each server
        # every push's loads, and byteps's pull of the same pieces, by the push's order
        rows = [p for _, _, _, p in sorted(jobs, key=lambda j: j[1])]
        ups = self.loads(rows, up=True)
        downs = self.loads(rows, up=False) if self.byteps else []
        pulled, pulls = 0.0, []
        while jobs:
            ready, order, push, p = heapq.heappop(jobs)
            if not push:
                pulled = max(pulled, self.run(downs[order], ready))
                continue
            done = max(self.run(ups[order], ready), shared.get(order, 0.0))
            if self.byteps:
                heapq.heappush(jobs, (done + alpha, order, False, p))
                continue
            left -= p > 0
            last = (p > 0) & (left == 0)
            if last.any():  # (servers whose last push this was: their shards, one pull)
                pulls.append((max(done + alpha, D + F + B), order, np.where(last, shard, 0.0)))
        pulls.sort(key=lambda j: j[:2])
        for (ready, _, _), job in zip(pulls, self.loads([p for *_, p in pulls], up=False)):
            pulled = max(pulled, self.run(job, ready))
        return pulled

    def prediction(self) -> Prediction:
        sim, G, rs, ag, prof = self.sim, self.G, self.rs, self.ag, self.sim.profile
        D, F, B, U = sim.compute
        pulled = self.serve()
        back = (prof.copy_s("h2d", sim.total / G) if prof.host_copy else 0.0) \
            + sim.total / G * sim.cast
        gather = (G - 1) * (len(sim.buckets) * ag[0] + sim.total / G * ag[1]) if G > 1 \
            else 0.0
        period = max(D + F + B, pulled + self.res.alpha) + back + gather \
            + (U if self.local_update else 0.0)
        util = {name: b / period for name, b in zip(self.res.names, self.busy)
                if b > 0 and name != "worker transport"}
        if G > 1:
            util["host inside (reduce-scatter, all-gather)"] = (G - 1) * (
                len(sim.buckets) * (rs[0] + ag[0]) + sim.total / G * (rs[1] + ag[1])) / period
        if prof.host_copy:
            util["worker d2h"] = prof.copy_s("d2h", sim.total / G) / period
            util["worker h2d"] = prof.copy_s("h2d", sim.total / G) / period
        return finish(sim, self.mode, period, local_update=self.local_update, util=util,
                      latency=3 * self.res.alpha + (G - 1) * (rs[0] + ag[0]))


def _pieces(sim: Sim, G: int, byteps: bool) -> np.ndarray:
    """(buckets, K) float32 bytes a sender pushes of each bucket to each server: the
    servers' element ranges as psring.strategies.ps splits the flat vector, or byteps's
    columns (a host's G parts of a bucket, each on the servers holding that part)."""
    return _layout(tuple(m for m, _ in sim.buckets), G, sim.cluster.servers, byteps)


@functools.lru_cache(maxsize=256)
def _layout(sizes: tuple[int, ...], G: int, K: int, byteps: bool) -> np.ndarray:
    # (the scaling question prices every setting at every size: the same buckets over
    # the same servers many times; read-only, shared)
    buckets = [(m, 0.0) for m in sizes]
    out = np.zeros((len(buckets), K))
    if byteps:
        for (_, i), ps in column_pieces(buckets, G, K).items():
            for k, m in ps:
                out[i, k] += m
    else:
        for i, ps in enumerate(shard_pieces(buckets, K)[0]):
            for k, m in ps:
                out[i, k] += m
    out.flags.writeable = False
    return out


def fair_share(ready: list[float], work: np.ndarray) -> np.ndarray:
    """When each job's last byte is through one link that the K connections with bytes
    queued share evenly (generalized processor sharing), each connection first in,
    first out: job j arrives at ``ready[j]`` (in order) with ``work[j, k]`` seconds of
    the link's time on connection k. Played by the link's virtual clock V (as weighted
    fair queueing does), which runs at 1/(connections busy): a job's bytes on k finish
    when V reaches their tag, max(V on arrival, k's last tag) + work."""
    last: dict[int, float] = {}            # each busy connection's last tag
    tags: list[tuple[float, int]] = []     # (tag, k) heap; stale entries skipped
    waiting: list[tuple[float, int]] = []  # (the job's largest tag, j)
    done = np.asarray(ready, dtype=float).copy()
    t = v = 0.0

    def advance(until: float) -> None:
        nonlocal t, v
        while last:
            n = len(last)
            while tags[0][0] != last.get(tags[0][1]):
                heapq.heappop(tags)
            t_next = t + (tags[0][0] - v) * n
            reach = min(t_next, until)
            v_end = v + (reach - t) / n
            while waiting and waiting[0][0] <= v_end + 1e-15:
                tag, j = heapq.heappop(waiting)
                done[j] = t + (tag - v) * n
            t, v = reach, v_end
            if t_next > until:
                return
            while tags and tags[0][0] <= v + 1e-15:
                tag, k = heapq.heappop(tags)
                if last.get(k) == tag:
                    del last[k]
        t = max(t, until)

    for j, row in enumerate(work):
        advance(ready[j])
        ks = np.nonzero(row > 0)[0]
        for k, w in zip(ks.tolist(), row[ks].tolist()):
            last[k] = last.get(k, v) + w
            heapq.heappush(tags, (last[k], k))
        if len(ks):
            heapq.heappush(waiting, (max(last[k] for k in ks.tolist()), j))
    advance(float("inf"))
    return done
