"""Reference: the batch-updating parameter server of PyTorch's RPC tutorial.

    .venv/bin/python benchmarks/ref_rpc_ps.py [--workers 2] [--batch-size 64] [--steps 60]

Written from the tutorial "Implementing Batch RPC Processing Using Asynchronous
Executions" (pytorch.org/tutorials/intermediate/rpc_async_execution.html), section
"Batch-Updating Parameter Server": one parameter-server process holding the model and
an SGD optimizer, whose ``update_and_fetch_model`` (an ``@rpc.functions.async_execution``
function) adds each trainer's gradients into the model's ``.grad``, and once all
trainers of the round have reported, averages them, steps the optimizer and answers
every waiting trainer with the updated model; trainers compute forward/backward and
call it with ``rpc_sync``. Transport: TensorPipe over loopback. The tutorial's model
and data are replaced by psring's default ``mlp`` on its synthetic task and
CrossEntropy, its SGD settings by psring's (lr 0.05, momentum 0.9), so the work is
psring's ``ps`` workload: 2 trainers and 1 server process, global batch split across
the trainers, one torch thread per process. Prints one JSON line: the median step
time over steps 3.. (a step counts as long as its slower trainer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics as st
import sys
import threading
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch import nn


def build(seed: int) -> nn.Module:
    from psring.train.models import ModelSettings, build_model

    return build_model("mlp", ModelSettings(features=256, classes=10), seed)[0]


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size: int, seed: int):
        self.model = build(seed)
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self) -> nn.Module:
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        for p, g in zip(self.model.parameters(), grads):
            p.grad += g
        with self.lock:
            self.curr_update_size += 1
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


class Trainer:
    def __init__(self, ps_rref, rank: int, args: argparse.Namespace):
        from psring.train.data import synthetic
        from psring.train.models import Inputs

        self.ps_rref = ps_rref
        self.rank, self.args = rank, args
        self.loss_fn = nn.CrossEntropyLoss()
        self.ds = synthetic(Inputs.vector(256, 10), 4096, 0, args.seed).train

    def train(self) -> list[float]:
        from psring.train.data import worker_batch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (self.args.workers + 1)))
        m = self.ps_rref.rpc_sync().get_model()
        times = []
        for step in range(self.args.steps):
            x, y = worker_batch(self.ds, self.args.batch_size, step, self.rank,
                                self.args.workers)
            t0 = time.perf_counter()
            self.loss_fn(m(x), y).backward()
            m = rpc.rpc_sync(self.ps_rref.owner(),
                             BatchUpdateParameterServer.update_and_fetch_model,
                             args=(self.ps_rref, [p.grad for p in m.cpu().parameters()]))
            times.append(time.perf_counter() - t0)
        return times


def run_trainer(ps_rref, rank: int, args: argparse.Namespace) -> list[float]:
    return Trainer(ps_rref, rank, args).train()


def run(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           num_worker_threads=16, rpc_timeout=300)
    if rank == 0:
        rpc.init_rpc("ps", rank=0, world_size=world, rpc_backend_options=opts)
        ps_rref = rpc.RRef(BatchUpdateParameterServer(world - 1, args.seed))
        futs = [rpc.rpc_async(f"trainer{r}", run_trainer, args=(ps_rref, r - 1, args))
                for r in range(1, world)]
        per_trainer = [f.wait() for f in futs]
        steps = [max(t[s] for t in per_trainer) for s in range(3, args.steps)]
        print(json.dumps({"reference": "torch.rpc batch-update PS", "step_s": st.median(steps)}),
              flush=True)
    else:
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    rpc.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="trainers")
    ap.add_argument("--batch-size", type=int, default=64, help="global batch")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    from psring.runtime.process import free_port

    mp.spawn(run, args=(args.workers + 1, args, free_port()), nprocs=args.workers + 1,
             join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
