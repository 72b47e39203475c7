"""What the worker loop does between optimizer steps, outside their timing: evaluate the
model on the held-out split (every --eval-every steps and before the first) and save
checkpoints (every --checkpoint-every steps and after the last).

    psring run --strategy allreduce --workers 2 --eval-every 10 --checkpoint-every 50 \\
        --out runs/ar      # runs/ar/evals.jsonl, runs/ar/checkpoints/step-00000050/

Rank 0 records both; every worker takes part, so synchronous workers stay in step.
"""

from __future__ import annotations

import time

from torch import nn

from psring.records.runlog import StepLog
from psring.strategies.base import Strategy, WorkerContext
from psring.train import checkpoint
from psring.train.data import Split
from psring.train.evaluate import evaluate
from psring.train.optim import SGD
from psring.workers.timing import TrainingClock, now


def evaluation(ctx: WorkerContext, strategy: Strategy, model: nn.Module, data: Split,
               done: int, clock: TrainingClock, evals: StepLog | None) -> float:
    """Every worker evaluates at the same steps (so synchronous workers stay in step,
    and asynchronous ones pause alike); rank 0 records. Outside the step timing, except
    the wait in eval_model for the parameters (a PS pull): the next step would have
    waited for them, so that time is returned, to be charged to the next step's
    communication, and the training clock keeps running through it."""
    t = now()
    target = strategy.eval_model(model)
    fetch = now() - t
    train_s = clock.elapsed()
    with clock.paused():
        t = now()
        loss, accuracy = evaluate(target, data.held_out, ctx.device)
        if evals is not None:
            evals.write({"step": done, "train_s": round(train_s, 6),
                         "loss": loss, "accuracy": accuracy, "eval_s": round(now() - t, 6),
                         "time": time.time(), "samples": len(data.held_out)})
    return fetch


def checkpoint_due(cfg, done: int) -> bool:
    """Save after ``done`` optimizer steps? (every --checkpoint-every, and the last)"""
    return bool(cfg.checkpoint_every) and (done % cfg.checkpoint_every == 0
                                           or done == cfg.steps)


def save_checkpoint(ctx: WorkerContext, strategy: Strategy, model: nn.Module,
                    optimizer: SGD | None, done: int, clock: TrainingClock) -> None:
    """Every worker takes the state at the same step (a strategy may communicate for
    it: ps fetches its servers' shards); rank 0 writes it, and under torchrun each other
    host's run directory's writer its own (psring.runtime.elastic), where the state is
    every worker's. Outside the step's timing: a checkpoint is not part of training's
    cost."""
    train_s = clock.elapsed()
    with clock.paused():
        state = strategy.checkpoint_state(model, optimizer)
        if ctx.rank == 0 or (ctx.writes_checkpoints and state):
            checkpoint.save(ctx.run_dir, strategy.checkpoint_step(done, state), state,
                            {"strategy": ctx.cfg.strategy, "workers": ctx.world,
                             "train_s": train_s, "loop_step": done})
