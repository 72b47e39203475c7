"""The `psring` commands of a test session, forked from one process that imported torch
and psring once, instead of each a new interpreter.

A `psring` command pays ~1.5 s of CPU importing torch and psring before it does
anything (2 cores here); the suite runs about 150 in its parallel phase alone, a third
of that phase's CPU. The zygote pays it once per pytest process: for each command it
forks a child that runs ``psring.cli.entry()`` with the command's arguments,
environment, working directory and standard streams, as ``python -m psring ARGS``
would (psring.runtime.forking does the same for a launcher's workers: the zygote is
declared to compute nothing, ``forking.allow()``, so its children fork theirs in turn).
The child's command line reads ``python -m psring ARGS`` (setproctitle), and so do
the processes it forks: what a run leaves behind is found by its run directory as
before (tests.helpers.runs.processes_mentioning).

    proc = start(["run", "--strategy", "ps", "--out", out], stdout=PIPE, stderr=PIPE)
    out, err = proc.communicate(timeout=60)     # as subprocess.Popen's

Where forking cannot serve (not Linux, a CUDA build of torch, no setproctitle,
PSRING_TEST_ZYGOTE=0) each command is a new interpreter, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

PSRING = [sys.executable, "-m", "psring"]
#: the repository's root, where the zygote starts (and ``tests`` imports from)
ROOT = Path(__file__).resolve().parents[2]
ENV = "PSRING_TEST_ZYGOTE"
#: characters a child's command line may take (its title is written over the zygote's)
TITLE_ROOM = 8192
PIPE, DEVNULL = subprocess.PIPE, subprocess.DEVNULL

_lock = threading.Lock()
_zygote: _Zygote | None = None
_unavailable = False


def start(args: list, env: dict[str, str] | None = None, cwd: str | None = None,
          stdout: int | None = None, stderr: int | None = None,
          start_new_session: bool = False) -> subprocess.Popen | Forked:
    """``psring ARGS`` started: forked from the zygote where it serves, else a new
    interpreter; a Popen or what a test uses of one."""
    global _unavailable
    args = [str(a) for a in args]
    z = _get()
    if z is not None:
        try:
            return z.start(args, dict(os.environ if env is None else env), cwd or os.getcwd(),
                           stdout, stderr, start_new_session)
        except OSError:  # (the zygote is gone: every command from here on starts anew)
            _unavailable = True
    return subprocess.Popen([*PSRING, *args], env=env, cwd=cwd, stdout=stdout, stderr=stderr,
                            text=True, start_new_session=start_new_session,
                            preexec_fn=_default_sigint)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _get() -> _Zygote | None:
    global _zygote, _unavailable
    with _lock:
        if _unavailable:
            return None
        if _zygote is None:
            try:
                _zygote = _Zygote() if serves() else None
            except OSError:
                _zygote = None
            _unavailable = _zygote is None
        return _zygote


def serves() -> bool:
    """Linux, a CPU build of torch (a GPU runtime may not be forked), setproctitle."""
    import importlib.util

    import torch

    return os.environ.get(ENV) != "0" and sys.platform.startswith("linux") \
        and torch.version.cuda is None and torch.version.hip is None \
        and importlib.util.find_spec("setproctitle") is not None


class _Zygote:
    """The test process's side: the zygote started, and a connection per command."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="psring-zygote-")
        self.path = os.path.join(self.dir, "socket")
        self.log = open(os.path.join(self.dir, "zygote.log"), "ab")
        # (run as a file: tests.helpers' package imports torch, which must come after
        # forking.allow(); the last argument is room for the children's command lines)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path, " " * TITLE_ROOM],
            cwd=ROOT, stdin=DEVNULL, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise OSError(f"the test zygote did not start (see {self.dir})")
            time.sleep(0.02)
        atexit.register(self.close)

    def close(self) -> None:
        """At the test process's exit: the zygote ended (it would die with this process
        anyway) and its directory removed, socket and log with it."""
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def start(self, args: list[str], env: dict[str, str], cwd: str, stdout: int | None,
              stderr: int | None, new_session: bool) -> Forked:
        ends, mine = [], []
        stdin = os.open(os.devnull, os.O_RDONLY)
        ends.append(stdin)
        for want in (stdout, stderr):
            if want == PIPE:
                r, w = os.pipe()
                ends.append(w)
                mine.append(r)
            elif want == DEVNULL:
                ends.append(os.open(os.devnull, os.O_WRONLY))
                mine.append(None)
            else:  # (inherit ours)
                ends.append(os.dup(1 if len(ends) == 1 else 2))
                mine.append(None)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            request = json.dumps({"args": args, "env": env, "cwd": cwd,
                                  "new_session": new_session}).encode()
            socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], ends)
        finally:
            for fd in ends:
                os.close(fd)
        return Forked([*PSRING, *args], conn, *mine)


class Forked:
    """A command forked by the zygote, with what tests use of ``subprocess.Popen``: pid,
    poll, wait, communicate, send_signal, terminate, kill, and text streams."""

    def __init__(self, args: list[str], conn: socket.socket, out: int | None,
                 err: int | None):
        self.args = args
        self.conn = conn
        self.buffer = b""
        self.returncode: int | None = None
        self.stdout: IO[str] | None = io.open(out, "r", errors="replace") if out else None
        self.stderr: IO[str] | None = io.open(err, "r", errors="replace") if err else None
        self.pid = int(self._line(timeout=60))

    def _line(self, timeout: float | None) -> str | None:
        """The zygote's next line about this command (None: none within ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.conn], [], [], left)[0]:
                return None
            chunk = self.conn.recv(256)
            if not chunk:
                raise RuntimeError(f"the test zygote went away while running {self.args}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(timeout=0)
            if line is not None:
                self.returncode = int(line)
                self.conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(line)
            self.conn.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        got: dict[IO[str], list[str]] = {s: [] for s in (self.stdout, self.stderr) if s}
        readers = [threading.Thread(target=lambda s=s: got[s].append(s.read()), daemon=True)
                   for s in got]
        for t in readers:
            t.start()
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        texts = {s: "".join(v) for s, v in got.items()}
        for s in got:
            s.close()
        return texts.get(self.stdout), texts.get(self.stderr)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# -- the zygote's side -------------------------------------------------------------------
def serve(path: str) -> None:
    """The zygote: preload, then fork a child per request until the test process goes."""
    from psring.runtime import forking
    from psring.runtime.process import kill_with_parent

    kill_with_parent()  # (it dies with its pytest process; the commands run on)
    forking.allow()  # torch and psring's worker and server code, threads counted
    import psring.cli
    import psring.report
    import psring.runs.launch  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.replace(path + ".new", path)  # (the client waits for this name)
    children: dict[int, socket.socket] = {}
    while True:
        if select.select([listener], [], [], 0.02)[0]:
            conn, _ = listener.accept()
            pid = _fork(conn, listener)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        for pid, code in _reaped():
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(f"{code}\n".encode())
                conn.close()


def _reaped() -> list[tuple[int, int]]:
    out = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        if not pid:
            return out
        out.append((pid, os.waitstatus_to_exitcode(status)))


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    size = int.from_bytes(data[:8], "big")
    while len(data) < 8 + size:
        data += conn.recv(8 + size - len(data))
    return json.loads(data[8:8 + size]), fds


def _fork(conn: socket.socket, listener: socket.socket) -> int:
    request, fds = _receive(conn)
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    # (imported here as serve() and _become() import theirs: the client half of this
    # module, in the test process, imports no psring)
    from psring.runtime.forking import finish_child

    def child() -> int:
        listener.close()
        conn.close()
        _become(request, fds)
        from psring.cli import entry

        entry()  # (leaves by os._exit)
        return 1

    finish_child(child)


def _become(request: dict, fds: list[int]) -> None:
    """This child as ``python -m psring ARGS`` would start, in the request's place."""
    import setproctitle
    import torch

    from psring.plugins import load_plugins
    from psring.runtime import forking

    # (first: setproctitle finds the command line's memory through the environment's)
    setproctitle.setproctitle(" ".join(PSRING + request["args"]))
    # the zygote's threads (a BLAS pool's) did not come along: a thread more than this
    # child has now, an OpenMP pool its command started, must stop it from forking
    forking._baseline_threads = forking._threads()
    if request["new_session"]:
        os.setsid()
    else:
        os.setpgid(0, 0)
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False),
                                                   write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False),
                                                   write_through=True,
                                                   errors="backslashreplace")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [request["cwd"], *filter(None, request["env"].get("PYTHONPATH", "").split(
        os.pathsep))]
    sys.path[:0] = [p for p in extra if p not in sys.path]
    sys.argv = [str(Path(__import__("psring").__file__).parent / "__main__.py"),
                *request["args"]]
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    torch.seed()
    load_plugins()


if __name__ == "__main__":
    del sys.path[0]  # (this file's folder: its modules are no command's to import)
    serve(sys.argv[1])
