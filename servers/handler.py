"""A parameter server's request handler: each request validated and answered, no sockets.

``Handler.handle(peer, message)`` takes one validated message and returns the replies
to send now, as ``(peer, frames, record)``; a reply may be held back (a pull waiting
for the next version) and released by a later request. The socket loop
(``psring.servers.server``) does the I/O; what a request does to its run (sums, the
version, backup workers' choice) is psring.servers.state's, retried and replayed pushes
are psring.servers.acks's, copies for checkpoints psring.servers.snapshots's. Keeping
the rules out of the sockets makes them testable without a network.

sync   a pull for ``min_version = s + 1`` is answered range by range: each range is
       sent as soon as it is updated (so replies overlap the summing of the rest), the
       pull is complete when the whole shard has been sent.
async  a pull is answered at once; with ``max_staleness S`` (on shard 0, which admits
       workers for all shards) only if no worker could then see more than S updates
       between its pull and its push.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from psring.comm.protocol import (
    DTYPE_NAMES,
    SNAPSHOT_NEWEST,
    SNAPSHOT_NOW,
    Message,
    encode,
    error_frames,
)
from psring.servers.acks import Replays
from psring.servers.replies import Deferred, Piece, Reply, RequestError
from psring.servers.state import RunState

#: pulls held back at once, beyond which new ones are refused (bounded memory)
MAX_DEFERRED = 4096


class Handler:
    """``key``: the shared secret replies are signed with (None: unsigned).
    ``check_replays``: drop requests whose seq is not new for their (run, worker) — on
    by default with a key (unsigned senders could forge any seq anyway)."""

    def __init__(self, name: str = "server", key: bytes | None = None,
                 check_replays: bool | None = None):
        self.name = name
        self.key = key
        self.check_replays = key is not None if check_replays is None else check_replays
        self.state: RunState | None = None
        self.deferred: list[Deferred] = []
        self.snapshot_waits: list[Deferred] = []  # snapshot requests for a later version
        self.counts = {"requests": 0, "errors": 0, "replays": 0, "retries": 0}
        self.replays = Replays()  # (check_replays)

    # ------------------------------------------------------------------ dispatch
    def handle(self, peer: bytes, msg: Message) -> list[Reply]:
        self.counts["requests"] += 1
        t0 = time.perf_counter()
        try:
            if msg.op == "push":
                again = self._retried(peer, msg, t0)
                if again is not None:
                    return [again]
            if self.check_replays and not self.replays.fresh(msg.header):
                self.counts["replays"] += 1
                return [Reply(peer, None, self._record(msg, t0, op="replay",
                                                       seq=msg.header["seq"],
                                                       count=self.counts["replays"]))]
            replies = getattr(self, "_" + msg.op)(peer, msg, t0)
        except RequestError as e:
            self.counts["errors"] += 1
            return [Reply(peer, error_frames(str(e), msg.header, self.key),
                          self._record(msg, t0, error=str(e)))]
        return replies + self._release() + self._release_snapshots()

    def _retried(self, peer: bytes, msg: Message, t0: float) -> Reply | None:
        """The remembered ack when this push repeats an acknowledged one; None if new."""
        st, h = self.state, msg.header
        if st is None or st.run != h["run"]:
            return None
        numel = msg.tensors[0].numel() if len(msg.tensors) == 1 else -1
        frames = st.acks.retried(h, numel)
        if frames is None:
            return None
        self.counts["retries"] += 1
        return Reply(peer, frames, self._record(msg, t0, op="retry", seq=h["seq"]))

    def _record(self, msg: Message, t0: float, wait: float = 0.0, **extra: Any) -> dict:
        h = msg.header
        return {"time": time.time(), "server": self.name, "op": h["op"],
                "worker": h["worker"], "step": h.get("step"),
                "bytes_in": sum(t.numel() * t.element_size() for t in msg.tensors),
                "wait_s": round(wait, 7), "apply_s": round(time.perf_counter() - t0, 7),
                "version": self.state.version if self.state else None, **extra}

    def _reply(self, peer: bytes, msg: Message, op: str, fields: dict, tensors=(),
               t0: float = 0.0, wait: float = 0.0, **extra: Any) -> Reply:
        h = msg.header
        frames = encode(op, {"run": h["run"], "worker": h["worker"], "seq": h["seq"],
                             "shard": h["shard"], **fields}, tensors, self.key)
        out = sum(t.numel() * t.element_size() for t in tensors)
        return Reply(peer, frames, self._record(msg, t0 or time.perf_counter(), wait,
                                                bytes_out=out, **extra))

    def _current(self, msg: Message) -> RunState:
        st = self.state
        if st is None or st.run != msg.header["run"]:
            raise RequestError(f"{self.name} holds no run {msg.header['run']!r}; worker 0 "
                               f"must initialize it first")
        w = msg.header["worker"]
        if not 0 <= w < st.workers:
            raise RequestError(f"worker {w} is outside 0..{st.workers - 1}")
        if msg.header["shard"] != st.shard:
            raise RequestError(f"this server holds shard {st.shard} of run {st.run!r}, "
                               f"not shard {msg.header['shard']}")
        return st

    # ------------------------------------------------------------------ ops
    def _init(self, peer: bytes, msg: Message, t0: float) -> list[Reply]:
        h = msg.header
        self.state = RunState.from_init(h, msg.tensors)
        self.snapshot_waits = [d for d in self.snapshot_waits if d.msg.header["run"] == h["run"]]
        # pulls held for an older run will never be answered: refuse them now
        stale = [d for d in self.deferred if d.msg.header["run"] != h["run"]]
        self.deferred = [d for d in self.deferred if d.msg.header["run"] == h["run"]]
        for d in self.deferred:
            d.part = None  # validated again against this run's shard (_fits)
        replies = [Reply(d.peer, error_frames(f"run {d.msg.header['run']!r} was replaced",
                                              d.msg.header, self.key), self._record(d.msg, t0))
                   for d in stale]
        return replies + [self._reply(peer, msg, "ok", {}, t0=t0)]

    def _push(self, peer: bytes, msg: Message, t0: float) -> list[Reply]:
        st = self._current(msg)
        start = self._check_push(st, msg)
        h, grad = msg.header, msg.tensors[0]
        w = h["worker"]
        late = st.backups and h["step"] < st.version  # (its step went on without it)
        got = (0 if late else st.received.get(w, 0)) + grad.numel()
        if got > st.store.numel:
            raise RequestError(f"worker {w} pushed more than one step's gradient for step "
                               f"{h['step']}")
        # workers push only after their first pull was answered: a push means the run
        # has started, even for a client that never asked for parameters
        st.started = True
        staleness, dropped = 0, False
        if st.mode == "sync":
            dropped = st.push_sync(h, grad, start, got)
        else:
            staleness = st.push_async(w, grad, start, got)
        fields = {"version": st.version, "staleness": staleness}
        if dropped:  # (only then: without backups the ack is as it always was)
            fields["dropped"] = True
        if "delivered" in h:  # a lossy_push's (psring.comm.lossy): what arrived of it
            fields["delivered"] = h["delivered"]
        ack = self._reply(peer, msg, "ack", fields, t0=t0, staleness=staleness,
                          **({"dropped": True} if dropped else {}))
        st.acks.remember(h, grad.numel(), ack.frames)
        return [ack]

    def _check_push(self, st: RunState, msg: Message) -> int:
        """A push's tensor, range and seq, checked before use; returns its offset in the
        shard."""
        h = msg.header
        if len(msg.tensors) != 1 or msg.tensors[0].dim() != 1 \
                or msg.tensors[0].dtype != st.wire_dtype:
            raise RequestError(f"a push carries one 1-d {DTYPE_NAMES[st.wire_dtype]} tensor "
                               f"(the run's wire dtype)")
        grad = msg.tensors[0]
        start = h["offset"] - st.store.lo
        if start < 0 or start + grad.numel() > st.store.numel or grad.numel() == 0:
            raise RequestError(f"push [{h['offset']}, {h['offset'] + grad.numel()}) is outside "
                               f"this shard [{st.store.lo}, {st.store.hi})")
        st.acks.check_new(h)  # (a remembered retry was answered already: _retried)
        return start

    def _pull(self, peer: bytes, msg: Message, t0: float) -> list[Reply]:
        if len(msg.tensors) != 0:
            raise RequestError("a pull carries no tensors")
        st = self.state
        part = None
        if st is not None and st.run == msg.header["run"]:
            self._current(msg)  # validates the worker index
            part = self._wanted(st, msg)  # and the range
            if part is None:
                raise RequestError(f"pull of [{msg.header['lo']}, {msg.header['hi']}) is not "
                                   f"inside this shard [{st.store.lo}, {st.store.hi})")
        if len(self.deferred) >= MAX_DEFERRED:
            raise RequestError(f"{self.name} already holds {MAX_DEFERRED} pulls")
        self.deferred.append(Deferred(peer, msg, time.perf_counter(), part=part))
        return []  # answered by _release, now or later

    def _leave(self, peer: bytes, msg: Message, t0: float) -> list[Reply]:
        st = self._current(msg)
        # A finished worker's last (prefetched) pull made it "in flight"; it will never
        # push again, so it must not hold back the others' admission.
        w = msg.header["worker"]
        st.in_flight.discard(w)
        # and its pull still held back will never be waited for
        self.deferred = [d for d in self.deferred
                         if not (d.msg.header["run"] == st.run and d.msg.header["worker"] == w)]
        return [self._reply(peer, msg, "ok", {}, t0=t0)]

    # ------------------------------------------------------------------ backup workers
    def _commit(self, peer: bytes, msg: Message, t0: float) -> list[Reply]:
        """Shard 0 counts the workers whose pushes of the step are all in; the first
        workers - backups are the step's, each answered once they are all known."""
        st, h = self._current(msg), msg.header
        if not st.backups or st.shard != 0:
            raise RequestError("commit goes to shard 0 of a synchronous run with backup "
                               "workers (init's backups > 0)")
        if h["step"] > st.version:
            raise RequestError(f"commit for step {h['step']} but the server is at step "
                               f"{st.version}")
        if h["step"] < st.version or st.chosen is not None:  # the step took others
            return [self._chosen(peer, msg, t0, list(st.chosen or ()))]
        made = st.commit(h["worker"], h["step"], Deferred(peer, msg, t0))
        if made is None:
            return []
        chosen, waits = made
        return [self._chosen(d.peer, d.msg, d.since, chosen, step_version=h["step"])
                for d in waits]

    def _chosen(self, peer: bytes, msg: Message, t0: float, chosen: list[int],
                step_version: int | None = None) -> Reply:
        version = self.state.version if step_version is None else step_version
        taken = msg.header["worker"] in chosen and msg.header["step"] == version
        return self._reply(peer, msg, "chosen", {"step": msg.header["step"],
                                                 "workers": chosen, "taken": taken},
                           t0=t0, wait=time.perf_counter() - t0, taken=taken,
                           **({"chosen": chosen} if taken else {}))

    def _choose(self, peer: bytes, msg: Message, t0: float) -> list[Reply]:
        """Another shard learns the step's workers from one of them."""
        st, h = self._current(msg), msg.header
        if not st.backups:
            raise RequestError("choose is for a synchronous run with backup workers")
        if h["step"] > st.version:
            raise RequestError(f"choose for step {h['step']} but the server is at step "
                               f"{st.version}")
        st.choose(h["step"], h["workers"])
        return [self._reply(peer, msg, "ok", {}, t0=t0, chosen=h["workers"])]

    # ------------------------------------------------------------------ checkpoints
    def _snapshot(self, peer: bytes, msg: Message, t0: float) -> list[Reply]:
        st = self._current(msg)
        if len(msg.tensors) != 0:
            raise RequestError("a snapshot request carries no tensors")
        v = msg.header["version"]
        if v == SNAPSHOT_NOW:  # (async; or sync between a worker's steps: psring.servers.store)
            st.snapshots.keep(st.store, st.version)
            v = st.version
        elif v == SNAPSHOT_NEWEST and st.snapshots:
            v = max(st.snapshots)
        if v in st.snapshots:
            return [self._state_reply(st, peer, msg, t0, v)]
        # (SNAPSHOT_NEWEST before any copy: held until the first, like a later version)
        if v != SNAPSHOT_NEWEST and (v < 0 or v <= st.version):
            raise RequestError(f"no copy of version {v} is kept (the server is at version "
                               f"{st.version} and keeps {sorted(st.snapshots) or 'none'}; it "
                               f"copies versions that are multiples of {st.snapshots.every} "
                               f"and {st.snapshots.last})")
        if len(self.snapshot_waits) >= MAX_DEFERRED:
            raise RequestError(f"{self.name} already holds {MAX_DEFERRED} snapshot requests")
        self.snapshot_waits.append(Deferred(peer, msg, t0))
        return []

    def _state_reply(self, st: RunState, peer: bytes, msg: Message, t0: float,
                     version: int) -> Reply:
        return self._reply(peer, msg, "state", {"version": version},
                           st.snapshots.tensors(version), t0=t0)

    def _release_snapshots(self) -> list[Reply]:
        st = self.state
        if st is None or not self.snapshot_waits or not st.snapshots:
            return []
        out, keep = [], []
        for d in self.snapshot_waits:
            v = d.msg.header["version"]
            v = max(st.snapshots) if v == SNAPSHOT_NEWEST else v
            if d.msg.header["run"] == st.run and v in st.snapshots:
                out.append(self._state_reply(st, d.peer, d.msg, d.since, v))
            else:
                keep.append(d)
        self.snapshot_waits = keep
        return out

    @staticmethod
    def _wanted(st: RunState, msg: Message) -> tuple[int, int] | None:
        """The part of the shard a pull asks for, [a, b) relative to the shard: all of
        it, or flat elements [lo, hi) when hi > 0; None when that is not in the shard."""
        lo, hi, store = msg.header["lo"], msg.header["hi"], st.store
        if hi == 0 and lo == 0:
            return 0, store.numel
        return (lo - store.lo, hi - store.lo) if store.lo <= lo < hi <= store.hi else None

    # ------------------------------------------------------------------ deferred pulls
    def _release(self) -> list[Reply]:
        st = self.state
        if st is None or not self.deferred:
            return []
        out, keep = [], []
        for d in self.deferred:
            if d.msg.header["run"] != st.run:
                keep.append(d)
            elif d.part is None and not self._fits(st, d):
                # held before init, when the worker count, shard and range were unknown
                out.append(Reply(d.peer, error_frames(
                    f"worker {d.msg.header['worker']}'s pull of shard {d.msg.header['shard']} "
                    f"(elements [{d.msg.header['lo']}, {d.msg.header['hi']})) does not fit "
                    f"this run: workers 0..{st.workers - 1}, shard {st.shard} of "
                    f"[{st.store.lo}, {st.store.hi})",
                    d.msg.header, self.key), self._record(d.msg, time.perf_counter())))
            elif self._can_answer(st, d.msg):
                out.extend(self._answer_pull(st, d))
            else:
                if st.mode == "sync" and st.version == d.msg.header["min_version"] - 1:
                    out.extend(self._stream(st, d, st.done[d.done_seen:], st.version + 1))
                    d.done_seen = len(st.done)
                keep.append(d)
        self.deferred = keep
        return out

    def _fits(self, st: RunState, d: Deferred) -> bool:
        """Validate, once, a pull held before init: worker, shard and range (d.part)."""
        h = d.msg.header
        if 0 <= h["worker"] < st.workers and h["shard"] == st.shard:
            d.part = self._wanted(st, d.msg)
        return d.part is not None

    def _can_answer(self, st: RunState, msg: Message) -> bool:
        if not st.started:
            # Start together: the first pulls are held until every worker has asked,
            # as torch.distributed's rendezvous does for allreduce. Worker processes
            # start up to hundreds of milliseconds apart; without this an async run's
            # first workers would run a short run's steps alone, unraced (measuring
            # neither contention nor staleness), and a sync run's first worker would
            # count the last one's start-up as training time.
            asking = {d.msg.header["worker"] for d in self.deferred
                      if d.msg.header["run"] == st.run}
            if len(asking) < st.workers:
                return False
            st.started = True
        if st.mode == "sync":
            return st.version >= msg.header["min_version"]
        if st.max_staleness < 0 or st.shard != 0:
            return True
        # Admission (shard 0 only): every worker x in flight must still be able to see
        # all other in-flight workers push once more without exceeding the bound.
        w = msg.header["worker"]
        others = st.in_flight - {w}
        if len(others) > st.max_staleness:
            return False
        for x in others:
            applied = st.version - st.base[x]
            if applied + (len(others - {x}) + 1) > st.max_staleness:
                return False
        return True

    def _answer_pull(self, st: RunState, d: Deferred) -> list[Reply]:
        w = d.msg.header["worker"]
        st.base[w] = st.version
        if st.mode == "async":
            st.received[w] = 0
            st.in_flight.add(w)
            # async pushes change the parameters while ZeroMQ may still be sending them:
            # send a snapshot.
            return self._stream(st, d, [(0, st.store.numel)], st.version,
                                snapshot=True)
        if d.sent:  # part of this version was streamed already: send the rest
            return self._stream(st, d, st.last_ranges, st.version)
        return self._stream(st, d, [(0, st.store.numel)], st.version)

    @staticmethod
    def _cast(st: RunState, start: int, n: int, version: int, params: torch.Tensor,
              snapshot: bool) -> torch.Tensor:
        """The range in the wire dtype. In sync mode it is final for ``version`` (see
        _stream), so every worker's pull of it shares one cast; a new version casts
        again into a fresh tensor, since ZeroMQ may still be sending the old one."""
        if snapshot:  # async: changes with every push
            return params.to(st.wire_dtype)
        hit = st.wire_cache.get((start, n))
        if hit is None or hit[0] != version:
            hit = (version, params.to(st.wire_dtype))
            st.wire_cache[(start, n)] = hit
        return hit[1]

    def _stream(self, st: RunState, d: Deferred, ranges: list[tuple[int, int]], version: int,
                snapshot: bool = False) -> list[Reply]:
        """``params`` messages for the ranges not yet sent to this pull (each cut to
        the part the pull asks for). In sync mode a range is final for ``version`` as
        soon as it is updated, and nothing changes it until every worker has pushed
        again — which each does only after its pull is complete — so it is sent
        zero-copy, while other ranges are still being summed. With backups N - B pushes
        are enough, so a late worker's reply could be overwritten in place: a copy."""
        out = []
        snapshot = snapshot or bool(st.backups)
        a, b = d.part
        h = d.msg.header
        # as datagrams when asked (the server knows where): a sync pull of its version
        datagrams = h["datagrams"] > 0 and not snapshot and version == h["min_version"]
        values = st.store.sendable(version)
        for start, n in ranges:
            start, n = max(start, a), min(start + n, b) - max(start, a)
            if n <= 0 or (start, n) in d.sent:
                continue
            d.sent.add((start, n))
            params = values[start:start + n]
            t0 = time.perf_counter()
            if st.wire_dtype != params.dtype:  # --compress: a cast copy is a snapshot too
                params = self._cast(st, start, n, version, params, snapshot)
            elif snapshot:
                params = params.clone()
            if datagrams:  # (the egress copies it into the pull's datagrams at once)
                out.append(Reply(d.peer, None, self._record(
                    d.msg, t0, t0 - d.since, bytes_out=n * params.element_size(),
                    datagrams=True), Piece(h, b - a, start - a, params)))
                continue
            out.append(self._reply(d.peer, d.msg, "params",
                                   {"version": version, "offset": st.store.lo + start},
                                   [params], t0=t0, wait=t0 - d.since))
        return out
