"""A parameter server process: a ROUTER socket, the request handler, a log.

    psring server --bind tcp://127.0.0.1:5555 [--log servers.jsonl] [--secret-file F]

One thread: receive a request, validate it (psring.comm.protocol.decode), let the handler
apply it, send the replies. A malformed message is answered with an error and the
server goes on serving everyone else. With a shared secret every message must be
signed: one that is not (or badly) is dropped unanswered and counted. Binding anything
but loopback (or ipc://) without a secret is refused. libzmq drops the connection of
a peer that sends a frame above ``max_frame_bytes`` (ZMQ_MAXMSGSIZE); the server keeps
serving the others. A TCP endpoint also gets a UDP socket of the same address and
port, for the gradient datagrams of bounded-loss pushes (psring.comm.lossy).
"""

from __future__ import annotations

import json
import os
import resource
import socket
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import torch
import zmq

from psring.cluster.netns import inside_cluster
from psring.cluster.spec import in_network
from psring.comm.credits import Granter
from psring.comm.egress import Egress
from psring.comm.endpoints import HOW_TO_SET_A_SECRET, is_local
from psring.comm.ingress import Ingress
from psring.comm.protocol import (
    MAX_HEADER_BYTES,
    REQUESTS,
    SIGNATURE_BYTES,
    AuthenticationError,
    ProtocolError,
    decode,
    encode,
    error_frames,
)
from psring.comm.receiving import drain, receiving_socket
from psring.comm.tcp_timers import lower_rto_min
from psring.errors import ConfigError
from psring.records.runlog import host_name, usable_cores
from psring.servers.handler import Handler

POLL_MS = 100
#: how often a server with flows owed grants looks at them (psring.comm.credits.EXPIRE_S)
GRANT_POLL_MS = 5
#: the largest frame accepted when the model is not known at start (--max-frame-mb)
DEFAULT_MAX_FRAME_BYTES = 2**30
#: what a run's frames may carry beyond its shard's bytes (header, signature)
FRAME_SLACK = 2**20
#: bytes of datagrams the kernel may hold for the server's UDP socket (bounded-loss
#: pushes): a round's bursts from every worker, not dropped for want of room
UDP_BUFFER_BYTES = 32 << 20
#: datagrams read in one go before the ROUTER socket is looked at again
UDP_BATCH = 1024
#: the most datagrams read before a lossy_push is answered (a flood cannot hold it)
UDP_DRAIN = 1 << 20
#: records per second, per kind, of refused or dropped messages (each carries the
#: running count), so a flood of garbage can't flood the log
NOTES_PER_S = 10


class RequestLog:
    """servers.jsonl: one line per answered request, written in batches so logging
    stays off the request path's critical time (one write() per batch, O_APPEND)."""

    def __init__(self, path: Path | None, flush_s: float = 0.5):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else -1
        # every line names the host, so a run over emulated hosts shows where each
        # server was (psring.cluster.emulate)
        self.host = host_name()
        self.lines: list[str] = []
        self.flush_s = flush_s
        self.last = time.monotonic()

    def add(self, record: dict) -> None:
        if self.fd >= 0:
            self.lines.append(json.dumps({**record, "host": self.host}, separators=(",", ":")))
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


#: kept for callers of the old name: loopback TCP or ipc://
is_loopback = is_local


def private_to_cluster(endpoint: str) -> bool:
    """An emulated host's address, bound inside the emulated network, which nothing
    outside psring's own namespaces can reach (psring.cluster.emulate): no secret needed."""
    return in_network(endpoint) and inside_cluster()


def check_endpoint(endpoint: str, what: str = "--bind") -> None:
    u = urlparse(endpoint)
    if u.scheme not in ("tcp", "ipc") or (u.scheme == "tcp" and not u.hostname):
        raise ConfigError(f"{what} {endpoint!r} is not a ZeroMQ endpoint like "
                          f"tcp://127.0.0.1:5555 (or ipc:///path).")


#: the most ZeroMQ I/O threads a server starts by itself (--io-threads 0)
MAX_IO_THREADS = 4


def default_io_threads() -> int:
    """One ZeroMQ I/O thread per core it may use, at most MAX_IO_THREADS (--io-threads 0)."""
    return min(MAX_IO_THREADS, usable_cores())


def _udp_socket(endpoint: str) -> socket.socket | None:
    """A UDP socket on a tcp:// endpoint's address and port (None for ipc://, or where
    the port is taken for UDP: bounded-loss pushes then get an error)."""
    u = urlparse(endpoint)
    if u.scheme != "tcp" or u.hostname is None:
        return None
    try:
        return receiving_socket(u.hostname, u.port, UDP_BUFFER_BYTES)
    except OSError:
        return None


class Server:
    """``secret``: the shared secret (psring.comm.endpoints.load_secret); with one, only
    signed requests are served and every reply is signed. ``max_frame_bytes``: the
    largest frame libzmq accepts (ZMQ_MAXMSGSIZE) — fixed when the socket binds, since
    libzmq copies a socket's options into its listener then."""

    def __init__(self, bind: str, name: str = "server", log_path: Path | None = None,
                 secret: bytes | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, io_threads: int = 0,
                 credit_window: int = 0, rto_min_us: int = 0):
        check_endpoint(bind)
        if secret is None and not is_local(bind) and not private_to_cluster(bind):
            raise ConfigError(
                f"refusing to listen on {bind} without a shared secret: beyond loopback "
                f"anyone who reaches the port could change the model. To listen there, "
                f"{HOW_TO_SET_A_SECRET}; or bind loopback (tcp://127.0.0.1:PORT).")
        if max_frame_bytes < MAX_HEADER_BYTES + SIGNATURE_BYTES:
            raise ConfigError(f"the frame limit ({max_frame_bytes} bytes) must be at least "
                              f"{MAX_HEADER_BYTES + SIGNATURE_BYTES} bytes (one header).")
        if rto_min_us < 0:
            raise ConfigError(f"--control-rto-min-us is microseconds, >= 0 (got "
                              f"{rto_min_us}).")
        self.secret = secret
        self.max_frame_bytes = max_frame_bytes
        if io_threads < 0:
            raise ConfigError(f"--io-threads must be >= 0 (0 = one per core, at most "
                              f"{MAX_IO_THREADS}; got {io_threads}).")
        # libzmq gives each connection to one I/O thread, which does that connection's
        # kernel copies. With one, every worker's pushes and pulls are copied in turn
        # while the workers wait on the round; with one per core they are copied side by
        # side (docs/results/2026-11-23-emulation-runs-and-prediction.md, issue 10, fix 3).
        self.io_threads = io_threads or default_io_threads()
        self.ctx = zmq.Context(io_threads=self.io_threads)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Before bind: the listener keeps the options it was bound with (setting this
        # later would not apply to new connections, and re-binding drops connected ones).
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
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
        #: --control-rto-min-us: the least TCP retransmission timeout of the connections
        #: it accepts, where the kernel lets it be set (psring.comm.tcp_timers)
        self.rto_min_us = rto_min_us if rto_min_us and self.endpoint.startswith("tcp://") \
            and lower_rto_min(rto_min_us, port=urlparse(self.endpoint).port) else 0
        self.udp = _udp_socket(self.endpoint)
        self.ingress = Ingress(secret)
        if credit_window < 0:
            raise ConfigError(f"--credit-window is bytes, >= 0 (got {credit_window}).")
        #: --credit-window: grants to the bounded-loss senders (psring.comm.credits)
        self.granter = Granter(self.udp, credit_window, secret) \
            if credit_window and self.udp is not None else None
        #: a sync run's bounded-loss pulls, answered as datagrams (psring.comm.egress)
        self.egress = Egress(secret)
        self.handler = Handler(name, key=secret)
        self.log = RequestLog(log_path)
        self.invalid = 0  # answered with an error: malformed, or the handler failed
        self.unauthenticated = 0  # dropped: unsigned or badly signed (with a secret)
        self._notes: dict[str, list] = {}  # kind -> [window start, records in it]

    @property
    def stats(self) -> dict[str, int]:
        return {**self.handler.counts, "invalid": self.invalid,
                "unauthenticated": self.unauthenticated,
                **({k: v for k, v in self.ingress.counts.items() if v} if self.udp else {}),
                **(self.granter.counts if self.granter is not None else {}),
                **{k: v for k, v in self.egress.counts.items() if v},
                **({"control_rto_min_us": self.rto_min_us} if self.rto_min_us else {})}

    def serve(self, should_stop: Callable[[], bool]) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.udp is not None:
            poller.register(self.udp.fileno(), zmq.POLLIN)
        while not should_stop():
            # (flows owed grants are looked at often: a quiet one is written off soon)
            ready = dict(poller.poll(GRANT_POLL_MS if self.granter and self.granter.flows
                                     else POLL_MS))
            if self.granter is not None:
                self.granter.expire()
            if not ready:
                self.log.flush()
                continue
            if self.udp is not None and self.udp.fileno() in ready:
                self.read_datagrams(UDP_BATCH)
            if self.sock in ready:
                self.serve_one(self.sock.recv_multipart(copy=False))

    def read_datagrams(self, most: int) -> None:
        """Hand up to ``most`` datagrams waiting on the UDP socket to the ingress."""
        drain(self.udp, self.ingress, most,
              heard=self.granter.heard if self.granter is not None else None)
        for nack in self.ingress.take_nacks():  # (a worker misses some of a pull)
            self.egress.nacked(nack)

    def _note(self, record: dict) -> None:
        """Log a refused or dropped message, at most NOTES_PER_S records per kind."""
        now = time.monotonic()
        window = self._notes.setdefault(record["op"], [now, 0])
        if now - window[0] >= 1.0:
            window[:] = [now, 0]
        if window[1] < NOTES_PER_S:
            window[1] += 1
            self.log.add(record)

    def serve_one(self, frames: list) -> None:
        peer, body = frames[0].bytes, frames[1:]
        try:
            msg = decode(body, expect=REQUESTS, key=self.secret)
        except AuthenticationError as e:
            # Dropped unanswered: the sender learns nothing, not even that it was heard.
            self.unauthenticated += 1
            self._note({"time": time.time(), "server": self.handler.name,
                        "op": "unauthenticated", "count": self.unauthenticated,
                        "error": str(e)[:300]})
            return
        except ProtocolError as e:
            self.invalid += 1
            self._note({"time": time.time(), "server": self.handler.name, "op": "invalid",
                        "count": self.invalid, "error": str(e)[:300]})
            self.sock.send_multipart([peer, *error_frames(f"protocol error: {e}",
                                                          key=self.secret)], copy=False)
            return
        try:
            if msg.op == "lossy_push":
                msg = self._lossy(peer, msg)
                if msg is None:
                    return
            if msg.op == "pull" and msg.header["datagrams"]:
                self._datagram_pull(body[0], msg.header)
            replies = self.handler.handle(peer, msg)
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the server
            self.invalid += 1
            self._note({"time": time.time(), "server": self.handler.name, "op": "failed",
                        "count": self.invalid, "error": f"{type(e).__name__}: {e}"[:300]})
            self.sock.send_multipart([peer, *error_frames(
                f"the server could not handle this request ({type(e).__name__}: {e})",
                msg.header, self.secret)], copy=False)
            return
        for reply in replies:
            if reply.piece is not None:  # a ready range of a pull, as datagrams
                p = reply.piece
                self.egress.piece(p.header, p.numel, p.start, p.values)
                self.log.add(reply.record)
                continue
            if reply.frames is None:  # a dropped replay: only noted
                self._note(reply.record)
                continue
            self.sock.send_multipart([reply.peer, *reply.frames], copy=False)
            self.log.add(reply.record)

    def _lossy(self, peer: bytes, msg):
        """A lossy_push: the push its datagrams make (psring.comm.lossy), or None when a
        resend was asked for instead. Every datagram that came before it is read first:
        the lossy_push is its push's deadline."""
        if self.udp is None:
            raise ProtocolError("this server has no UDP port (its endpoint is not "
                                "tcp://): bounded-loss pushes need one")
        self.read_datagrams(UDP_DRAIN)
        if self.granter is not None:  # (its datagrams are all sent: it waits for nothing)
            self.granter.done((msg.header["worker"], msg.header["transfer"]))
        done = self.ingress.complete(msg)
        if not isinstance(done, tuple):
            return done
        need, missing = done
        h = msg.header
        frames = encode("resend", {"run": h["run"], "worker": h["worker"], "seq": h["seq"],
                                   "shard": h["shard"], "need": need},
                        [torch.tensor(missing, dtype=torch.int32)], self.secret)
        self.sock.send_multipart([peer, *frames], copy=False)
        self.log.add({"time": time.time(), "server": self.handler.name, "op": "resend",
                      "worker": h["worker"], "step": h["step"], "offset": h["offset"],
                      "missing": len(missing), "need": need})
        return None

    def _datagram_pull(self, frame: zmq.Frame, h: dict) -> None:
        """A pull that asks for datagrams: learn where its worker's go (the address
        its request came from, the port it names), or answer it over TCP (no UDP
        socket here, or no address: h["datagrams"] = 0)."""
        if not 0 < h["datagrams"] < 65536 or h["pace"] < 0 or h["burst"] < 0:
            raise ProtocolError(f"a pull's datagram port {h['datagrams']}, pace "
                                f"{h['pace']} or burst {h['burst']} is out of range")
        try:
            host = frame.get("Peer-Address") if isinstance(frame, zmq.Frame) else None
        except zmq.ZMQError:  # (not over TCP)
            host = None
        if self.udp is None or not host:
            h["datagrams"] = 0
            return
        self.egress.learn(h["run"], h["worker"], host, h["datagrams"], h["pace"], h["burst"])

    def close(self) -> None:
        if getattr(self, "egress", None) is not None:
            self.egress.close()
        if hasattr(self, "log"):
            # peak memory (Linux reports ru_maxrss in KiB): the load tests bound it
            peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            self.log.add({"time": time.time(), "server": self.handler.name, "op": "stats",
                          **self.stats, "max_rss_mb": round(peak_mb, 1)})
            self.log.close()
        self.sock.close(linger=0)
        if getattr(self, "udp", None) is not None:
            self.udp.close()
        self.ctx.term()
