"""A parameter server's store: one shard of the flat parameters and its optimizer state.

The update is ``torch.optim.SGD``'s own arithmetic (lr, momentum, weight decay; no
dampening, no Nesterov), applied elementwise with the same tensor ops in the same
order, so a synchronous parameter server trains exactly the model ``allreduce`` trains.
"""

from __future__ import annotations

import torch


class ShardStore:
    def __init__(self, lo: int, hi: int, params: torch.Tensor, lr: float, momentum: float,
                 weight_decay: float):
        self.lo, self.hi = lo, hi
        self.params = params.detach().clone().contiguous()
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        # SGD creates the buffer as a clone of the first gradient; 0 * m + g is the same
        # number, so a zero buffer gives identical results.
        self.buf = torch.zeros_like(self.params) if self.momentum else None

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def apply(self, grad: torch.Tensor, start: int = 0) -> None:
        """SGD step on elements [start, start + len(grad)) of this shard."""
        end = start + grad.numel()
        p = self.params[start:end]
        d_p = grad
        if self.weight_decay:
            d_p = d_p.add(p, alpha=self.weight_decay)
        if self.buf is not None:
            buf = self.buf[start:end]
            buf.mul_(self.momentum).add_(d_p)
            d_p = buf
        p.add_(d_p, alpha=-self.lr)
