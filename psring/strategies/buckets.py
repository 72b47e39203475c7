"""Gradient bucketing driven by gradient hooks: the piece that makes overlap happen.

Parameters are grouped, in reverse registration order (roughly the order backward
produces their gradients), into flat buffers of about ``cap_bytes`` (the first one
smaller, ``first_cap_bytes``, so communication starts early; DDP uses 1 MB and 25 MB).
``Tensor.register_post_accumulate_grad_hook`` fires when a parameter's gradient is
final; the hook copies it, pre-scaled, into its bucket's slot, and when a bucket is
full it is handed to ``launch`` (an all-reduce, a push to a server, ...), which returns
a handle. Buckets are launched strictly in index order so every rank issues the same
collectives in the same order.

Each ``param.grad`` is pointed at its slot of the bucket as soon as it is copied there
(the reduction then happens in place: no copy back), and autograd's own gradient tensor
is freed at once (in device mode it is the stand-in's, kept: psring.train.device);
:meth:`GradientBuckets.assign_grads` does the same for parameters that got no gradient.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

import torch
from torch import nn

# DEFAULT_BUCKET_MB and bucket_caps are re-exported: the strategies import them from here
from psring.comm.partition import DEFAULT_BUCKET_MB as DEFAULT_BUCKET_MB
from psring.comm.partition import bucket_assignment
from psring.comm.partition import bucket_caps as bucket_caps
from psring.strategies.base import Handle, StepStats


class Bucket:
    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index = index
        self.params = params
        self.numel = sum(p.numel() for p in params)
        first = params[0]
        self.buffer = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.pending = len(params)
        self.ready = [False] * len(params)

    @property
    def nbytes(self) -> int:
        return self.numel * self.buffer.element_size()

    def reset(self) -> None:
        self.pending = len(self.params)
        self.ready = [False] * len(self.params)


class _TimedHandle:
    """Wraps a launch's handle; records when its communication finished."""

    def __init__(self, handle: Handle, index: int, stats: StepStats):
        self.handle = handle
        self.index = index
        self.stats = stats
        self.done_at: float | None = None
        self._lock = threading.Lock()

    def mark_done(self, *_: object) -> None:
        # Called from the communication library's thread when the work completes.
        with self._lock:
            if self.done_at is None:
                self.done_at = time.perf_counter()

    def wait(self) -> None:
        self.handle.wait()
        self.mark_done()
        self.stats.bucket_done[self.index] = self.done_at


class GradientBuckets:
    def __init__(self, params: list[nn.Parameter], cap_bytes: int, first_cap_bytes: int,
                 scale: float, launch: Callable[[Bucket], Handle],
                 stats_of: Callable[[], StepStats],
                 on_complete: Callable[[Bucket, _TimedHandle], None] | None = None):
        self.scale = scale
        self.launch = launch
        self.stats_of = stats_of
        self.on_complete = on_complete
        self.enabled = True
        self.buckets = _group(params, cap_bytes, first_cap_bytes)
        self._slot: dict[nn.Parameter, tuple[Bucket, int]] = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._slot[p] = (b, i)
        self._next = 0
        self._handles: list[_TimedHandle] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for b in self.buckets for p in b.params]

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No launches inside: gradients only accumulate (a strategy's no_sync for
        --accumulate; the last micro-batch's hooks launch the buckets)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        bucket, i = self._slot[p]
        if bucket.ready[i]:
            return  # a parameter used twice in one graph: its grad is final only once
        # Scale while copying (DDP does the same) to save a pass over the bucket.
        torch.mul(p.grad, self.scale, out=bucket.views[i])
        # The gradient lives on in the bucket: let autograd's copy go now, during
        # backward, where the next layer's gradient of the same size reuses its memory.
        # Freed only after the all-reduce (assign_grads), glibc returned it to the
        # kernel and the next step page-faulted it back: ~2000 faults per step, and a
        # backward 1.5x DDP's in separate runs
        # (docs/results/2026-11-23-emulation-runs-and-prediction.md, issue 10).
        p.grad = bucket.views[i]
        bucket.ready[i] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_in_order()

    def _launch_in_order(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._start(self.buckets[self._next])
            self._next += 1

    def _start(self, bucket: Bucket) -> None:
        stats = self.stats_of()
        if not stats.bucket_launch:
            stats.bucket_launch = [0.0] * len(self.buckets)
            stats.bucket_done = [0.0] * len(self.buckets)
        stats.bucket_launch[bucket.index] = time.perf_counter()
        timed = _TimedHandle(self.launch(bucket), bucket.index, stats)
        if self.on_complete is not None:
            self.on_complete(bucket, timed)
        self._handles.append(timed)

    def finish(self) -> list[_TimedHandle]:
        """Launch what backward left incomplete (unused parameters count as zero
        gradients, in order) and return every handle of this step."""
        for b in self.buckets[self._next:]:
            for i, _p in enumerate(b.params):
                if not b.ready[i]:
                    b.views[i].zero_()
                    b.ready[i] = True
            b.pending = 0
        self._launch_in_order()
        handles, self._handles = self._handles, []
        for b in self.buckets:
            b.reset()
        self._next = 0
        return handles

    def assign_grads(self) -> None:
        for b in self.buckets:
            for p, v in zip(b.params, b.views):
                p.grad = v


def _group(params: list[nn.Parameter], cap_bytes: int, first_cap_bytes: int) -> list[Bucket]:
    params = [p for p in params if p.requires_grad]
    groups = bucket_assignment([p.numel() * p.element_size() for p in params], cap_bytes,
                               first_cap_bytes, [(p.dtype, p.device) for p in params])
    return [Bucket(i, [params[j] for j in g]) for i, g in enumerate(groups)]
