"""Faults placed from the command line, and restarts after them.

    psring run --strategy allreduce --workers 4 --steps 40 --kill-worker 1:25 \\
        --checkpoint-every 10 --max-restarts 1 --out runs/ar-fault

``--kill-worker I:STEP``: worker I stops itself (SIGSTOP: every thread frozen, nothing
more sent) as it begins step STEP, so it never finishes it however short a step is, and
the launcher, seeing it stopped, SIGKILLs it. ``--kill-server K:STEP``: worker 0 stops
itself as it begins step STEP, the launcher SIGKILLs server K and lets worker 0 go on
(SIGCONT): the server dies exactly there. The launcher's part is :class:`Injector`,
called on every tick of its supervisor; it reads the run's steps.jsonl as the workers
append to it for the step a stopped worker is at. A process alone on an emulated host takes the
host down with it: the host's link is cut first (psring.cluster.emulate), so what the
dying process's kernel would send (a FIN, a reset) reaches nobody and its peers see
what a crashed machine shows them, silence. Each fault fires once per run, restarts
included (a restart's workers are not given the faults that fired), and is recorded in
``DIR/faults.jsonl``.

``--max-restarts K`` (:func:`restart`): when a process dies, the launcher restarts the
whole run from its last complete checkpoint, as torchrun's elastic agent restarts every
worker and the job resumes from its checkpoint; each restart is a line of
``DIR/restarts.jsonl`` (the cause, the step resumed from, the steps redone).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psring.errors import PsringError
from psring.records.runlog import (
    EVALS,
    FAULTS,
    RESTARTS,
    STEPS,
    append_record,
    atomic_write_bytes,
    read_steps,
)
from psring.runtime.process import describe_exit
from psring.train import checkpoint

if TYPE_CHECKING:  # (psring.config sits above: it validates against the registries)
    from psring.config import RunConfig


@dataclass(frozen=True)
class Fault:
    """One --kill-worker or --kill-server entry."""

    kind: str  # "worker" or "server"
    index: int
    step: int

    @property
    def process(self) -> str:
        return f"{self.kind}-{self.index}"

    @property
    def flag(self) -> str:
        return f"--kill-{self.kind} {self.index}:{self.step}"


def planned(cfg: RunConfig) -> list[Fault]:
    return [Fault(kind, index, step) for kind, index, step in cfg.faults]


def stops_at(cfg: RunConfig, rank: int) -> set[int]:
    """The steps at whose start worker ``rank`` stops itself (:func:`stop_here`): its
    own faults' and, for worker 0, the servers' (they die as worker 0 begins the step);
    not those the run's faults.jsonl says fired already (a restart under torchrun)."""
    fired = {r.get("fault") for r in read_steps(Path(cfg.out or "."), FAULTS)}
    return {f.step for f in planned(cfg) if f.flag not in fired and
            (f.process == f"worker-{rank}" or f.kind == "server" and rank == 0)}


def stop_here(cfg: RunConfig, rank: int, step: int) -> None:
    """A worker's half of a fault: freeze, for psring run's launcher to act. Without
    that launcher (under torchrun) nobody would: the worker records its own fault and
    dies at once (SIGKILL); a server's fault is then not placed."""
    if os.environ.get("PSRING_PARENT_PID"):
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    mine = [f for f in planned(cfg) if f.process == f"worker-{rank}" and f.step == step]
    if mine:
        append_record(Path(cfg.out) / FAULTS, {
            "time": time.time(), "fault": mine[0].flag, "process": mine[0].process,
            "step": step, "host_down": None})
        os.kill(os.getpid(), signal.SIGKILL)


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(") ", 1)[1][:1] in ("T", "t")


def without(cfg: RunConfig, fired: set[Fault]) -> RunConfig:
    """``cfg`` without the faults that fired (a restart must not meet them again)."""
    left = [f for f in planned(cfg) if f not in fired]
    return cfg.replace(**{f"kill_{kind}": ",".join(f"{f.index}:{f.step}" for f in left
                                                   if f.kind == kind)
                          for kind in ("worker", "server")})


@dataclass
class Progress:
    """Each worker's last logged step, read from steps.jsonl as it grows."""

    path: Path
    offset: int = 0
    last: dict[int, int] = field(default_factory=dict)
    time: float = 0.0  # when the newest record was logged

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1  # a line being written is read next time
        self.offset += end
        for line in chunk[:end].splitlines():
            try:
                r = json.loads(line)
                w, s = int(r["worker"]), int(r["step"])
            except (ValueError, KeyError, TypeError):
                continue
            self.last[w] = max(self.last.get(w, -1), s)
            self.time = max(self.time, float(r.get("time", 0.0)))

    @property
    def reached(self) -> int:
        """Steps the furthest worker has finished (0: none)."""
        return max(self.last.values()) + 1 if self.last else 0


class Injector:
    """Fires the run's faults as its workers reach them (:meth:`tick`): a worker that
    stopped itself at the start of a step (:func:`stop_here`) is at a fault's step;
    the launcher kills the servers due there, then kills that worker if it is due too,
    else lets it go on (SIGCONT)."""

    def __init__(self, faults: list[Fault], run_dir: Path, fired: set[Fault]):
        self.pending = [f for f in faults if f not in fired]
        self.fired = fired  # shared across restarts: a fault fires once per run
        self.run_dir = run_dir
        self.progress = Progress(run_dir / STEPS)

    def tick(self, sup: Any, net: Any) -> None:
        if not self.pending:
            return
        for c in sup.children:
            if c.spec.name.startswith("worker-") and _stopped(c.proc.pid):
                self._at_stop(c, sup, net)

    def _at_stop(self, worker: Any, sup: Any, net: Any) -> None:
        self.progress.read()
        rank = int(worker.spec.name.split("-")[1])
        step = self.progress.last.get(rank, -1) + 1  # (a restart's records end before it)
        due = [f for f in self.pending if f.step == step and
               (f.process == worker.spec.name or f.kind == "server" and rank == 0)]
        for f in sorted(due, key=lambda f: f.kind == "worker"):  # servers first
            self.pending.remove(f)
            self._fire(f, next(c for c in sup.children if c.spec.name == f.process), net)
        if not any(f.kind == "worker" for f in due):
            _signal(worker.proc.pid, signal.SIGCONT)  # (a server's fault: worker 0 goes on)

    def _fire(self, f: Fault, child: Any, net: Any) -> None:
        host = net.plan.host_of(f.process) if net.plan.emulated else None
        crash = host is not None and host.processes == [f.process]
        if crash:
            try:
                net.cut(host.name)
            except (OSError, subprocess.SubprocessError, PsringError) as e:
                crash = False  # (the process still dies; its peers may hear it)
                print(f"psring: could not cut {host.name}'s link: {e}", file=sys.stderr)
        # its process group: a worker's own helpers (a forked data loader) die with it
        _signal(child.proc.pid, signal.SIGKILL)
        self.fired.add(f)
        what = f"{host.name} crashed (link cut, then {f.process} killed)" if crash else \
            f"{f.process} killed"
        append_record(self.run_dir / FAULTS, {"time": time.time(), "fault": f.flag,
                                              "process": f.process, "step": f.step,
                                              "host_down": host.name if crash else None})
        print(f"psring: fault {f.flag}: {what}", file=sys.stderr, flush=True)


def _signal(pid: int, sig: int) -> None:
    """``sig`` to the process group ``pid`` leads (each child leads its own session)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def record_loss(run_dir: Path, child: Any) -> None:
    """A process the run went on without (Supervisor.lost), in faults.jsonl."""

    append_record(run_dir / FAULTS, {"time": time.time(), "lost": child.spec.name,
                                     "exit": describe_exit(child.proc.returncode)})


def blame(message: str, fired: list[Fault]) -> str:
    """A failure's message, saying which placed fault caused it."""
    for f in fired:
        if message.startswith(f.process + " failed"):
            return f"{message}\n(The fault {f.flag} placed it: the run fail-stops on a " \
                   f"lost process unless --max-restarts K lets it restart from its last " \
                   f"checkpoint.)"
    return message


def restart(cfg: RunConfig, run_dir: Path, attempt: int, cause: str,
            fired: set[Fault]) -> Any | None:
    """After a failure: record restart ``attempt`` in restarts.jsonl and return the
    config that continues the run from its last complete checkpoint (from the start
    when none was written yet, its records cleared), without the faults that fired;
    None when the last checkpoint is the run's end (nothing left to run again)."""
    cfg = without(cfg, fired)

    ckpt = checkpoint.latest(run_dir, log=lambda m: print(f"psring: {m}", file=sys.stderr))
    if ckpt is not None and ckpt.step >= cfg.steps:
        return None
    record_restart(run_dir, attempt, cfg.max_restarts, cause,
                   ckpt.step if ckpt is not None else None)
    if ckpt is not None:
        return cfg.replace(out=str(run_dir), resume=str(run_dir))
    clear_records(run_dir)
    return cfg.replace(out=str(run_dir), resume="")


def record_restart(run_dir: Path, attempt: int, limit: int, cause: str,
                   start: int | None) -> None:
    """Restart ``attempt`` (of at most ``limit``) in restarts.jsonl, and said: the step
    it resumes from (None: from the start, no checkpoint yet), how far the run had got
    (its steps.jsonl, before it is cut back), the steps redone."""
    progress = Progress(run_dir / STEPS)
    progress.read()
    cause = cause.splitlines()[0]
    append_record(run_dir / RESTARTS, {
        "attempt": attempt, "time": time.time(), "cause": cause,
        "resumed_from": start or 0, "reached": progress.reached, "reached_at": progress.time,
        "steps_redone": max(0, progress.reached - (start or 0))})
    print(f"psring: restart {attempt} of {limit}: "
          + (f"from the checkpoint at step {start}" if start is not None else "from the "
             "start (no checkpoint yet)") + f"; {cause}", file=sys.stderr, flush=True)


def clear_records(run_dir: Path) -> None:
    """A run that starts over keeps no step or evaluation records."""
    for name in (STEPS, EVALS):
        atomic_write_bytes(run_dir / name, b"")
        (run_dir / name).unlink()
