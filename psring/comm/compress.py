"""Gradient compression on the wire: ``--compress none|fp16|bf16``.

    psring run --strategy allreduce --workers 2 --compress fp16
    psring run --strategy ps --workers 2 --compress bf16

What is sent becomes half as many bytes; what is computed with stays float32:

- ``allreduce``: each bucket (float32, already scaled by 1/N) is cast to the wire dtype,
  all-reduced (summed) in it, and cast back. Scaling before the cast, in float32, means
  the N addends of the sum are each at most 1/N of the largest gradient, so float16's
  range (65504) overflows no sooner than the gradients themselves would; DDP's
  ``fp16_compress_hook`` divides after casting instead, one more rounding.
- ``ddp``: torch's own hooks, ``fp16_compress_hook`` and ``bf16_compress_hook``.
- ``ps``, ``async-ps``: gradients are pushed and parameters pulled in the wire dtype;
  the server keeps float32 master parameters and momentum, and sums pushes in float32
  (the protocol carries each tensor's dtype, docs/protocol.md).
- ``single``, ``hogwild``: nothing is sent; ``--compress`` is refused.

This module is the one place that knows the choices; strategies ask it for the dtype.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

CHOICES = ("none", "fp16", "bf16")
DTYPES = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def wire_dtype(compress: str) -> torch.dtype:
    """The dtype gradients (and pulled parameters) travel in."""
    return DTYPES[compress]


def wire_bytes(param_bytes: int, compress: str, param_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of ``param_bytes`` worth of parameters once cast for the wire."""
    size = torch.empty((), dtype=param_dtype).element_size()
    return param_bytes // size * torch.empty((), dtype=wire_dtype(compress)).element_size()


class CastBack:
    """The handle of a collective run on a cast copy: waiting on it waits for the
    collective, then writes the result back into the float32 buffer (once)."""

    def __init__(self, work: Any, wire: torch.Tensor, dst: torch.Tensor):
        self.work, self.wire, self.dst = work, wire, dst
        self.done = False

    def wait(self) -> None:
        if not self.done:
            self.work.wait()
            self.dst.copy_(self.wire)
            self.done = True


def ddp_hook(compress: str) -> Callable | None:
    """torch's DDP comm hook for ``compress`` (None: DDP's own all-reduce)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if compress == "fp16":
        return default_hooks.fp16_compress_hook
    if compress == "bf16":
        # torch's bf16 hook itself, under another name: DistributedDataParallel refuses
        # a hook *named* bf16_compress_hook unless NCCL >= 2.10 is there (NCCL's old bf16
        # gap), but gloo sums bfloat16 on the CPU (checked by the tests)
        def bf16_hook(state, bucket):
            return default_hooks.bf16_compress_hook(state, bucket)

        return bf16_hook
    return None
