"""The one worker training loop every strategy runs in.

It knows phases, not strategies: it calls the strategy's hooks (see
``psring.strategies.base``) and reads its capability flags, and times each segment of
the step into exactly one of five phases, so ``data_s + forward_s + backward_s +
comm_s + update_s == step_s`` (up to clock reads). ``comm_s`` is time spent *blocked*
on communication; communication that overlaps backward is inside ``backward_s``.

With ``--trace`` each record also carries ``start`` (wall-clock time of the step's
start, the clock all processes of a host share) and ``spans``: the phases in the
order they happened, as ``[phase, start_s, end_s]`` relative to ``start``
(psring.runs.trace turns them into a timeline).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
from torch import nn

from psring.train.checkpoint import Checkpoint
from psring.train.data import Split, worker_batch
from psring.errors import PsringError
from psring.train.evaluate import is_due
from psring.train.models import loss_of
from psring.train.optim import SGD
from psring.runs.runlog import EVALS, PHASES, StepLog
from psring.strategies.base import Strategy, WorkerContext
from psring.workers.periodic import checkpoint_due, evaluation, save_checkpoint
from psring.workers.timing import TrainingClock, now


def make_optimizer(model: nn.Module, cfg) -> SGD:
    return SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
               weight_decay=cfg.weight_decay)


def train(ctx: WorkerContext, strategy: Strategy, model: nn.Module, data: Split,
          log: StepLog | None, on_step: Callable[[dict], None] | None = None,
          resume: Checkpoint | None = None) -> None:
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
    evals = StepLog(ctx.run_dir, EVALS) if ctx.rank == 0 and log is not None else None
    try:
        _steps(ctx, strategy, model, module, optimizer, data, log, on_step, first_step,
               clock, evals)
    except RuntimeError as e:
        # torch.distributed's timeouts (gloo, NCCL) say only "timed out"; name what was
        # waited for and the knob, as the parameter-server client does for its servers
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        raise PsringError(
            f"worker {ctx.rank}: no progress within --timeout {cfg.timeout:g} s while "
            f"waiting for {strategy.caps.waits_for}; see the other workers' logs for which one "
            f"stopped (or raise --timeout if a step can legitimately take that long). "
            f"({str(e).splitlines()[0][:200]})") from e
    finally:
        if evals is not None:
            evals.close()


def _steps(ctx: WorkerContext, strategy: Strategy, model: nn.Module, module: nn.Module,
           optimizer: SGD | None, split: Split, log: StepLog | None,
           on_step: Callable[[dict], None] | None, first_step: int, clock: TrainingClock,
           evals: StepLog | None) -> None:
    cfg = ctx.cfg
    device = ctx.device
    data = split.train
    every = cfg.eval_interval
    micro = cfg.accumulate
    # On CUDA, kernels run asynchronously: synchronize at phase boundaries so time lands
    # in the phase that caused it. On CPU this is a no-op.
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    slow_rank, slow_factor = cfg.slow
    slowed = slow_rank == ctx.rank and slow_factor > 1
    # --time-scale S (device mode) runs the cluster S times slower than the one it stands
    # for: every duration is recorded on that cluster's clock, divided by S
    per = 1.0 / ctx.stand_in.time_scale if ctx.stand_in is not None else 1.0
    # a device's loss is part of its forward: the stand-in's costs the host nothing
    loss_fn = ctx.stand_in.loss if ctx.stand_in is not None else loss_of
    # --worker-batch: this worker's mean loss over its n samples, weighed by n / (B / N):
    # every synchronous strategy averages N workers' gradients, so the average is then
    # the global batch's mean gradient, what single computes
    sizes = cfg.worker_batches
    uneven = bool(cfg.worker_batch)
    weight = ctx.world * sizes[ctx.rank] / cfg.batch_size

    last_compute = 0.0
    # When each parameter's gradient became final (one hook per parameter): the last
    # one marks the end of backward's compute for a strategy that waits for
    # communication inside backward(); with --trace all of them are logged, for
    # psring.predict.profile (the simulator rebuckets a profile at any bucket size).
    last_grad = [0.0]
    grad_ready: list[float] | None = None
    if strategy.caps.syncs_inside_backward or cfg.trace:
        params = [p for p in model.parameters() if p.requires_grad]
        ready_at = [0.0] * len(params)
        grad_ready = ready_at if cfg.trace else None

        def ready(i: int) -> Callable[[torch.Tensor], None]:
            def hook(_: torch.Tensor) -> None:
                last_grad[0] = ready_at[i] = now()
            return hook

        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(ready(i))

    carried = 0.0  # communication an evaluation waited for on this step's behalf
    if first_step == 0 and is_due(0, cfg.steps, every):
        carried = evaluation(ctx, strategy, model, split, 0, clock, evals)  # the start
    for step in range(first_step, cfg.steps):
        clock.begin(carried)
        ph = dict.fromkeys(PHASES, 0.0)
        mark = now()
        t0 = mark - carried  # the step began with that wait
        ph["comm_s"] = carried
        start = time.time() - carried
        spans: list[list] | None = [] if cfg.trace else None
        if spans is not None and carried:
            spans.append(["comm", 0.0, round(carried, 7)])
        carried = 0.0

        def lap(phase: str) -> None:
            nonlocal mark
            sync()
            t = now()
            ph[phase] += t - mark
            if spans is not None and t > mark:
                spans.append([phase[:-2], round(mark - t0, 7), round(t - t0, 7)])
            mark = t

        model.zero_grad(set_to_none=True)
        lap("update_s")
        strategy.begin_step(step).wait()
        lap("comm_s")

        loss_sum = torch.zeros((), device=device)
        backward_end = 0.0
        for m in range(micro):
            x, y = worker_batch(data, cfg.batch_size, step * micro + m, ctx.rank, ctx.world,
                                sizes)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            lap("data_s")
            last = m == micro - 1
            compute_start = mark
            with contextlib.nullcontext() if last else strategy.no_sync():
                loss = loss_fn(module(x), y) / micro
                # (the record keeps this worker's own mean loss, not the weighed one)
                weighed = loss * weight if uneven else loss
                if slowed:
                    # --slow-worker: a straggler's gradients come late, so stretch the
                    # compute before backward, by the previous micro-batch's compute time
                    # (3x this forward for the first one).
                    time.sleep((slow_factor - 1) * (last_compute or 3 * (now() - compute_start)))
                lap("forward_s")
                backward_start = mark
                last_grad[0] = 0.0
                weighed.backward()
                lap("backward_s")
                last_compute = (mark - compute_start) / (slow_factor if slowed else 1)
                backward_end = mark
            if last and strategy.caps.syncs_inside_backward and last_grad[0] > backward_start:
                blocked = backward_end - last_grad[0]
                ph["backward_s"] -= blocked
                ph["comm_s"] += blocked
                backward_end = last_grad[0]
                if spans and spans[-1][0] == "backward":
                    spans[-1][2] = round(backward_end - t0, 7)
                    spans.append(["comm", spans[-1][2], round(mark - t0, 7)])
            loss_sum += loss.detach()

        handle = strategy.finish_backward()
        lap("backward_s")
        handle.wait()
        lap("comm_s")
        strategy.update(optimizer)
        lap("update_s")

        stats = strategy.take_stats()
        record = {
            "strategy": cfg.strategy, "worker": ctx.rank, "host": ctx.host, "step": step,
            "time": time.time(),
            **{k: round(v * per, 7) for k, v in ph.items()},
            "step_s": round((mark - t0) * per, 7),
            "bytes_sent": stats.bytes_sent, "bytes_recv": stats.bytes_recv,
            "loss": float(loss_sum),
            "backward_end_s": round((backward_end - t0) * per, 7),
        }
        if spans is not None:
            record["start"] = start
            record["spans"] = spans if per == 1.0 else \
                [[name, round(a * per, 7), round(b * per, 7)] for name, a, b in spans]
        if grad_ready is not None:
            # offsets from the last micro-batch's backward start, in parameter order
            record["grad_ready_s"] = [round(max(0.0, t - backward_start) * per, 7)
                                      for t in grad_ready]
        if stats.bucket_launch:
            record["bucket_launch_s"] = [round((t - t0) * per, 7) for t in stats.bucket_launch]
            record["bucket_done_s"] = [round((t - t0) * per, 7) for t in stats.bucket_done]
        record.update({k: round(v * per, 7) if k.endswith("_s") else v
                       for k, v in stats.extra.items()})
        if ctx.stand_in is not None:
            record.update(ctx.stand_in.record())
        if log is not None:
            log.write(record)
        if on_step is not None:
            on_step(record)
        done = step + 1
        if is_due(done, cfg.steps, every):
            carried = evaluation(ctx, strategy, model, split, done, clock, evals)
        if checkpoint_due(cfg, done):
            save_checkpoint(ctx, strategy, model, optimizer, done, clock)
