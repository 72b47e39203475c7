"""The simulator's engine (psring.predict.sim.simulate): an event queue; resources that work
queues for, first come first served (a CPU, a copy engine, a host's collectives); links
that connections share at once, as TCP's flows do (Link, Connection, Flows: the
parameter servers' messages); and the pieces every timeline shares — how a bucket
splits over the servers, a ring's and Adasum's steps. Python and numpy, no torch.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from typing import Any, Callable

import numpy as np

from psring.cluster.spec import Cluster
from psring.comm.partition import even_split, overlaps

#: byteps's largest push, bytes (psring.strategies.byteps.PARTITION_ELEMENTS x 4; kept
#: here so the simulator needs no torch; a test checks the two agree)
PARTITION_BYTES = 4_096_000

class Resource:
    """Something messages queue for, FIFO: a transport, one direction of a link, a CPU."""

    def __init__(self, name: str, beta: float):
        self.name = name
        self.beta = beta  # seconds per byte
        self.free = 0.0
        self.spans: list[tuple[float, float]] = []

    def occupy(self, t: float, seconds: float) -> float:
        start = max(self.free, t)
        self.free = start + seconds
        if seconds > 0:
            self.spans.append((start, self.free))
        return self.free

    def busy_between(self, a: float, b: float) -> float:
        return sum(max(0.0, min(e, b) - max(s, a)) for s, e in self.spans)


class Events:
    def __init__(self) -> None:
        self.queue: list[tuple[float, int, Callable[[float], None]]] = []
        self.seq = itertools.count()

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self.queue, (t, next(self.seq), fn))

    def run(self) -> None:
        while self.queue:
            t, _, fn = heapq.heappop(self.queue)
            fn(t)


def _carried(end, delivered, instant):
    """Whether a message ending at byte ``end`` is carried: up to a millionth of its
    bytes, or what the connection moves in an ``instant`` (numbers or arrays)."""
    return end <= delivered + np.maximum(1e-6 * np.maximum(1.0, end), instant)


def _carried_one(end: float, delivered: float, instant: float) -> bool:
    """:func:`_carried` of one message, in Python's floats (the events ask it of every
    message they hand over)."""
    return end <= delivered + max(1e-6 * max(1.0, end), instant)


class Link:
    """Something flows share at once (one direction of a host's link, a process's
    transport): ``beta`` seconds a byte at its full rate, divided among the flows on it.
    What it carried is kept by its Flows (:meth:`Flows.busy`)."""

    def __init__(self, name: str, beta: float):
        self.name = name
        self.beta = beta
        self.rate = 1.0 / beta if beta > 0 else math.inf  # bytes a second


class Connection:
    """One direction of a TCP connection: a FIFO byte stream over at most four links
    (a transport, a host's link out, the other host's link in, a transport). Messages
    sent on it arrive in order; while it has bytes queued it is a flow in its Flows."""

    def __init__(self, net: "Flows", index: int, alpha: float):
        self.net, self.index, self.alpha = net, index, alpha
        self.queue: list[tuple[float, Callable[[float], None]]] = []  # (end offset, cb)

    def send(self, t: float, nbytes: float, arrived: Callable[[float], None]) -> None:
        """Queue ``nbytes`` behind what is queued; ``arrived(t)`` once carried, α later."""
        self.net.queue(self, t, nbytes, arrived)


class Flows:
    """The connections crossing shared links, played as a fluid in the event queue.

    A link's rate is shared among the connections with bytes queued on it, as TCP's
    flows share a bottleneck: each gets a weighted share of its tightest link, then the
    ones that can still grow share what their links have left (close to max-min
    fairness). Weights are drawn per burst (a connection that goes from idle to busy)
    from a lognormal of ``spread``: TCP's flows through one queue never share it evenly,
    and that unevenness is what lets a synchronous parameter server's workers drift out
    of step (docs/prediction.md).
    ``spread`` 0: equal shares, a deterministic fluid. The connections' state is kept
    in arrays, so a change of shares costs a few vector operations however many
    connections are busy."""

    WIDTH = 4  # links a connection crosses at most

    def __init__(self, ev: Events, spread: float = 0.0, seed: int = 0):
        self.ev, self.spread = ev, spread
        self.rng = random.Random(seed)
        self.links: list[Link | None] = [None]  # index 0: no link (a shorter path's pad)
        self.link_rate = np.array([np.inf])
        self._link_ix: dict[int, int] = {}
        self.conns: list[Connection] = []
        self.paths = np.zeros((0, self.WIDTH), dtype=np.int64)
        self.weight = np.zeros(0)
        self.sent = np.zeros(0)       # bytes queued so far, per connection
        self.delivered = np.zeros(0)  # bytes carried so far
        self.head = np.zeros(0)       # where the first queued message ends
        self.rate = np.zeros(0)
        self.active = np.zeros(0, dtype=bool)
        # bytes each connection's rate carried so far (delivered, but for the remnant a
        # finished message is rounded up by): a link's carriage is the sum over the
        # connections crossing it, summed only where it is read (mark), not each advance
        self.counted = np.zeros(0)
        self.marks: dict[float, np.ndarray] = {}  # t -> each link's carriage then (mark)
        self._act: np.ndarray | None = np.zeros(0, dtype=np.int64)  # active, cached
        self.flushing = False
        # the active connections or their weights changed since the last sharing: the
        # shares depend on nothing else, so a message carried on a connection that stays
        # busy leaves them as they are
        self.dirty = False
        self.now = 0.0
        self.epoch = 0

    def _link(self, link: Link) -> int:
        if id(link) not in self._link_ix:
            self._link_ix[id(link)] = len(self.links)
            self.links.append(link)
            self.link_rate = np.append(self.link_rate, link.rate)
        return self._link_ix[id(link)]

    def connection(self, links: list[Link], alpha: float) -> Connection:
        if not 0 < len(links) <= self.WIDTH:
            raise ValueError(f"a connection crosses 1 to {self.WIDTH} links, not {len(links)}")
        path = [self._link(link) for link in links] + [0] * (self.WIDTH - len(links))
        c = Connection(self, len(self.conns), alpha)
        self.conns.append(c)
        self.paths = np.vstack([self.paths, path])
        for name in ("weight", "sent", "delivered", "head", "rate", "counted"):
            setattr(self, name, np.append(getattr(self, name), 0.0))
        self.active = np.append(self.active, False)
        return c

    def queue(self, c: Connection, t: float, nbytes: float,
              arrived: Callable[[float], None]) -> None:
        self.advance(t)
        i = c.index
        self.sent[i] += nbytes
        c.queue.append((float(self.sent[i]), arrived))
        if not self.active[i]:
            self.active[i] = True
            self._act = None
            self.dirty = True
            self.head[i] = self.sent[i]
            self.weight[i] = math.exp(self.spread * self.rng.gauss(0.0, 1.0)) \
                if self.spread else 1.0
        # the shares are settled once every event of this moment has queued its
        # messages: one flush, not one per message
        if not self.flushing:
            self.flushing = True
            self.ev.at(self.now, self._flush)

    def advance(self, t: float) -> None:
        """Carry every active connection's bytes from ``now`` to t at its rate."""
        dt = t - self.now
        if dt <= 0:
            return
        act = self.busy_conns()
        if len(act):
            moved = np.minimum(self.rate[act] * dt, self.sent[act] - self.delivered[act])
            self.delivered[act] += moved
            self.counted[act] += moved
        self.now = t

    def busy_conns(self) -> np.ndarray:
        """The indices of the connections with bytes queued (kept until one changes)."""
        if self._act is None:
            self._act = np.flatnonzero(self.active)
        return self._act

    def mark(self, t: float) -> None:
        """Remember what every link has carried by t (an event's time), for :meth:`busy`."""
        self.advance(t)
        self.marks[t] = np.bincount(self.paths.ravel(), np.repeat(self.counted, self.WIDTH),
                                    minlength=len(self.links))

    def busy(self, link: Link, a: float, b: float) -> float:
        """Seconds of its full rate ``link`` carried between two marked times."""
        i = self._link_ix.get(id(link))
        if i is None:
            return 0.0
        return float(self.marks[b][i] - self.marks[a][i]) * link.beta

    def _flush(self, t: float) -> None:
        self.flushing = False
        self.advance(t)
        self._deliver()

    def _tick(self, t: float, epoch: int) -> None:
        if epoch != self.epoch:
            return  # the shares changed since this was the next arrival
        self.advance(t)
        self._deliver()

    def _deliver(self) -> None:
        """Hand over the messages carried by now, then share the links anew and wait for
        the next message to be carried."""
        t = self.now
        act = self.busy_conns()
        # what the rate moves in the last few representable instants of t: a later tick
        # could not move the clock to carry it
        instant = self.rate[act] * 8 * math.ulp(max(t, 1.0))
        due = _carried(self.head[act], self.delivered[act], instant)
        for i, last in zip(act[due], instant[due]):
            c = self.conns[i]
            delivered, last = float(self.delivered[i]), float(last)
            while c.queue and _carried_one(c.queue[0][0], delivered, last):
                self.ev.at(t + c.alpha, c.queue.pop(0)[1])
            if c.queue:
                self.head[i] = c.queue[0][0]
            else:
                self.delivered[i] = self.sent[i]
                self.active[i] = False
                self._act = None
                self.rate[i] = 0.0
                self.dirty = True
        act = act[self.active[act]]
        if self.dirty:
            self._share(act)
            self.dirty = False
        self.epoch += 1
        if len(act):
            with np.errstate(divide="ignore", invalid="ignore"):
                left = (self.head[act] - self.delivered[act]) / self.rate[act]
            epoch = self.epoch
            self.ev.at(t + max(float(left.min()), 0.0), lambda tt: self._tick(tt, epoch))

    def _share(self, act: np.ndarray) -> None:
        """Progressive filling, twice over: every connection gets its weighted share of
        its tightest link; then the connections that cross no full link share what their
        links have left, weighted, and once more (max-min fairness, after at most three
        rounds; TCP's flows do not quite reach it either)."""
        if not len(act):
            return
        paths, w = self.paths[act], self.weight[act]
        flat, n = paths.ravel(), len(self.links)
        with np.errstate(divide="ignore", invalid="ignore"):
            load = np.bincount(flat, np.repeat(w, self.WIDTH), minlength=n)
            share = self.link_rate / load  # per unit of weight
            share[0] = np.inf
            rate = w * share[paths].min(axis=1)
            for _ in range(2):
                left = self.link_rate - np.bincount(flat, np.repeat(rate, self.WIDTH),
                                                    minlength=n)
                full = left <= 1e-9 * self.link_rate
                full[0] = False
                grow = ~full[paths].any(axis=1)
                if not grow.any():
                    break
                room = np.bincount(paths[grow].ravel(), np.repeat(w[grow], self.WIDTH),
                                   minlength=n)
                extra = w[grow] * (np.maximum(left, 0.0) / room)[paths[grow]].min(axis=1)
                rate[grow] += np.where(np.isfinite(extra), extra, 0.0)
        self.rate[act] = rate


def shard_pieces(buckets: list[tuple[int, float]], servers: int
                 ) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """Each bucket's pieces as (server, float32 bytes), and each server's shard bytes: the
    flat vector of float32 elements split as psring.strategies.ps splits it. Servers
    beyond the element count would hold nothing, as the strategy's would: at most one
    server per element."""
    elems = [-(-m // 4) for m, _ in buckets]
    ranges = even_split(sum(elems), max(1, min(servers, sum(elems))))
    pieces, start = [], 0
    for e in elems:
        pieces.append([(k, (b - a) * 4) for k, a, b in overlaps(start, start + e, ranges)])
        start += e
    return pieces, [(hi - lo) * 4 for lo, hi in ranges]


def column_pieces(buckets: list[tuple[int, float]], G: int, servers: int
                  ) -> dict[tuple[int, int], list[tuple[int, float]]]:
    """byteps's layout (psring.strategies.byteps): local rank l's part of bucket i (1/G
    of its float32 elements, the last part short) as (server, bytes) pieces, the
    servers holding the parts in columns: every bucket's part 0, then every part 1..."""
    elems = [-(-m // 4) for m, _ in buckets]
    cut = [-(-e // G) for e in elems]
    ranges = even_split(sum(elems), servers)
    out, off = {}, 0
    for lr in range(G):
        for i, e in enumerate(elems):
            v = max(0, min(cut[i], e - lr * cut[i]))
            out[(lr, i)] = [(k, (b - a) * 4.0) for k, a, b in overlaps(off, off + v, ranges)]
            off += v
    return out


def group_size(cluster: Cluster) -> int:
    """Workers per host (byteps's groups; every host holds as many)."""
    hosts = len(set(cluster.worker_host))
    return max(1, cluster.workers // max(1, hosts))


def ring_steps(n: int, M: float, alpha: float, beta: float, gamma: float) -> list[float]:
    """The durations of a ring all-reduce's 2(n−1) steps on M bytes: n−1 of the
    reduce-scatter (send a chunk, add the received one) then n−1 of the all-gather."""
    if n <= 1:
        return []
    c = M / n
    return [alpha + c * beta + (c * gamma if j < n - 1 else 0.0) for j in range(2 * (n - 1))]


def ring_seconds(n: int, M: float, alpha: float, beta: float, gamma: float) -> float:
    """The sum of :func:`ring_steps`, in closed form (a ring of many thousand ranks is
    priced without listing its steps)."""
    if n <= 1:
        return 0.0
    c = M / n
    return 2 * (n - 1) * (alpha + c * beta) + (n - 1) * c * gamma


def adasum_steps(n: int, M: float, alpha: float, beta: float, gamma: float
                 ) -> tuple[float, float]:
    """(seconds, of which α) of Adasum's vector halving, distance doubling over n = 2^k
    ranks on M bytes (psring.comm.adasum.reduce): level i swaps M/2^(i+1), sums 3 numbers a
    tensor over its block of 2^(i+1) ranks (an all-reduce of a few bytes: 2(i+1) α) and
    passes over its half four times (γ a byte each); then the swaps back."""
    t = lat = 0.0
    level, i = 1, 0
    while level < n:
        half = M / (2 * level)
        t += 2 * (alpha + half * beta) + 2 * (i + 1) * alpha + 4 * half * gamma
        lat += 2 * alpha + 2 * (i + 1) * alpha
        level, i = level * 2, i + 1
    return t, lat


def launches(start: float, compute, buckets) -> list[float]:
    """When each bucket is launched: ready in backward, strictly in order."""
    D, F, _, _ = compute
    out, last = [], start
    for _, ready in buckets:
        last = max(last, start + D + F + ready)
        out.append(last)
    return out


def server_update_per_byte(profile: Any, cal: Any) -> float:
    """Seconds per byte of a server's update, an SGD step over its shard: the profile's
    optimizer time per byte, never below two adds' worth (a PS run's own profile has no
    optimizer time: its workers do not update)."""
    return max(profile.update_s / max(1, profile.total_bytes), 2 * cal.gamma)


def host_steps(sim: Any) -> tuple[tuple[float, float], tuple[float, float]]:
    """(α, β) of one step of a host's reduce-scatter and of its all-gather: the device
    link's (``inside``: sums on the devices), else gloo's on loopback as measured."""
    if sim.inside:
        return sim.inside, sim.inside
    return sim.cal.host_steps()
