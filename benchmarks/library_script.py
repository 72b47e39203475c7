"""The script side of benchmarks/bench_library.py: psring's own model and data for the
run psring launch set (the same --model, --batch-size, --seed ... as `psring run`), fed
as psring's loop feeds them (contiguous rows, no DataLoader), trained through
psring.init/wrap/step with the SGD psring's loop uses (psring.train.optim.SGD: torch.optim's
arithmetic without its first-use import of torch._dynamo, about a second here, which a
script with torch.optim.SGD pays once; ``--torch-optim`` measures that).

    psring launch --strategy ps --workers 2 --steps 60 -- python benchmarks/library_script.py
"""

from __future__ import annotations

import sys

import torch

import psring
from psring.train.models import loss_for
from psring.train.optim import SGD
from psring.train.workload import build_workload


def main() -> None:
    dist = psring.init()
    cfg = dist.cfg
    work = build_workload(cfg)
    x, y = work.data.train.x, work.data.train.y
    sampler = dist.sampler(len(x), cfg.batch_size, shuffle=False)
    make = torch.optim.SGD if "--torch-optim" in sys.argv else SGD
    optimizer = make(work.model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                     weight_decay=cfg.weight_decay)
    model, optimizer = dist.wrap(work.model, optimizer)
    loss_fn = loss_for(work.model)
    while dist.done < dist.steps:  # (epochs of the sampler until --steps)
        for rows in sampler:
            # (unshuffled, a worker's rows are contiguous: a slice, as the loop takes them)
            xb, yb = x[rows[0]:rows[-1] + 1], y[rows[0]:rows[-1] + 1]
            with dist.step() as s:
                loss = loss_fn(model(xb), yb)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                s.loss = loss
    dist.finish()


if __name__ == "__main__":
    main()
