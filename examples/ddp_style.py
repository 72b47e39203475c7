"""A training script written the way DistributedDataParallel's tutorials write one, run
under any psring strategy: its own epochs (``set_epoch``), early stopping, a clip right
after ``backward()``, ``torch.amp.GradScaler``, ``model.no_sync()`` micro-batches, its
own evaluation and a checkpoint of ``model.state_dict()`` and ``optimizer.state_dict()``
between steps. psring's five calls stand where DDP's would (docs/your-script.md).

    python examples/ddp_style.py                  # alone: one worker of `single`
    psring launch --strategy allreduce --workers 2 -- python examples/ddp_style.py
    psring launch --strategy ps --workers 2 --servers 2 -- \\
        python examples/ddp_style.py --clip 0 --no-scaler   # servers update: no edits

Where the parameter servers update (ps, async-ps, byteps without --update-on worker)
the workers never hold the averaged gradient, so clipping and GradScaler are refused
there with the fix; everywhere else the averaged gradient is what they act on.
The data: 4 Gaussian blobs in 8 dimensions, 1,600 rows and 400 held out; no download.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import psring


def blobs(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """4 classes of 8-d points around random centres; the last fifth held out."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, 8, generator=g) * 1.2
    y = torch.randint(0, 4, (2000,), generator=g)
    x = centres[y] + torch.randn(2000, 8, generator=g)
    return TensorDataset(x[:1600], y[:1600]), TensorDataset(x[1600:], y[1600:])


def accuracy(model: nn.Module, held_out: TensorDataset, device: torch.device) -> float:
    """Held-out accuracy, the way a DDP script computes it: on the model between steps."""
    x, y = held_out.tensors
    model.eval()
    with torch.no_grad():
        logits = model(x)  # (the wrapped model moves its inputs to its device)
    model.train()
    return (logits.argmax(1).cpu() == y).float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=64, help="the global batch")
    ap.add_argument("--lr", type=float, default=0.002)
    ap.add_argument("--clip", type=float, default=1.0, help="clip the gradient's norm "
                    "right after backward (0: no clipping)")
    ap.add_argument("--no-scaler", action="store_true", help="no torch.amp.GradScaler")
    ap.add_argument("--micro", type=int, default=1, help="micro-batches a step, all but "
                    "the last under model.no_sync()")
    ap.add_argument("--target", type=float, default=0.9, help="stop at this held-out "
                    "accuracy (checked after each epoch)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--loader-workers", type=int, default=0, help="the DataLoader's "
                    "worker processes (kept across epochs)")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    dist = psring.init() if psring.launched() else psring.init(strategy="single")
    train, held_out = blobs(args.seed)
    sampler = dist.sampler(train, args.batch_size, seed=args.seed)
    loader = DataLoader(train, batch_sampler=sampler, num_workers=args.loader_workers,
                        persistent_workers=args.loader_workers > 0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = dist.wrap(model, optimizer)
    scaler = torch.amp.GradScaler(dist.device.type, enabled=not args.no_scaler)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = dist.to_device((x, y))
            with dist.step() as s:
                for i, (xm, ym) in enumerate(zip(x.chunk(args.micro), y.chunk(args.micro))):
                    last = i == args.micro - 1
                    with contextlib.nullcontext() if last else model.no_sync():
                        loss = loss_fn(model(xm), ym) / args.micro
                        scaler.scale(loss).backward()
                if args.clip:
                    scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                s.loss = loss
        acc = accuracy(model, held_out, dist.device)
        dist.evaluate(dist.done, lambda m: {"accuracy": accuracy(m, held_out, dist.device)})
        if dist.rank == 0:
            print(f"epoch {epoch}: {dist.done} steps, held-out accuracy {acc:.3f}")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch}, dist.run_dir / "checkpoint.pt")
        if acc >= args.target:
            break  # (every worker: synchronous workers hold the same parameters)
    dist.finish()


if __name__ == "__main__":
    main()
