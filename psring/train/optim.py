"""SGD as every psring worker and parameter server applies it: ``torch.optim.SGD``'s
arithmetic (lr, momentum, weight decay; no dampening, no Nesterov) without
``torch.optim``'s machinery.

Why not ``torch.optim.SGD`` itself: its constructor and ``step()`` import
``torch._dynamo`` on first use (they are wrapped for ``torch.compile``), which costs
about 1 s on this machine, in every worker process, before the first step — more than a
short run's training. psring never compiles its loop, so the wrapping buys nothing here.

    opt = SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.0)
    loss.backward(); opt.step()

The update is the same tensor ops as ``torch.optim.SGD``'s CPU path, so results are
bit-identical (tests/unit/test_optim.py checks ``torch.equal``); the parameter servers use
the same function in its fused form (:func:`sgd_update`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch

_FUSED = getattr(torch, "_fused_sgd_", None)


def sgd_update(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, lr: float,
               momentum: float, weight_decay: float, fused: bool = False) -> None:
    """``p -= lr * (buf = momentum * buf + grad + weight_decay * p)``, in place; with
    ``buf`` None (no momentum) ``p -= lr * (grad + weight_decay * p)``. A zero ``buf``
    is SGD's first step exactly (``0 * m + g`` is ``g``).

    ``fused``: one pass through torch's fused SGD kernel where the build has it (what
    the parameter servers use: a third of the memory traffic). It rounds differently
    from torch.optim.SGD's separate ops in the last bit now and then (it may contract
    a multiply and an add), so workers, whose ``single`` baseline must be torch's SGD
    bit for bit, use the separate ops."""
    bufs = [buf] if buf is not None else []
    if fused and _FUSED is not None:
        _FUSED([p], [grad], bufs, weight_decay=weight_decay, momentum=momentum, lr=lr,
               dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
        return
    d_p = grad
    if weight_decay:
        d_p = d_p.add(p, alpha=weight_decay)
    if buf is not None:
        buf.mul_(momentum).add_(d_p)
        d_p = buf
    p.add_(d_p, alpha=-lr)


class SGD:
    """The subset of ``torch.optim.Optimizer`` psring's loop and strategies use:
    ``step()``, ``zero_grad()``, ``param_groups`` and ``state[p]["momentum_buffer"]``
    (checkpoints read and restore it)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD needs lr, momentum and weight_decay >= 0 (got {lr}, "
                             f"{momentum}, {weight_decay})")
        self.param_groups: list[dict[str, Any]] = [
            {"params": list(params), "lr": float(lr), "momentum": float(momentum),
             "weight_decay": float(weight_decay)}]
        self.state: defaultdict[torch.Tensor, dict[str, torch.Tensor]] = defaultdict(dict)

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = None
                if group["momentum"]:
                    buf = self.state[p].get("momentum_buffer")
                    if buf is None:
                        buf = self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                sgd_update(p, p.grad, buf, group["lr"], group["momentum"],
                           group["weight_decay"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
