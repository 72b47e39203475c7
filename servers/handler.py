"""A parameter server's request handler: the rules of sync and async SGD, no sockets.

``Handler.handle(peer, message)`` takes one validated request and returns the replies
to send now, as ``(peer, frames, record)``; a reply may be held back (a pull waiting
for the next version) and released by a later request. The socket loop
(``psring.servers.server``) does the I/O. Keeping the rules here makes them testable
without a network.

sync   pushes for step ``s`` are summed (into the momentum buffer, as they arrive:
       see psring.servers.store); each range is updated (SGD) as soon as all N
       workers' pushes of it are in (with init's ``group`` G, N / G pushes: byteps's
       workers push one host's sum each, a range from one worker per host), and when
       every element is updated the version becomes ``s + 1``. With init's
       ``backups`` b, a step takes the first N - b workers to ``commit`` (shard 0
       counts them, each after all its pushes of the step were acknowledged, and
       answers each commit with the chosen workers once there are N - b; a chosen
       worker tells the other shards with ``choose``): pushes are held until the
       choice is known, the chosen ones are summed in worker order and the others
       dropped, and a push of a finished step is acknowledged ``dropped``. A pull for
       ``min_version = s + 1`` is answered range by range: each range is sent as soon
       as it is updated (so replies overlap the summing of the rest), the pull is
       complete when the whole shard has been sent.
async  every push is applied as it arrives (Downpour). When a worker's push for a step
       covers the whole shard, the version goes up by one and its staleness is the
       number of updates applied since the version it pulled. With ``max_staleness S``
       (on shard 0, which admits workers for all shards) a pull is answered only if no
       worker could then see more than S updates between its pull and its push.

Exactly once: a push is identified by ``(worker, seq)``. A second push with the same
pair (a retry after a timeout) is not applied again: it gets the very ack the first one
got. The acks of each worker's current and previous step are remembered (at most
MAX_ACKS per worker); a push reusing a seq for different data, or a retry older than
what is remembered, is refused. With a shared secret (``check_replays``) every request
must also carry a seq above the highest seen from its (run, worker) — else it is a
replay, dropped unanswered — except such a retry, which is answered as above.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from psring.comm.protocol import (
    DTYPE_NAMES,
    DTYPES,
    MODES,
    SNAPSHOT_NEWEST,
    SNAPSHOT_NOW,
    UPDATES,
    Message,
    encode,
    error_frames,
)
from psring.servers.store import ShardStore

#: pulls held back at once, beyond which new ones are refused (bounded memory)
MAX_DEFERRED = 4096
#: acks remembered per worker for answering retried pushes (its current and previous
#: step's; this caps them when a step has more pushes than that)
MAX_ACKS = 8192
#: runs whose highest seq per worker is remembered (replay protection with a secret):
#: a replayed message of a run older than these is still refused by the run check,
#: unless it is an init
MAX_RUNS_SEEN = 1024


class RequestError(Exception):
    """A valid message that the server's state can't accept (answered with an error)."""


@dataclass
class Reply:
    peer: bytes
    frames: list | None  # None: nothing to send (a dropped replay), only the record
    record: dict[str, Any]


@dataclass
class _Ack:
    """What a push was answered with, to answer its retry with the same."""
    step: int
    offset: int
    numel: int
    frames: list


@dataclass
class _Deferred:
    peer: bytes
    msg: Message
    since: float
    sent: set = field(default_factory=set)  # ranges already streamed to it (sync)
    #: how many of the step's updated ranges (_Run.done) it has been offered: each
    #: request then streams only the new ones (held pulls x ranges would be quadratic)
    done_seen: int = 0
    #: the part of the shard it asks for, [a, b) relative to it, once validated (_fits)
    part: tuple[int, int] | None = None


@dataclass
class _Run:
    run: str
    shard: int
    workers: int
    mode: str
    store: ShardStore
    max_staleness: int
    version: int = 0
    #: what pushes and pulled parameters travel in (--compress); the store is float32
    wire_dtype: torch.dtype = torch.float32
    # sync, compressed: (start, len) -> (version, the range cast to the wire dtype),
    # cast once per version for all N workers' pulls
    wire_cache: dict[tuple[int, int], tuple[int, torch.Tensor]] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)  # worker -> elements this step
    base: dict[int, int] = field(default_factory=dict)      # worker -> version it pulled
    in_flight: set[int] = field(default_factory=set)        # pulled, not yet pushed all
    # (start, len) -> [pushes summed in (in worker order), workers pushed, held pushes]
    covered: dict[tuple[int, int], list] = field(default_factory=dict)
    applied: int = 0  # elements of this step already updated (sync)
    done: list[tuple[int, int]] = field(default_factory=list)  # ranges updated this step
    last_ranges: list[tuple[int, int]] = field(default_factory=list)  # of the last step
    # worker -> seq -> the ack its push got (current and previous step, at most MAX_ACKS)
    acks: dict[int, "OrderedDict[int, _Ack]"] = field(default_factory=dict)
    acked_seq: dict[int, int] = field(default_factory=dict)  # worker -> highest acked seq
    # checkpoints: keep a copy of the shard when the version becomes a multiple of
    # snapshot_every (or snapshot_last): version -> (params, momentum or None), the
    # last one, or with backups the last BACKUP_COPIES (worker 0 asks every shard for
    # its newest copy and then for the oldest of those: the shards may be a few
    # versions apart, each waiting to learn whom a step took)
    snapshot_every: int = 0
    snapshot_last: int = 0
    snapshots: dict[int, tuple] = field(default_factory=dict)
    started: bool = False  # every worker has asked for parameters once
    #: init's `group`: workers // group push each range, worker w in place w // group
    group: int = 1
    #: init's `backups` b (sync): a step takes the first workers - b to commit
    backups: int = 0
    #: this step's chosen workers, ascending, once known (backups)
    chosen: tuple[int, ...] | None = None
    #: shard 0 (backups): the workers that committed this step, and their held commits
    commits: list[int] = field(default_factory=list)
    commit_waits: list["_Deferred"] = field(default_factory=list)

    @property
    def pushers(self) -> int:
        return self.workers // self.group

    def order(self) -> list[int] | None:
        """The places whose pushes a step sums, in summing order: all of them, or with
        backups the chosen workers once known (None before: every push is held)."""
        if not self.backups:
            return list(range(self.pushers))
        return list(self.chosen) if self.chosen is not None else None


#: copies of the shard kept for checkpoints with backup workers (else one)
BACKUP_COPIES = 4


def _keep_copy(st: _Run, version: int) -> None:
    """A copy of the shard (parameters and momentum) at ``version``; the oldest beyond
    those kept dropped."""
    buf = st.store.buf
    st.snapshots[version] = (st.store.params.clone(), buf.clone() if buf is not None else None)
    for old in sorted(st.snapshots)[:-(BACKUP_COPIES if st.backups else 1)]:
        del st.snapshots[old]


class Handler:
    """``key``: the shared secret replies are signed with (None: unsigned).
    ``check_replays``: drop requests whose seq is not new for their (run, worker) — on
    by default with a key (unsigned senders could forge any seq anyway)."""

    def __init__(self, name: str = "server", key: bytes | None = None,
                 check_replays: bool | None = None):
        self.name = name
        self.key = key
        self.check_replays = key is not None if check_replays is None else check_replays
        self.state: _Run | None = None
        self.deferred: list[_Deferred] = []
        self.snapshot_waits: list[_Deferred] = []  # snapshot requests for a later version
        self.counts = {"requests": 0, "errors": 0, "replays": 0, "retries": 0}
        # run -> worker -> highest seq seen (check_replays), the MAX_RUNS_SEEN latest runs
        self.seen: OrderedDict[str, dict[int, int]] = OrderedDict()

    # ------------------------------------------------------------------ dispatch
    def handle(self, peer: bytes, msg: Message) -> list[Reply]:
        self.counts["requests"] += 1
        t0 = time.perf_counter()
        try:
            if msg.op == "push":
                again = self._retried(peer, msg, t0)
                if again is not None:
                    return [again]
            if self.check_replays and not self._fresh(msg):
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

    def _fresh(self, msg: Message) -> bool:
        """Is this request's seq above every seq seen from its (run, worker)? Records it."""
        h = msg.header
        seen = self.seen.get(h["run"])
        if seen is None:
            seen = self.seen[h["run"]] = {}
            while len(self.seen) > MAX_RUNS_SEEN:
                self.seen.popitem(last=False)
        else:
            self.seen.move_to_end(h["run"])
        last = seen.get(h["worker"])
        if last is not None and h["seq"] <= last:
            return False
        seen[h["worker"]] = h["seq"]
        return True

    def _retried(self, peer: bytes, msg: Message, t0: float) -> Reply | None:
        """The remembered ack when this push repeats an acknowledged one; None if new."""
        st, h = self.state, msg.header
        if st is None or st.run != h["run"]:
            return None
        ack = st.acks.get(h["worker"], {}).get(h["seq"])
        if ack is None:
            return None
        numel = msg.tensors[0].numel() if len(msg.tensors) == 1 else -1
        if (ack.step, ack.offset, ack.numel) != (h["step"], h["offset"], numel):
            raise RequestError(
                f"worker {h['worker']} reused seq {h['seq']} for a different push (step "
                f"{h['step']}, offset {h['offset']}, {numel} elements; the first was step "
                f"{ack.step}, offset {ack.offset}, {ack.numel} elements)")
        self.counts["retries"] += 1
        return Reply(peer, ack.frames, self._record(msg, t0, op="retry", seq=h["seq"]))

    @staticmethod
    def _remember(st: _Run, h: dict, numel: int, frames: list) -> None:
        w, step = h["worker"], h["step"]
        acks = st.acks.setdefault(w, OrderedDict())
        acks[h["seq"]] = _Ack(step, h["offset"], numel, frames)
        st.acked_seq[w] = max(st.acked_seq.get(w, h["seq"]), h["seq"])
        # keep this worker's current and previous step (seqs, hence steps, only grow)
        while acks and (next(iter(acks.values())).step < step - 1 or len(acks) > MAX_ACKS):
            acks.popitem(last=False)

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

    def _current(self, msg: Message) -> _Run:
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
        lo, hi = h["lo"], h["hi"]
        if not (0 <= lo < hi) or len(msg.tensors) not in (1, 2) \
                or any(t.numel() != hi - lo for t in msg.tensors):
            raise RequestError(f"init needs one tensor of hi - lo elements, and optionally "
                               f"a momentum buffer of as many (lo={lo}, hi={hi})")
        if any(t.dtype != torch.float32 or t.dim() != 1 for t in msg.tensors):
            raise RequestError("init parameters must be a 1-d float32 tensor")
        if h["version"] < 0 or h["snapshot_every"] < 0 or h["snapshot_last"] < 0:
            raise RequestError(f"init: version {h['version']}, snapshot_every "
                               f"{h['snapshot_every']} and snapshot_last {h['snapshot_last']} "
                               f"must be >= 0")
        if len(msg.tensors) == 2 and not h["momentum"]:
            raise RequestError("init: a momentum buffer was sent for SGD without momentum")
        if h["mode"] not in MODES or h["workers"] < 1 or not 0 < h["lr"] < math.inf \
                or not 0 <= h["momentum"] < 1 or not 0 <= h["weight_decay"] < math.inf:
            raise RequestError(f"bad run settings: mode {h['mode']!r}, workers {h['workers']}, "
                               f"lr {h['lr']}, momentum {h['momentum']}, "
                               f"weight_decay {h['weight_decay']}")
        if h["worker"] != 0:
            raise RequestError("only worker 0 initializes a server")
        if h["wire_dtype"] not in ("float32", "float16", "bfloat16"):
            raise RequestError(f"init: wire_dtype {h['wire_dtype']!r} is not float32, "
                               f"float16 or bfloat16")
        group, sync = h["group"], h["mode"] == "sync"
        if group < 1 or h["workers"] % group or group > 1 and not sync:
            raise RequestError(f"init: group {group} must be >= 1 and divide the {h['workers']}"
                               f" workers, and a group > 1 needs mode 'sync' (an async "
                               f"server applies each worker's push alone)")
        if h["update"] not in UPDATES or h["update"] == "sum" and not sync:
            raise RequestError(f"init: update {h['update']!r} must be one of {UPDATES}, and "
                               f"'sum' needs mode 'sync'")
        if not 0 <= h["backups"] < h["workers"] or h["backups"] and (not sync or group > 1):
            raise RequestError(f"init: backups {h['backups']} must be 0..workers - 1 "
                               f"({h['workers'] - 1}), and backups need mode 'sync' and "
                               f"group 1")
        store = ShardStore(lo, hi, msg.tensors[0], h["lr"], h["momentum"], h["weight_decay"],
                           update=h["update"])
        store.new_step(h["version"])
        if len(msg.tensors) == 2:  # resuming from a checkpoint
            store.buf.copy_(msg.tensors[1])
        self.state = _Run(run=h["run"], shard=h["shard"], workers=h["workers"], mode=h["mode"],
                          store=store, max_staleness=h["max_staleness"], version=h["version"],
                          snapshot_every=h["snapshot_every"],
                          snapshot_last=h["snapshot_last"],
                          wire_dtype=DTYPES[h["wire_dtype"]], group=h["group"],
                          backups=h["backups"])
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
            dropped = self._push_sync(st, h, grad, start, got)
        else:
            st.store.apply(grad, start)
            st.received[w] = got
            staleness = st.version - st.base.get(w, st.version)
            if got == st.store.numel:
                st.received[w] = 0
                st.version += 1
                st.in_flight.discard(w)
                self._maybe_snapshot(st)
        fields = {"version": st.version, "staleness": staleness}
        if dropped:  # (only then: without backups the ack is as it always was)
            fields["dropped"] = True
        if "delivered" in h:  # a lossy_push's (psring.comm.lossy): what arrived of it
            fields["delivered"] = h["delivered"]
        ack = self._reply(peer, msg, "ack", fields, t0=t0, staleness=staleness,
                          **({"dropped": True} if dropped else {}))
        self._remember(st, h, grad.numel(), ack.frames)
        return [ack]

    def _check_push(self, st: _Run, msg: Message) -> int:
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
        w = h["worker"]
        if h["seq"] <= st.acked_seq.get(w, h["seq"] - 1):
            # not remembered (or _retried would have answered it): not a fresh push
            raise RequestError(
                f"push seq {h['seq']} of worker {w} is not above its last acknowledged "
                f"push (seq {st.acked_seq[w]}): a retry older than the acks the server "
                f"keeps (this step's and the last), or a client reusing sequence numbers")
        return start

    def _push_sync(self, st: _Run, h: dict, grad, start: int, got: int) -> bool:
        """Add a synchronous push; a range every worker has pushed is updated and can be
        sent while the rest of the gradients may still be arriving (per-element SGD, so
        range by range is the same as all at once); the last one ends the step. True
        when the push is dropped (backups: its step went on without its worker)."""
        if st.backups and (h["step"] < st.version or h["step"] == st.version
                           and st.chosen is not None and h["worker"] not in st.chosen):
            return True
        if h["step"] != st.version:
            raise RequestError(f"push for step {h['step']} but the server is at step "
                               f"{st.version} (synchronous mode)")
        complete = self._accumulate(st, start, grad, h["worker"])  # may refuse: count after
        st.received[h["worker"]] = got
        if complete:
            self._range_done(st, start, grad.numel())
        self._maybe_end_step(st)
        return False

    @staticmethod
    def _range_done(st: _Run, start: int, n: int) -> None:
        st.applied += n
        st.done.append((start, n))

    def _maybe_end_step(self, st: _Run) -> None:
        """Every range of the step is updated: the version goes up by one."""
        if st.applied != st.store.numel:
            return
        st.covered.clear()
        st.received.clear()
        st.applied = 0
        st.last_ranges, st.done = st.done, []
        st.chosen, st.commits = None, []
        st.version += 1
        st.store.new_step(st.version)
        self._maybe_snapshot(st)

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
        self.deferred.append(_Deferred(peer, msg, time.perf_counter(), part=part))
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
        if h["worker"] in st.commits:
            raise RequestError(f"worker {h['worker']} committed step {h['step']} twice")
        st.commits.append(h["worker"])
        st.commit_waits.append(_Deferred(peer, msg, t0))
        if len(st.commits) < st.workers - st.backups:
            return []
        chosen, waits = sorted(st.commits), st.commit_waits
        st.commit_waits = []
        replies = [self._chosen(d.peer, d.msg, d.since, chosen) for d in waits]
        self._adopt(st, chosen)
        return replies

    def _chosen(self, peer: bytes, msg: Message, t0: float, chosen: list[int]) -> Reply:
        taken = msg.header["worker"] in chosen and msg.header["step"] == self.state.version
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
        chosen = h["workers"]
        if not (len(chosen) == st.workers - st.backups
                and all(isinstance(w, int) and 0 <= w < st.workers for w in chosen)
                and chosen == sorted(set(chosen))):
            raise RequestError(f"choose names {chosen!r}: {st.workers - st.backups} distinct "
                               f"workers of 0..{st.workers - 1}, ascending")
        if h["step"] == st.version:
            if st.chosen is None:
                self._adopt(st, chosen)
            elif list(st.chosen) != chosen:
                raise RequestError(f"choose names {chosen} for step {h['step']}, which "
                                   f"took {list(st.chosen)}")
        return [self._reply(peer, msg, "ok", {}, t0=t0, chosen=chosen)]

    def _adopt(self, st: _Run, chosen: list[int]) -> None:
        """The step's workers are known: drop the others' held pushes, sum the rest."""
        st.chosen = tuple(chosen)
        for (start, n), entry in st.covered.items():
            for slot in [s for s in entry[2] if s not in st.chosen]:
                del entry[2][slot]
            if entry[0] < len(chosen) and self._sum_in(st, start, entry):
                self._range_done(st, start, n)
        self._maybe_end_step(st)

    # ------------------------------------------------------------------ checkpoints
    @staticmethod
    def _maybe_snapshot(st: _Run) -> None:
        """Copy the shard at the moment its version becomes a checkpoint's: nothing of
        the next step can be in it yet (in sync mode the first push of the next step
        changes the momentum buffer at once), so every shard's copy is of the same
        version, taken without stopping anyone."""
        v = st.version
        if st.snapshot_every and (v % st.snapshot_every == 0 or v == st.snapshot_last):
            _keep_copy(st, v)

    def _snapshot(self, peer: bytes, msg: Message, t0: float) -> list[Reply]:
        st = self._current(msg)
        if len(msg.tensors) != 0:
            raise RequestError("a snapshot request carries no tensors")
        v = msg.header["version"]
        if v == SNAPSHOT_NOW:  # (async; or sync between a worker's steps: psring.servers.store)
            _keep_copy(st, st.version)
            v = st.version
        elif v == SNAPSHOT_NEWEST and st.snapshots:
            v = max(st.snapshots)
        if v in st.snapshots:
            return [self._state_reply(st, peer, msg, t0, v)]
        # (SNAPSHOT_NEWEST before any copy: held until the first, like a later version)
        if v != SNAPSHOT_NEWEST and (v < 0 or v <= st.version):
            raise RequestError(f"no copy of version {v} is kept (the server is at version "
                               f"{st.version} and keeps {sorted(st.snapshots) or 'none'}; it "
                               f"copies versions that are multiples of {st.snapshot_every} "
                               f"and {st.snapshot_last})")
        if len(self.snapshot_waits) >= MAX_DEFERRED:
            raise RequestError(f"{self.name} already holds {MAX_DEFERRED} snapshot requests")
        self.snapshot_waits.append(_Deferred(peer, msg, t0))
        return []

    def _state_reply(self, st: _Run, peer: bytes, msg: Message, t0: float,
                     version: int) -> Reply:
        params, buf = st.snapshots[version]
        tensors = [params] if buf is None else [params, buf]
        return self._reply(peer, msg, "state", {"version": version}, tensors, t0=t0)

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
    def _accumulate(st: _Run, start: int, grad: torch.Tensor, worker: int) -> int:
        """Add a push into this step's update of its range (the last of N also applies
        it); return whether the range is complete (updated). Pushes are
        summed in worker order whatever order they arrive in (one that comes early is
        held, a view of its received frame, until its turn), so the floating-point sum
        — and the trained model — is the same on every run. All workers of a run push
        the same ranges (same buckets, same partition); a range overlapping a
        differently cut one means they disagree, and a second push of a range by one
        worker is refused before it touches anything. With a ``group`` G, worker w
        takes place w // G (its host's), and a second push of a range from that place
        is refused the same way."""
        key = (start, grad.numel())
        entry = st.covered.get(key)
        if entry is None:
            end = start + grad.numel()
            if any(s < end and start < s + n for s, n in st.covered):
                raise RequestError(f"push range [{start}, {end}) overlaps a differently cut "
                                   f"range: the run's workers disagree about the buckets")
            entry = st.covered[key] = [0, set(), {}]  # [summed in, pushed, held]
        slot = worker // st.group
        if slot in entry[1]:
            who = f"worker {worker}" if st.group == 1 else \
                f"group {slot} (workers {slot * st.group}..{slot * st.group + st.group - 1})"
            raise RequestError(f"{who} pushed range [{start}, {start + grad.numel()}) "
                               f"twice in step {st.version}")
        entry[1].add(slot)
        entry[2][slot] = grad
        return Handler._sum_in(st, start, entry)

    @staticmethod
    def _sum_in(st: _Run, start: int, entry: list) -> bool:
        """Sum the held pushes of a range whose turn has come (st.order()); True when
        the range's last one is in (it is updated)."""
        order = st.order()
        if order is None:
            return False  # (backups: held until the step's workers are chosen)
        n = len(order)
        while entry[0] < n and order[entry[0]] in entry[2]:
            k = entry[0]
            g = entry[2].pop(order[k])
            if n == 1:
                st.store.apply(g, start)
            elif k == 0:
                st.store.begin(g, start)
            elif k < n - 1:
                st.store.add(g, start)
            else:
                st.store.finish(g, start)
            entry[0] += 1
        return entry[0] == n

    @staticmethod
    def _wanted(st: _Run, msg: Message) -> tuple[int, int] | None:
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

    def _fits(self, st: _Run, d: _Deferred) -> bool:
        """Validate, once, a pull held before init: worker, shard and range (d.part)."""
        h = d.msg.header
        if 0 <= h["worker"] < st.workers and h["shard"] == st.shard:
            d.part = self._wanted(st, d.msg)
        return d.part is not None

    def _can_answer(self, st: _Run, msg: Message) -> bool:
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

    def _answer_pull(self, st: _Run, d: _Deferred) -> list[Reply]:
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
    def _cast(st: _Run, start: int, n: int, version: int, params: torch.Tensor,
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

    def _stream(self, st: _Run, d: _Deferred, ranges: list[tuple[int, int]], version: int,
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
            out.append(self._reply(d.peer, d.msg, "params",
                                   {"version": version, "offset": st.store.lo + start},
                                   [params], t0=t0, wait=t0 - d.since))
        return out
