"""The one worker training loop every strategy runs in.

    psring run --strategy ddp --workers 2 --steps 20 --out runs/ddp   # runs/ddp/steps.jsonl

It knows phases, not strategies: it calls the strategy's hooks (see
``psring.strategies.base``) and reads its capabilities (``strategy.caps``). One
optimizer step (:meth:`StepRunner.step`), each segment timed into one phase:

    model.zero_grad(set_to_none=True)                   update_s
    strategy.begin_step(step).wait()                    comm_s
    for each of --accumulate micro-batches:
        x, y = this worker's slice of the global batch  data_s
        with strategy.no_sync() unless it is the last one:
            loss = loss_fn(module(x), y) / accumulate   forward_s
            loss.backward()  (hooks may start comm)     backward_s
    handle = strategy.finish_backward()                 backward_s
    handle.wait()                                       comm_s
    strategy.update(optimizer)                          update_s
    -> one steps.jsonl record

Between steps, outside their timing: evaluation and checkpoints
(psring.workers.periodic). The phases are laps of one clock
(psring.workers.timing.PhaseTimer), so ``data_s + forward_s + backward_s + comm_s +
update_s == step_s`` (up to clock reads). ``comm_s`` is time spent *blocked* on
communication; communication that overlaps backward is inside ``backward_s``.

With ``--trace`` each record also carries ``start`` (wall-clock time of the step's
start, the clock all processes of a host share) and ``spans``: the phases in the
order they happened, as ``[phase, start_s, end_s]`` relative to ``start``
(psring.records.trace turns them into a timeline).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
from torch import nn

from psring.errors import PsringError
from psring.records.runlog import EVALS, StepLog
from psring.runtime import faults
from psring.strategies.base import Strategy, WorkerContext
from psring.train.checkpoint import Checkpoint
from psring.train.data import Dataset, Split, worker_batch
from psring.train.elimination import Elimination
from psring.train.evaluate import is_due
from psring.train.models import loss_for
from psring.train.optim import SGD
from psring.train.shares import gradient_weight
from psring.workers.periodic import checkpoint_due, evaluation, save_checkpoint
from psring.workers.timing import (
    GradientClock,
    PhaseTimer,
    TrainingClock,
    device_sync,
    now,
)


def make_optimizer(model: nn.Module, cfg) -> SGD:
    return SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
               weight_decay=cfg.weight_decay)


def train(ctx: WorkerContext, strategy: Strategy, model: nn.Module, data: Split,
          log: StepLog | None, on_step: Callable[[dict], None] | None = None,
          resume: Checkpoint | None = None) -> None:
    """Train ``model`` for --steps optimizer steps (from ``resume``'s step on), one
    ``log`` record (and ``on_step`` call) each."""
    cfg = ctx.cfg
    module = strategy.setup(model)
    optimizer = None
    if strategy.caps.local_optimizer(cfg.update_on):
        # with --compute device the step is the device's (psring.train.device.DeviceSGD)
        optimizer = ctx.stand_in.optimizer() if ctx.stand_in else make_optimizer(model, cfg)
    first_step = 0
    clock = TrainingClock()
    if resume is not None:
        # The step counter is also the data position: batches are a function of (step,
        # rank), so from here on every worker sees what the uninterrupted run saw.
        strategy.restore_checkpoint(model, optimizer, resume.tensors)
        first_step = resume.step
        clock.resumed = float(resume.meta.get("train_s", 0.0))
    run = StepRunner(ctx, strategy, model, module, optimizer, data.train)
    evals = StepLog(ctx.run_dir, EVALS) if ctx.rank == 0 and log is not None else None
    try:
        with _timeouts_named(ctx, strategy):
            _steps(run, data, log, on_step, first_step, clock, evals)
    finally:
        if evals is not None:
            evals.close()


@contextlib.contextmanager
def _timeouts_named(ctx: WorkerContext, strategy: Strategy):
    """torch.distributed's timeouts (gloo, NCCL) say only "timed out": name what was
    waited for and the knob, as the parameter-server client does for its servers."""
    try:
        yield
    except RuntimeError as e:
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        raise PsringError(
            f"worker {ctx.rank}: no progress within --timeout {ctx.cfg.timeout:g} s while "
            f"waiting for {strategy.caps.waits_for}; see the other workers' logs for which one "
            f"stopped (or raise --timeout if a step can legitimately take that long). "
            f"({str(e).splitlines()[0][:200]})") from e


def _steps(run: StepRunner, split: Split, log: StepLog | None,
           on_step: Callable[[dict], None] | None, first_step: int, clock: TrainingClock,
           evals: StepLog | None) -> None:
    """The steps from ``first_step`` on, with evaluations and checkpoints between them."""
    ctx, strategy, model, cfg = run.ctx, run.strategy, run.model, run.cfg
    every = cfg.eval_interval
    carried = 0.0  # communication an evaluation waited for on the next step's behalf
    if first_step == 0 and is_due(0, cfg.steps, every):
        carried = evaluation(ctx, strategy, model, split, 0, clock, evals)  # the start
    stops = faults.stops_at(cfg, ctx.rank)  # --kill-worker: where the launcher kills it
    kept = Elimination(split.train, cfg.eliminate_every)  # --eliminate-every
    for step in range(first_step, cfg.steps):
        if step in stops:
            faults.stop_here(cfg, ctx.rank, step)
        run.data = kept.before_step(step, model, ctx.device, resumed=step == first_step)
        clock.begin(carried)
        record = run.step(step, carried)
        record.update(kept.describe())
        carried = 0.0
        if log is not None:
            log.write(record)
        if on_step is not None:
            on_step(record)
        done = step + 1
        if is_due(done, cfg.steps, every):
            carried = evaluation(ctx, strategy, model, split, done, clock, evals)
        if checkpoint_due(cfg, done):
            save_checkpoint(ctx, strategy, model, run.optimizer, done, clock)


class Straggler:
    """--slow-worker I:FACTOR: worker I's gradients come late. Its compute before
    backward is stretched by the previous micro-batch's compute time (3x this forward
    for the first one), so it computes FACTOR times as long."""

    def __init__(self, cfg, rank: int, sync: Callable[[], None] = lambda: None):
        slow_rank, factor = cfg.slow
        self.factor = factor if slow_rank == rank and factor > 1 else 1
        self.last_compute = 0.0
        self.sync = sync  # (CUDA: the forward is queued, not done, until synchronized)

    def delay(self, compute_start: float) -> None:
        if self.factor > 1:
            self.sync()
            time.sleep((self.factor - 1)
                       * (self.last_compute or 3 * (now() - compute_start)))

    def computed(self, seconds: float) -> None:
        """One micro-batch's forward and backward took ``seconds``, delay included."""
        self.last_compute = seconds / self.factor


class StepRunner:
    """One worker's optimizer steps: what stays the same from step to step (set up
    once, hooks included), and :meth:`step`."""

    def __init__(self, ctx: WorkerContext, strategy: Strategy, model: nn.Module,
                 module: nn.Module, optimizer: SGD | None, data: Dataset):
        self.ctx, self.cfg, self.strategy = ctx, ctx.cfg, strategy
        self.model, self.module, self.optimizer, self.data = model, module, optimizer, data
        cfg, stand_in = ctx.cfg, ctx.stand_in
        cuda = ctx.device.type == "cuda"
        self.sync = device_sync(ctx.device)
        # --time-scale S (device mode) runs the cluster S times slower than the one it
        # stands for: every duration is recorded on that cluster's clock, divided by S
        self.scale = 1.0 / stand_in.time_scale if stand_in is not None else 1.0
        # a device's loss is part of its forward: the stand-in's costs the host nothing
        self.loss_fn = stand_in.loss if stand_in is not None else loss_for(model)
        self.sizes = cfg.worker_batches
        self.weight = gradient_weight(cfg, ctx.rank, ctx.world)  # (--worker-batch)
        self.straggler = Straggler(cfg, ctx.rank, self.sync)
        # the last gradient's time splits backward from the wait inside it; --trace
        # records every gradient's
        self.grads = (GradientClock(model, cuda=cuda)
                      if strategy.caps.syncs_inside_backward or cfg.trace else None)

    def step(self, step: int, carried: float = 0.0) -> dict:
        """One optimizer step, timed phase by phase; returns its steps.jsonl record.
        ``carried``: communication already waited for on its behalf (comm_s)."""
        strategy, micro = self.strategy, self.cfg.accumulate
        timer = PhaseTimer(self.sync, self.cfg.trace, carried, self.scale)
        self.model.zero_grad(set_to_none=True)
        timer.lap("update_s")
        strategy.begin_step(step).wait()
        timer.lap("comm_s")

        loss_sum = torch.zeros((), device=self.ctx.device)
        for m in range(micro):
            x, y = self._batch(step * micro + m)
            if self.ctx.stand_in is not None:  # a device's input copy, as profiled
                self.ctx.stand_in.loaded(timer.mark)
            timer.lap("data_s")
            with contextlib.nullcontext() if m == micro - 1 else strategy.no_sync():
                loss = self._forward_backward(x, y, timer)
            loss_sum += loss
        if strategy.caps.syncs_inside_backward:
            timer.blocked_since(self.grads.last)

        handle = strategy.finish_backward()
        timer.lap("backward_s")
        handle.wait()
        timer.lap("comm_s")
        strategy.update(self.optimizer)
        timer.lap("update_s")
        return self._record(step, timer, loss_sum)

    def _batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This worker's rows of global (micro-)batch ``index``, on its device."""
        ctx, device = self.ctx, self.ctx.device
        x, y = worker_batch(self.data, self.cfg.batch_size, index, ctx.rank, ctx.world,
                            self.sizes)
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor,
                          timer: PhaseTimer) -> torch.Tensor:
        """One micro-batch's forward (forward_s) and backward (backward_s); its loss."""
        compute_start = timer.mark
        loss = self.loss_fn(self.module(x), y) / self.cfg.accumulate
        # (the record keeps this worker's own mean loss, not the weighed one)
        weighed = loss * self.weight if self.weight is not None else loss
        self.straggler.delay(compute_start)
        timer.lap("forward_s")
        if self.grads is not None:
            self.grads.start()
        if self.ctx.stand_in is not None:
            self.ctx.stand_in.begin_backward()
        timer.backward(weighed.backward)
        if self.grads is not None:
            self.grads.settle()
        self.straggler.computed(timer.mark - compute_start)
        return loss.detach()

    def _record(self, step: int, timer: PhaseTimer, loss_sum: torch.Tensor) -> dict:
        return step_record(self.ctx, self.strategy, timer, step, float(loss_sum), self.grads)


def step_record(ctx: WorkerContext, strategy: Strategy, timer: PhaseTimer, step: int,
                loss: float | None, grads: GradientClock | None = None) -> dict:
    """A step's steps.jsonl line: the phases, the strategy's stats (byte counts, bucket
    times, its own fields), and under --trace the spans and gradient times. ``loss``:
    this worker's own mean loss (None where a user's script did not say it)."""
    cfg = ctx.cfg
    stats = strategy.take_stats()
    record = {
        "strategy": cfg.strategy, "worker": ctx.rank, "host": ctx.host, "step": step,
        "time": time.time(), **timer.phases(),
        "bytes_sent": stats.bytes_sent, "bytes_recv": stats.bytes_recv,
        "loss": loss, "backward_end_s": timer.offset(timer.backward_end),
        **timer.trace(),
    }
    if cfg.trace and grads is not None:
        # offsets from the last micro-batch's backward start, in parameter order
        record["grad_ready_s"] = timer.since_backward(grads.ready_at)
    if stats.bucket_launch:
        record["bucket_launch_s"] = [timer.offset(t) for t in stats.bucket_launch]
        record["bucket_done_s"] = [timer.offset(t) for t in stats.bucket_done]
    record.update({k: round(v * timer.scale, 7) if k.endswith("_s") else v
                   for k, v in stats.extra.items()})
    if ctx.stand_in is not None:
        record.update(ctx.stand_in.record())
    return record
