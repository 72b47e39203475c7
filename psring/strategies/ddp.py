"""``ddp``: torch's DistributedDataParallel, the reference for ``allreduce``.

Same algorithm (bucketed ring all-reduce overlapped with backward, ``bucket_cap_mb``
from ``--bucket-mb``); DDP waits for its buckets inside ``backward()``, so this
strategy sets ``syncs_inside_backward`` and the loop counts the time after the last
gradient hook as communication.
"""

from __future__ import annotations

from typing import ContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from psring.comm.compress import ddp_hook, wire_bytes
from psring.strategies.allreduce import RING_WAITS_FOR, ring_bytes
from psring.strategies.base import STRATEGIES, Capabilities, Strategy
from psring.strategies.buckets import DEFAULT_BUCKET_MB


@STRATEGIES.register("ddp")
class DDP(Strategy):
    name = "ddp"
    caps = Capabilities(
        uses_process_group=True, syncs_inside_backward=True, supports_compression=True,
        cost_model="ring", waits_for=RING_WAITS_FOR)

    def setup(self, model: nn.Module) -> nn.Module:
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # DDP's default (bucket_cap_mb=None) is 25 MB with a 1 MB first bucket; an explicit
        # cap makes every bucket that size. allreduce follows the same rule (bucket_caps).
        cap = self.ctx.cfg.bucket_mb
        self.ddp = DistributedDataParallel(
            model, device_ids=device_ids,
            bucket_cap_mb=None if cap == DEFAULT_BUCKET_MB else cap)
        hook = ddp_hook(self.ctx.cfg.compress)  # torch's own compression hooks
        if hook is not None:
            self.ddp.register_comm_hook(None, hook)
        self._bytes = ring_bytes(wire_bytes(sum(p.numel() * p.element_size()
                                                for p in model.parameters()),
                                            self.ctx.cfg.compress), self.ctx.world)
        return self.ddp

    def no_sync(self) -> ContextManager[None]:
        return self.ddp.no_sync()

    def finish_backward(self):
        self.stats.bytes_sent = self.stats.bytes_recv = self._bytes
        return super().finish_backward()

    @classmethod
    def bytes_per_step(cls, param_bytes: int, world: int,
                       per_host: int = 1) -> tuple[int, int]:
        b = ring_bytes(param_bytes, world)
        return b, b
