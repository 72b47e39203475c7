"""Adasum: an adaptive sum of the workers' gradients (Maleki et al., "Scaling
Distributed Training with Adaptive Summation", MLSys 2021; in Horovod as
``op=hvd.Adasum``), for ``allreduce --reduce adasum``.

Two gradients a and b of one tensor combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so orthogonal gradients add (a.b = 0) and equal ones average (a.b = |a|^2 = |b|^2):
a large global batch keeps taking the step of a small one where the workers agree and
adds their steps where they do not. Over N = 2^k ranks the rule is applied as a binary
tree, ranks {0,1}, {2,3}, ..., then pairs of pairs, each tensor on its own.

:func:`reduce` does it the way Horovod's ``adasum.h`` does (``FusedAllreduce``):
recursive vector halving, distance doubling. At level L = 1, 2, 4, ... each rank swaps
half of its current segment with rank ^ L, keeps the other half, and combines its own
and the neighbour's copy of that half; the dot products and norms of each tensor are
partial (each rank of the 2L-rank block holds one piece of it), so they are summed over
the block first (3 float64 per tensor). Then the halves travel back (an all-gather in
the reverse order). Every rank sends 2 (N - 1) / N of the buffer, as in a ring.

    psring run --strategy allreduce --reduce adasum --workers 4 --lr 0.1

The communicator is an interface (:class:`Comm`): torch.distributed here
(:class:`TorchComm`), threads with queues in tests (tests/multiproc/test_adasum.py), which check
the result against :func:`reference`, the tree applied to whole tensors in one process.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from psring.comm.interconnect import gloo_group

#: below this squared norm a side's coefficient is 1 (Horovod's threshold): a zero
#: gradient neither scales the other nor divides by zero
EPS = 1e-8


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def combine(a: torch.Tensor, b: torch.Tensor, dot: float, a2: float, b2: float
            ) -> torch.Tensor:
    """The pairwise rule, given a.b, |a|^2 and |b|^2 of the whole tensors."""
    ca = 1.0 - dot / (2 * a2) if a2 >= EPS else 1.0
    cb = 1.0 - dot / (2 * b2) if b2 >= EPS else 1.0
    return a * ca + b * cb


def reference(grads: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Adasum of ``grads[rank][tensor]`` in one process: the binary tree over ranks
    (0 with 1, 2 with 3, then the pairs), each tensor on its own, in float64."""
    level = [[g.double() for g in rank] for rank in grads]
    if not is_power_of_two(len(level)):
        raise ValueError(f"Adasum needs a power-of-two number of ranks (got {len(level)})")
    while len(level) > 1:
        nxt = []
        for left, right in zip(level[::2], level[1::2]):
            nxt.append([combine(a, b, float((a * b).sum()), float((a * a).sum()),
                                float((b * b).sum()))
                        for a, b in zip(left, right)])
        level = nxt
    return [g.to(grads[0][i].dtype) for i, g in enumerate(level[0])]


class Comm(Protocol):
    rank: int
    size: int

    def sendrecv(self, peer: int, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Send ``send`` to ``peer`` while receiving what it sends into ``recv`` (the
        two may differ in size by one element)."""

    def sum_in_block(self, level: int, t: torch.Tensor) -> None:
        """Sum ``t`` in place over the 2 * ``level`` ranks of this rank's block
        (ranks r with r // (2 * level) equal)."""


def _pieces(bounds: Sequence[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(tensor, start, end) of every tensor's part inside [lo, hi) of the flat buffer,
    ``bounds`` the tensors' start offsets plus the end."""
    out = []
    for i in range(len(bounds) - 1):
        s, e = max(bounds[i], lo), min(bounds[i + 1], hi)
        if s < e:
            out.append((i, s, e))
    return out


def slice_counts(counts: Sequence[int], lo: int, hi: int, padded: int) -> list[int]:
    """Each tensor's element count inside [lo, hi) of a bucket of ``counts`` padded to
    ``padded`` elements, and last the padding's (hierarchical Adasum: a worker's slice
    of the bucket; zeros for tensors outside it, so every worker's list is aligned)."""
    out, start = [], 0
    for c in counts:
        out.append(max(0, min(start + c, hi) - max(start, lo)))
        start += c
    out.append(max(0, min(padded, hi) - max(start, lo)))
    return out


def reduce(buf: torch.Tensor, counts: Sequence[int], comm: Comm) -> None:
    """Adasum of every rank's ``buf`` (flat, float), in place; ``counts`` are the
    element counts of the tensors laid end to end in it (each combined on its own)."""
    rank, size = comm.rank, comm.size
    if not is_power_of_two(size):
        raise ValueError(f"Adasum needs a power-of-two number of ranks (got {size})")
    if sum(counts) != buf.numel():
        raise ValueError(f"counts add up to {sum(counts)}, the buffer has {buf.numel()}")
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    lo, hi = 0, buf.numel()
    swapped: list[tuple[int, int, int]] = []  # (peer, its range) per level, for the way back
    level = 1
    while level < size:
        peer = rank ^ level
        mid = lo + (hi - lo) // 2
        left = rank & level == 0  # the lower block of the pair: keeps the first half
        keep, give = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
        theirs = torch.empty(keep[1] - keep[0], dtype=buf.dtype, device=buf.device)
        comm.sendrecv(peer, buf[give[0]:give[1]], theirs)
        mine = buf[keep[0]:keep[1]]
        # per tensor: a.b, |left side|^2, |right side|^2 over this rank's piece, summed
        # over the block (the other pieces of each tensor are on the block's other ranks)
        # (on the buffer's device: NCCL sums GPU tensors only)
        stats = torch.zeros(len(counts), 3, dtype=torch.float64, device=buf.device)
        pieces = _pieces(bounds, *keep)
        for i, s, e in pieces:
            a = mine[s - keep[0]:e - keep[0]].double()
            b = theirs[s - keep[0]:e - keep[0]].double()
            own, other = a @ a, b @ b
            stats[i] = torch.stack([a @ b, *((own, other) if left else (other, own))])
        comm.sum_in_block(level, stats)
        rows = stats.tolist()  # one device-to-host read per level, not one per tensor
        for i, s, e in pieces:
            dot, l2, r2 = rows[i]
            a2, b2 = (l2, r2) if left else (r2, l2)
            sl = slice(s - keep[0], e - keep[0])
            mine[sl] = combine(mine[sl], theirs[sl], dot, a2, b2)
        swapped.append((peer, *give))
        lo, hi = keep
        level <<= 1
    # the way back: each rank holds the result on [lo, hi); swap it for the peer's part
    for peer, s, e in reversed(swapped):
        got = torch.empty(e - s, dtype=buf.dtype, device=buf.device)
        comm.sendrecv(peer, buf[lo:hi].clone(), got)
        buf[s:e] = got
        lo, hi = min(lo, s), max(hi, e)


class TorchComm:
    """:class:`Comm` over torch.distributed (gloo here, NCCL on CUDA): point-to-point
    isend/irecv, and one process group per block of each level for the sums. Creating
    the groups is collective: every rank constructs this at the same point.

    ``per_host`` G > 1 (hallreduce): Adasum across hosts, as Horovod's hierarchical
    Adasum (``AdasumGpuAllreduceOp::NcclHierarchical``: start level = local size). The
    Adasum ranks are the hosts; this worker (local rank l) swaps with local rank l of
    the peer host, holding the same slice of every bucket, and a level's sums run over
    every worker of the block's hosts: the host's G workers hold different slices of
    the same tensors, so the per-tensor dot products and norms add up to the whole
    tensors' (``counts`` then has a zero for a tensor outside this worker's slice)."""

    def __init__(self, per_host: int = 1) -> None:
        import torch.distributed as dist


        self.dist = dist
        # gloo sends CPU tensors only: on a gloo group (workers sharing a GPU) CUDA
        # tensors go through host copies
        self.gloo = gloo_group(None)
        g = per_host
        self.per_host, self.local = g, dist.get_rank() % g
        self.rank, self.size = dist.get_rank() // g, dist.get_world_size() // g
        self.groups: dict[int, object] = {}
        level = 1
        while level < self.size:
            width = 2 * level
            for start in range(0, self.size, width):
                # every rank creates every group (torch requires it), keeps its own
                g_ = dist.new_group(list(range(start * g, (start + width) * g)))
                if start <= self.rank < start + width:
                    self.groups[level] = g_
            level <<= 1

    def sendrecv(self, peer: int, send: torch.Tensor, recv: torch.Tensor) -> None:
        dist = self.dist
        peer = peer * self.per_host + self.local  # the same local rank on the peer host
        staged = recv.is_cuda and self.gloo
        into = torch.empty(recv.shape, dtype=recv.dtype) if staged else recv
        out = send.cpu() if staged else send.contiguous()
        ops = [dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if staged:
            recv.copy_(into)

    def sum_in_block(self, level: int, t: torch.Tensor) -> None:
        self.dist.all_reduce(t, group=self.groups[level])
