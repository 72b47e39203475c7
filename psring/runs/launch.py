"""Start a run's processes, watch them, and make the run fail-stop.

``psring run`` starts one OS process per worker (``python -m psring.workers``, or a
fork of the launcher: psring.runtime.forking) with the environment torchrun would give it
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the
same worker runs unchanged under ``torchrun`` across hosts; a parameter-server strategy
gets its servers first. The run's cluster (``cfg.cluster``, psring.cluster.spec) says where
each process lives; psring.cluster.emulate builds it when it spans emulated hosts; the
processes are supervised by psring.runtime.process (fail-stop, no orphans).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

from psring.cluster.emulate import network_for
from psring.comm.endpoints import ABSTRACT_IPC, abstract_ipc_endpoint
from psring.comm.tcp_timers import CONTROL_RTO_MIN_US
from psring.config import RunConfig, validate
from psring.errors import ConfigError, PsringError, RunFailed
from psring.records.runlog import (
    EVALS,
    STEPS,
    atomic_write_json,
    count_lines,
    default_out,
    read_manifest,
    truncate_records,
)
from psring.records.trace import write_trace
from psring.runtime import faults
from psring.runtime.process import (
    LogStream,
    ProcessSpec,
    Supervisor,
    check_port_free,
    free_port,
    server_threads,
    worker_threads,
)
from psring.runtime.rendezvous import RUN_ARGS_ENV
from psring.strategies import STRATEGIES
from psring.strategies.ps import server_frame_limit
from psring.train import checkpoint
from psring.train.device import capacity
from psring.units import parse_window

#: RunConfig's default rendezvous address
DEFAULT_MASTER_ADDR = "127.0.0.1"


class _Terminated(Exception):
    pass


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM raises inside the launcher, so cleanup runs as for Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(*_: object) -> None:
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


LAUNCH = "launch.json"


def resume_config(resume_dir: str, given: dict) -> RunConfig:
    """The config to continue the run in ``resume_dir``: the run's own settings (as its
    launch recorded them, else from its manifest), with the flags given now on top."""

    d = Path(resume_dir)
    try:
        base = json.loads((d / LAUNCH).read_text())["config"]
    except (OSError, ValueError, KeyError):
        try:
            base = read_manifest(d)["config"]
        except Exception:  # noqa: BLE001 - any unreadable run directory
            raise ConfigError(f"--resume {resume_dir}: not a psring run directory (no "
                              f"{LAUNCH} or manifest.json); pass the --out of the run to "
                              f"continue.") from None
        base["master_port"] = 0  # the old run's port; pick a free one
        if base.get("hosts", 1) > 1 or \
                base.get("server_placement") == "own-hosts":
            base["master_addr"] = DEFAULT_MASTER_ADDR  # chosen by the new cluster
    known = {f.name for f in dataclasses.fields(RunConfig)}
    values = {k: v for k, v in base.items() if k in known}
    values.update(given)
    values.update(out=str(d), resume=str(d))
    return validate(RunConfig(**values))


def prepare(cfg: RunConfig) -> tuple[str, int]:
    """Resolve the run directory and the rendezvous port, checking both up front."""
    out = cfg.out or default_out(cfg)
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, STEPS).exists()
        writable = os.access(out, os.W_OK | os.X_OK)
    except OSError as e:
        writable, why = False, e.strerror
    else:
        why = "not writable"
    if not writable:
        raise ConfigError(f"cannot use run directory {out} ({why}); pass an --out this "
                          f"user can write.")
    if cfg.resume:

        if Path(out).resolve() != Path(cfg.resume).resolve():
            raise ConfigError(f"--resume {cfg.resume} continues that run in its own "
                              f"directory; drop --out {out}.")
        ckpt = checkpoint.latest(Path(out), log=lambda m: print(f"psring: {m}", file=sys.stderr))
        if ckpt is None:
            raise ConfigError(f"--resume {cfg.resume}: the run has no checkpoint (in "
                              f"{Path(out) / checkpoint.CHECKPOINTS}); it must have run with "
                              f"--checkpoint-every N.")
        if ckpt.step >= cfg.steps:
            raise ConfigError(f"--resume {cfg.resume}: its last checkpoint is at step "
                              f"{ckpt.step} and the run has {cfg.steps} steps: nothing to "
                              f"do (pass a larger --steps to train on).")
        truncate_records(Path(out, STEPS), ckpt.step)
        # evaluations of the model after the checkpoint's step are made again; the one
        # at that step (made before the checkpoint was written) stands. (With backup
        # workers the checkpoint is of the servers' version, which worker 0's loop,
        # where rank 0 evaluates, may trail: what it evaluated after it goes.)
        truncate_records(Path(out, EVALS), ckpt.meta.get("loop_step", ckpt.step) + 1)
    elif Path(out, STEPS).exists():
        raise ConfigError(f"run directory {out} already holds a run (steps.jsonl); pass a new "
                          f"--out, or remove the old one.")
    # an emulated cluster's rendezvous is in a fresh namespace, where every port this
    # machine has free is free too; its address does not exist out here
    where = DEFAULT_MASTER_ADDR if cfg.cluster.emulated else cfg.master_addr
    port = cfg.master_port
    if port:
        check_port_free(where, port, "--master-port")
    else:
        port = free_port(where)
    return out, port


def worker_specs(cfg: RunConfig, command: list[str] | None = None) -> list[ProcessSpec]:
    """One process per worker: psring's own (``python -m psring.workers``), or a user's
    ``command`` (psring launch), which reads the run's flags from the environment
    (psring.runtime.rendezvous.RUN_ARGS_ENV) in ``psring.init()``."""
    argv = command or [sys.executable, "-m", "psring.workers", *cfg.to_argv()]
    script = {RUN_ARGS_ENV: json.dumps(cfg.to_argv()), "PYTHONUNBUFFERED": "1"} \
        if command else {}
    specs = []
    for rank in range(cfg.workers):
        local_rank, local_world = cfg.cluster.local_ranks(rank)
        env = {"RANK": str(rank), "WORLD_SIZE": str(cfg.workers), "LOCAL_RANK": str(local_rank),
               "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": cfg.master_addr,
               "MASTER_PORT": str(cfg.master_port),
               # Before torch is imported, so its thread pools are sized right from start.
               "OMP_NUM_THREADS": str(worker_threads(cfg, cfg.workers)), **script}
        specs.append(ProcessSpec(f"worker-{rank}", argv, env))
    return specs


def local_ipc(cfg: RunConfig) -> bool:
    """Whether psring's own servers are reached over Unix domain sockets (--transport)."""

    if cfg.transport == "auto":  # (--loss-tolerance: datagrams need a UDP port)
        return ABSTRACT_IPC and not cfg.cluster.emulated and not cfg.loss_tolerance
    return cfg.transport == "ipc"


def server_endpoint(cfg: RunConfig, k: int) -> str:
    """Where server ``k`` of this run listens. On one host: an abstract Unix socket,
    since large messages cross a Unix socket with less kernel work than TCP's
    segmenting and acknowledging
    (docs/results/2026-11-23-emulation-runs-and-prediction.md, issue 10, fix 4). Else
    loopback TCP, or the server's emulated host's address (a fresh namespace: any port free
    here is free there)."""

    if local_ipc(cfg):
        return abstract_ipc_endpoint(f"psring-{os.getpid()}-{k}")
    host = cfg.cluster.server_address(k) if cfg.cluster.emulated else "127.0.0.1"
    return f"tcp://{host}:{free_port()}"


def server_specs(cfg: RunConfig, run_dir: Path) -> tuple[dict[str, str], list[ProcessSpec]]:
    """Parameter servers to start for ``cfg`` (none when it names running ones), and
    the settings the workers get to reach them (their addresses)."""

    if not STRATEGIES.get(cfg.strategy).caps.uses_servers or cfg.server_addrs:
        return {}, []

    addrs = [server_endpoint(cfg, k) for k in range(cfg.servers)]
    extra = ["--secret-file", cfg.secret_file] if cfg.secret_file else []
    limit = server_frame_limit(cfg)
    if limit is not None:  # libzmq then refuses any larger frame (ZMQ_MAXMSGSIZE)
        extra += ["--max-frame-mb", f"{limit / 2**20:.6f}"]
    if cfg.credit_window:  # (the servers grant their bounded-loss senders: psring.comm.credits)
        extra += ["--credit-window", str(parse_window(cfg.credit_window))]
    if cfg.loss_tolerance:  # (their TCP carries only control: psring.comm.tcp_timers)
        extra += ["--control-rto-min-us", str(CONTROL_RTO_MIN_US)]
    specs = [ProcessSpec(f"server-{k}", [sys.executable, "-m", "psring.servers",
                                         "--bind", addr, "--name", f"server-{k}",
                                         "--log", str(run_dir / "servers.jsonl"), *extra],
                         env={"OMP_NUM_THREADS": str(server_threads(cfg.servers, cfg.workers))},
                         service=True)
             for k, addr in enumerate(addrs)]
    # the addresses now say the transport (tcp:// or ipc://)
    return {"server_addrs": ",".join(addrs), "transport": "auto"}, specs


def launch(cfg: RunConfig, progress: Callable[[int, int], None] | None = None,
           command: list[str] | None = None, stream: str = "none") -> Path:
    """Run ``cfg`` to completion, restarting it from its last checkpoint when a process
    dies (--max-restarts, psring.runtime.faults); return its run directory. Raises
    RunFailed. ``command``: each worker runs it, a user's script (psring launch);
    ``stream``: whose output goes to stdout as it comes ("rank0", "all", "none")."""
    cfg = validate(cfg)  # (once per config: psring run has validated it already)
    _check_emulated(cfg)
    if command is None and cfg.steps < 1:
        raise ConfigError("--steps 0 (as many steps as a script trains) is psring launch's; "
                          "psring's own loop needs a number of steps: --steps N.")
    # (imported here: psring.train.device imports torch, and psring --help reaches this module)

    for why in capacity(cfg):  # --compute device beyond what this machine emulates
        print(f"psring: warning: {why}.", file=sys.stderr)
    cfg = cfg.replace(out=cfg.out or default_out(cfg))  # (one directory, restarts included)
    fired: set[faults.Fault] = set()
    for attempt in range(cfg.max_restarts + 1):
        try:
            return _launch_once(cfg, progress, fired, command, stream)
        except RunFailed as e:
            interrupted = e.exit_code in (130, 143)  # the user stopped it: no fault
            try:
                again = None if interrupted or attempt == cfg.max_restarts else \
                    faults.restart(cfg, Path(cfg.out), attempt + 1, str(e), fired)
            except PsringError as why:  # (no usable checkpoint): the failure stands
                raise RunFailed(f"{faults.blame(str(e), fired)}\nIt could not restart: "
                                f"{why}", e.exit_code) from None
            if again is None:
                raise RunFailed(faults.blame(str(e), fired), e.exit_code) from None
            cfg = again
    raise AssertionError("unreachable")


def _launch_once(cfg: RunConfig, progress: Callable[[int, int], None] | None,
                 fired: set[faults.Fault], command: list[str] | None = None,
                 stream: str = "none") -> Path:
    """One attempt at the run: its directory prepared, its processes run to the end."""
    out, port = prepare(cfg)
    run_dir = Path(out)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.resume:
        # the settings as given (ports and server addresses not yet filled in): what
        # --resume starts from
        atomic_write_json(run_dir / LAUNCH, {"config": {**cfg.to_dict(), "out": out}})
    # A new id for every launch, inherited by the run's processes (psring.records.runlog.run_id)
    os.environ["PSRING_RUN_ID"] = uuid.uuid4().hex
    net = network_for(cfg.cluster, run_dir)
    # what the launcher decides, filled in at once (its values checked once, not one each)
    decided: dict = {"out": out, "master_port": port}
    if cfg.cluster.emulated:
        # Emulated hosts share this machine's cores: threads are the machine's cores
        # shared by all the run's workers, not by a host's.
        decided.update(master_addr=cfg.cluster.master_addr,
                       threads=worker_threads(cfg, cfg.workers))
    placed = cfg.replace(**decided)
    reach, services = server_specs(placed, run_dir)
    cfg = placed.replace(**reach) if reach else placed
    ticker = _Progress(progress, run_dir / STEPS, cfg.steps * cfg.workers)
    injector = faults.Injector(faults.planned(cfg), run_dir, fired)
    ranks = {"rank0": [0], "all": list(range(cfg.workers)), "none": []}[stream]
    output = LogStream(run_dir / "logs", ranks, prefixed=stream == "all")
    _supervise(cfg, run_dir, net, services, ticker, injector, command, output)
    ticker.report()
    if cfg.trace:

        write_trace(run_dir)
    return run_dir


def _check_emulated(cfg: RunConfig) -> None:
    """What an emulated cluster (or the launcher) decides itself, refused when given."""
    if cfg.cluster.emulated and cfg.server_addrs:
        raise ConfigError("--server-addrs names servers outside the emulated cluster, "
                          "which its hosts cannot reach; with --hosts or own-hosts "
                          "placement psring starts the servers inside it: drop "
                          "--server-addrs.")
    if cfg.kill_server and cfg.server_addrs:
        raise ConfigError("--kill-server kills a parameter server psring started, and "
                          "--server-addrs names servers of yours: drop one of the two.")
    if cfg.cluster.emulated and cfg.master_addr != DEFAULT_MASTER_ADDR:
        raise ConfigError("--master-addr is chosen by the emulated cluster (worker 0's "
                          "host); drop it.")


class _Progress:
    """Steps logged so far, out of the run's total, for a progress callback (at most
    five times a second while the run goes on, and once at its end)."""

    def __init__(self, progress: Callable[[int, int], None] | None, steps: Path, total: int):
        self.progress, self.steps, self.total = progress, steps, total
        self.last = 0.0

    def tick(self) -> None:
        if self.progress is not None and time.monotonic() - self.last > 0.2:
            self.last = time.monotonic()
            self.report()

    def report(self) -> None:
        if self.progress is not None:
            self.progress(min(count_lines(self.steps), self.total), self.total)


def _supervise(cfg: RunConfig, run_dir: Path, net, services: list, ticker: _Progress,
               injector: faults.Injector, command: list[str] | None = None,
               output: LogStream | None = None) -> None:
    """Start the cluster, the services and the workers under one supervisor and wait for
    them: fail-stop on the first failure, every process stopped whatever happens, the
    strategy's leftovers (shared memory) cleaned up. Each tick places the faults due
    and copies the workers' new output (``output``)."""

    caps = STRATEGIES.get(cfg.strategy).caps
    sup = Supervisor(run_dir / "logs",
                     may_lose=lambda c: caps.may_lose(cfg, c.spec.name, len(sup.lost)),
                     on_lost=lambda c: faults.record_loss(run_dir, c))

    def tick() -> None:
        ticker.tick()
        injector.tick(sup, net)
        if output is not None:
            output.poll()

    with _signals_raise():
        try:
            net.start(sup)
            for spec in services + worker_specs(cfg, command):
                sup.start(net.place(spec))
            sup.wait(tick)
        except RunFailed as e:
            why = net.explain()
            raise RunFailed(f"{e}\n{why}" if why else str(e), e.exit_code) from None
        except KeyboardInterrupt:
            sup.stop()
            raise RunFailed(f"interrupted; all {len(sup.children)} processes of the run in "
                            f"{run_dir} were stopped.", exit_code=130) from None
        except _Terminated:
            sup.stop()
            raise RunFailed(f"terminated (SIGTERM); all {len(sup.children)} processes of the "
                            f"run in {run_dir} were stopped.", exit_code=143) from None
        finally:
            sup.stop()
            if output is not None:
                output.close()
            STRATEGIES.get(cfg.strategy).cleanup_run(cfg)
