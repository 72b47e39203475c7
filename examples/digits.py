"""A training script of your own, run under any psring strategy unchanged.

    python examples/digits.py                     # alone: psring.init(strategy="single")
    psring launch --strategy ps --workers 2 --servers 2 --out runs/digits-ps \\
        -- python examples/digits.py
    psring launch --strategy allreduce --workers 2 --hosts 2 --link 1gbit \\
        -- python examples/digits.py --clip 1.0
    psring report runs/digits-ps

scikit-learn's handwritten digits (1,797 8x8 images, 10 classes; `pip install
scikit-learn`), a small convolutional network, label smoothing, a DataLoader of its own,
its own epochs, held-out accuracy every 10 steps (time to accuracy in psring report).
Nothing in it names a strategy: psring launch's flags choose it (docs/your-script.md).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import psring


def digits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The digits as 1x8x8 images scaled to [0, 1], a fifth held out."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    held = order[: len(y) // 5]
    train = order[len(y) // 5:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[held], y[held])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
                                  nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def accuracy(model: nn.Module, held_out: TensorDataset) -> dict:
    x, y = held_out.tensors
    model.eval()
    with torch.no_grad():
        logits = model(x)  # (the wrapped model moves x to its device)
    model.train()
    y = y.to(logits.device)
    return {"accuracy": (logits.argmax(1) == y).float().mean().item(),
            "loss": nn.functional.cross_entropy(logits, y).item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64, help="the global batch")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--clip", type=float, default=0.0,
                    help="clip the averaged gradient's norm (strategies that update on "
                         "the workers)")
    ap.add_argument("--eval-every", type=int, default=10)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    # under psring launch the launch's run; alone, one worker of `single`
    dist = psring.init() if psring.launched() else psring.init(strategy="single")
    train, held_out = digits(args.seed)
    sampler = dist.sampler(train, args.batch_size, seed=args.seed)
    loader = DataLoader(train, batch_sampler=sampler)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = dist.wrap(model, optimizer)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.05)

    dist.evaluate(0, lambda m: accuracy(m, held_out))
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = dist.to_device((x, y))
            with dist.step() as s:
                loss = loss_fn(model(x), y)
                loss.backward()  # returns with the averaged gradient
                if args.clip:
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                optimizer.zero_grad()
                s.loss = loss
            if dist.done % args.eval_every == 0:
                metrics = dist.evaluate(dist.done, lambda m: accuracy(m, held_out))
                if dist.rank == 0:
                    print(f"step {dist.done}: held-out accuracy {metrics['accuracy']:.3f}")
    if dist.done % args.eval_every:
        dist.evaluate(dist.done, lambda m: accuracy(m, held_out))
    dist.finish()


if __name__ == "__main__":
    main()
