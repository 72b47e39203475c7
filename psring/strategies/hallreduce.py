"""``hallreduce``: hierarchical all-reduce (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE,
horovod PR #411), bucketed and overlapped like ``allreduce``.

Per bucket, on a cluster of H hosts with G workers each (ranks h*G .. h*G+G-1 on host
h, as torchrun and psring's launcher number them):

1. reduce-scatter inside the host: local rank l ends with the host's sum of shard l
   (1/G of the bucket);
2. all-reduce of shard l across the hosts, among the H ranks that hold it (local rank l
   of every host): only these 1/G shards cross the host links, in G parallel rings;
3. all-gather inside the host: every rank has the whole reduced bucket.

A host link then carries 2 (H - 1) / H of the bucket each way, once per host, instead
of a flat ring's 2 (N - 1) / N per rank crossing it; inside the host the traffic is
local (loopback here; NVLink/PCIe on a GPU host). torch process groups: one per host
and one per local rank, created by every rank in the same order (gloo here, NCCL where
CUDA is). The three collectives of a bucket run on a communication thread, so the
buckets still go out while backward runs.

``--reduce adasum`` (Horovod's hierarchical Adasum, ``AdasumGpuAllreduceOp``): the
host's reduce-scatter averages its workers' gradients, step 2 is Adasum across the
hosts instead of a sum (psring.comm.adasum with the hosts as its ranks), then the all-gather.

    psring run --strategy hallreduce --workers 8 --hosts 2 --link 1gbit [--reduce adasum]
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from psring.comm import adasum
from psring.comm.interconnect import group_timeout, host_comm, host_layout
from psring.strategies.allreduce import AllReduce, ring_bytes
from psring.strategies.base import STRATEGIES, Handle
from psring.strategies.buckets import Bucket


def hierarchy_bytes(param_bytes: int, hosts: int, per_host: int) -> int:
    """Bytes one rank sends (and receives) a step: a ring reduce-scatter and all-gather
    inside its host, (G - 1) / G of the gradients each, and its shard's all-reduce
    across the hosts, 2 (H - 1) / H of 1/G of them."""
    inside = 2 * (per_host - 1) / per_host * param_bytes if per_host > 1 else 0
    return int(inside + ring_bytes(param_bytes // per_host, hosts))


@STRATEGIES.register("hallreduce")
class HierarchicalAllReduce(AllReduce):
    name = "hallreduce"
    # adasum: Adasum across hosts of each host's average (Horovod's hierarchical
    # Adasum); every host holds as many workers (shard l lives on every host); three
    # collectives a bucket, G rings across the hosts (docs/cost-model.md)
    caps = replace(AllReduce.caps, supports_compression=False, needs_equal_hosts=True,
                   inside_host="collectives", cost_model="hring", loss_tolerant=False)

    def setup(self, model: nn.Module) -> nn.Module:
        g, self.hosts, _, local = host_layout(self.ctx, "hallreduce")
        self.per_host = g
        # the host's collectives (its process group, or a device link's time)
        self.inside = host_comm(self.ctx, "hallreduce")
        # every rank creates every group, in the same order (torch requires it)
        for lr in range(g):
            grp = dist.new_group(list(range(lr, self.ctx.world, g)),
                                 timeout=group_timeout(self.ctx))
            if lr == local:
                self.across = grp
        # the buckets, pre-scaled by 1/N: the sum is the average (by 1/G with Adasum:
        # each host's average, then Adasum across the hosts)
        super().setup(model)
        # G equal shards: a bucket whose size is not a multiple of G is reduced in a
        # padded copy (most are: layer sizes are multiples of their channels)
        self.padded = [None if b.numel % g == 0 else
                       torch.zeros(-(-b.numel // g) * g, dtype=b.buffer.dtype,
                                   device=b.buffer.device) for b in self.buckets.buckets]
        # each bucket's shard, allocated once (the reduce-scatter's output)
        self.shards = [torch.empty(-(-b.numel // g), dtype=b.buffer.dtype,
                                   device=b.buffer.device) for b in self.buckets.buckets]
        self._bytes = hierarchy_bytes(sum(b.nbytes for b in self.buckets.buckets),
                                      self.hosts, g)
        # Adasum combines each tensor on its own: the tensors' counts in this worker's
        # slice of each bucket (zeros outside it, and the padding last)
        self.slice_counts = [adasum.slice_counts(
            [p.numel() for p in b.params], local * c, (local + 1) * c, c * g)
            for b, c in ((b, -(-b.numel // g)) for b in self.buckets.buckets)]
        return model

    def close(self) -> None:
        super().close()
        if getattr(self, "inside", None) is not None:
            self.inside.close()

    def _adasum_comm(self) -> adasum.TorchComm:
        return adasum.TorchComm(per_host=self.per_host)

    def _scale(self) -> float:
        return 1.0 / self.per_host if self.adasum else 1.0 / self.ctx.world

    def _launch(self, bucket: Bucket) -> Handle:
        return self._on_thread(self._reduce, bucket)

    def _reduce(self, bucket: Bucket) -> None:
        g = self.per_host
        full = self.padded[bucket.index]
        if full is None:
            full = bucket.buffer  # in place
        else:
            full[:bucket.numel].copy_(bucket.buffer)
        shard = self.shards[bucket.index]
        if g > 1:
            self.inside.reduce_scatter(shard, full).wait()
        else:
            shard.copy_(full)
        if self.hosts > 1 and self.adasum:
            adasum.reduce(shard, self.slice_counts[bucket.index], self.comm)
        elif self.hosts > 1:
            dist.all_reduce(shard, group=self.across)
        if g > 1:
            self.inside.all_gather(full, shard).wait()
        else:
            full.copy_(shard)
        if full is not bucket.buffer:
            bucket.buffer.copy_(full[:bucket.numel])

    @classmethod
    def bytes_per_step(cls, param_bytes: int, world: int,
                       per_host: int = 1) -> tuple[int, int]:
        b = hierarchy_bytes(param_bytes, world // per_host, per_host)  # as each step counts
        return b, b
