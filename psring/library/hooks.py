"""A script's step timed as psring's loop times its own, by hooks on the wrapped module.

Inside ``with dist.step(step)`` the laps of the step's PhaseTimer fall where the loop's
do (psring.workers.loop): from the step's start (or the last backward's end) to a
forward's start is ``data_s`` (inputs moved, a micro-batch fetched), the forward and
the loss until backward reaches the model's output ``forward_s``, backward until
autograd finishes it ``backward_s`` (a callback queued on the engine marks the end,
ahead of DDP's own, so DDP's wait for its all-reduces is left to ``comm_s``). The same
output hook weighs the gradient for uneven batches (``--worker-batch``): every output
tensor gradients flow through is scaled, so the average over workers is the global
batch's mean gradient. A second backward in one step is refused unless the earlier
ones ran under ``dist.no_sync()``: a bucketed strategy launches its communication at
the first, and later gradients would be added into buffers being sent.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from psring.errors import PsringError


def grad_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's output that gradients flow back through."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    items = output.values() if isinstance(output, dict) else \
        output if isinstance(output, (list, tuple)) else ()
    return [t for item in items for t in grad_tensors(item)]


class StepHooks:
    """Installed on the module ``dist.wrap`` returns (see the module's docstring)."""

    def __init__(self, dist, module: nn.Module, weight: float | None):
        self.dist, self.weight = dist, weight
        module.register_forward_pre_hook(self.forward_begins)
        module.register_forward_hook(self.forward_ends, with_kwargs=True)

    def _timed(self):
        """The current step's scope, while its forward and backward are timed."""
        scope = self.dist.current
        return None if scope is None or scope.stepped else scope

    def forward_begins(self, module: nn.Module, args: tuple) -> None:
        scope = self._timed()
        if scope is not None and not scope.in_backward:
            scope.timer.lap("data_s")

    def forward_ends(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.dist.inputs is None:  # (for the manifest's FLOPs per sample)
            self.dist.inputs = ([(a.shape, a.dtype) for a in args
                                 if isinstance(a, torch.Tensor)],
                                {k: (v.shape, v.dtype) for k, v in kwargs.items()
                                 if isinstance(v, torch.Tensor)})
        scope = self._timed()
        if scope is None:
            return  # (outside a step: an evaluation)
        if not scope.in_backward:
            scope.timer.lap("forward_s")
        for t in grad_tensors(output):
            t.register_hook(lambda g, scope=scope: self._gradient(scope, g))

    def _gradient(self, scope, grad: torch.Tensor) -> torch.Tensor | None:
        if not scope.in_backward:
            self._backward_begins(scope)
        scope.weighed = True
        return grad * self.weight if self.weight is not None else None

    def _backward_begins(self, scope) -> None:
        dist = self.dist
        if not dist.paused:
            scope.sending_backwards += 1
            if scope.sending_backwards > 1:
                raise PsringError(
                    f"a second backward in dist.step({scope.step}): the strategy sends "
                    f"the gradients when the first one ends. Accumulate micro-batches "
                    f"with all but the last backward under `with dist.no_sync():`.")
        timer = scope.timer
        timer.lap("forward_s")  # (the loss's computation)
        timer.backward_start = timer.mark
        scope.in_backward = True
        if dist.grads is not None:
            dist.grads.start()
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._backward_ends(scope))

    def _backward_ends(self, scope) -> None:
        timer = scope.timer
        timer.lap("backward_s")
        timer.backward_end = timer.mark
        scope.in_backward = False
        if self.dist.grads is not None:
            self.dist.grads.settle()
