"""``ddp``: torch's DistributedDataParallel, the reference for ``allreduce``.

Same algorithm (bucketed ring all-reduce overlapped with backward, ``bucket_cap_mb``
from ``--bucket-mb``); DDP waits for its buckets inside ``backward()``, so this
strategy sets ``syncs_inside_backward`` and the loop counts the time after the last
gradient hook as communication.

``--device-link`` (device mode): a comm hook sends the buckets round psring's ring,
whose hops inside a host take the device interconnect's time (psring.comm.hostring).
"""

from __future__ import annotations

from typing import Callable, ContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from psring.comm.compress import ddp_hook, wire_bytes, wire_dtype
from psring.comm.hostring import HostRing, flat_ring
from psring.comm.interconnect import gloo_group
from psring.errors import ConfigError
from psring.strategies.allreduce import RING_WAITS_FOR, ring_bytes
from psring.strategies.base import STRATEGIES, Capabilities, Strategy
from psring.strategies.buckets import DEFAULT_BUCKET_MB


def ring_hook(ring: HostRing, compress: str) -> Callable:
    """A DDP comm hook averaging each bucket on ``ring`` (cast to the wire dtype and
    back under --compress): its Future completes on the ring's stream."""
    dtype = None if compress == "none" else wire_dtype(compress)

    def hook(_state, bucket):  # (DDP checks an annotation by value: none given)
        grads = bucket.buffer().div_(ring.world)
        wire = grads if dtype is None else grads.to(dtype)
        fut: torch.futures.Future = torch.futures.Future()

        def then(error: BaseException | None) -> None:
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(grads if wire is grads else grads.copy_(wire))

        ring.all_reduce(wire, then)
        return fut

    return hook


@STRATEGIES.register("ddp")
class DDP(Strategy):
    name = "ddp"
    caps = Capabilities(
        uses_process_group=True, syncs_inside_backward=True, supports_compression=True,
        cost_model="ring", waits_for=RING_WAITS_FOR, inside_host="ring-hops")

    def setup(self, model: nn.Module) -> nn.Module:
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        if device_ids and self.ctx.cfg.compress == "bf16" and gloo_group(None):
            # workers sharing a GPU run gloo, whose CUDA all-reduce has no bfloat16
            # (pytorch/pytorch#111131); allreduce stages it through host memory
            raise ConfigError("ddp --compress bf16 on workers that share a GPU: they "
                              "communicate over gloo, which cannot sum bfloat16 CUDA "
                              "tensors. Use --strategy allreduce (it sums them in host "
                              "memory), --compress fp16, or one GPU per worker.")
        # DDP's default (bucket_cap_mb=None) is 25 MB with a 1 MB first bucket; an explicit
        # cap makes every bucket that size. allreduce follows the same rule (bucket_caps).
        cap = self.ctx.cfg.bucket_mb
        self.ddp = DistributedDataParallel(
            model, device_ids=device_ids,
            bucket_cap_mb=None if cap == DEFAULT_BUCKET_MB else cap)
        # --device-link: the buckets go round psring's timed ring (a comm hook, as
        # OptiReduce's benchmarks plug into DDP); else torch's own compression hooks
        self.ring = flat_ring(self.ctx)
        hook = ddp_hook(self.ctx.cfg.compress) if self.ring is None else \
            ring_hook(self.ring, self.ctx.cfg.compress)
        if hook is not None:
            self.ddp.register_comm_hook(None, hook)
        self._bytes = ring_bytes(wire_bytes(sum(p.numel() * p.element_size()
                                                for p in model.parameters()),
                                            self.ctx.cfg.compress), self.ctx.world)
        return self.ddp

    def close(self) -> None:
        if getattr(self, "ring", None) is not None:
            self.ring.close()

    def no_sync(self) -> ContextManager[None]:
        # (the class's: a script's module has psring's no_sync on the instance, which
        # comes here; psring.library.wrap)
        return DistributedDataParallel.no_sync(self.ddp)

    def finish_backward(self):
        self.stats.bytes_sent = self.stats.bytes_recv = self._bytes
        return super().finish_backward()

    @classmethod
    def bytes_per_step(cls, param_bytes: int, world: int,
                       per_host: int = 1) -> tuple[int, int]:
        b = ring_bytes(param_bytes, world)
        return b, b
