"""Reference: a plain PyTorch DDP training loop, as PyTorch's DDP tutorial writes one.

    .venv/bin/python benchmarks/ref_ddp.py [--workers 2] [--batch-size 64] [--steps 60]

Two processes (torch.multiprocessing.spawn), gloo on the CPU, DistributedDataParallel
with its defaults, SGD with momentum, ``zero_grad / forward / loss / backward / step``
and nothing else: no hooks, no logging, no phases. The model and data are psring's
default ``mlp`` on its synthetic task (built by psring's own functions so the work is
the same), each process taking its slice of the global batch, one torch thread per
process (the cores divided by the workers, as psring does). Prints one JSON line: the
median step time over steps 3.. (a step counts as long as its slower rank), for
benchmarks/bench_runs.py to put beside ``psring run --strategy allreduce``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics as st
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    from psring.train.data import synthetic, worker_batch
    from psring.train.models import Inputs, ModelSettings, build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.workers))
    dist.init_process_group("gloo", rank=rank, world_size=args.workers)
    ds = synthetic(Inputs.vector(256, 10), 4096, 0, args.seed).train
    model = DDP(build_model("mlp", ModelSettings(features=256, classes=10), args.seed)[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for step in range(args.steps):
        x, y = worker_batch(ds, args.batch_size, step, rank, args.workers)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    queue.put((rank, times))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    from psring.runtime.process import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, queue), daemon=True)
             for r in range(args.workers)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    steps = [max(per_rank[r][s] for r in per_rank) for s in range(3, args.steps)]
    print(json.dumps({"reference": "torch DDP loop", "step_s": st.median(steps)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
