"""``byteps``: a parameter server with per-host aggregation (BytePS, Jiang et al. OSDI
'20; bytedance/byteps), bucketed and overlapped with backward like ``ps``.

On H hosts of G workers each (ranks h*G .. h*G+G-1 on host h), per bucket:

1. reduce-scatter inside the host (a torch process group per host: gloo here, NCCL
   where CUDA is): local rank l ends with the host's sum of part l of the bucket (1/G
   of it), while backward goes on;
2. local rank l pushes only its part, so a host's link carries the gradients once per
   direction instead of G times; the servers (``--servers K``, sharded as for ``ps``)
   sum one push per host (init's ``group`` = G);
3. local rank l pulls its part back — one pull per server, sent with the step's first
   push, which the server answers partition by partition as soon as every host's push
   of a partition is summed, while later partitions are still being pushed (BytePS's
   pipelining: pushes go out in partitions of at most 4 MB, BYTEPS_PARTITION_BYTES's
   default, and a host link carries pushes one way and pulls the other at once) — and
   after backward the host all-gathers the parts.

``--update-on server`` (default): the servers run SGD, as ``ps``, and the pull brings
parameters. ``--update-on worker`` (BytePS's own split): the servers only add
("summation service"); the pull brings the summed gradient and every worker runs the
optimizer on its own copy, like ``allreduce``.

The servers hold the flat vector in a different order than ``ps``: every local rank's
parts of all buckets, one after the other ("columns"), so a worker's pull is one
contiguous range per server it overlaps (docs/protocol.md: ``lo``, ``hi``).

    psring run --strategy byteps --workers 8 --hosts 2 --link 1gbit --servers 2 \\
        --server-placement own-hosts [--update-on worker]
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace

import torch
from torch import nn

from psring.comm.endpoints import load_secret
from psring.comm.interconnect import host_comm, host_layout
from psring.comm.lossy import Marks
from psring.comm.partition import even_split, overlaps
from psring.comm.protocol import Message
from psring.comm.psclient import PSClient, Replies
from psring.errors import PsringError
from psring.records.runlog import run_id
from psring.strategies.base import DONE, STRATEGIES, Handle
from psring.strategies.buckets import Bucket, GradientBuckets, bucket_caps
from psring.strategies.ps import ParameterServer

#: the largest push (BytePS's BYTEPS_PARTITION_BYTES default, 4096000 bytes): a part is
#: pushed in partitions, each summed and streamed back on its own
PARTITION_ELEMENTS = 4_096_000 // 4


def partitions(lo: int, hi: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(server, start, end) of [lo, hi) cut at the servers' ranges and into partitions of
    at most PARTITION_ELEMENTS."""
    out = []
    for k, a, b in overlaps(lo, hi, ranges):
        for x in range(a, b, PARTITION_ELEMENTS):
            out.append((k, x, min(b, x + PARTITION_ELEMENTS)))
    return out


class _Part:
    """What a bucket's reduce-scatter produced and what its push sent."""

    def __init__(self):
        self.work = None   # the reduce-scatter in flight (None: done or not started)
        self.acks: Replies | None = None
        #: set by the pusher once the part's partitions are sent (or sending failed)
        self.sent = threading.Event()
        self.error: BaseException | None = None
        #: a GPU part's host copy, alive until its push is acknowledged (ZeroMQ sends
        #: tensors without copying them)
        self.staged: torch.Tensor | None = None


class _BucketPush:
    """A bucket's handle: its host's reduce-scatter, then the push of this worker's part."""

    def __init__(self, strategy: "BytePS", index: int):
        self.strategy, self.index = strategy, index
        self.part = strategy.parts[index]  # this step's, whenever it is waited for

    def wait(self) -> None:
        self.strategy._pushed(upto=self.index)
        self.part.acks.wait()


class _StepEnd:
    """finish_backward's handle: the remaining pushes (each part's pull behind it), their
    acks; with updates on the workers also the pulls and the all-gather of the summed
    gradients (the optimizer needs them)."""

    def __init__(self, strategy: "BytePS", handles: list):
        self.strategy, self.handles = strategy, handles

    def wait(self) -> None:
        s = self.strategy
        s._pushed(upto=len(s.parts) - 1)
        if not s.pull_keys:  # (a column with nothing in it: pull nothing)
            s._send_column_pulls()
        s.pull = Replies(s.client, s.pull_keys, "a pull of this worker's part")
        s.gathered = False
        for h in self.handles:
            h.wait()
        # (updates on the servers: the parameters are gathered when the next step
        # begins, or by every worker at the run's end: finish_run)
        if s.update_on_worker:
            s._gather()
        s._account()  # after the gather: its pull's bytes are this step's


@STRATEGIES.register("byteps")
class BytePS(ParameterServer):
    name = "byteps"
    caps = replace(ParameterServer.caps, uses_process_group=True,
                   supports_compression=False, supports_checkpoint=False,
                   needs_equal_hosts=True, update_sites=("server", "worker"),
                   inside_host="collectives", cost_model="byteps",
                   supports_backups=False)  # (a host's collective waits for all its workers)

    def setup(self, model: nn.Module) -> nn.Module:
        ctx, cfg = self.ctx, self.ctx.cfg
        g, self.hosts, _, self.local = host_layout(ctx, "byteps")
        self.per_host = g
        self.inside = host_comm(ctx, "byteps")  # a process group, or a device link's time
        self.update_on_worker = self.caps.local_optimizer(cfg.update_on)
        params = [p for p in model.parameters() if p.requires_grad]
        cap, first = bucket_caps(cfg.bucket_mb)
        self.buckets = GradientBuckets(params, cap, first, scale=1.0 / ctx.world,
                                       launch=self._launch, stats_of=lambda: self.stats)
        total = self._flatten()
        self._lay_out_parts(g)
        self.ranges = even_split(total, len(cfg.server_addr_list))
        self.parts = [_Part() for _ in self.buckets.buckets]
        self.client = PSClient(cfg.server_addr_list, run=run_id(cfg), worker=ctx.rank,
                               timeout=cfg.timeout, secret=load_secret(cfg.secret_file),
                               pace_bits=cfg.cluster.emulated_link_bits,
                               pace_burst=cfg.cluster.pacing_burst,
                               marks=Marks.for_switch(cfg.switch, total),
                               credits=bool(cfg.credit_window),
                               datagram_pulls=bool(cfg.loss_tolerance))
        self.wire_dtype = torch.float32
        self.finished = False
        self._early_recv = 0
        self.step = 0
        self._staleness = -1
        self.version0 = 0
        self.gathered = True  # the parameters hold the pulled values
        self.pulled = 0  # their version
        if ctx.rank == 0:
            self._initialize_servers(None)
        self._first_pull()
        self.pull = None
        self.pull_keys: list = []  # this step's pulls, one per part and server
        self._start_pusher()
        return model

    def _flatten(self) -> int:
        """The parameters in bucket order, as views of one flat vector (as for ps);
        returns its length."""
        bks = self.buckets.buckets
        order = [p for b in bks for p in b.params]
        total = sum(p.numel() for p in order)
        self.host_flat = self.dev_flat = torch.empty(total, dtype=torch.float32,
                                                     device=self.ctx.device)
        self.bucket_start, off = [], 0
        for b in bks:
            self.bucket_start.append(off)
            off += b.numel
        off = 0
        for p in order:
            self.host_flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.host_flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        return total

    def _lay_out_parts(self, g: int) -> None:
        """Part l of bucket b: its elements [l*c, min((l+1)*c, n)), c = ceil(n / G); the
        reduce-scatter needs G equal parts, so a bucket of n not divisible by G is
        reduced in a padded copy. The servers hold them in columns: local rank 0's parts
        of every bucket, then local rank 1's..."""
        bks, dev = self.buckets.buckets, self.ctx.device
        self.chunk = [-(-b.numel // g) for b in bks]
        self.padded = [None if b.numel % g == 0 else torch.zeros(c * g, device=dev)
                       for b, c in zip(bks, self.chunk)]
        self.shards = [torch.zeros(c, device=dev) for c in self.chunk]
        self.server_off = [[0] * len(bks) for _ in range(g)]
        self.columns, off = [], 0
        for lr in range(g):
            start = off
            for i in range(len(bks)):
                self.server_off[lr][i] = off
                off += self._valid(i, lr)
            self.columns.append((start, off))
        lo, hi = self.columns[self.local]
        self.column = torch.empty(hi - lo, device=dev)  # this worker's parts, as pulled

    def _first_pull(self) -> None:
        """Start together (the servers hold the first pulls until all have asked): every
        worker pulls every shard whole once, which with updates on the servers also
        gives it the initial parameters; a summing server's answer is ignored."""
        recv = self.client.bytes_recv
        keys = [self.client.pull(k, 0, hi - lo, self._initial_piece, at=lo)
                for k, (lo, hi) in enumerate(self.ranges)]
        Replies(self.client, keys, "a pull of parameters").wait()
        self._early_recv = self.client.bytes_recv - recv

    def _start_pusher(self) -> None:
        """The pusher: pushes each bucket's part as soon as the host's reduce-scatter of
        it is done, while backward goes on (the loop's thread is inside backward between
        gradient hooks, and would push it only at the next hook). It sends on the
        client, under its lock; replies are read by the loop's thread once a step's
        parts are all sent."""
        self._pushq: queue.SimpleQueue = queue.SimpleQueue()
        self._pusher = threading.Thread(target=self._push_loop, name="psring-pusher",
                                        daemon=True)
        self._pusher.start()

    # -- layout -----------------------------------------------------------------------
    def _valid(self, i: int, local: int) -> int:
        """Elements of bucket i in local rank ``local``'s part (the last may be short)."""
        n, c = self.buckets.buckets[i].numel, self.chunk[i]
        return max(0, min(c, n - local * c))

    def _init_fields(self) -> dict:
        return {"group": self.per_host, "update": "sum" if self.update_on_worker else "sgd"}

    def _spans(self, lo: int, hi: int):
        """(server offset, bucket-order offset, length) of every part's elements inside
        servers' elements [lo, hi): how the two orders of the flat vector meet."""
        for lr in range(self.per_host):
            for i in range(len(self.buckets.buckets)):
                s = self.server_off[lr][i]
                a, b = max(s, lo), min(s + self._valid(i, lr), hi)
                if a < b:
                    yield a, self.bucket_start[i] + lr * self.chunk[i] + (a - s), b - a

    def _in_bucket_order(self, flat: torch.Tensor) -> torch.Tensor:
        """The servers' columns of parts, in the workers' bucket order."""
        out = torch.empty_like(flat)
        for a, src, n in self._spans(0, flat.numel()):
            out[src:src + n].copy_(flat[a:a + n])
        return out

    def _server_values(self, lo: int, hi: int) -> torch.Tensor:
        """Flat elements [lo, hi) in the servers' order (columns of parts)."""
        out = torch.empty(hi - lo)
        for a, src, n in self._spans(lo, hi):
            out[a - lo:a - lo + n].copy_(self.host_flat[src:src + n])
        return out

    def _initial_piece(self, msg: Message) -> None:
        if self.update_on_worker:
            return  # a summing server's sum of no step: the parameters are the workers'
        a, piece = msg.header["offset"], msg.tensors[0]
        for s, dst, n in self._spans(a, a + piece.numel()):
            self.host_flat[dst:dst + n].copy_(piece[s - a:s - a + n])

    # -- a step -----------------------------------------------------------------------
    def _launch(self, bucket: Bucket) -> Handle:
        i = bucket.index
        full = self.padded[i]
        if full is None:
            full = bucket.buffer
        else:
            full[:bucket.numel].copy_(bucket.buffer)
        if self.inside is not None:
            self.parts[i].work = self.inside.reduce_scatter(self.shards[i], full)
        else:
            self.shards[i].copy_(full)
        if not self.pull_keys:
            self._send_column_pulls()
        self._pushq.put((self.parts[i], i))
        return _BucketPush(self, i)

    def _push_loop(self) -> None:
        """The pusher's thread: parts in launch (bucket) order, each pushed once its
        host's reduce-scatter is done; a failure is handed to whoever waits for it."""
        while (item := self._pushq.get()) is not None:
            part, i = item
            try:
                if part.work is not None:
                    part.work.wait()
                    part.work = None
                n, s = self._valid(i, self.local), self.server_off[self.local][i]
                data = self.shards[i]
                if data.device.type != "cpu":  # a GPU's part goes via the host
                    data = part.staged = data[:n].cpu()
                elif self.ctx.stand_in is not None:  # (device mode: that copy's time)
                    self.ctx.stand_in.copy("d2h", n * 4)
                keys = [self.client.push(k, {"step": self.step, "offset": a},
                                         data[a - s:b - s], self.ctx.cfg.loss_tolerance)
                        for k, a, b in partitions(s, s + n, self.ranges)]
                part.acks = Replies(self.client, keys, "a gradient push")
            except BaseException as e:  # noqa: BLE001 -- raised where the part is waited for
                part.error = e
            part.sent.set()

    def _pushed(self, upto: int) -> None:
        """Wait until the parts of buckets 0 .. ``upto`` are sent."""
        for part in self.parts[:upto + 1]:
            part.sent.wait()
            if part.error is not None:
                raise part.error

    def _send_column_pulls(self) -> None:
        """With the step's first push: one pull per server of this worker's column (the
        part it pushes, of every bucket), which the server streams back partition by
        partition as each is summed, while later ones are still being pushed."""
        lo, hi = self.columns[self.local]
        version = self.step + 1
        # what each bucket's part still waits for, and the host's all-gathers started
        # (in bucket order, as every rank of the host issues them)
        self.missing = [self._valid(i, self.local) for i in range(len(self.parts))]
        self.gathers: list = []
        for k, a, b in overlaps(lo, hi, self.ranges):
            key = self.client.pull(k, version, b - a, lambda m, a=a, b=b, v=version:
                                   self._column_piece(m, a, b, v), at=a, lo=a, hi=b)
            self.pull_keys.append(key)

    def _column_piece(self, msg: Message, lo: int, hi: int, version: int) -> None:
        """A piece of the pull of [lo, hi) for ``version``, checked before use."""
        ts = msg.tensors
        a = msg.header["offset"]
        b = a + (ts[0].numel() if len(ts) == 1 else 0)
        if len(ts) != 1 or ts[0].dtype != torch.float32 or not lo <= a < b <= hi \
                or msg.header["version"] != version:
            raise PsringError(f"worker {self.ctx.rank}: a parameter server answered the pull "
                              f"of [{lo}, {hi}) for version {version} with elements [{a}, "
                              f"{b}) of version {msg.header['version']} in {len(ts)} "
                              f"tensor(s): not what was asked")
        start = self.columns[self.local][0]
        self.column[a - start:b - start].copy_(ts[0])
        if self.ctx.stand_in is not None:  # (device mode: a GPU's copy of it back)
            self.ctx.stand_in.copy("h2d", (b - a) * 4)
        mine = self.server_off[self.local]
        for i in range(len(self.missing)):  # (tens of buckets, a piece every 4 MB)
            lo_i, hi_i = mine[i], mine[i] + self._valid(i, self.local)
            self.missing[i] -= max(0, min(b, hi_i) - max(a, lo_i))
        self._start_gathers()

    def _dest(self, i: int) -> torch.Tensor:
        """Where bucket i's all-gather lands: the gradients (updates on the workers) or
        the parameters."""
        b = self.buckets.buckets[i]
        return b.buffer if self.update_on_worker else \
            self.host_flat[self.bucket_start[i]:self.bucket_start[i] + b.numel]

    def _start_gathers(self) -> None:
        """All-gather, in bucket order, every bucket whose part has been pulled whole, as
        the pieces arrive: the host's all-gathers overlap the rest of the pull. (A
        bucket's pieces come after the acknowledgements of its pushes on each
        connection, so its shard, their zero-copy source, is free to reuse.)"""
        lo = self.columns[self.local][0]
        while len(self.gathers) < len(self.missing) and self.missing[len(self.gathers)] == 0:
            i = len(self.gathers)
            n, s = self._valid(i, self.local), self.server_off[self.local][i]
            shard = self.shards[i]
            shard[:n].copy_(self.column[s - lo:s - lo + n])
            full = self.padded[i] if self.padded[i] is not None else self._dest(i)
            if self.inside is not None:
                self.gathers.append(self.inside.all_gather(full, shard))
            else:
                full.copy_(shard)
                self.gathers.append(None)

    def _gather(self) -> None:
        """Wait for the pulled part and the host's all-gathers of every bucket into the
        parameters (update on the servers) or the gradients (on the workers)."""
        if self.gathered:
            return
        t0 = time.perf_counter()
        self.pull.wait()
        self._start_gathers()  # (parts with nothing to pull)
        t1 = time.perf_counter()
        for i, work in enumerate(self.gathers):
            if work is not None:
                work.wait()
            if self.padded[i] is not None:
                dest = self._dest(i)
                dest.copy_(self.padded[i][:dest.numel()])
        if self.update_on_worker:
            self.buckets.assign_grads()
        self.gathered = True
        self.pulled = self.step + 1  # (the version the parameters are now)
        # where the wait went: the rest of the pull, and the all-gathers not yet done
        self.stats.extra["pull_wait_s"] = round(t1 - t0, 7)
        self.stats.extra["gather_s"] = round(time.perf_counter() - t1, 7)

    # -- the loop's hooks -------------------------------------------------------------
    def begin_step(self, step: int) -> Handle:
        self.step = step
        self._at_start = self.client.mark(self._early_recv)
        self._early_recv = 0
        self.parts = [_Part() for _ in self.buckets.buckets]
        self.pull_keys = []
        return _Gathered(self) if not self.update_on_worker and self.pull is not None \
            else DONE

    def finish_backward(self) -> Handle:
        return _StepEnd(self, self.buckets.finish())

    def update(self, optimizer) -> None:
        if self.update_on_worker:
            optimizer.step()

    def _account(self) -> None:
        self.finished = self.step == self.ctx.cfg.steps - 1
        # (the pull of this step's result is waited for in the next begin_step, updates
        # on the servers: its bytes are counted there)
        self.client.account(self.stats, self._at_start)

    def eval_model(self, model: nn.Module) -> nn.Module:
        if not self.update_on_worker:
            recv = self.client.bytes_recv
            self._gather()
            self._early_recv += self.client.bytes_recv - recv
        return model

    def final_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if not self.update_on_worker:
            self._gather()
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    def close(self) -> None:
        if getattr(self, "_pusher", None) is not None:
            self._pushq.put(None)
            # (after a failure it may still be sending queued parts: let it finish one
            # before the sockets close; a send after that fails and is dropped)
            self._pusher.join(timeout=5.0)
        if getattr(self, "inside", None) is not None:
            self.inside.close()
        super().close()

    @classmethod
    def bytes_per_step(cls, param_bytes: int, world: int,
                       per_host: int = 1) -> tuple[int, int]:
        # each worker pushes its 1/G part and pulls it back (the host's collectives are
        # not counted: they do not leave the host)
        part = -(-param_bytes // per_host)
        return part, part


class _Gathered:
    """begin_step's handle (updates on the servers): the pulled part, all-gathered."""

    def __init__(self, strategy: BytePS):
        self.strategy = strategy

    def wait(self) -> None:
        self.strategy._gather()
