"""How the flat parameter vector is split across K parameter servers.

The swappable piece of sharding (ps-lite's Slicer): a partitioner maps the flat
vector's length to K contiguous ranges. The default balances bytes, cutting through
large tensors where needed, as ps-lite and MXNet split large arrays evenly by key
range; servers only ever see a range ``[lo, hi)``.
"""

from __future__ import annotations

from typing import Protocol


class Partitioner(Protocol):
    def __call__(self, numel: int, shards: int) -> list[tuple[int, int]]: ...


def even_split(numel: int, shards: int) -> list[tuple[int, int]]:
    """K contiguous ranges whose sizes differ by at most one element."""
    if shards < 1:
        raise ValueError("need at least one shard")
    base, extra = divmod(numel, shards)
    ranges, lo = [], 0
    for k in range(shards):
        hi = lo + base + (1 if k < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


def overlaps(lo: int, hi: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(shard, start, end) for each shard range that intersects [lo, hi)."""
    out = []
    for k, (a, b) in enumerate(ranges):
        s, e = max(lo, a), min(hi, b)
        if s < e:
            out.append((k, s, e))
    return out


def bucket_assignment(sizes: list[int], cap_bytes: int, first_cap_bytes: int,
                      kinds: list[object] | None = None) -> list[list[int]]:
    """Gradient buckets as lists of parameter indices, by DDP's rule
    (compute_bucket_assignment_by_size): parameters are taken in reverse order (roughly
    the order backward produces their gradients); a bucket closes once it reaches its
    cap (so it may exceed it by one tensor), the first at ``first_cap_bytes``, and
    holds one kind (dtype and device) only. ``sizes`` are bytes per parameter. Pure:
    psring.strategies.buckets groups real tensors with it, psring.predict.sim.simulate sizes."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size, cap = 0, first_cap_bytes
    for i in reversed(range(len(sizes))):
        if current and kinds is not None and kinds[i] != kinds[current[0]]:
            buckets.append(current)
            current, size, cap = [], 0, cap_bytes
        current.append(i)
        size += sizes[i]
        if size >= cap:
            buckets.append(current)
            current, size, cap = [], 0, cap_bytes
    if current:
        buckets.append(current)
    return buckets


MB = 1024 * 1024
DEFAULT_BUCKET_MB = 25.0


def bucket_caps(bucket_mb: float) -> tuple[int, int]:
    """(cap, first-bucket cap) in bytes, by DDP's own rule (torch 2.x): the small 1 MB
    first bucket applies only with the default 25 MB cap; an explicit cap applies to
    every bucket. ``ddp`` is given the same, so the two always bucket alike."""
    cap = max(1, int(bucket_mb * MB))
    return cap, (min(cap, MB) if bucket_mb == DEFAULT_BUCKET_MB else cap)
