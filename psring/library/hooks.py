"""A script's step as psring's loop runs its own, by hooks on the wrapped model.

Inside ``with dist.step()`` the laps of the step's PhaseTimer fall where the loop's do
(psring.workers.loop): from the step's start (or the last backward's end) to a
forward's start is ``data_s`` (inputs moved, a micro-batch fetched), the forward and the
loss until backward reaches the model's output ``forward_s``, backward until autograd
finishes it ``backward_s``.

**Gradients ready when backward() returns**, as DDP's contract has them: a callback
queued on autograd's engine runs when a backward ends and finishes the strategy's
communication there (psring.library.wrap.finish_backward), so ``p.grad`` holds the
average as soon as ``loss.backward()`` returns, for a clip, ``GradScaler.unscale_`` or
any edit. For a strategy that waits inside backward itself (DDP's reducer, whose own
callback runs after this one) a second callback, queued from the first, marks the end
of that wait: DDP's all-reduces are ``comm_s``.

**The weight of each backward** (``--worker-batch`` shares, ``dist.accumulate``'s 1/K)
is applied to every parameter's gradient as autograd hands it over (a hook on each
parameter), once per backward, whatever the forward returns or the loss is made of.

A second backward in one step is refused unless the earlier ones ran under
``dist.no_sync()``: the strategy sends the gradients when the first one ends.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from psring.errors import PsringError


def grad_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's output that gradients flow back through: in tuples,
    lists, dicts (HuggingFace's ModelOutput is one) and dataclasses."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, dict):
        items = output.values()
    elif isinstance(output, (list, tuple)):
        items = output
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = [getattr(output, f.name) for f in dataclasses.fields(output)]
    else:
        items = ()
    return [t for item in items for t in grad_tensors(item)]


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (in tuples, named tuples, lists, dicts and
    dataclasses, nested) on ``device``; anything else as it is."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return type(obj)({k: to_device(v, device) for k, v in obj.items()}) \
            if type(obj) is dict else _rebuilt_mapping(obj, device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(to_device(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _rebuilt_mapping(obj: dict, device: torch.device) -> dict:
    """A dict subclass (a BatchEncoding, an OrderedDict) moved key by key in place of a
    copy: its constructor may take other arguments than a dict."""
    moved = {k: to_device(v, device) for k, v in obj.items()}
    try:
        return type(obj)(moved)
    except TypeError:
        return moved


class StepHooks:
    """Installed by ``dist.wrap`` on the module it returns, the model inside it, and
    each trainable parameter (see the module's docstring)."""

    def __init__(self, dist, module: nn.Module, model: nn.Module):
        self.dist = dist
        self.engine = torch.autograd.Variable._execution_engine
        if dist.device.type != "cpu":  # (on a CPU-only process every tensor is there)
            for m in {id(module): module, id(model): model}.values():
                m.register_forward_pre_hook(self.inputs_to_device, with_kwargs=True)
        module.register_forward_pre_hook(self.forward_begins)
        module.register_forward_hook(self.forward_ends, with_kwargs=True)
        for p in model.parameters():
            if p.requires_grad:
                p.register_hook(self.parameter_gradient)

    def _timed(self):
        """The current step's scope, while its forward and backward are timed."""
        scope = self.dist.current
        return None if scope is None or scope.stepped else scope

    def inputs_to_device(self, module: nn.Module, args: tuple, kwargs: dict):
        """Tensor arguments onto the worker's device (DDP's ``device_ids``, Accelerate's
        ``prepare``), in training and in evaluation alike."""
        device = self.dist.device
        return to_device(args, device), to_device(kwargs, device)

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
            t.register_hook(lambda g, scope=scope: self._output_gradient(scope))

    def _output_gradient(self, scope) -> None:
        """Backward reached the model's output: its forward (the loss) is over."""
        if not scope.in_backward:
            self._backward_begins(scope)

    def parameter_gradient(self, grad: torch.Tensor) -> torch.Tensor | None:
        """A parameter's gradient of this backward, weighed (once per backward)."""
        scope = self._timed()
        if scope is None:
            return None
        if not scope.in_backward:  # (a loss that did not come through the output)
            self._backward_begins(scope)
        scope.gradients = True
        return grad * scope.factor if scope.factor != 1.0 else None

    def _backward_begins(self, scope) -> None:
        dist = self.dist
        scope.sending = not dist.paused
        if scope.sending:
            scope.sending_backwards += 1
            if scope.sending_backwards > 1:
                raise PsringError(
                    f"a second backward in dist.step({scope.step}): the strategy sends "
                    f"the gradients when the first one ends. Accumulate micro-batches "
                    f"with all but the last backward under `with dist.no_sync():`, or "
                    f"one `with dist.accumulate(model):` each.")
        timer = scope.timer
        timer.lap("forward_s")  # (the loss's computation)
        timer.backward_start = timer.mark
        scope.in_backward, scope.gradients = True, False
        if dist.grads is not None:
            dist.grads.start()
        self.engine.queue_callback(lambda: self._backward_ends(scope))

    def _backward_ends(self, scope) -> None:
        """Autograd's last callback but DDP's: the backward's compute is over; where it
        sent gradients, the strategy's communication is finished here."""
        timer = scope.timer
        timer.lap("backward_s")
        timer.backward_end = timer.mark
        scope.in_backward = False
        dist = self.dist
        if dist.grads is not None:
            dist.grads.settle()
        if not (scope.sending and scope.gradients):
            return  # (a micro-batch under no_sync, or a backward past the parameters)
        if dist.strategy.caps.syncs_inside_backward:
            self.engine.queue_callback(lambda: finish_backward(dist, scope, waited=True))
        else:
            finish_backward(dist, scope)


def finish_backward(dist, scope, waited: bool = False) -> None:
    """The step's end of backward (once a step): the communication started during it
    finished and waited for (comm_s). Called when a backward ends, or by
    ``optimizer.step()`` and the step's end where none was seen. ``waited``: the
    strategy waited inside backward itself (DDP), and the time since the backward's
    compute ended was that wait."""
    if scope.synchronized:
        return
    if scope.in_backward:
        raise PsringError("optimizer.step() inside backward (a gradient hook?): call it "
                          "after loss.backward() returns.")
    timer = scope.timer
    timer.lap("comm_s" if waited else "backward_s")
    handle = dist.strategy.finish_backward()
    timer.lap("backward_s")
    handle.wait()
    timer.lap("comm_s")
    scope.synchronized = True
    if dist.on_server:
        scope.sent = gradients_as_sent(dist.model)


def gradients_as_sent(model: nn.Module) -> list[tuple[int, int] | None]:
    """Each parameter's gradient as it stood when the servers had it: its storage and
    its version counter, which every in-place change (a clip, an unscale) moves."""
    return [None if p.grad is None else (p.grad.data_ptr(), p.grad._version)
            for p in model.parameters() if p.requires_grad]
