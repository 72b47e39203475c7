"""A parameter server process: a ROUTER socket, the request handler, a log.

    psring server --bind tcp://127.0.0.1:5555 [--log servers.jsonl]

One thread: receive a request, validate it (psring.protocol.decode), let the handler
apply it, send the replies. A malformed message is answered with an error (or dropped
when it is too broken to answer) and the server goes on serving everyone else.
"""

from __future__ import annotations

import ipaddress
import json
import os
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import zmq

from psring.errors import ConfigError
from psring.protocol import REQUESTS, ProtocolError, decode, error_frames

from .handler import Handler

POLL_MS = 100


class RequestLog:
    """servers.jsonl: one line per answered request, written in batches so logging
    stays off the request path's critical time (one write() per batch, O_APPEND)."""

    def __init__(self, path: Path | None, flush_s: float = 0.5):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else -1
        self.lines: list[str] = []
        self.flush_s = flush_s
        self.last = time.monotonic()

    def add(self, record: dict) -> None:
        if self.fd >= 0:
            self.lines.append(json.dumps(record, separators=(",", ":")))
            if len(self.lines) >= 1000 or time.monotonic() - self.last > self.flush_s:
                self.flush()

    def flush(self) -> None:
        if self.fd >= 0 and self.lines:
            os.write(self.fd, ("\n".join(self.lines) + "\n").encode())
            self.lines = []
        self.last = time.monotonic()

    def close(self) -> None:
        self.flush()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def is_loopback(endpoint: str) -> bool:
    host = urlparse(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_endpoint(endpoint: str, what: str = "--bind") -> None:
    u = urlparse(endpoint)
    if u.scheme not in ("tcp", "ipc") or (u.scheme == "tcp" and not u.hostname):
        raise ConfigError(f"{what} {endpoint!r} is not a ZeroMQ endpoint like "
                          f"tcp://127.0.0.1:5555 (or ipc:///path).")


class Server:
    def __init__(self, bind: str, name: str = "server", log_path: Path | None = None):
        check_endpoint(bind)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            if bind.startswith("tcp://") and bind.endswith(":0"):
                self.sock.bind_to_random_port(bind[:-2])
            else:
                self.sock.bind(bind)
        except zmq.ZMQError as e:
            self.close()
            raise ConfigError(f"the server cannot bind {bind}: {e.strerror}; pick another "
                              f"port (or :0 for a free one).") from None
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.handler = Handler(name)
        self.log = RequestLog(log_path)
        self.invalid = 0

    def serve(self, should_stop: Callable[[], bool]) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not should_stop():
            if not poller.poll(POLL_MS):
                self.log.flush()
                continue
            frames = self.sock.recv_multipart(copy=False)
            self.serve_one(frames)

    def serve_one(self, frames: list) -> None:
        peer, body = frames[0].bytes, frames[1:]
        try:
            msg = decode(body, expect=REQUESTS)
        except ProtocolError as e:
            self.invalid += 1
            self.log.add({"time": time.time(), "server": self.handler.name, "op": "invalid",
                          "error": str(e)[:300]})
            self.sock.send_multipart([peer, *error_frames(f"protocol error: {e}")], copy=False)
            return
        try:
            replies = self.handler.handle(peer, msg)
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the server
            self.invalid += 1
            self.log.add({"time": time.time(), "server": self.handler.name, "op": "failed",
                          "error": f"{type(e).__name__}: {e}"[:300]})
            self.sock.send_multipart([peer, *error_frames(
                f"the server could not handle this request ({type(e).__name__}: {e})",
                msg.header)], copy=False)
            return
        for reply in replies:
            self.sock.send_multipart([reply.peer, *reply.frames], copy=False)
            self.log.add(reply.record)

    def close(self) -> None:
        if hasattr(self, "log"):
            self.log.close()
        self.sock.close(linger=0)
        self.ctx.term()
