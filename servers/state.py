"""One run's state on a parameter server, and the rules that change it: a synchronous
step's pushes summed in worker order into the store, the version moved on when every
range is updated, with backup workers the step's workers chosen. The request handler
(psring.servers.handler) validates requests and answers them; this is what they do to
the run.

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
       dropped, and a push of a finished step is acknowledged ``dropped``.
async  every push is applied as it arrives (Downpour); when a worker's push for a step
       covers the whole shard, the version goes up by one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from psring.comm.protocol import DTYPES, MODES, UPDATES
from psring.servers.acks import AckLedger
from psring.servers.replies import Deferred, RequestError
from psring.servers.snapshots import Snapshots
from psring.servers.store import ShardStore


@dataclass
class RunState:
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
    #: the acks of each worker's pushes (exactly once: psring.servers.acks)
    acks: AckLedger = field(default_factory=AckLedger)
    #: copies of the shard for checkpoints (psring.servers.snapshots)
    snapshots: Snapshots = field(default_factory=Snapshots)
    started: bool = False  # every worker has asked for parameters once
    #: init's `group`: workers // group push each range, worker w in place w // group
    group: int = 1
    #: init's `backups` b (sync): a step takes the first workers - b to commit
    backups: int = 0
    #: this step's chosen workers, ascending, once known (backups)
    chosen: tuple[int, ...] | None = None
    #: shard 0 (backups): the workers that committed this step, and their held commits
    commits: list[int] = field(default_factory=list)
    commit_waits: list[Deferred] = field(default_factory=list)

    @classmethod
    def from_init(cls, h: dict, tensors: list[torch.Tensor]) -> RunState:
        """The run an ``init`` sets up, its settings checked first (RequestError)."""
        _check_init(h, tensors)
        store = ShardStore(h["lo"], h["hi"], tensors[0], h["lr"], h["momentum"],
                           h["weight_decay"], update=h["update"])
        store.new_step(h["version"])
        if len(tensors) == 2:  # resuming from a checkpoint
            store.buf.copy_(tensors[1])
        return cls(run=h["run"], shard=h["shard"], workers=h["workers"], mode=h["mode"],
                   store=store, max_staleness=h["max_staleness"], version=h["version"],
                   snapshots=Snapshots(h["snapshot_every"], h["snapshot_last"], h["backups"]),
                   wire_dtype=DTYPES[h["wire_dtype"]], group=h["group"],
                   backups=h["backups"])

    @property
    def pushers(self) -> int:
        return self.workers // self.group

    def order(self) -> list[int] | None:
        """The places whose pushes a step sums, in summing order: all of them, or with
        backups the chosen workers once known (None before: every push is held)."""
        if not self.backups:
            return list(range(self.pushers))
        return list(self.chosen) if self.chosen is not None else None

    # -- a synchronous step ----------------------------------------------------------
    def push_sync(self, h: dict, grad: torch.Tensor, start: int, got: int) -> bool:
        """Add a synchronous push; a range every worker has pushed is updated and can be
        sent while the rest of the gradients may still be arriving (per-element SGD, so
        range by range is the same as all at once); the last one ends the step. True
        when the push is dropped (backups: its step went on without its worker)."""
        if self.backups and (h["step"] < self.version or h["step"] == self.version
                             and self.chosen is not None and h["worker"] not in self.chosen):
            return True
        if h["step"] != self.version:
            raise RequestError(f"push for step {h['step']} but the server is at step "
                               f"{self.version} (synchronous mode)")
        complete = self._accumulate(start, grad, h["worker"])  # may refuse: count after
        self.received[h["worker"]] = got
        if complete:
            self._range_done(start, grad.numel())
        self._maybe_end_step()
        return False

    def push_async(self, w: int, grad: torch.Tensor, start: int, got: int) -> int:
        """Apply an asynchronous push at once; its staleness (updates since its pull)."""
        self.store.apply(grad, start)
        self.received[w] = got
        staleness = self.version - self.base.get(w, self.version)
        if got == self.store.numel:
            self.received[w] = 0
            self.version += 1
            self.in_flight.discard(w)
            self.snapshots.at_version(self.store, self.version)
        return staleness

    def _accumulate(self, start: int, grad: torch.Tensor, worker: int) -> bool:
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
        entry = self.covered.get(key)
        if entry is None:
            end = start + grad.numel()
            if any(s < end and start < s + n for s, n in self.covered):
                raise RequestError(f"push range [{start}, {end}) overlaps a differently cut "
                                   f"range: the run's workers disagree about the buckets")
            entry = self.covered[key] = [0, set(), {}]  # [summed in, pushed, held]
        slot = worker // self.group
        if slot in entry[1]:
            g = self.group
            who = f"worker {worker}" if g == 1 else \
                f"group {slot} (workers {slot * g}..{slot * g + g - 1})"
            raise RequestError(f"{who} pushed range [{start}, {start + grad.numel()}) "
                               f"twice in step {self.version}")
        entry[1].add(slot)
        entry[2][slot] = grad
        return self._sum_in(start, entry)

    def _sum_in(self, start: int, entry: list) -> bool:
        """Sum the held pushes of a range whose turn has come (:meth:`order`); True when
        the range's last one is in (it is updated)."""
        order = self.order()
        if order is None:
            return False  # (backups: held until the step's workers are chosen)
        n = len(order)
        while entry[0] < n and order[entry[0]] in entry[2]:
            k = entry[0]
            g = entry[2].pop(order[k])
            if n == 1:
                self.store.apply(g, start)
            elif k == 0:
                self.store.begin(g, start)
            elif k < n - 1:
                self.store.add(g, start)
            else:
                self.store.finish(g, start)
            entry[0] += 1
        return entry[0] == n

    def _range_done(self, start: int, n: int) -> None:
        self.applied += n
        self.done.append((start, n))

    def _maybe_end_step(self) -> None:
        """Every range of the step is updated: the version goes up by one."""
        if self.applied != self.store.numel:
            return
        self.covered.clear()
        self.received.clear()
        self.applied = 0
        self.last_ranges, self.done = self.done, []
        self.chosen, self.commits = None, []
        self.version += 1
        self.store.new_step(self.version)
        self.snapshots.at_version(self.store, self.version)

    # -- backup workers --------------------------------------------------------------
    def commit(self, worker: int, step: int, held: Deferred) -> tuple[list[int], list] | None:
        """(shard 0) ``worker``'s pushes of ``step`` are all acknowledged: count it in;
        once workers - backups have, (the chosen workers, the held commits to answer),
        the choice adopted. None while the step still waits for others."""
        if worker in self.commits:
            raise RequestError(f"worker {worker} committed step {step} twice")
        self.commits.append(worker)
        self.commit_waits.append(held)
        if len(self.commits) < self.workers - self.backups:
            return None
        chosen, waits = sorted(self.commits), self.commit_waits
        self.commit_waits = []
        self.adopt(chosen)
        return chosen, waits

    def choose(self, step: int, chosen: list[int]) -> None:
        """Another shard's choice of ``step``'s workers, checked, adopted if new."""
        if not (len(chosen) == self.workers - self.backups
                and all(isinstance(w, int) and 0 <= w < self.workers for w in chosen)
                and chosen == sorted(set(chosen))):
            raise RequestError(f"choose names {chosen!r}: {self.workers - self.backups} "
                               f"distinct workers of 0..{self.workers - 1}, ascending")
        if step == self.version:
            if self.chosen is None:
                self.adopt(chosen)
            elif list(self.chosen) != chosen:
                raise RequestError(f"choose names {chosen} for step {step}, which took "
                                   f"{list(self.chosen)}")

    def adopt(self, chosen: list[int]) -> None:
        """The step's workers are known: drop the others' held pushes, sum the rest."""
        self.chosen = tuple(chosen)
        for (start, n), entry in self.covered.items():
            for slot in [s for s in entry[2] if s not in self.chosen]:
                del entry[2][slot]
            if entry[0] < len(chosen) and self._sum_in(start, entry):
                self._range_done(start, n)
        self._maybe_end_step()


def _check_init(h: dict, tensors: list[torch.Tensor]) -> None:
    """An ``init``'s shard, tensors and settings, or a RequestError naming the bad one."""
    lo, hi = h["lo"], h["hi"]
    if not (0 <= lo < hi) or len(tensors) not in (1, 2) \
            or any(t.numel() != hi - lo for t in tensors):
        raise RequestError(f"init needs one tensor of hi - lo elements, and optionally "
                           f"a momentum buffer of as many (lo={lo}, hi={hi})")
    if any(t.dtype != torch.float32 or t.dim() != 1 for t in tensors):
        raise RequestError("init parameters must be a 1-d float32 tensor")
    if h["version"] < 0 or h["snapshot_every"] < 0 or h["snapshot_last"] < 0:
        raise RequestError(f"init: version {h['version']}, snapshot_every "
                           f"{h['snapshot_every']} and snapshot_last {h['snapshot_last']} "
                           f"must be >= 0")
    if len(tensors) == 2 and not h["momentum"]:
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
