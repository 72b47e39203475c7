"""Foundation benchmarks: ratios measured side by side in one run.

    make bench          # or: .venv/bin/python benchmarks/bench_foundation.py [--quick]

1. Loop overhead: psring's loop with ``single`` vs a bare PyTorch loop, same model,
   batch and threads, alternated in one process. Target: <= 1.03x.
2. ``allreduce`` vs ``ddp`` at 2 workers on ``mlp``: both strategies run through the
   same loop in the same two processes, alternated. Target: <= 1.05x.
3. Bus bandwidth of ``allreduce``'s bucketed all-reduce vs one raw ``dist.all_reduce``
   of the same bytes, in the same two processes. Target: >= 0.9x.

Each comparison alternates its contenders round by round so machine noise hits both;
the figure is the median over rounds of per-step medians. Results go in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics as st
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from psring.config import RunConfig
from psring.strategies import STRATEGIES, WorkerContext
from psring.strategies.base import StepStats
from psring.strategies.buckets import GradientBuckets, bucket_caps
from psring.train import data
from psring.train.models import ModelSettings, build_model
from psring.train.workload import build_workload
from psring.workers.loop import make_optimizer, train

# eval_samples=0: these time steps, and the loop would otherwise also evaluate
MODEL = dict(model="mlp", width=1024, depth=3, features=256, batch_size=64, eval_samples=0)


def bench_loop_overhead(rounds: int, steps: int) -> dict:
    torch.set_num_threads(os.cpu_count() or 1)
    cfg = RunConfig(strategy="single", steps=steps, out="unused", **MODEL)
    split = build_workload(cfg).data
    ds = split.train
    ctx = WorkerContext(cfg, 0, 1, 0, 1, torch.device("cpu"), Path("."), logging.getLogger())

    def bare() -> list[float]:
        model = build_model("mlp", ModelSettings.from_config(cfg), 0)[0]
        opt = make_optimizer(model, cfg)
        loss_fn = torch.nn.CrossEntropyLoss()
        times = []
        for step in range(steps):
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            x, y = data.worker_batch(ds, cfg.batch_size, step, 0, 1)
            loss_fn(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        return times

    def psring_loop(log_dir: str) -> list[float]:
        from psring.records.runlog import StepLog

        model = build_model("mlp", ModelSettings.from_config(cfg), 0)[0]
        recs: list[dict] = []
        log = StepLog(Path(log_dir))  # the real loop writes its log line every step
        try:
            train(ctx, STRATEGIES.get("single")(ctx), model, split, log, on_step=recs.append)
        finally:
            log.close()
        return [r["step_s"] for r in recs]

    res: dict[str, list[float]] = {"bare": [], "psring": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for name in (("bare", "psring") if i % 2 == 0 else ("psring", "bare")):
                times = bare() if name == "bare" else psring_loop(tmp)
                res[name].append(st.median(times[2:]))
    bare_ms, ps_ms = st.median(res["bare"]) * 1e3, st.median(res["psring"]) * 1e3
    return {"bare_ms": bare_ms, "psring_single_ms": ps_ms, "ratio": ps_ms / bare_ms}


def _worker(rank: int, port: int, rounds: int, steps: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        out = {"steps": _ar_vs_ddp(rank, rounds, steps),
               "busbw": {name: _busbw(rank, rounds, width, depth)
                         for name, (width, depth) in BUSBW_MODELS.items()}}
        if rank == 0:
            queue.put(out)
        dist.barrier()  # rank 0 hosts the store: nobody tears down while others use it
    finally:
        dist.destroy_process_group()


def _ar_vs_ddp(rank: int, rounds: int, steps: int) -> dict:
    split = build_workload(RunConfig(out="unused", **MODEL)).data
    res: dict[str, list[float]] = {"allreduce": [], "ddp": []}
    for i in range(rounds):
        # alternate which goes first, so warm caches or a noisy neighbour favour neither
        for name in (list(res) if i % 2 == 0 else list(res)[::-1]):
            cfg = RunConfig(strategy=name, workers=2, steps=steps, out="unused", **MODEL)
            ctx = WorkerContext(cfg, rank, 2, rank, 2, torch.device("cpu"), Path("."),
                                logging.getLogger())
            model = build_model("mlp", ModelSettings.from_config(cfg), 0)[0]
            strategy = STRATEGIES.get(name)(ctx)
            recs: list[dict] = []
            train(ctx, strategy, model, split, None, on_step=recs.append)
            strategy.close()
            # a synchronous step lasts as long as the slower rank
            t = torch.tensor([r["step_s"] for r in recs[3:]])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            res[name].append(t.median().item())
    return {k: st.median(v) * 1e3 for k, v in res.items()}


#: gradient sizes for the bandwidth comparison: the default mlp (~9 MiB, where
#: per-call latency still matters) and a wide one (~50 MiB, the bandwidth regime)
BUSBW_MODELS = {"mlp-1024x3": (1024, 3), "mlp-2048x4": (2048, 4)}


def _busbw(rank: int, rounds: int, width: int, depth: int, iters: int = 25) -> dict:
    settings = ModelSettings(features=MODEL["features"], width=width, depth=depth)
    model = build_model("mlp", settings, 0)[0]
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    nbytes = sum(p.numel() * 4 for p in params)
    flat = torch.randn(nbytes // 4)
    stats = StepStats()
    cap, first = bucket_caps(25.0)
    buckets = GradientBuckets(params, cap, first, 0.5,
                              lambda b: dist.all_reduce(b.buffer, async_op=True), lambda: stats)
    for b in buckets.buckets:
        b.buffer.normal_()

    def raw() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        return time.perf_counter() - t0

    def bucketed() -> float:
        # every bucket full, launched back to back, as the hooks do at the end of backward
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.all_reduce(b.buffer, async_op=True) for b in buckets.buckets]
        for w in works:
            w.wait()
        return time.perf_counter() - t0

    def with_copy() -> float:
        # the whole hook path: scale-and-copy each gradient into its bucket, launch, wait
        dist.barrier()
        t0 = time.perf_counter()
        for p in reversed(params):
            buckets._on_grad(p)
        for h in buckets.finish():
            h.wait()
        return time.perf_counter() - t0

    res: dict[str, list[float]] = {"raw": [], "bucketed": [], "with_copy": []}
    fns = {"raw": raw, "bucketed": bucketed, "with_copy": with_copy}
    for i in range(rounds):
        for name, fn in (list(fns.items()) if i % 2 == 0 else list(fns.items())[::-1]):
            times = [fn() for _ in range(iters)]
            t = torch.tensor(times[2:])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            res[name].append(t.median().item())
    busbw = {k: nbytes / st.median(v) * 2 * (2 - 1) / 2 / 1e9 for k, v in res.items()}
    return {"bytes": nbytes, "busbw_GBps": busbw,
            "ms": {k: st.median(v) * 1e3 for k, v in res.items()},
            "buckets": [b.nbytes for b in buckets.buckets]}


def bench_distributed(rounds: int, steps: int) -> dict:
    from psring.runtime.process import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, rounds, steps, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = queue.get(timeout=1200)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rounds, steps = (3, 15) if args.quick else (7, 30)
    loop = bench_loop_overhead(rounds, steps)
    distd = bench_distributed(rounds, steps)
    ar, ddp = distd["steps"]["allreduce"], distd["steps"]["ddp"]
    for b in distd["busbw"].values():
        bw = b["busbw_GBps"]
        b["ratio_bucketed"] = bw["bucketed"] / bw["raw"]
        b["ratio_with_copy"] = bw["with_copy"] / bw["raw"]
    result = {
        "loop_overhead": loop,
        "allreduce_vs_ddp": {"allreduce_ms": ar, "ddp_ms": ddp, "ratio": ar / ddp},
        "busbw": distd["busbw"],
        "rounds": rounds, "steps": steps, "cores": os.cpu_count(),
        "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"psring foundation benchmark ({rounds} rounds, torch {torch.__version__}, "
          f"{os.cpu_count()} cores)")
    print(f"1. loop overhead: bare {loop['bare_ms']:.2f} ms, psring single "
          f"{loop['psring_single_ms']:.2f} ms -> ratio {loop['ratio']:.3f} (target <= 1.03)")
    print(f"2. allreduce {ar:.2f} ms vs ddp {ddp:.2f} ms per step -> ratio "
          f"{ar / ddp:.3f} (target <= 1.05)")
    for name, b in distd["busbw"].items():
        bw = b["busbw_GBps"]
        print(f"3. busbw, {name} ({b['bytes'] / 2**20:.1f} MiB in {len(b['buckets'])} buckets): "
              f"raw all_reduce {bw['raw']:.2f} GB/s, allreduce's buckets {bw['bucketed']:.2f} "
              f"GB/s -> ratio {b['ratio_bucketed']:.3f} (target >= 0.9); with the gradient "
              f"copy-in {bw['with_copy']:.2f} GB/s -> {b['ratio_with_copy']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
