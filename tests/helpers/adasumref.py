"""The model an Adasum run should end with, computed in one process: the run's own
initial model and batches (its manifest's settings), SGD on the tree's Adasum
(psring.comm.adasum.reference) of the workers' gradients — or, with ``per_host`` G
(hallreduce --reduce adasum), of each host's average of its G workers' gradients."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from psring.comm import adasum
from psring.config import RunConfig
from psring.train.data import worker_batch
from psring.train.models import loss_of
from psring.train.optim import SGD
from psring.train.workload import build_workload


def trained_by_the_tree(run_dir: Path, per_host: int = 1) -> dict:
    m = json.loads((Path(run_dir) / "manifest.json").read_text())
    names = {f.name for f in dataclasses.fields(RunConfig)}
    cfg = RunConfig(**{k: v for k, v in m["config"].items() if k in names})
    work = build_workload(cfg)  # the run's seed: the same initial model and data
    model, world = work.model, cfg.workers
    params = list(model.parameters())
    opt = SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    for step in range(cfg.steps):
        grads = []
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            x, y = worker_batch(work.data.train, cfg.batch_size, step, rank, world)
            loss_of(model(x), y).backward()
            grads.append([p.grad.detach().clone() for p in params])
        hosts = [[sum(gs) / per_host for gs in zip(*grads[h:h + per_host])]
                 for h in range(0, world, per_host)]
        for p, g in zip(params, adasum.reference(hosts)):
            p.grad = g
        opt.step()
    return model.state_dict()
