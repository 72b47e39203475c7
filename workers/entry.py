"""Worker process entry point: parse, build, run, always clean up.

Started by ``psring run`` (one process per worker) or directly by ``torchrun``, which
sets the same environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). Two hosts, one worker each:

    # on host A (198.18.0.1 as host B sees it)
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 \\
        --master-addr 198.18.0.1 --master-port 29500 --rdzv-conf timeout=60 \\
        -m psring.workers --strategy allreduce --timeout 60 --out runs/two-hosts
    # on host B: the same with --node-rank 1

Takes every flag of ``psring run``. Under torchrun the workers agree on the run through
torchrun's store (psring.runtime.rendezvous) and choose their network interface
(psring.cluster.netif); docs/reliability.md says what is bounded by which timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from psring.cluster import netif
from psring.config import RunConfig, add_config_flags, config_from_args
from psring.errors import ConfigError, PsringError
from psring.records.runlog import MODEL, WORKERS, StepLog, append_record, host_name, save_state_dict
from psring.runtime import elastic, rendezvous
from psring.runtime.allocator import keep_freed_memory
from psring.runtime.process import (
    die_with_parent,
    error_line,
    set_process_name,
    worker_threads,
)
from psring.strategies import STRATEGIES, Strategy, WorkerContext
from psring.train import checkpoint
from psring.train import device as psring_device
from psring.train.data import worker_batch
from psring.train.models import loss_for
from psring.train.workload import Workload, build_workload
from psring.workers.loop import train
from psring.workers.manifest import write_manifest

#: objects kept alive until the process exits (see _teardown)
_RETAINED: list = []


def env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


def main(argv: list[str] | None = None) -> int:
    # A crash in C++ (SIGSEGV, SIGABRT) still prints where Python was, into the log.
    faulthandler.enable(all_threads=True)
    # `kill -USR1 PID` prints every thread's Python stack into the log: for a hang
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    die_with_parent()
    keep_freed_memory()  # no page faults on each step's tensors (psring.runtime.allocator)
    # SIGTERM (from the launcher or torchrun) unwinds through finally blocks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(prog="python -m psring.workers",
                                     description="one psring worker process")
    add_config_flags(parser)
    args = parser.parse_args(argv)
    rank = env_int("RANK", 0)
    world = env_int("WORLD_SIZE", 0)
    local_rank = env_int("LOCAL_RANK", 0)
    local_world = env_int("LOCAL_WORLD_SIZE", world or 1)
    prefix = f"[worker {rank}/{world or args.workers}]"
    set_process_name(f"worker-{rank}")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {prefix} %(message)s",
                        stream=sys.stderr)
    log = logging.getLogger("psring.worker")
    try:
        cfg = worker_config(args, world)
        run_worker(cfg, rank, cfg.workers, local_rank, local_world, log, prefix)
    except PsringError as e:
        message = " ".join(filter(None, [str(e), rendezvous.current().explain()]))
        print(error_line(prefix, message), file=sys.stderr, flush=True)
        rendezvous.report_failure(rank, message)
        return e.exit_code
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - last line must name the failure
        traceback.print_exc()
        message = f"{type(e).__name__}: {e}"
        print(error_line(prefix, message), file=sys.stderr, flush=True)
        rendezvous.report_failure(rank, message)
        return 1
    finally:
        rendezvous.current().close()
    return 0


def worker_config(args: argparse.Namespace, world: int) -> RunConfig:
    """The run's RunConfig from this worker's flags (under torchrun, WORLD_SIZE is the
    number of workers), and what a worker process needs besides a valid config."""
    cfg = config_from_args(args, **({"workers": world} if world else {}))
    if cfg.cluster.emulated and not os.environ.get("PSRING_HOST"):
        raise ConfigError("--hosts, --link and --server-placement own-hosts ask for an "
                          "emulated cluster, which `psring run` builds; this worker was "
                          "started outside one (torchrun runs on real hosts): drop them.")
    if not cfg.out:
        raise ConfigError("a worker needs a run directory: pass --out DIR (psring run "
                          "does this for you; under torchrun each host writes its own "
                          "workers' steps there, and `psring merge` joins the hosts' "
                          "directories).")
    if cfg.steps < 1:
        raise ConfigError("a worker of psring's own loop needs --steps N (at least 1; 0 is "
                          "for a script's run, where the script decides).")
    elastic.check(cfg)
    servers_named(cfg)
    return cfg


def servers_named(cfg: RunConfig) -> None:
    """Under torchrun nobody starts a parameter-server strategy's servers: they are
    named (--server-addrs), or the run is refused with how to start them (psring's
    workers, and a script's)."""

    if rendezvous.under_torchrun() and not cfg.server_addrs \
            and STRATEGIES.get(cfg.strategy).caps.uses_servers:
        raise ConfigError(
            f"{cfg.strategy} under torchrun needs parameter servers of its own, which "
            f"torchrun does not start: run `psring server --bind tcp://HOST:PORT` (one per "
            f"server, on hosts the workers reach) and give their addresses with "
            f"--server-addrs tcp://HOST:PORT[,...] (in {rendezvous.RUN_ARGS_ENV} for a script; "
            f"docs/multihost.md).")


def warm_up(model, ds, cfg: RunConfig, rank: int, world: int, device) -> None:
    """One forward and backward, discarded, before anything is timed or shared. The
    first pass pays one-time costs (allocator, thread pools, kernel selection, lazy
    imports). Rank 0 already paid them counting FLOPs for the manifest; without this
    every other rank would pay them in its first step, and workers that do not wait for
    each other (async-ps, hogwild) would start a whole short run apart. No gradient hook
    is registered yet, and the gradients are dropped, so training is unchanged."""

    # batch norm's running statistics must not count the discarded pass
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    x, y = worker_batch(ds, cfg.batch_size, 0, rank, world, cfg.worker_batches)
    loss_for(model)(model(x.to(device)), y.to(device)).backward()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(buffers[k])


def run_worker(cfg: RunConfig, rank: int, world: int, local_rank: int, local_world: int,
               log: logging.Logger, prefix: str = "") -> None:
    """One worker, from its config to its logs, in the order docs/architecture.md
    gives ("From the command line to the logs"): the data and the model (the
    workload), manifest.json (rank 0), the process group if the strategy's caps ask for
    one, loop.train, model.pt (rank 0), a barrier, and always the teardown."""

    ctx, threads = worker_context(cfg, rank, world, local_rank, local_world, log)
    strategy_cls = STRATEGIES.get(cfg.strategy)
    launch, net = join_run(ctx, prefix)
    # who writes checkpoints; after a restart by torchrun, the one every host resumes from
    elastic.after_join(ctx, launch, strategy_cls.caps.uses_servers)
    launch.stage("building the model", waiting=False)  # (a data download has no deadline)
    work = build_workload(cfg)
    if rank == 0:
        write_manifest(ctx.run_dir, cfg, work, strategy_cls, threads,
                       launch={**launch.describe(), "network": net.describe()},
                       per_host=local_world)
    _place_model(ctx, work, strategy_cls)

    strategy = None
    steps = StepLog(ctx.run_dir)
    try:
        if strategy_cls.caps.uses_process_group:
            start_process_group(ctx, launch, net)
        launch.stage(f"setting up {cfg.strategy}")
        strategy = strategy_cls(ctx)
        log.info("training %s on %s, %d steps, %d threads", cfg.strategy, ctx.device,
                 cfg.steps, threads)
        _train_and_save(ctx, strategy, work, steps, launch)
        launch.done()
        log.info("done")
    finally:
        teardown(steps, strategy, work.model)


def worker_context(cfg: RunConfig, rank: int, world: int, local_rank: int, local_world: int,
             log: logging.Logger) -> tuple[WorkerContext, int]:
    """This worker's WorkerContext (its device, the run directory, the checkpoint it
    resumes from) and its number of threads, already set for torch."""

    threads = worker_threads(cfg, local_world)
    torch.set_num_threads(threads)
    device = torch.device(cfg.resolved_device)
    if device.type == "cuda":
        slot, _ = machine_share(rank, local_rank, local_world, cfg.workers)
        device = torch.device("cuda", slot % torch.cuda.device_count())
        torch.cuda.set_device(device)
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    ctx = WorkerContext(cfg=cfg, rank=rank, world=world, local_rank=local_rank,
                        local_world=local_world, device=device, run_dir=run_dir, log=log,
                        resume=_checkpoint_to_resume(cfg, run_dir, log), host=host_name())
    return ctx, threads


def _checkpoint_to_resume(cfg: RunConfig, run_dir: Path, log: logging.Logger):
    """--resume: the run directory's latest complete checkpoint (else None). Under
    torchrun the hosts agree on one after joining (psring.runtime.elastic)."""
    if not cfg.resume or rendezvous.under_torchrun():
        return None

    resume = checkpoint.latest(run_dir, log=log.warning)
    if resume is None:
        raise ConfigError(f"--resume {cfg.resume}: no checkpoint in "
                          f"{run_dir / checkpoint.CHECKPOINTS}.")
    log.info("resuming from %s (step %d)", resume.path, resume.step)
    return resume


def join_run(ctx: WorkerContext, prefix: str) -> tuple[rendezvous.Launch, netif.Choice]:
    """Choose the network interface and join the run (psring.runtime.rendezvous); this
    worker's line goes into the run directory's workers.jsonl."""

    cuda = ctx.device.type == "cuda"
    # which interface gloo (NCCL) advertises to the other hosts, before anything dials
    net = netif.choose(os.environ, cuda=cuda)
    os.environ.update(net.env)
    record = {"host": ctx.host, "address": net.address, "interface": net.interface,
              "node": env_int("GROUP_RANK", 0), "local_rank": ctx.local_rank,
              "pid": os.getpid(), "out": str(ctx.run_dir.resolve()),
              **elastic.offer(ctx.cfg, ctx.local_rank, ctx.run_dir)}
    launch = rendezvous.join(ctx.rank, ctx.world, ctx.cfg.timeout, record, ctx.log, prefix)
    # node 0 with MASTER_ADDR loopback learns its interface from its peers' addresses
    net = netif.after_join(net, launch.peers, ctx.host, cuda=cuda)
    os.environ.update(net.env)
    record.update(address=net.address, interface=net.interface)
    for p in launch.peers:
        if p.get("rank") == ctx.rank:
            p.update(record)
    if launch.kind == "torchrun" and net.interface:
        ctx.log.info("collectives on %s", net.message())
    append_record(ctx.run_dir / WORKERS, {"run": launch.run_id, "world": ctx.world,
                                          "rank": ctx.rank, **record, "time": time.time()})
    return launch, net


def _place_model(ctx: WorkerContext, work: Workload, strategy_cls: type[Strategy]) -> None:
    """The model onto the worker's device, and its first pass paid before timing: with
    --compute device the device's times stand in for forward, backward and the
    optimizer step (psring.train.device), and a warm-up would time nothing."""
    work.model.to(ctx.device)
    ctx.stand_in = stand_in = psring_device.for_worker(ctx.cfg, ctx.rank, work.inputs)
    if stand_in is not None:
        psring_device.check(ctx.cfg, strategy_cls, work.model)
        stand_in.install(work.model)
    else:
        warm_up(work.model, work.data.train, ctx.cfg, ctx.rank, ctx.world, ctx.device)


def machine_share(rank: int, local_rank: int, local_world: int,
                  workers: int) -> tuple[int, int]:
    """(this worker's place among the workers of its machine, how many they are): what
    the machine's GPUs are dealt out over. torchrun starts LOCAL_WORLD_SIZE workers per
    machine; psring's own launcher starts every worker on this machine, its emulated
    hosts included (namespaces share the GPUs)."""
    if rendezvous.under_torchrun():
        return local_rank, local_world
    return rank, workers


def process_group_backend(device_type: str, sharing: int, gpus: int) -> tuple[str, str]:
    """(backend, why) for torch.distributed's process group: NCCL among GPUs, gloo on
    the CPU, and gloo over CUDA tensors where ``sharing`` workers (:func:`machine_share`)
    outnumber the machine's GPUs: NCCL refuses two ranks on one device ("Duplicate GPU
    detected"). gloo takes CUDA tensors for all_reduce and broadcast only; the host
    collectives and Adasum's exchanges stage theirs through host memory
    (psring.comm.interconnect.GroupComm, psring.comm.adasum.TorchComm)."""
    if device_type != "cuda":
        return "gloo", "CPU tensors"
    if sharing > gpus:
        return "gloo", (f"{sharing} workers share this machine's {gpus} GPU"
                        f"{'s' if gpus != 1 else ''}, and NCCL takes one rank per GPU")
    return "nccl", "one GPU per worker"


def start_process_group(ctx: WorkerContext, launch: rendezvous.Launch, net: netif.Choice) -> None:
    """torch.distributed's process group (see :func:`process_group_backend`)."""
    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    _, sharing = machine_share(ctx.rank, ctx.local_rank, ctx.local_world, ctx.world)
    backend, why = process_group_backend(ctx.device.type, sharing, gpus)
    launch.stage(f"creating the {backend} process group")
    ctx.log.info("joining process group (%s: %s; %s:%s)", backend, why,
                 os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
    _init_process_group(backend, ctx.rank, ctx.world, ctx.cfg.timeout, launch, net)


def _train_and_save(ctx: WorkerContext, strategy: Strategy, work: Workload, steps: StepLog,
                    launch: rendezvous.Launch) -> None:
    """loop.train, then :func:`save_and_wait`."""

    with broken_connections_named(ctx.rank):
        train(ctx, strategy, work.model, work.data, steps, resume=ctx.resume,
              on_step=lambda r: launch.stage("training", r["step"]))
        save_and_wait(ctx, strategy, work.model, launch)


def save_and_wait(ctx: WorkerContext, strategy: Strategy, model: nn.Module,
                  launch: rendezvous.Launch) -> None:
    """The run's end: the strategy ends on every rank, rank 0 saves model.pt, then
    every rank waits for the others (psring's loop, and a script's dist.finish)."""

    strategy.finish_run(model)
    if ctx.rank == 0:
        launch.stage("saving the model", waiting=False)
        save_state_dict(ctx.run_dir / MODEL, strategy.final_state(model))
    if dist.is_initialized():
        # Rank 0 hosts the rendezvous store: no rank may tear down while another
        # still talks to it (that aborts the process in C++).
        launch.stage("waiting for the others to finish")
        dist.barrier()


def teardown(steps: StepLog, strategy: Strategy | None, model: nn.Module) -> None:
    """Close the step log and the strategy, and leave the process group."""
    steps.close()
    if strategy is not None:
        strategy.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    # Never destroyed: the process leaves with os._exit (psring.workers.__main__).
    # Freeing DDP's reducer when run_worker's frame ended dropped the last reference to
    # the gloo process group, whose C++ destructor then waited forever for its threads
    # in about 1 run in 10 (seen with `kill -USR1`: no Python frame below main).
    _RETAINED.append((strategy, model))


@contextlib.contextmanager
def broken_connections_named(rank: int):
    """A collective that failed because a peer went says so, in one paragraph."""
    try:
        yield
    except RuntimeError as e:
        if not _broken_connection(e):
            raise
        raise PsringError(
            f"worker {rank}: the connection to another worker broke "
            f"({str(e).strip().splitlines()[0][:200]}): one of them stopped, or its host "
            f"went away; see its output.") from None


def _broken_connection(e: BaseException) -> bool:
    """A collective failed because a peer's connection went (gloo, NCCL), not a bug."""
    text = str(e)
    if "invalid usage" in text:  # NCCL's own refusal (a duplicate GPU, say): a bug to see
        return False
    return any(w in text for w in ("Connection closed", "Connection reset", "Broken pipe",
                                   "Connection refused", "NCCL error", "ProcessGroupGloo"))


def _init_process_group(backend: str, rank: int, world: int, timeout: float,
                        launch: rendezvous.Launch, net: netif.Choice) -> None:
    """init_process_group through the launch's store when it has one (torchrun), with
    its failures told in terms of the hosts."""
    store = getattr(launch, "store", None)
    if store is not None:
        # this attempt's keys: a launch torchrun restarted keeps its store, and gloo
        # would read the last attempt's workers' addresses from it
        store = dist.PrefixStore(launch.key("pg/"), store)
    kwargs = {"store": store} if store is not None else {}
    try:
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout), **kwargs)
    except Exception as e:  # noqa: BLE001 - gloo, NCCL and the store raise several types
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise PsringError(
            f"worker {rank}: creating the {backend} process group failed within --timeout "
            f"{timeout:g} s: {first}. Every worker connects to every other one directly, at "
            f"the address of the interface each one advertises (here: {net.message()}); "
            f"each host must reach the others' addresses on any TCP port. A remote "
            f"address of 127.0.0.1 means that host advertised loopback: set "
            f"{netif.GLOO} there.") from None
