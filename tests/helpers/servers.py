"""Test helpers: a parameter server in a thread or a child process, and a raw client
that speaks the wire protocol directly (so tests can send exactly the frames they mean,
twice, unsigned, or signed with the wrong secret)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import torch
import zmq

from psring.comm.protocol import decode, encode

#: the run id of the requests :func:`req` makes
RUN = "run-1"


def req(op: str, worker: int = 0, seq: int = 1, **fields):
    """A request as a server's Handler receives it (encoded and decoded again, without
    a socket); ``tensors`` and ``shard`` (default 0) among ``fields``."""
    tensors = fields.pop("tensors", [])
    return decode(encode(op, {"run": RUN, "worker": worker, "seq": seq, "shard": fields.pop(
        "shard", 0), **fields}, tensors))


def ops(replies) -> list[tuple[bytes, str]]:
    """A Handler's replies as (peer, op) pairs."""
    return [(r.peer, decode(r.frames).op) for r in replies]


class LiveServer:
    """A Server serving in a daemon thread; ``with LiveServer(...) as server:``."""

    def __init__(self, log_path: Path | None = None, **kw):
        from psring.servers.server import Server

        self.server = Server("tcp://127.0.0.1:0", "test-server", log_path, **kw)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.server.serve, args=(self.stop.is_set,),
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        return self.server

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()
        self.server.close()


class RawClient:
    """One DEALER socket; ``key`` signs what it sends and checks what it receives."""

    def __init__(self, endpoint: str, key: bytes | None = None, run: str = "run",
                 worker: int = 0):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.key, self.run, self.worker = key, run, worker
        self.seq = 0

    def frames(self, op: str, tensors=(), seq: int | None = None, **fields) -> list:
        if seq is None:
            self.seq += 1
            seq = self.seq
        return [bytes(f) for f in encode(op, {"run": self.run, "worker": self.worker,
                                              "seq": seq, "shard": 0, **fields},
                                         tensors, self.key)]

    def send(self, frames: list) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_ms: int = 5000) -> list | None:
        """The next reply's raw frames, or None if nothing came within the timeout."""
        if not self.sock.poll(timeout_ms):
            return None
        return self.sock.recv_multipart()

    def request(self, op: str, tensors=(), **fields):
        self.send(self.frames(op, tensors, **fields))
        reply = self.recv()
        assert reply is not None, f"no answer to {op}"
        return decode(reply, key=self.key)

    def init(self, n: int = 4, workers: int = 1, mode: str = "sync", lr: float = 1.0,
             params: torch.Tensor | None = None):
        params = torch.zeros(n) if params is None else params
        reply = self.request("init", [params], lo=0, hi=n, workers=workers, mode=mode,
                             lr=lr, momentum=0.0, weight_decay=0.0, max_staleness=-1)
        assert reply.op == "ok", reply.header
        return reply

    def pull(self, min_version: int = 0) -> torch.Tensor:
        reply = self.request("pull", min_version=min_version)
        assert reply.op == "params", reply.header
        return reply.tensors[0].clone()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_server_process(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """``python -m psring.servers ARGS`` on a free loopback port; (process, endpoint)."""
    proc = subprocess.Popen([sys.executable, "-m", "psring.servers",
                             "--bind", "tcp://127.0.0.1:0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    m = re.search(r"tcp://[\d.]+:\d+", line)
    if m is None:
        proc.kill()
        raise AssertionError(f"server did not start: {line}{proc.stderr.read()}")
    return proc, m.group(0)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")
