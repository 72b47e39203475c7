"""The parameter-server client a worker uses (ps, async-ps, byteps): one ZeroMQ DEALER
socket per server, requests matched to replies by (shard, seq), replies validated
(psring.comm.protocol) before use, pulls answered in streamed pieces.

    client = PSClient(["tcp://127.0.0.1:5555"], run="r1", worker=0, timeout=60)
    key = client.send(0, "push", {"step": 0, "offset": 0}, [grad])
    client.pull(0, min_version=1, numel=n, on_piece=copy_into_place)
    Replies(client, [key], "a gradient push").wait()
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Callable

import torch
import zmq

from psring.comm.lossy import LossySender, Marks
from psring.comm.protocol import (
    DTYPE_NAMES,
    REPLIES,
    AuthenticationError,
    Message,
    ProtocolError,
    decode,
    encode,
)
from psring.comm.pulls import DatagramPulls
from psring.comm.tcp_timers import CONTROL_RTO_MIN_US, lower_rto_min, tcp_peers
from psring.errors import PsringError


class PSClient:
    """One DEALER socket per server; requests are matched to replies by (shard, seq).
    With ``secret`` requests are signed and replies verified."""

    def __init__(self, addrs: list[str], run: str, worker: int, timeout: float,
                 secret: bytes | None = None, pace_bits: float | None = None,
                 marks: Marks | None = None, credits: bool = False,
                 datagram_pulls: bool = False, pace_burst: int = 0):
        self.addrs = addrs
        self.run = run
        self.worker = worker
        self.timeout = timeout
        self.key = secret
        #: --switch priority: the bounded-loss datagrams' priority marks
        self.marks = marks
        #: --credit-window: bounded-loss senders wait for the servers' grants
        self.credits = credits
        self.ctx = zmq.Context()
        self.socks = []
        self.poller = zmq.Poller()
        for addr in addrs:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)  # never hang on exit with unsent messages
            s.connect(addr)
            self.poller.register(s, zmq.POLLIN)
            self.socks.append(s)
        self.index = {s: k for k, s in enumerate(self.socks)}
        #: the shards whose connection has had its least retransmission timeout lowered:
        #: once this client pushes with bounded loss, its TCP carries only control
        #: (psring.comm.tcp_timers; the servers' side: --control-rto-min-us)
        self._timed: set[int] = set()
        # Seqs start at the clock (µs), so a client's seqs are above those of any earlier
        # client of the same (run, worker), which a server with a secret drops as replays.
        self.seq = time.time_ns() // 1000
        # ZeroMQ sockets are not thread-safe: a strategy that sends from a thread of its
        # own (byteps's pusher) does so under this lock, as every send and poll here does.
        # A poll holds it up to 1 s: byteps polls only once a step's parts are all sent,
        # so its pusher never waits behind one.
        self.lock = threading.RLock()
        self.pending: set[tuple[int, int]] = set()  # requests sent, not yet answered
        self.replies: dict[tuple[int, int], Message] = {}
        # pulls answered in pieces: key -> [elements still expected, callback per piece]
        self._streams: dict[tuple[int, int], list] = {}
        self.bytes_sent = 0
        self.bytes_recv = 0
        # bounded-loss pushes (send_lossy): a datagram sender per shard, the pushes
        # not yet acknowledged (key -> [transfer, lossy_push header]), packets resent;
        # pushes whose datagrams are out, and a pipe that wakes a waiting poll for them
        self._senders: dict[int, LossySender] = {}
        self.pace_bits = pace_bits  # the datagrams' pace: the host's link rate
        self.pace_burst = pace_burst  # bytes they may run ahead of it (its port's share)
        self._ready: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._lossy: dict[tuple[int, int], tuple] = {}
        #: each sent lossy_push's (shard, seq) -> the push's first key
        self._attempts: dict[tuple[int, int], tuple[int, int]] = {}
        self.resent = 0
        self.lossy_elements = self.lossy_delivered = 0
        #: lossy pushes whose lossy_push is not sent yet, and the pulls held behind them
        #: per shard (:meth:`pull`)
        self._unannounced: set[tuple[int, int]] = set()
        self._held: dict[int, list[tuple[tuple[int, int], dict]]] = {}
        self._renamed: dict[tuple[int, int], tuple[int, int]] = {}  # held pulls, as sent
        #: a sync run's bounded-loss pulls, answered as datagrams (psring.comm.pulls):
        #: the pulls that ask for them, by key -> (offset, min_version); the sent seq
        #: of each -> its key
        self.pulls = DatagramPulls(addrs, run, worker, secret) if datagram_pulls else None
        if self.pulls is not None:
            self.poller.register(self.pulls.fileno(), zmq.POLLIN)
        self._by_datagram: dict[tuple[int, int], tuple[int, int]] = {}
        self._sent_as: dict[int, tuple[int, int]] = {}

    def send(self, shard: int, op: str, fields: dict, tensors=()) -> tuple[int, int]:
        with self.lock:
            self._send_ready()  # (lossy_pushes whose datagrams are out go first)
            self.seq += 1
            self._send_frames(shard, op, fields, tensors)
            self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
            self.pending.add((shard, self.seq))
            return shard, self.seq

    def _send_frames(self, shard: int, op: str, fields: dict, tensors=()) -> None:
        """Under the lock: one request under the current seq."""
        frames = encode(op, {"run": self.run, "worker": self.worker, "seq": self.seq,
                             "shard": shard, **fields}, tensors, self.key)
        self.socks[shard].send_multipart(frames, copy=False)

    def push(self, shard: int, fields: dict, grad: torch.Tensor,
             tolerance: float = 0.0) -> tuple[int, int]:
        """A gradient push: reliable (a ``push`` message), or with ``tolerance`` > 0 a
        bounded-loss one (:meth:`send_lossy`)."""
        if tolerance:
            return self.send_lossy(shard, fields, grad, tolerance)
        return self.send(shard, "push", fields, [grad])

    def mark(self, early_recv: int = 0) -> tuple[int, int, int, int]:
        """The counters at a step's start, for :meth:`account` at its end; bytes
        already received for this step (``early_recv``) count in it."""
        return (self.bytes_sent, self.bytes_recv - early_recv, self.lossy_elements,
                self.lossy_delivered)

    def account(self, stats, mark: tuple[int, int, int, int]) -> None:
        """A step's bytes into its ``stats`` (psring.strategies.base.StepStats), and
        with bounded-loss pushes the fraction of their elements delivered."""
        stats.bytes_sent = self.bytes_sent - mark[0]
        stats.bytes_recv = self.bytes_recv - mark[1]
        pushed = self.lossy_elements - mark[2]
        if pushed:  # --loss-tolerance: what of the gradients arrived
            stats.extra["delivered"] = round((self.lossy_delivered - mark[3]) / pushed, 6)

    def send_lossy(self, shard: int, fields: dict, grad: torch.Tensor,
                   tolerance: float) -> tuple[int, int]:
        """A push whose gradient goes as datagrams (psring.comm.lossy), at most the
        fraction ``tolerance`` of it allowed to be lost; answered by an ack like a push
        (its ``delivered`` says how much arrived), after as many resends as it takes."""
        with self.lock:
            sender = self._senders.get(shard)
            if sender is None:
                sender = self._senders[shard] = LossySender(
                    self.addrs[shard], self.run, self.worker, self.key, self._datagrams_sent,
                    self.pace_bits, self.marks, self.credits, burst_bytes=self.pace_burst)
            self.seq += 1
            key = (shard, self.seq)
            header = {"run": self.run, "worker": self.worker, "seq": self.seq,
                      "shard": shard, **fields, "numel": grad.numel(), "packets": 0,
                      "dtype": DTYPE_NAMES[grad.dtype], "tolerance": tolerance,
                      "transfer": self.seq}
            self._lossy[key] = [None, header]
            transfer = sender.send(self.seq, shard, grad, token=key,
                                   offset=fields.get("offset", 0))
            self._lossy[key][0] = transfer
            self._unannounced.add(key)
            header["packets"] = transfer.count
            self.bytes_sent += grad.numel() * grad.element_size()
            self.lossy_elements += grad.numel()
            self.pending.add(key)
            return key

    def _datagrams_sent(self, key: object) -> None:
        """(A sender's thread) a job's datagrams are out: whoever holds the lock next
        sends its lossy_push (a ZeroMQ socket is used under the lock only)."""
        self._ready.append(key)
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the poll wakes anyway
        except OSError:
            pass  # (closed: the client is closing)

    def _send_ready(self) -> None:
        """Under the lock: the lossy_push of every push whose datagrams are out, each
        under a seq taken now (a server with a secret takes a worker's requests in seq
        order: a pull sent while the datagrams were still leaving has a lower one),
        which answers to the push's first key."""
        while self._ready:
            key = self._ready.popleft()
            if key in self._lossy:
                self.seq += 1
                header = self._lossy[key][1]
                header["seq"] = self.seq
                self._attempts[(key[0], self.seq)] = key
                self.socks[key[0]].send_multipart(encode("lossy_push", header, (), self.key))
            self._unannounced.discard(key)
            self._send_held(key[0])

    def _send_held(self, shard: int) -> None:
        """Under the lock: the pulls held for ``shard``, once no lossy_push to it is
        still unsent, each under a seq taken now that answers to its key."""
        if not self._held.get(shard) or self._leaving(shard):
            return
        for key, fields in self._held.pop(shard):
            self.seq += 1
            self._renamed[(shard, self.seq)] = key  # (every piece of the answer bears it)
            self._expect(key, self.seq)
            self._send_frames(shard, "pull", fields)

    def _expect(self, key: tuple[int, int], seq: int) -> None:
        """Under the lock: the pull ``key``, about to leave under ``seq``, is answered
        as datagrams if it asked for them."""
        if key in self._by_datagram:
            self.pulls.expect(seq, key[0], self._streams[key][0])
            self._sent_as[seq] = key

    def _leaving(self, shard: int) -> bool:
        """A lossy push to ``shard`` whose lossy_push is not sent yet."""
        return any(k[0] == shard for k in self._unannounced)

    def _resend(self, key: tuple[int, int], msg: Message) -> None:
        """The server misses more of a lossy push than it may: send the packets it
        asks for again, then (_send_ready) the lossy_push again, under a new seq."""
        transfer, _ = self._lossy[key]
        missing = msg.tensors[0].tolist() if msg.tensors else []
        sent = self._senders[key[0]].resend(transfer, missing, msg.header["need"], key)
        self.resent += sent
        self.bytes_sent += sent * transfer.per * transfer.grad.element_size()

    def pull(self, shard: int, min_version: int, numel: int,
             on_piece: Callable[[Message], None], at: int | None = None,
             **fields: int) -> tuple[int, int]:
        """Request ``numel`` elements of a shard (all of it; or ``lo``/``hi``, a range of
        the flat vector, in ``fields``); ``on_piece`` gets each ``params`` piece as it
        arrives (the server streams ranges as they are updated); the request is answered
        when the pieces cover what was asked. Made while a lossy push to the shard is
        still leaving, it is sent behind that push's lossy_push. ``at``: the flat
        offset of what is asked, given by a sync strategy: with datagram pulls the
        answer may come as one piece of datagrams, at ``min_version``."""
        with self.lock:  # (the piece may arrive before the stream is known otherwise)
            self._send_ready()
            fields = {"min_version": min_version, **fields}
            if self.pulls is not None and at is not None:
                fields.update(datagrams=self.pulls.port, pace=int(self.pace_bits or 0),
                              burst=self.pace_burst)
            self.seq += 1
            key = (shard, self.seq)
            self.pending.add(key)
            self._streams[key] = [numel, on_piece]
            if "datagrams" in fields:
                self._by_datagram[key] = (at, min_version)
            if self._leaving(shard):
                # behind this worker's lossy_pushes, as a pull is behind its pushes over
                # TCP: sent before them, it would have the server stream the parameters
                # of the buckets already in ahead of those pushes' acks
                self._held.setdefault(shard, []).append((key, fields))
            else:
                self._expect(key, self.seq)
                self._send_frames(shard, "pull", fields)
        return key

    def wait(self, keys: list[tuple[int, int]], what: str,
             timeout: float | None = None) -> list[Message]:
        deadline = time.monotonic() + (timeout or self.timeout)
        while any(k not in self.replies for k in keys):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted({self.addrs[k[0]] for k in keys if k not in self.replies})
                if self.resent and any(k in self.pending for k in self._lossy):
                    raise PsringError(
                        f"worker {self.worker}: no answer to {what} from parameter "
                        f"server(s) {', '.join(missing)} within "
                        f"{timeout or self.timeout:.0f} s: they still missed this worker's "
                        f"bounded-loss pushes after it sent {self.resent} datagrams again; "
                        f"its datagrams are not getting through (a switch port too shallow "
                        f"for the senders' bursts, or more loss than resends recover). Give "
                        f"--credit-window SIZE (the servers pace their senders), a deeper "
                        f"--link-buffer, a larger --loss-tolerance, or drop "
                        f"--loss-tolerance (TCP).")
                if any(k in self._by_datagram for k in keys if k not in self.replies):
                    raise PsringError(
                        f"worker {self.worker}: a pull of parameters from parameter "
                        f"server(s) {', '.join(missing)} was not complete within "
                        f"{timeout or self.timeout:.0f} s after {self.pulls.counts['pull_nacks']}"
                        f" resend requests: its datagrams (UDP, from the server to this "
                        f"worker's port {self.pulls.port}) are not getting through, or the "
                        f"server stopped. Let UDP through between them, or drop "
                        f"--loss-tolerance (pulls and pushes over TCP).")
                secret = ("the same shared secret as this worker" if self.key else
                          "no shared secret, as this worker has none")
                raise PsringError(
                    f"worker {self.worker}: no answer to {what} from parameter server(s) "
                    f"{', '.join(missing)} within {timeout or self.timeout:.0f} s; check "
                    f"that they run, are reachable and have {secret} (a server with a "
                    f"secret drops unsigned messages unanswered: --secret-file or "
                    f"PSRING_SECRET), or raise --timeout.")
            with self.lock:
                self._send_ready()
                due = self.pulls.due() if self.pulls is not None else None
                wait = min(left, 1.0, 1.0 if due is None else due)
                for sock, _ in self.poller.poll(wait * 1000):
                    if sock == self._wake_r:  # a lossy push's datagrams are out
                        os.read(self._wake_r, 4096)
                    elif isinstance(sock, zmq.Socket):
                        self._receive(sock)
                if self.pulls is not None:
                    self._take_pulls()
                self._send_ready()
        return [self.replies.pop(k) for k in keys]

    def _receive(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart(copy=False)
        shard = self.index[sock]
        if self.lossy_elements and shard not in self._timed:
            self._timed.add(shard)
            lower_rto_min(CONTROL_RTO_MIN_US, peers=tcp_peers(self.addrs[shard]))
        try:
            msg = decode(frames, expect=REPLIES, key=self.key)
        except AuthenticationError as e:
            raise PsringError(f"worker {self.worker}: a reply from parameter server "
                              f"{self.addrs[shard]} failed authentication ({e}); the server "
                              f"and this worker must share the same secret (--secret-file "
                              f"or PSRING_SECRET).") from None
        except ProtocolError as e:
            raise PsringError(f"worker {self.worker}: malformed reply from "
                              f"{self.addrs[shard]}: {e}") from None
        h = msg.header
        if msg.op == "error":
            raise PsringError(f"parameter server {self.addrs[shard]} refused a request of "
                              f"worker {self.worker}: {h['message']}")
        sent = (shard, h["seq"])
        key = self._attempts.pop(sent, None) or self._renamed.get(sent, sent)
        if h["run"] != self.run or h["worker"] != self.worker or key not in self.pending:
            return  # a late answer meant for an earlier run, or for nothing asked
        if key in self._lossy:
            if msg.op == "resend":
                self._resend(key, msg)
                return
            del self._lossy[key]  # answered: its datagrams are not needed again
            if msg.op == "ack":
                self.lossy_delivered += max(0, h["delivered"])
        self._answer(key, sent, msg)

    def _answer(self, key: tuple[int, int], sent: tuple[int, int], msg: Message) -> None:
        """Under the lock: a reply to request ``key`` (sent as ``sent``), or a piece of
        the answer to a pull."""
        shard = key[0]
        self.bytes_recv += sum(t.numel() * t.element_size() for t in msg.tensors)
        stream = self._streams.get(key)
        if stream is None:
            self.pending.discard(key)
            self.replies[key] = msg
            return
        if msg.op != "params" or sum(t.numel() for t in msg.tensors) > stream[0]:
            raise PsringError(f"worker {self.worker}: parameter server {self.addrs[shard]} "
                              f"answered a pull with more than the shard")
        stream[1](msg)  # copy this piece into place now, while the others arrive
        stream[0] -= msg.tensors[0].numel()
        if stream[0] == 0:
            del self._streams[key]
            self._renamed.pop(sent, None)
            if self._by_datagram.pop(key, None) is not None:  # (answered either way)
                self.pulls.forget(sent[1])
                self._sent_as.pop(sent[1], None)
            self.pending.discard(key)
            self.replies[key] = msg

    def _take_pulls(self) -> None:
        """Under the lock: pulls whose datagrams have all arrived, each one piece at its
        version; resend requests for those quiet too long."""
        for seq, tensor in self.pulls.receive():
            key = self._sent_as.get(seq)
            if key is None or key not in self._streams:
                continue  # (answered over TCP meanwhile)
            at, version = self._by_datagram[key]
            header = {"op": "params", "run": self.run, "worker": self.worker, "seq": seq,
                      "shard": key[0], "version": version, "offset": at,
                      "tensors": [[DTYPE_NAMES[tensor.dtype], [tensor.numel()]]]}
            self._answer(key, (key[0], seq), Message(header, [tensor]))
        if self.pulls.due() == 0:
            self.pulls.ask_again()

    def close(self) -> None:
        with self.lock:  # (never under a send of another thread)
            for sender in self._senders.values():
                sender.close()
            if self.pulls is not None:
                self.pulls.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            for s in self.socks:
                s.close(linger=0)
            self.ctx.term()


class Replies:
    """The handle for requests in flight: wait() blocks until all are answered."""

    def __init__(self, client: PSClient, keys: list[tuple[int, int]], what: str,
                 on_done: Callable[[list[Message]], None] | None = None):
        self.client, self.keys, self.what, self.on_done = client, keys, what, on_done
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        msgs = self.client.wait(self.keys, self.what)
        self.done = True
        if self.on_done is not None:
            self.on_done(msgs)
