"""A torchrun launch that torchrun restarted: every host resumes from one checkpoint.

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --max-restarts 2 \\
        --master-addr HOST0 --master-port 29500 -m psring.workers --strategy allreduce \\
        --steps 1000 --checkpoint-every 100 --max-restarts 2 --out runs/host0

torchrun's elastic agents restart every worker of a launch when one fails (torchrun's
``--max-restarts``); the same flag given to psring's workers makes the restarted workers
resume from the run's last checkpoint instead of starting the run over. Each host keeps
its own run directory (``--out``), so each writes its own checkpoints: the lowest rank
of every run directory writes them (:func:`writer_of`) when its strategy's
state is its own (a replicated model and momentum); a parameter server's state is in
the servers and is fetched by rank 0 alone, so only rank 0's directory holds it. On a
restart (:func:`after_join`):

1. each directory's writer has put in its rendezvous record the steps of the
   checkpoints it holds that verify (:func:`offer`);
2. every rank takes the newest step that all those directories hold
   (:func:`agreed_step`): a host that crashed while writing the newest one makes every
   host go back one;
3. each directory's writer cuts its steps.jsonl and evals.jsonl back to that step and
   records the restart in restarts.jsonl, then marks it done; the other ranks of the
   directory wait for the mark before they log anything;
4. each rank loads the agreed checkpoint from its own directory.

A synchronous run restarted this way ends with the parameters of one never interrupted,
as under ``psring run --max-restarts`` (psring.runtime.faults).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psring.errors import ConfigError, PsringError
from psring.records.runlog import EVALS, FAULTS, RESTARTS, STEPS, read_steps, truncate_records
from psring.runtime import faults, rendezvous
from psring.train import checkpoint

if TYPE_CHECKING:  # (psring.config sits above: it validates against the registries)
    from psring.config import RunConfig

#: the rendezvous record's field with a directory's usable checkpoint steps
OFFER = "checkpoints"


def check(cfg: RunConfig) -> None:
    """Under torchrun, psring's --max-restarts only acts when torchrun restarts."""
    if not cfg.max_restarts or not rendezvous.under_torchrun():
        return
    if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":
        raise ConfigError(
            f"--max-restarts {cfg.max_restarts}: under torchrun the restarts are "
            f"torchrun's (its elastic agent restarts every worker), and this torchrun "
            f"restarts none; psring's flag makes the restarted workers resume from the "
            f"last checkpoint. Pass torchrun --max-restarts {cfg.max_restarts} as well.")


def offer(cfg: RunConfig, local_rank: int, run_dir: Path) -> dict[str, Any]:
    """What a worker adds to its rendezvous record: a host's first worker, where restarts
    may resume, lists the checkpoints of its run directory that verify."""
    if not (cfg.max_restarts or cfg.resume) or local_rank != 0 \
            or not rendezvous.under_torchrun():
        return {}

    return {OFFER: checkpoint.usable_steps(run_dir)}


def writer_of(rank: int, peers: list[dict], host: str, out: str) -> int:
    """The rank that writes the run directory ``out`` of ``host``: the lowest rank
    there (rank 0 under psring run, where every worker shares one directory)."""
    same = [p["rank"] for p in peers if p.get("host") == host and p.get("out") == out]
    return min(same, default=0 if not peers else rank)


def agreed_step(peers: list[dict], uses_servers: bool) -> int | None:
    """The newest checkpoint step every run directory holds; None (the run starts
    over) when rank 0's holds none, or another's none where the state is every
    worker's (not in servers: there only rank 0's directory has it)."""
    offers = {p["rank"]: p[OFFER] for p in peers if OFFER in p}
    if not offers.get(0) or not uses_servers and not all(offers.values()):
        return None
    held = [set(v) for v in offers.values() if v]
    common = set.intersection(*held)
    if not common:
        where = "; ".join(f"rank {r}'s directory: steps {sorted(v)}"
                          for r, v in sorted(offers.items()) if v)
        raise PsringError(f"the hosts' run directories hold no checkpoint of one step in "
                          f"common ({where}): they cannot resume together. Start the run "
                          f"again with a new --out on every host.")
    return max(common)


def after_join(ctx: Any, launch: Any, uses_servers: bool) -> None:
    """Set ``ctx.writes_checkpoints`` and, when torchrun restarted the launch (or it
    was started with --resume), ``ctx.resume``: the agreed checkpoint, this rank's
    directory prepared. (psring run's --resume is its launcher's: launch.prepare.)"""
    me = next((p for p in launch.peers if p.get("rank") == ctx.rank), {})
    writer = writer_of(ctx.rank, launch.peers, me.get("host"), me.get("out"))
    ctx.writes_checkpoints = writer == ctx.rank
    cfg, restart = ctx.cfg, launch.attempt - 1
    if restart == 0 and not (cfg.resume and launch.peers):
        return
    if restart:
        _check_restart(cfg, restart)
    step = agreed_step(launch.peers, uses_servers)
    if step is None and not restart:
        raise ConfigError(f"--resume {cfg.resume}: the hosts' run directories hold no "
                          f"checkpoint to resume from together (every host's --out needs "
                          f"one of the same step, rank 0's at least): start the run "
                          f"without --resume.")
    if ctx.writes_checkpoints:
        _prepare(ctx.run_dir, restart, cfg.max_restarts, step)
        launch.mark(f"prepared/{ctx.rank}")
    else:
        launch.wait_mark(f"prepared/{writer}", f"rank {writer} to prepare the run "
                                                f"directory {ctx.run_dir} to resume")
    ctx.resume = _load(ctx, step, writer, launch.peers, uses_servers)


def _check_restart(cfg: RunConfig, restart: int) -> None:
    if not cfg.max_restarts:
        raise ConfigError(
            f"torchrun restarted this launch (restart {restart}), but its workers were not "
            f"given --max-restarts: the run would start over on top of its own records. "
            f"Give the workers --checkpoint-every N --max-restarts K (K as torchrun's), or "
            f"run torchrun with --max-restarts 0.")
    if restart > cfg.max_restarts:
        raise PsringError(f"torchrun restarted this launch {restart} times, more than the "
                          f"workers' --max-restarts {cfg.max_restarts}: pass torchrun and "
                          f"the workers the same K.")


def _prepare(run_dir: Path, restart: int, limit: int, step: int | None) -> None:
    """The directory's records cut back to ``step`` (all of them for None), the restart
    (if this is one: else --resume) in restarts.jsonl."""
    if restart:
        faults.record_restart(run_dir, restart, limit, _cause(run_dir, restart), step)
    if step is None:
        faults.clear_records(run_dir)
        return
    truncate_records(run_dir / STEPS, step)
    # the evaluation at the checkpoint's step was made before it was written: it stands
    truncate_records(run_dir / EVALS, step + 1)


def _cause(run_dir: Path, restart: int) -> str:
    """What the restart follows: a fault placed on this host since the last restart,
    else a failure elsewhere (the other host's output says which)."""
    since = max((r.get("time", 0.0) for r in read_steps(run_dir, RESTARTS)), default=0.0)
    fired = [f for f in read_steps(run_dir, FAULTS) if f.get("time", 0.0) > since]
    what = f"{fired[-1]['process']} killed by {fired[-1]['fault']}" if fired else \
        "a worker failed (see every host's torchrun output)"
    return f"torchrun restarted the launch (restart {restart}): {what}"


def _load(ctx: Any, step: int | None, writer: int, peers: list[dict],
          uses_servers: bool) -> Any:
    """This rank's checkpoint of ``step`` from its own directory (None: start over)."""

    if step is None:
        return None
    held = next((p.get(OFFER) or [] for p in peers if p["rank"] == writer), [])
    if step in held:
        ctx.log.info("restarted by torchrun: resuming from step %d", step)
        return checkpoint.at(ctx.run_dir, step)
    if not held and uses_servers:
        # the servers' state comes back from rank 0's checkpoint; this worker holds none
        return checkpoint.Checkpoint(step, {}, {}, ctx.run_dir / checkpoint.CHECKPOINTS)
    raise PsringError(f"worker {ctx.rank}: {ctx.run_dir} holds no checkpoint of step "
                      f"{step}, which the other hosts resume from (it holds "
                      f"{held or 'none'}): was its --out emptied? Start the run again "
                      f"with a new --out on every host.")
