"""``allreduce``: ring all-reduce through torch.distributed, bucketed and overlapped.

Backend: NCCL when the device is CUDA, gloo on CPU (chosen by the worker entry point).
Gradients are pre-divided by the world size and summed, so each rank ends with the
average; each bucket's all-reduce starts from the gradient hooks while backward is
still running, and the update waits on the handles. ``ddp`` is the reference
implementation of the same algorithm.

``--device-link`` (device mode): the ring runs as point-to-point sends whose hops
inside a host take the device interconnect's time (psring.comm.hostring).

``--loss-tolerance F`` reduces each bucket by a transpose all-reduce over datagrams
(psring.comm.transpose): its reduce-scatter may lose at most F of each shard, its
all-gather is kept only whole (the replicas stay identical).

``--reduce adasum`` combines the buckets by Adasum instead (psring.comm.adasum: recursive
vector halving over point-to-point swaps, each parameter's tensor on its own; no
pre-division), on one communication thread per worker so that buckets still go out
while backward runs, as Horovod's background thread does.

    psring run --strategy allreduce --workers 2 --bucket-mb 25 [--compress fp16]
    psring run --strategy allreduce --workers 4 --reduce adasum
    psring run --strategy allreduce --workers 2 --hosts 2 --link 100mbit --loss 0.01 \\
        --loss-tolerance 0.02
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ContextManager

import torch
from torch import nn

from psring.cluster.netif import is_loopback, source_address
from psring.comm import adasum, interconnect
from psring.comm.compress import CastBack, wire_dtype
from psring.comm.endpoints import load_secret
from psring.comm.hostring import flat_ring
from psring.comm.lossy import Marks
from psring.comm.transpose import TransposeAllReduce
from psring.strategies.base import STRATEGIES, Capabilities, Handle, Strategy, WaitAll
from psring.strategies.buckets import Bucket, GradientBuckets, bucket_caps
from psring.units import parse_window


class Pending:
    """The handle of a bucket reduced on the communication thread; its error, if any,
    is raised where the step waits."""

    def __init__(self, future: Future, then_wait: bool = False):
        self.future = future
        #: the thread's work returns a handle of its own to wait on (a transpose
        #: all-reduce's all-gather, in flight while the thread goes on to the next bucket)
        self.then_wait = then_wait

    def wait(self) -> None:
        rest = self.future.result()
        if self.then_wait:
            rest.wait()


def ring_bytes(param_bytes: int, world: int) -> int:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``param_bytes``:
    reduce-scatter plus all-gather, 2(n-1)/n of the data (nccl-tests' bus factor)."""
    return 0 if world < 2 else int(2 * (world - 1) / world * param_bytes)


#: what a ring's worker waits for when --timeout expires (allreduce, ddp)
RING_WAITS_FOR = ("the other workers' gradients (an all-reduce needs every worker; one of "
                  "them stopped, hung or is far slower)")


@STRATEGIES.register("allreduce")
class AllReduce(Strategy):
    name = "allreduce"
    caps = Capabilities(
        uses_process_group=True, supports_compression=True, reductions=("sum", "adasum"),
        cost_model="ring", waits_for=RING_WAITS_FOR, inside_host="ring-hops",
        loss_tolerant=True)

    def setup(self, model: nn.Module) -> nn.Module:
        cap, first = bucket_caps(self.ctx.cfg.bucket_mb)
        self.adasum = self.ctx.cfg.reduce == "adasum"
        if self.adasum:
            # collective (every rank builds the same groups here, in setup)
            self.comm = self._adasum_comm()
        # --device-link: the ring's hops inside a host timed (collective, like the above)
        self.ring = flat_ring(self.ctx) if self.caps.inside_host == "ring-hops" else None
        # --loss-tolerance: a transpose all-reduce over datagrams (collective set-up too)
        params = list(model.parameters())
        self.model_numel = sum(p.numel() for p in params)
        self.tar = self._transpose() if self.caps.loss_tolerant and \
            self.ctx.cfg.loss_tolerance else None
        self.buckets = GradientBuckets(
            params, cap, first, scale=self._scale(),
            launch=self._launch, stats_of=lambda: self.stats)
        # where each bucket begins in the model's order (--switch priority's layer marks)
        starts, at = {}, 0
        for p in params:
            starts[id(p)], at = at, at + p.numel()
        self.bucket_offset = [min(starts[id(p)] for p in b.params)
                              for b in self.buckets.buckets]
        compress = self.ctx.cfg.compress
        # --compress: one wire buffer per bucket, allocated once (psring.comm.compress)
        self.wire = [None if compress == "none" else
                     torch.empty(b.numel, dtype=wire_dtype(compress), device=b.buffer.device)
                     for b in self.buckets.buckets]
        self._bytes = ring_bytes(sum(b.numel * (w if w is not None else b.buffer).element_size()
                                     for b, w in zip(self.buckets.buckets, self.wire)),
                                 self.ctx.world)
        return model

    def _transpose(self) -> TransposeAllReduce:
        """The bounded-loss all-reduce (psring.comm.transpose), its datagrams sent from
        the address this host reaches the rendezvous from, at the link's pace."""
        cfg = self.ctx.cfg
        master = os.environ.get("MASTER_ADDR", "127.0.0.1")
        address = "127.0.0.1" if is_loopback(master) else (source_address(master) or master)
        self._delivered_at = (0, 0)
        return TransposeAllReduce(self.ctx.rank, self.ctx.world, address, cfg.loss_tolerance,
                                  pace_bits=cfg.cluster.emulated_link_bits,
                                  timeout=cfg.timeout, key=load_secret(cfg.secret_file),
                                  marks=Marks.for_switch(cfg.switch, self.model_numel),
                                  credit_window=parse_window(cfg.credit_window)
                                  if cfg.credit_window else 0)

    def _adasum_comm(self) -> adasum.TorchComm:
        return adasum.TorchComm()

    def _scale(self) -> float:
        """What the hooks multiply gradients by: a sum is pre-divided into the average;
        Adasum's rule is scale-aware: it is given each worker's own gradient."""
        return 1.0 if self.adasum else 1.0 / self.ctx.world

    def _launch(self, bucket: Bucket) -> Handle:
        if self.tar is not None:
            # the datagrams queued from the hook (they leave while the thread still
            # collects the bucket before); collecting the parts and queueing the sum on
            # the thread; the others' sums collected where the step waits
            scattered = self.tar.scatter(bucket.buffer, self.bucket_offset[bucket.index])
            return self._on_thread(self.tar.finish, scattered, then_wait=True)
        if self.adasum:
            counts = [p.numel() for p in bucket.params]
            return self._on_thread(adasum.reduce, bucket.buffer, counts, self.comm)
        wire = self.wire[bucket.index]
        if wire is None:
            return self._all_reduce(bucket.buffer)
        # already scaled by 1/N in float32 (the hooks): summing N such values in the wire
        # dtype overflows no sooner than the gradients would
        wire.copy_(bucket.buffer)
        return CastBack(self._all_reduce(wire), wire, bucket.buffer)

    def _all_reduce(self, t: torch.Tensor) -> Handle:
        if self.ring is not None:
            return self.ring.all_reduce(t)
        return interconnect.all_reduce(t)  # (bfloat16 through the host on gloo + CUDA)

    def _on_thread(self, fn, *args, then_wait: bool = False) -> Handle:
        """Run a reduction of several collectives on the worker's one communication
        thread (started at first use): backward goes on meanwhile, and buckets are
        reduced in launch order, so every rank issues the same collectives in order."""
        if getattr(self, "pool", None) is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="psring-comm")
        return Pending(self.pool.submit(fn, *args), then_wait)

    def no_sync(self) -> ContextManager[None]:
        return self.buckets.paused()

    def finish_backward(self) -> Handle:
        self.stats.bytes_sent = self.stats.bytes_recv = self._bytes
        # once every bucket is averaged, param.grad points at the buffers (no copy back)
        if self.tar is None:
            return WaitAll(self.buckets.finish(), then=self.buckets.assign_grads)
        return WaitAll(self.buckets.finish(), then=self._assign_and_account)

    def _assign_and_account(self) -> None:
        """(--loss-tolerance) what of the step's shards reached their owners."""
        self.buckets.assign_grads()
        got, sent = self.tar.delivered, self.tar.expected
        if sent > self._delivered_at[1]:
            self.stats.extra["delivered"] = round(
                (got - self._delivered_at[0]) / (sent - self._delivered_at[1]), 6)
        self._delivered_at = (got, sent)

    def close(self) -> None:
        if hasattr(self, "buckets"):
            self.buckets.remove_hooks()
        if getattr(self, "pool", None) is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        if getattr(self, "ring", None) is not None:
            self.ring.close()
        if getattr(self, "tar", None) is not None:
            self.tar.close()

    @classmethod
    def bytes_per_step(cls, param_bytes: int, world: int,
                       per_host: int = 1) -> tuple[int, int]:
        b = ring_bytes(param_bytes, world)
        return b, b

