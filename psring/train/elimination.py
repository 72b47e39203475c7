"""Sample elimination for margin classifiers (the seeds' parallel SVM): samples beyond
the margin leave the batches for a while.

    psring run --model svm --strategy ps --workers 4 --steps 200 --eliminate-every 20

Every ``--eliminate-every K`` steps each worker scores the whole training set with its
current model (:class:`Elimination`): a sample whose margin is 1 or more (its hinge
loss is zero, so its gradient is too) leaves the batches until the next check, which
scores every sample again and brings back those that were wrongly eliminated (their
margin fell below 1 since). Batches are drawn from the samples left, in order, as
psring.train.data.worker_batch draws them from the whole set. The model must say what
a margin is (``margins(out, y)``, psring.zoo.simple.LinearSVM).

In a synchronous run every worker holds the same parameters at a check, so every
worker keeps the same samples and the global batch is the one ``single`` draws: the
run still ends with single's parameters. The check is training's cost (the training
clock runs through it: time to accuracy counts it), not a step's.
"""

from __future__ import annotations

import torch
from torch import nn

from psring.errors import ConfigError
from psring.train.data import Dataset
from psring.train.evaluate import in_eval_mode, rows

#: rows scored per forward pass at a check (memory, not results, depends on it)
CHECK_BATCH = 4096


def check_model(model: nn.Module, every: int) -> None:
    """--eliminate-every needs a model that defines its margins."""
    if every and not callable(getattr(model, "margins", None)):
        raise ConfigError(f"--eliminate-every {every} drops samples beyond a classifier's "
                          f"margin, and this model defines none (a margins(out, y) method, "
                          f"as --model svm has): use --model svm, or drop "
                          f"--eliminate-every.")


class Elimination:
    """The training samples still in the batches (:attr:`active`), checked every
    ``every`` steps (0: never, every sample always in)."""

    def __init__(self, train: Dataset, every: int):
        self.train, self.every = train, every
        self.active = train

    def describe(self) -> dict[str, float]:
        """For a step's record: the fraction of the samples its batch was drawn from
        (nothing when elimination is off)."""
        return {"active": round(len(self.active) / len(self.train), 4)} if self.every else {}

    @torch.no_grad()
    def before_step(self, step: int, model: nn.Module, device: torch.device,
                    resumed: bool = False) -> Dataset:
        """The data set step ``step`` draws its batch from (scored again at a check, and
        at the first step of a resumed run: it ends as the uninterrupted one when
        --checkpoint-every is a multiple of --eliminate-every)."""
        if self.every and step > 0 and (step % self.every == 0 or resumed):
            keep = self._inside_margin(model, device)
            # (all beyond the margin: nothing left to learn from; keep every sample)
            self.active = Dataset(self.train.x[keep], self.train.y[keep],
                                  self.train.classes) if keep.any() else self.train
        return self.active

    def _inside_margin(self, model: nn.Module, device: torch.device) -> torch.Tensor:
        with in_eval_mode(model):
            return torch.cat([model.margins(model(x), y).cpu() < 1
                              for x, y in rows(self.train, CHECK_BATCH, device)])
