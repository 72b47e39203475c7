"""A parameter server's store: one shard of the flat parameters and its optimizer state.

The update is the workers' own SGD (psring.train.optim.sgd_update: ``torch.optim.SGD``'s
arithmetic; lr, momentum, weight decay; no dampening, no Nesterov) in its fused form:
one pass over parameters, gradient and momentum instead of three (what
``SGD(fused=True)`` calls), so a synchronous parameter server trains the model
``allreduce`` trains (tests/unit/test_server.py compares with ``torch.optim.SGD``).

Synchronous steps with N > 1 workers sum the N pushes of a range straight into the
momentum buffer instead of into a separate sum (``begin``/``add``/``finish``): the
first push makes ``buf = m*buf + g_1 (+ wd*p)`` as soon as it arrives, and the last
one is a single fused pass ``buf += g_N; p -= lr*buf``. That keeps one pass, not
three, between the last gradient arriving and the range being ready to send, and
frees each pushed frame at once. It is SGD's arithmetic with the additions in another
order, so it agrees with ``torch.optim.SGD`` to float rounding (a few ulps), not bit
for bit. The step's sum goes into a second momentum buffer (``buf = m*buf + g_1``
written out of place, at the same cost), swapped in when the step ends: until then
``buf`` is the momentum of the version the parameters are at, which a snapshot between
steps returns (a script's ``optimizer.state_dict()``), whatever the other workers have
pushed of the next step.

``update="sum"`` (byteps ``--update-on worker``, BytePS's summation servers): no
optimizer here; the pushes of a step are only added, and a pull returns the sum (the
workers run the update). Two sums alternate by step: step s+1's first push must not
touch what pulls of step s's sum may still be sending (see ``sendable``).
"""

from __future__ import annotations

import torch

from psring.train.optim import sgd_update


class ShardStore:
    def __init__(self, lo: int, hi: int, params: torch.Tensor, lr: float, momentum: float,
                 weight_decay: float, update: str = "sgd"):
        self.lo, self.hi = lo, hi
        self.sum_only = update == "sum"
        self.params = params.detach().clone().contiguous()
        # sum mode: the sums of even and odd steps (the parameters are the workers')
        self.sums = (torch.zeros_like(self.params), torch.zeros_like(self.params)) \
            if self.sum_only else None
        self.step = 0  # (sum mode) the step whose pushes are being added
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        # SGD creates the buffer as a clone of the first gradient; 0 * m + g is the same
        # number, so a zero buffer gives identical results. The second one (a sync step
        # of several pushers adds into it) is allocated at its first use.
        self._bufs: list[torch.Tensor | None] | None = \
            [torch.zeros_like(self.params), None] if self.momentum else None
        self._cur = 0  # which of the two is the momentum of the current version
        self._began = False  # a step's sum went into the other one
        self._sum: torch.Tensor | None = None  # the running sum when there is no buf

    @property
    def buf(self) -> torch.Tensor | None:
        """The momentum of the version the parameters are at (None: SGD without it)."""
        return None if self._bufs is None else self._bufs[self._cur]

    def _next_buf(self) -> torch.Tensor:
        """The buffer this step's pushes are summed into (the momentum of the next version)."""
        i = 1 - self._cur
        if self._bufs[i] is None:
            self._bufs[i] = torch.empty_like(self.params)
        return self._bufs[i]

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def sendable(self, version: int) -> torch.Tensor:
        """What a pull of ``version`` is answered with: the parameters, or in sum mode
        the sum of step ``version - 1`` (kept until step ``version + 1`` starts adding,
        which needs every pusher of a range to have pulled it first)."""
        if not self.sum_only:
            return self.params
        return self.sums[(version - 1) % 2]

    def new_step(self, step: int) -> None:
        """Pushes of ``step`` go into its sum from now on (sum mode); a synchronous
        step's sum is now the momentum of the version it made."""
        self.step = step
        if self._began:
            self._cur, self._began = 1 - self._cur, False

    def _master(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient pushed in a compressed dtype (--compress), in the store's float32:
        the sum and the update are done in float32 whatever travelled."""
        return grad if grad.dtype == self.params.dtype else grad.to(self.params.dtype)

    def apply(self, grad: torch.Tensor, start: int = 0) -> None:
        """SGD step on elements [start, start + len(grad)) of this shard (sum mode: the
        one push of the range is the sum)."""
        if self.sum_only:
            self._acc(start, grad.numel()).copy_(grad)
            return
        grad = self._master(grad)
        end = start + grad.numel()
        buf = self.buf[start:end] if self.buf is not None else None
        sgd_update(self.params[start:end], grad, buf, self.lr, self.momentum,
                   self.weight_decay, fused=True)

    def _acc(self, start: int, n: int) -> torch.Tensor:
        if self.sum_only:
            return self.sums[self.step % 2][start:start + n]
        if self._bufs is not None:
            return self._next_buf()[start:start + n]
        if self._sum is None:
            self._sum = torch.empty_like(self.params)
        return self._sum[start:start + n]

    def begin(self, grad: torch.Tensor, start: int = 0) -> None:
        """The first of several pushes of a range in a sync step: ``buf = m*buf + g``,
        plus weight decay (once per step). A compressed ``grad`` is promoted to float32
        inside the kernel (exactly: float32 holds every float16 and bfloat16)."""
        acc = self._acc(start, grad.numel())
        if self.sum_only:
            acc.copy_(grad)
            return
        if self.momentum:  # (out of place: the current version's momentum stays)
            torch.add(grad, self.buf[start:start + grad.numel()], alpha=self.momentum,
                      out=acc)
            self._began = True
        else:
            acc.copy_(grad)
        if self.weight_decay:
            acc.add_(self.params[start:start + grad.numel()], alpha=self.weight_decay)

    def add(self, grad: torch.Tensor, start: int = 0) -> None:
        """A push between the first and the last: ``buf += g``."""
        self._acc(start, grad.numel()).add_(grad)  # promoted in the kernel, as in begin

    def finish(self, grad: torch.Tensor, start: int = 0) -> None:
        """The last push: ``buf += g; p -= lr*buf`` in one fused pass (momentum 1 makes
        the fused kernel's ``buf = 1*buf + g`` exact)."""
        grad = self._master(grad)
        n = grad.numel()
        if self.sum_only:
            self._acc(start, n).add_(grad)
            return
        sgd_update(self.params[start:start + n], grad, self._acc(start, n), self.lr, 1.0, 0.0,
                   fused=True)
