"""Held-out evaluation and time to accuracy.

The loop (psring.workers.loop) evaluates the model on the held-out split before the
first step and every ``--eval-every`` steps, outside the step timing, and rank 0
appends one record per evaluation to ``evals.jsonl``::

    {"step": 20, "train_s": 3.41, "loss": 0.21, "accuracy": 0.953, "eval_s": 0.05, ...}

``step`` counts optimizer steps done; ``train_s`` is rank 0's wall-clock time since its
first step began, less the time spent evaluating and checkpointing. *Time to
accuracy* is MLPerf Training's: the ``train_s`` of the first evaluation whose accuracy
reaches the target (:func:`time_to_accuracy`); a run that never reaches it has none,
and reports say "not reached".
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn

from psring.train.data import Dataset
from psring.train.models import loss_and_correct, loss_for

#: rows per forward pass when evaluating (memory, not results, depends on it)
EVAL_BATCH = 256


@torch.no_grad()
def evaluate(model: nn.Module, ds: Dataset, device: torch.device) -> tuple[float, float]:
    """(mean loss, accuracy) of ``model`` on every row of ``ds``, in eval mode (batch
    norm uses its running statistics); the model's mode is restored."""
    loss_sum, correct, predictions = 0.0, 0, 0
    loss_fn = loss_for(model)
    with in_eval_mode(model):
        for x, y in rows(ds, EVAL_BATCH, device):
            loss, right = loss_and_correct(model(x), y, loss_fn)
            n = y.numel()
            loss_sum += float(loss) * n
            correct += int(right)
            predictions += n
    return loss_sum / predictions, correct / predictions


@contextlib.contextmanager
def in_eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode inside, its own mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def rows(ds: Dataset, batch: int, device: torch.device
         ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Every row of ``ds``, ``batch`` at a time, on ``device``."""
    for a in range(0, len(ds), batch):
        yield ds.x[a:a + batch].to(device), ds.y[a:a + batch].to(device)


def is_due(done: int, steps: int, interval: int) -> bool:
    """Evaluate after ``done`` optimizer steps? (0 = the initial model)."""
    return interval > 0 and (done % interval == 0 or done == steps)


def time_to_accuracy(evals: Iterable[dict], target: float) -> tuple[float | None, int | None]:
    """(train_s, step) of the first evaluation at or above ``target``; (None, None)
    when none reached it."""
    for e in sorted(evals, key=lambda e: e["step"]):
        if e["accuracy"] >= target:
            return e["train_s"], e["step"]
    return None, None
