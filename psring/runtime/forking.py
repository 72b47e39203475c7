"""Start a run's workers and servers by forking the launcher instead of a new
interpreter.

Every psring worker and server imports torch, about 1-2 s on a 2-core machine: a
2-worker ps run paid it four times (launcher, two workers, one server), a sweep once
more per run. The launcher has imported torch already; once it has also imported the
worker and server code (:func:`preload`), a child forked from it starts at
``main()`` with nothing left to import. A forked child then behaves as if started by
``python -m psring.workers ARGS`` with the spec's environment: its own session, stdio
on its log file, default signal dispositions, no inherited file descriptors, and the
same ``__main__`` module run with the same ``sys.argv``.

Forking is safe only from a process in which nothing else runs: a thread holding a
lock at fork time (an OpenMP pool that ran a parallel region, ZeroMQ's I/O threads, a
progress-bar thread) leaves the child with a lock nobody will release. So forking is
opt-in and checked:

- a process declares that it will not compute before launching (:func:`allow`; the
  ``psring run``, ``sweep`` and ``compare`` commands do), which also preloads;
- torch is a CPU build (a GPU runtime initialized in the launcher cannot be used by a
  forked child; CUDA and ROCm builds start every process anew);
- at each start the process must still have the threads it had right after
  preloading (numpy's BLAS pool, which hands itself over at fork), and no other
  Python thread;
- ``PSRING_FORK=0`` turns it off (benchmarks compare both ways; docs/benchmarks.md).

A user's script (``psring launch -- python train.py``) is forked the same way, run as
``python train.py`` would run it (:func:`_run_script`: ``runpy.run_path``, its folder as
``sys.path[0]``, fresh random generators, its exit handlers), with torch and psring
already imported.

Anything else (an in-process ``launch()`` from a test or a notebook, a process placed
on an emulated host through its setns trampoline, another OS) starts a new interpreter
as before.

    PSRING_FORK=0 psring run --strategy ps --workers 2 --steps 1   # the exec path
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib
import io
import logging
import os
import random
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable, Mapping, NoReturn

ENV = "PSRING_FORK"
#: what can be forked: the modules of ``python -m MODULE`` that preload() imports
MODULES = ("psring.workers", "psring.servers")
_PRELOAD = ("torch", "torch.distributed", "psring.workers.entry", "psring.workers.loop",
            "psring.workers.manifest", "psring.train.workload", "psring.strategies",
            "psring.train.checkpoint", "psring.servers.entry", "psring.servers.server")

_baseline_threads: int | None = None
_BLOCKED = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD}


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork") \
        and os.environ.get(ENV, "1") != "0"


def preload() -> int:
    """Import what a worker and a server import, once, in this process; return the
    threads the process had once torch was imported, before any psring module (and
    with it a user's plugin) was."""
    for name in _PRELOAD[:2]:
        importlib.import_module(name)
    clean = _threads()
    for name in _PRELOAD[2:]:
        importlib.import_module(name)
    return clean


def allow() -> None:
    """This process will start runs and compute nothing itself before it does: fork
    their workers and servers from it (when :func:`supported`). Call it first thing,
    before torch is imported (else it does nothing): it imports torch and the worker
    and server code, and remembers the threads the process then has; any thread more
    at a start (plugins or a user's model computing at import, a calibration) means a
    new interpreter instead."""
    global _baseline_threads
    if not supported() or _baseline_threads is not None:
        return
    if "torch" in sys.modules:
        # torch came in before this declaration, and whatever ran since may have
        # started its thread pools: no telling what a fork would inherit
        return
    clean = preload()
    if not _cpu_only_torch():
        return
    now = _threads()
    if now > clean:
        # code run since torch was imported (a plugin, a user's model module) started
        # threads, e.g. torch's OpenMP pool by computing: a fork could inherit its locks
        return
    # the launcher must reap its children itself: with SIGCHLD ignored (inherited from
    # whoever started it) the kernel would, and every exit status would be lost
    if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _baseline_threads = now


def _cpu_only_torch() -> bool:
    """A torch built for CUDA or ROCm may have initialized its GPU runtime in the
    launcher (``torch.cuda.is_available()`` does, when the config resolves --device
    auto), and a forked child cannot use a runtime its parent initialized. Such builds
    start every process anew; CPU builds fork."""
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    return torch is not None and getattr(version, "cuda", None) is None \
        and getattr(version, "hip", None) is None


#: what :func:`target` returns for ``python SCRIPT.py ARGS`` (psring launch's workers)
SCRIPT = "<script>"
#: a forked script's exit status while its exit handlers run (None: not one, or not yet;
#: psring.library's handler tells a failure from a missing dist.finish() by it)
exiting_with: int | None = None


def target(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(module, args)`` when ``argv`` is ``python -m MODULE ARGS`` for a module this
    process can fork now, ``(SCRIPT, [path, *args])`` for ``python SCRIPT.py ARGS`` (a
    user's script, psring launch); None to start a new interpreter."""
    if _baseline_threads is None or not supported() or len(argv) < 2 \
            or argv[0] != sys.executable:
        return None
    if argv[1] == "-m" and len(argv) >= 3 and argv[2] in MODULES:
        found = argv[2], argv[3:]
    elif argv[1].endswith(".py") and os.path.isfile(argv[1]):
        found = SCRIPT, argv[1:]
    else:
        return None
    if threading.active_count() != 1 or _threads() > _baseline_threads:
        return None  # a thread appeared since preload(): it may hold a lock
    return found


class ForkedProcess:
    """A forked child, as much of ``subprocess.Popen`` as the supervisor uses."""

    def __init__(self, pid: int, args: list[str]):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: nothing more to learn
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode


def start(module: str, args: list[str], env: Mapping[str, str], log_fd: int,
          enter: Callable[[], None] | None = None) -> ForkedProcess:
    """Fork a child that runs ``python -m module args`` in this interpreter, after
    ``enter()`` (e.g. moving onto an emulated host's namespaces; the child is
    single-threaded, as setns into a user namespace requires)."""
    for stream in (sys.stdout, sys.stderr):  # nothing buffered may be written twice
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    # no signal may be handled between fork() and the child's own handlers: the
    # launcher's would raise in the child's copy of the launcher's stack
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED)
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return ForkedProcess(pid, [sys.executable, *([] if module == SCRIPT else ["-m", module]),
                                   *args])

    def child() -> int:
        _become_child(env, log_fd)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if enter is not None:
            enter()
        return _run_main(module, args)

    finish_child(child)


def _become_child(env: Mapping[str, str], log_fd: int) -> None:
    if log_fd < 3:  # the launcher started with stdio closed: keep the log clear of them
        log_fd = fcntl.fcntl(log_fd, fcntl.F_DUPFD, 3)
    os.setsid()
    # what a new interpreter starts with, whatever the launcher installed
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024)
    # unbuffered, as PYTHONUNBUFFERED makes a new interpreter's
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False),
                                                   write_through=True, line_buffering=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False),
                                                   write_through=True, line_buffering=True,
                                                   errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    # the launcher's logging set-up is not the child's: its entry configures its own
    root = logging.getLogger()
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    threads = env.get("OMP_NUM_THREADS")
    torch = sys.modules.get("torch")
    if threads and torch is not None:
        # OpenMP read OMP_NUM_THREADS when the launcher started, not now
        torch.set_num_threads(int(threads))


def exit_status(e: SystemExit) -> int:
    """The status a process ending with ``e`` exits with, as Python's own: None 0, a
    number itself, anything else (a message) 1."""
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def finish_child(body: Callable[[], int]) -> NoReturn:
    """Run a forked child's ``body`` and leave with its status by ``os._exit``: a
    child must never return into its parent's copy of the stack. A SystemExit leaves
    with its status, any other raise with 1 and its traceback printed; the streams are
    flushed first (the zygote of the tests' commands ends its children so too)."""
    code = 1
    try:
        code = body()
    except SystemExit as e:
        code = exit_status(e)
    except BaseException:  # noqa: BLE001 - the child must never return into the parent
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _run_main(module: str, args: list[str]) -> int:
    if module == SCRIPT:
        return _run_script(args)
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return exit_status(e)
    return 0


def _run_script(args: list[str]) -> int:
    """``python SCRIPT.py ARGS`` as a new interpreter runs it: ``__file__`` absolute,
    the script's folder as ``sys.path[0]``, the random generators as a new process has
    them (torch's, Python's and numpy's seeded from fresh entropy, as each is at its
    start; the launcher's are seeded), exit handlers run at the end, and
    ``sys.exit("message")`` printed."""
    path = os.path.abspath(args[0])
    sys.argv = [args[0], *args[1:]]
    sys.path[0] = os.path.dirname(path)
    atexit._clear()  # (the launcher's are not the script's)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.modules["torch"].seed()
    global exiting_with
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = exit_status(e)
        if not isinstance(e.code, (int, type(None))):  # sys.exit("message"): printed
            print(e.code, file=sys.stderr)
    except BaseException as e:  # noqa: BLE001 - what the interpreter does with it, below
        # the interpreter prints an uncaught error and keeps it in sys.last_value before
        # the exit handlers run (psring.library's tells a failure from a missing finish)
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
        traceback.print_exc()
        code = 1
    finally:
        exiting_with = code
        atexit._run_exitfuncs()
    return code
