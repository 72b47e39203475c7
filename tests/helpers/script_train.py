"""A user's training script for the tests of psring.library (tests/multiproc/
test_script_runs.py): a regression with its own loss (mean squared error, no classes),
its own DataLoader, and options that exercise what a strategy can and cannot drive.

    psring launch --strategy ps --workers 2 --out DIR -- \\
        python tests/helpers/script_train.py [--optimizer adam] [--clip 1] [--schedule]
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import psring


def data(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.1 * torch.randn(512, 1, generator=g))


def micro_batches(x, y, k: int):
    """``k`` equal parts of a batch, the last one flagged."""
    for i, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):
        yield xm, ym, i == k - 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--schedule", action="store_true", help="a StepLR schedule")
    ap.add_argument("--fail-rank", type=int, default=-1, help="this rank exits 3 at step 2")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=1, help="16 steps each")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="micro-batches a step, all but the last under dist.no_sync()")
    ap.add_argument("--forget-no-sync", action="store_true",
                    help="accumulate without dist.no_sync() (refused)")
    ap.add_argument("--no-finish", action="store_true", help="end without dist.finish()")
    args = ap.parse_args()

    torch.manual_seed(5)  # (psring.init must leave the script's generator as it was)
    dist = psring.init()
    ds = data()
    sampler = dist.sampler(ds, args.batch_size, seed=3)
    loader = DataLoader(ds, batch_sampler=sampler)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = (torch.optim.Adam(model.parameters(), lr=0.01) if args.optimizer == "adam"
                 else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model, optimizer = dist.wrap(model, optimizer)
    schedule = (torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
                if args.schedule else None)
    held_x, held_y = ds.tensors
    dist.evaluate(0, lambda m: {"mse": nn.functional.mse_loss(m(held_x), held_y).item()})
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            if dist.done == 2 and dist.rank == args.fail_rank:
                print("failing on purpose", file=sys.stderr)
                return 3
            with dist.step() as s:
                for xm, ym, last in micro_batches(x, y, args.accumulate):
                    with contextlib.nullcontext() if last or args.forget_no_sync \
                            else dist.no_sync():
                        loss = nn.functional.mse_loss(model(xm), ym)
                        (loss / args.accumulate).backward()
                if args.clip:
                    optimizer.synchronize()  # (Horovod's habit: a no-op now)
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                optimizer.zero_grad()
                s.loss = loss
            if schedule is not None:
                schedule.step()
    with torch.no_grad():
        dist.evaluate(dist.done, lambda m: {"mse": nn.functional.mse_loss(
            m(held_x), held_y).item()})
    if not args.no_finish:
        dist.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
