"""The simulator's engine (psring.predict.simulate): resources that messages queue for,
an event queue, and the pieces every timeline shares — how a bucket splits over the
servers, a ring's and Adasum's steps. Pure Python, no torch.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable

from psring.cluster.spec import Cluster
from psring.comm.partition import even_split, overlaps


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


def send_together(t: float, msgs: list[tuple[float, list[Resource], float]]) -> list[float]:
    """Messages sent at the same moment from one process (a server answering every
    held pull, a worker pushing a bucket's pieces to K servers): they go out on separate
    connections, which share each resource fairly (TCP flows through a link, ZeroMQ's
    I/O thread over its pipes), not one after another. So a resource they share carries
    their bytes together and each message is done when all its resources have carried
    the group's bytes (processor sharing of equal-sized messages started together).
    Returns each message's arrival."""
    load: dict[int, tuple[Resource, float]] = {}
    for nbytes, path, _ in msgs:
        for r in path:
            res, b = load.get(id(r), (r, 0.0))
            load[id(r)] = (res, b + nbytes)
    done = {key: res.occupy(t, b * res.beta) for key, (res, b) in load.items()}
    return [max([t, *(done[id(r)] for r in path)]) + alpha for _, path, alpha in msgs]


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
