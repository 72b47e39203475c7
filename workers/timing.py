"""The worker's clocks: one step's phases, when each gradient became final, and rank
0's training time.

    timer = PhaseTimer(sync, trace=cfg.trace, carried=0.0, scale=1.0)
    model.zero_grad(); timer.lap("update_s")        # each lap: since the previous one
    strategy.begin_step(step).wait(); timer.lap("comm_s")
    ...
    timer.phases()   # {"data_s": .., "forward_s": .., .., "update_s": .., "step_s": ..}

Every lap reads the same clock and charges the time since the previous lap to exactly
one phase, so the phases add up to ``step_s`` (up to rounding). Used by
psring.workers.loop; psring.records.trace turns the spans into a timeline.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
from torch import nn

from psring.records.runlog import PHASES

now = time.perf_counter


def device_sync(device: torch.device) -> Callable[[], None]:
    """What a phase boundary runs before reading the clock. On CUDA, kernels run
    asynchronously: synchronize so time lands in the phase that caused it (the compute
    stream only: a collective on NCCL's own stream is waited for where its handle is).
    On the CPU, nothing."""
    if device.type == "cuda":
        return torch.cuda.current_stream(device).synchronize
    return lambda: None


class PhaseTimer:
    """One optimizer step's clock. ``sync`` runs before each clock read (CUDA's
    synchronize: kernels run asynchronously, and their time belongs to the phase that
    queued them); with ``trace`` it also keeps the laps as spans ``[phase, start_s,
    end_s]`` from the step's start. ``carried``: communication an evaluation already
    waited for on this step's behalf, charged to comm_s as the step's first lap.
    ``scale``: what every recorded duration is multiplied by (1 / --time-scale)."""

    def __init__(self, sync: Callable[[], None], trace: bool, carried: float = 0.0,
                 scale: float = 1.0):
        self.sync = sync
        self.scale = scale
        self.ph = dict.fromkeys(PHASES, 0.0)
        self.mark = now()
        self.t0 = self.mark - carried  # the step began with that wait
        self.ph["comm_s"] = carried
        self.start = time.time() - carried
        self.spans: list[list] | None = [] if trace else None
        if self.spans is not None and carried:
            self.spans.append(["comm", 0.0, round(carried, 7)])
        #: the last backward lap's ends (the last micro-batch's backward)
        self.backward_start = 0.0
        self.backward_end = 0.0

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to ``phase``."""
        self.sync()
        t = now()
        self.ph[phase] += t - self.mark
        if self.spans is not None and t > self.mark:
            self.spans.append([phase[:-2], round(self.mark - self.t0, 7),
                               round(t - self.t0, 7)])
        self.mark = t

    def backward(self, run: Callable[[], None]) -> None:
        """Time ``run`` (a backward pass) as one backward_s lap, and keep its ends."""
        self.backward_start = self.mark
        run()
        self.lap("backward_s")
        self.backward_end = self.mark

    def blocked_since(self, last_grad: float) -> None:
        """The last backward lap waited for communication after its last gradient was
        final at ``last_grad`` (a strategy that syncs inside backward): that tail is
        comm_s, not backward_s. Nothing changes when no gradient came in that lap."""
        if last_grad <= self.backward_start:
            return
        blocked = self.backward_end - last_grad
        self.ph["backward_s"] -= blocked
        self.ph["comm_s"] += blocked
        self.backward_end = last_grad
        spans = self.spans
        if spans and spans[-1][0] == "backward":
            spans[-1][2] = round(last_grad - self.t0, 7)
            spans.append(["comm", spans[-1][2], round(self.mark - self.t0, 7)])

    def offset(self, t: float) -> float:
        """A clock reading as seconds from the step's start, scaled."""
        return round((t - self.t0) * self.scale, 7)

    def phases(self) -> dict[str, float]:
        """The five phases and ``step_s``, scaled, in the step record's order."""
        return {**{k: round(v * self.scale, 7) for k, v in self.ph.items()},
                "step_s": self.offset(self.mark)}

    def trace(self) -> dict:
        """``start`` (wall clock) and the spans, under --trace; else nothing."""
        if self.spans is None:
            return {}
        per = self.scale
        spans = self.spans if per == 1.0 else \
            [[name, round(a * per, 7), round(b * per, 7)] for name, a, b in self.spans]
        return {"start": self.start, "spans": spans}

    def since_backward(self, times: list[float]) -> list[float]:
        """Clock readings as offsets from the last backward's start, scaled."""
        return [round(max(0.0, t - self.backward_start) * self.scale, 7) for t in times]


class GradientClock:
    """When each parameter's gradient became final (one hook per parameter): ``last``
    marks the end of backward's compute for a strategy that waits for communication
    inside backward(); with --trace all of them (``ready_at``, in parameter order) go
    into the step record, for psring.records.profile (the simulator rebuckets a
    profile at any bucket size).

    On CUDA a hook runs when autograd *queues* the gradient's kernels, long before the
    device computes it: ``cuda=True`` records an event on the stream in each hook, and
    :meth:`settle` (after backward's synchronize) turns them into clock readings."""

    def __init__(self, model: nn.Module, cuda: bool = False):
        params = [p for p in model.parameters() if p.requires_grad]
        self.last = 0.0
        self.ready_at = [0.0] * len(params)
        self.cuda = cuda
        # (created once and recorded again each step: creating an event costs the host
        # more than recording one, and a backward's hooks are on its critical path)
        self.events: list = []
        self.recorded = [False] * len(params)
        self.origin: tuple[float, object] | None = None  # (clock, event) at backward's start
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(self._ready(i))

    def start(self) -> None:
        """A backward begins (the device idle: the forward's lap synchronized)."""
        self.last = 0.0
        if self.cuda:
            if not self.events:
                self.events = [torch.cuda.Event(enable_timing=True)
                               for _ in range(len(self.recorded) + 1)]
            self.events[-1].record()
            self.origin = (now(), self.events[-1])
            self.recorded = [False] * len(self.recorded)

    def _ready(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if self.cuda:
                if self.events:  # (a backward before the first start() goes untimed)
                    self.events[i].record()
                    self.recorded[i] = True
            else:
                self.last = self.ready_at[i] = now()
        return hook

    def settle(self) -> None:
        """Once backward's kernels are done: the events as clock readings."""
        if not self.cuda or self.origin is None:
            return
        t0, start = self.origin
        for i, done in enumerate(self.recorded):
            if done:
                self.events[i].synchronize()
                self.ready_at[i] = t0 + start.elapsed_time(self.events[i]) / 1e3
                self.last = max(self.last, self.ready_at[i])


class TrainingClock:
    """Rank 0's training time: wall-clock since its first step began, less what is not
    training (evaluations, checkpoints); a resumed run continues its checkpoint's."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.excluded = 0.0
        self.resumed = 0.0

    def begin(self, already: float = 0.0) -> None:
        """The first step begins (``already`` seconds ago: a wait charged to it)."""
        if self.start is None:
            self.start = now() - already
            self.excluded = 0.0  # (the evaluation of the initial model came before)

    def elapsed(self) -> float:
        return self.resumed + (now() - self.start - self.excluded if self.start else 0.0)

    @contextlib.contextmanager
    def paused(self):
        t = now()
        try:
            yield
        finally:
            self.excluded += now() - t
