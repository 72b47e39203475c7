"""A training script written the way Hugging Face Accelerate's examples write one, run
under any psring strategy: a data set of dict rows, a model whose forward takes keyword
arguments and returns its loss with the logits (a dataclass, as ``ModelOutput`` is),
and micro-batch accumulation where the loader yields the micro-batches and
``dist.accumulate(model)`` stands where ``accelerator.accumulate(model)`` would.

    python examples/accelerate_style.py           # alone: one worker of `single`
    psring launch --strategy allreduce --workers 2 --accumulate 2 -- \\
        python examples/accelerate_style.py
    psring launch --strategy ps --workers 2 --worker-batch 16,48 --accumulate 2 -- \\
        python examples/accelerate_style.py       # uneven batches: each worker's weight

``--accumulate K`` is psring launch's (as ``gradient_accumulation_steps`` is the
Accelerator's): the sampler yields K micro-batches of the global batch per optimizer
step, and each backward's gradient counts 1/K (Accelerate's ``backward`` divides the
loss by K). The data: a noisy 3-class problem in 12 dimensions, 1,536 rows; no download.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import psring


class Rows(Dataset):
    """Rows as dicts of tensors ({"features", "labels"}), as a tokenized data set's are."""

    def __init__(self, seed: int, n: int = 1536):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 12, generator=g)
        w = torch.randn(12, 3, generator=g)
        self.y = (self.x @ w + 0.5 * torch.randn(n, 3, generator=g)).argmax(1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": self.x[i], "labels": self.y[i]}


@dataclass
class Output:
    """What the forward returns: the loss (given labels) and the logits."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 48), nn.GELU(), nn.Linear(48, 3))

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        logits = self.body(features)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return Output(loss, logits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64,
                    help="the global batch of one micro-step")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    dist = psring.init() if psring.launched() else psring.init(strategy="single")
    data = Rows(args.seed)
    sampler = dist.sampler(data, args.batch_size, seed=args.seed)
    loader = DataLoader(data, batch_sampler=sampler)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = dist.wrap(model, optimizer)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:  # micro-batches: --accumulate of them an optimizer step
            with dist.accumulate(model):
                out = model(**batch)  # (moved to the worker's device by the model)
                out.loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        metrics = dist.evaluate(dist.done, lambda m: {"loss": m(**dist.to_device(
            {"features": data.x, "labels": data.y})).loss.item()})
        if dist.rank == 0:
            print(f"epoch {epoch}: {dist.done} optimizer steps, loss {metrics['loss']:.4f}")
    dist.finish()


if __name__ == "__main__":
    main()
