"""Processes of a run: start them, watch them, stop them, leave no orphans.

The :class:`Supervisor` is psring's process manager (psring.runs.launch starts a run's
workers and servers with it, psring.cluster.emulate its cluster agent):

- every child runs in its own session (so a terminal's Ctrl-C reaches only the
  launcher, which then stops the children in order) and is told to die with its
  parent (PR_SET_PDEATHSIG), so a SIGKILLed launcher leaves no orphans;
- its stdout and stderr go to ``DIR/logs/<name>.log``;
- when any child exits non-zero, the others get SIGTERM, then SIGKILL after a grace
  period, and the run fails with that child's name, exit status and last lines.

A child is started one of two ways (psring.runtime.forking): forked from this process, which
has imported torch and psring's worker and server code once, or as a new interpreter
(``python -m psring.workers ...``), which pays the ~1-2 s of importing torch again.
Both look the same to the supervisor and to the child's code.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from psring.errors import ConfigError, RunFailed
from psring.records.runlog import usable_cores
from psring.runtime import forking

if TYPE_CHECKING:  # (psring.config sits above: it validates against the registries)
    from psring.config import RunConfig

GRACE_S = 5.0
#: how often the supervisor looks at its children: a run ends at most this late
POLL_S = 0.02


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the launcher dies (even by SIGKILL),
    so a killed ``psring run`` (or torchrun agent) leaves no orphans. SIGKILL, not
    SIGTERM: a worker blocked in a collective (C++, waiting for a peer that died with the
    launcher) would run its Python SIGTERM handler only when the collective times out,
    minutes later. Nothing is lost that a crash would not lose: checkpoints and run files
    are written atomically. Linux only; elsewhere a no-op."""
    parent = os.environ.get("PSRING_PARENT_PID")
    if not parent:
        # under torchrun the parent is its agent, which a SIGKILL (or a lost terminal)
        # ends without it stopping its workers
        if "TORCHELASTIC_RUN_ID" in os.environ and kill_with_parent() and os.getppid() == 1:
            os._exit(143)
        return
    if not kill_with_parent():
        return
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        os._exit(143)


def kill_with_parent() -> bool:
    """PR_SET_PDEATHSIG: SIGKILL this process when its parent dies (the primitive under
    :func:`die_with_parent`, and under the emulated cluster's holders and trampoline,
    whose parent is whoever started them). False where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    PR_SET_PDEATHSIG = 1
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0
    except (OSError, AttributeError):
        return False


def worker_threads(cfg: RunConfig, local_workers: int) -> int:
    """torch threads per worker: --threads, or the host's cores shared by its workers."""
    return cfg.threads or max(1, usable_cores() // max(1, local_workers))


def server_threads(servers: int, workers: int) -> int:
    """torch threads per parameter server started beside the workers: the cores the
    workers leave, shared by the servers, at least 1. (On 2 cores with 2 workers a
    second server thread measured slower: it competes with ZeroMQ's I/O threads.)"""
    return max(1, (usable_cores() - workers) // servers)


def set_process_name(name: str) -> None:
    """This process's name in ps, top and /proc/PID/comm (15 bytes), e.g. worker-1: a
    forked worker's command line is its launcher's, and every exec'd one's is
    ``python -m psring.workers`` with the same flags. Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    PR_SET_NAME = 15
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int, what: str) -> None:
    """Fail before anything is spawned if ``port`` is already taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR: a port with only TIME_WAIT connections is free for a listener.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"{what} port {host}:{port} is already in use by another process; "
                    f"pass a different port, or 0 to let psring pick a free one.") from None
            raise ConfigError(f"cannot bind {what} address {host}:{port}: {e.strerror}; "
                              f"check the address belongs to this host.") from None


@dataclass
class ProcessSpec:
    name: str  # e.g. "worker-0"; also the log file's name
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    #: a service (a parameter server) runs until the workers are done; then it is stopped
    service: bool = False
    #: where the process runs when not on this machine's own network (psring.cluster.emulate's
    #: hosts): ``prefix`` is a trampoline put before ``argv`` that moves a new process
    #: there, ``enter`` the same move made by a forked child before its ``main``
    prefix: list[str] = field(default_factory=list)
    enter: Callable[[], None] | None = None


@dataclass
class Child:
    spec: ProcessSpec
    proc: subprocess.Popen | forking.ForkedProcess
    log_path: Path


def oom_kills(vmstat: str = "/proc/vmstat") -> int:
    """How many processes the kernel's OOM killer has ended since boot (0 where the
    kernel does not say: Linux before 4.13, or not Linux)."""
    try:
        for line in Path(vmstat).read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# Lines a process prints when it fails only because a peer already did; the launcher
# blames the process that failed for a reason of its own when it can tell.
_CASCADE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                    "exit code 143", "SIGTERM", "caused by a remote worker crashing",
                    "caused by a remote worker hanging",
                    # (a worker's own word for it: workers/entry.py, broken_connections_named)
                    "the connection to another worker broke")
#: what psring's worker prints last when it fails (:func:`error_line`), after its prefix
_OWN_ERROR = "] error: "


def error_line(prefix: str, message: str) -> str:
    """The last line a psring worker prints when it fails (``prefix``: "[worker R/N]"):
    the supervisor reads a child still closing down as the cause by it."""
    return f"{prefix}{_OWN_ERROR[1:]}{message}"

#: seconds to wait for the cause of a failure to show when only peers' cascades have
BLAME_WAIT_S = 2.0


#: a line psring's own worker logging writes (psring.workers.entry): kept out of the
#: stream of a script's output, which is the script's
_PSRING_LINE = re.compile(rb"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \[worker \d+/\d+\] ")


class LogStream:
    """What workers write to their logs, copied to this process's stdout as it comes
    (psring launch: the script's prints, as torchrun streams them): the workers in
    ``ranks``, each line prefixed ``[rank r]`` when ``prefixed``. :meth:`poll` on each of
    the supervisor's ticks; :meth:`close` once they are done."""

    def __init__(self, log_dir: Path, ranks: list[int], prefixed: bool):
        self.files = {r: log_dir / f"worker-{r}.log" for r in ranks}
        self.prefixed = prefixed
        self.offsets = dict.fromkeys(ranks, 0)
        self.partial = dict.fromkeys(ranks, b"")

    def poll(self) -> None:
        for r, path in self.files.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[r])
                    data = f.read()
            except OSError:
                continue  # (not started yet)
            self.offsets[r] += len(data)
            *lines, self.partial[r] = (self.partial[r] + data).split(b"\n")
            self._write(r, lines)

    def close(self) -> None:
        self.poll()
        for r, rest in self.partial.items():
            self._write(r, [rest] if rest else [])
        sys.stdout.flush()

    def _write(self, rank: int, lines: list[bytes]) -> None:
        prefix = f"[rank {rank}] ".encode() if self.prefixed else b""
        out = b"".join(prefix + line + b"\n" for line in lines
                       if not _PSRING_LINE.match(line))
        if out:
            sys.stdout.flush()
            sys.stdout.buffer.write(out)
            sys.stdout.flush()


class Supervisor:
    """``may_lose(child)``: whether the run goes on when that child dies (a strategy
    that survives lost workers, psring.strategies.base.Capabilities.may_lose) — only
    when a signal ended it (a crash, the OOM killer, a placed fault): one that exited
    with an error has a bug to show, and fails the run. Those lost are kept in
    :attr:`lost`, not waited for, and handed to ``on_lost``."""

    def __init__(self, log_dir: Path, may_lose: Callable[[Child], bool] | None = None,
                 on_lost: Callable[[Child], None] | None = None):
        self.log_dir = Path(log_dir)
        self.children: list[Child] = []
        self.may_lose = may_lose or (lambda child: False)
        self.on_lost = on_lost or (lambda child: None)
        self.lost: list[Child] = []
        self.oom_kills = oom_kills()  # (the machine's count so far: a rise names the cause)

    def start(self, spec: ProcessSpec) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.name}.log"
        env = {**os.environ, **spec.env, "PSRING_PARENT_PID": str(os.getpid()),
               "PYTHONUNBUFFERED": "1"}
        fork = forking.target(spec.argv)
        with open(log_path, "ab") as logf:
            if fork is not None:
                proc = forking.start(*fork, env=env, log_fd=logf.fileno(), enter=spec.enter)
            else:
                proc = subprocess.Popen([*spec.prefix, *spec.argv], stdin=subprocess.DEVNULL,
                                        stdout=logf,
                                        stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        child = Child(spec, proc, log_path)
        self.children.append(child)
        return child

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children]

    def wait(self, on_tick: Callable[[], None] | None = None) -> None:
        """Block until every non-service child exited 0; raise RunFailed as soon as any
        child (services included) fails or a service exits before the workers are done."""
        while True:
            failed = self._unexpected()
            if failed:
                # A peer's disconnection is often seen before the process that caused it
                # has finished dying: give it a moment to be the one named.
                deadline = time.monotonic() + BLAME_WAIT_S
                while all(self._cascade(c) for c in failed) and time.monotonic() < deadline \
                        and any(self._poll(c) is None for c in self.children):
                    time.sleep(POLL_S)
                    failed = self._unexpected()
                failed = self._unexpected()  # (the cause may have exited since the last look)
                reported = self._reported(failed)
                self.stop()
                raise RunFailed(self._failure_message(reported + failed, reported))
            if all(self._poll(c) == 0 for c in self.children
                   if not c.spec.service and c not in self.lost):
                return
            if on_tick is not None:
                on_tick()
            time.sleep(POLL_S)

    def _unexpected(self) -> list[Child]:
        """The failed children the run cannot go on without; those it can join
        :attr:`lost` (each said once)."""
        failed = [c for c in self._failed() if c not in self.lost]
        for c in failed:
            if (c.proc.returncode or 0) < 0 and self.may_lose(c):
                self.lost.append(c)
                print(f"psring: {c.spec.name} lost ({describe_exit(c.proc.returncode)}); "
                      f"the run goes on without it", file=sys.stderr, flush=True)
                self.on_lost(c)
        return [c for c in failed if c not in self.lost]

    def _failed(self) -> list[Child]:
        return [c for c in self.children if self._poll(c) not in (None, 0)
                or (c.spec.service and c.proc.poll() == 0)]

    @staticmethod
    def _poll(c: Child) -> int | None:
        """The child's exit status (None: running). What it left behind in its session
        (a DataLoader's worker processes, say) is killed before it is reaped: until
        then the exited child, a zombie, keeps its process group's id, so the group
        signalled is its own."""
        if c.proc.returncode is None and _exited(c.proc.pid):
            _signal_group(c.proc, signal.SIGKILL)
        return c.proc.poll()

    def _reported(self, failed: list[Child]) -> list[Child]:
        """When every failure seen is a peer's cascade: the children still running whose
        log already names an error of their own (a worker prints its error line before it
        closes its connections, which may take seconds on a loaded machine)."""
        if not all(self._cascade(c) for c in failed):
            return []
        return [c for c in self.children if c not in failed and self._poll(c) is None
                and _OWN_ERROR in tail(c.log_path, 20) and not self._cascade(c)]

    @staticmethod
    def _cascade(c: Child) -> bool:
        """Did ``c`` fail only because a peer did (its log says a peer went away)?"""
        text = tail(c.log_path, 20)
        return any(m in text for m in _CASCADE_MARKERS)

    def _failure_message(self, failed: list[Child], reported: list[Child]) -> str:
        """``reported``: children that had named their error but not yet exited (the
        cause, stopped with the rest: their exit status is the stop's)."""
        culprit = reported[0] if reported else \
            next((c for c in failed if not self._cascade(c)), failed[0])
        how = "it reported an error" if culprit in reported else \
            describe_exit(culprit.proc.returncode)
        others = [c.spec.name for c in failed if c is not culprit]
        msg = (f"{culprit.spec.name} failed ({how}); "
               f"the other processes were stopped. Its log is {culprit.log_path}")
        if others:
            msg += f" (also failed: {', '.join(others)})"
        if culprit.proc.returncode == -signal.SIGKILL and oom_kills() > self.oom_kills:
            msg += (". The kernel's OOM killer ended processes meanwhile: the machine ran "
                    "out of memory (fewer workers or a smaller model fit; `dmesg` names "
                    "them)")
        last = tail(culprit.log_path)
        return msg + (f"; its last lines:\n{last}" if last else ".")

    def stop(self, grace: float = GRACE_S) -> None:
        """SIGTERM every live child's process group, then SIGKILL after ``grace``."""
        live = [c for c in self.children if self._poll(c) is None]
        for c in live:
            _signal_group(c.proc, signal.SIGTERM)
            # a stopped child (--kill-worker's, psring.runtime.faults) handles it only
            # once continued: else it would wait out the grace period
            _signal_group(c.proc, signal.SIGCONT)
        deadline = time.monotonic() + grace
        for c in live:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in live:
            # Only children not yet reaped: a reaped pid may already belong to someone else.
            if c.proc.poll() is None:
                _signal_group(c.proc, signal.SIGKILL)
                c.proc.wait()


def _exited(pid: int) -> bool:
    """Whether child ``pid`` has exited and waits to be reaped (waitid's WNOWAIT: it
    stays a zombie)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # (reaped elsewhere: its ids may be anyone's now)
        return False


def _signal_group(proc: subprocess.Popen | forking.ForkedProcess, sig: int) -> None:
    # The child leads its own session, so its pid is its process group's id; a child
    # forked an instant ago may not have called setsid() yet: then signal it alone.
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, sig)
    except PermissionError:
        pass
