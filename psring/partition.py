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
