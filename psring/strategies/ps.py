"""``ps`` and ``async-ps``: data-parallel SGD through parameter servers over ZeroMQ.

The model's parameters live in one flat vector (in gradient-bucket order), split by the
partitioner (``psring.comm.partition``) into K shards, one per server. Each step:

- gradient hooks fill buckets (pre-scaled by 1/N, as ``allreduce``); a full bucket is
  pushed at once, in pieces, to every server whose range it overlaps, so pushes overlap
  backward exactly as ``allreduce``'s all-reduces do;
- ``finish_backward`` then sends the pull for the next parameters right behind the
  pushes on each connection (the earliest moment correctness allows) and returns a
  handle on the pushes' acknowledgements;
- the next ``begin_step`` waits for the pulled shards and writes them into the model.

``ps`` (synchronous): a server answers the pull for version ``s + 1`` once all N
workers' gradients of step ``s`` are summed and applied — the same SGD as ``allreduce``,
so the same final parameters. ``--servers K`` shards it across K servers.

``async-ps`` (Downpour): servers apply every push on arrival and answer pulls at once;
workers never wait for each other. Each step logs ``staleness``: updates the server
(shard 0) applied between the worker's pull and its push. ``--max-staleness S`` bounds
it: shard 0 holds back a pull that could let any worker see more than S updates.

With a shared secret (``--secret-file`` or PSRING_SECRET) every request is signed and
every reply must carry a valid signature (docs/protocol.md).

    psring run --strategy ps --workers 2 --servers 2
    psring run --strategy async-ps --workers 4 --max-staleness 2
    psring run --strategy ps --workers 2 --server-addrs tcp://hostA:5555,tcp://hostB:5555
    psring run --strategy ps --workers 2 --compress fp16    (psring.comm.compress)
"""

from __future__ import annotations

import bisect
from dataclasses import replace
from typing import ClassVar, ContextManager

import torch
from torch import nn

from psring.comm.compress import wire_dtype
from psring.comm.endpoints import load_secret
from psring.comm.lossy import Marks
from psring.comm.partition import even_split, overlaps
from psring.comm.protocol import (
    DTYPE_NAMES,
    SNAPSHOT_NEWEST,
    SNAPSHOT_NOW,
    Message,
)
from psring.comm.psclient import PSClient, Replies
from psring.errors import PsringError
from psring.records.runlog import run_id
from psring.servers.server import FRAME_SLACK
from psring.strategies.base import DONE, STRATEGIES, Capabilities, Handle, Strategy, WaitAll
from psring.strategies.buckets import Bucket, GradientBuckets, bucket_caps
from psring.train.workload import meta_model


def server_frame_limit(cfg) -> int | None:
    """The largest frame a server of this run receives — worker 0's ``init`` carries a
    whole shard; pushes carry pieces of one — plus slack for the header and signature.
    The launcher starts its servers with it (``--max-frame-mb``), so libzmq disconnects
    a peer sending anything larger. None when the model's size is known only once the
    data is loaded (digits, .npz) or the model can't be built on the meta device: the
    servers then keep their default bound."""

    if cfg.data != "synthetic":
        return None
    try:
        model, _ = meta_model(cfg)
    except Exception:  # noqa: BLE001 - a plugin model may not build on meta; keep the default
        return None
    numel = sum(p.numel() for p in model.parameters())
    largest = max(hi - lo for lo, hi in even_split(numel, cfg.servers))
    return largest * 4 + FRAME_SLACK  # float32


@STRATEGIES.register("ps")
class ParameterServer(Strategy):
    name = "ps"
    caps = Capabilities(uses_servers=True, supports_compression=True,
                        update_sites=("server",), cost_model="ps", inside_host="host-copies",
                        supports_backups=True, loss_tolerant=True)
    mode: ClassVar[str] = "sync"
    #: --backup-workers B (ps; set in setup): a step sums the first N - B workers'
    backups: int = 0

    def setup(self, model: nn.Module) -> nn.Module:
        cfg, ctx = self.ctx.cfg, self.ctx
        params = [p for p in model.parameters() if p.requires_grad]
        cap, first = bucket_caps(cfg.bucket_mb)
        # --backup-workers B: a step sums the first N - B workers' gradients
        self.backups = cfg.backup_workers if self.caps.supports_backups else 0
        self.buckets = GradientBuckets(params, cap, first,
                                       scale=1.0 / (ctx.world - self.backups),
                                       launch=self._push, stats_of=lambda: self.stats)
        # (under torchrun a host other than rank 0's holds no copy of the servers' state:
        # its resume is a step only, its parameters come with the first pull)
        resume = ctx.resume.tensors if ctx.resume is not None and ctx.resume.tensors else None
        total = self._flatten(resume)
        self.host_buckets = [torch.empty(b.numel, pin_memory=True)
                             if ctx.device.type == "cuda" else None for b in self.buckets.buckets]
        # --compress: pushes and pulls travel in the wire dtype, one cast buffer per
        # bucket (psring.comm.compress); the servers keep float32
        self.wire_dtype = wire_dtype(cfg.compress)
        self.wire_buckets = [None if self.wire_dtype == torch.float32 else
                             torch.empty(b.numel, dtype=self.wire_dtype)
                             for b in self.buckets.buckets]
        self.ranges = even_split(total, len(cfg.server_addr_list))
        # (bounded-loss pulls as datagrams where each is answered at the version it asks)
        dgram = bool(cfg.loss_tolerance) and self.mode == "sync" and not self.backups
        self.client = PSClient(cfg.server_addr_list, run=run_id(cfg), worker=ctx.rank,
                               timeout=cfg.timeout, secret=load_secret(cfg.secret_file),
                               pace_bits=cfg.cluster.emulated_link_bits,
                               pace_burst=cfg.cluster.pacing_burst,
                               marks=Marks.for_switch(cfg.switch, total),
                               credits=bool(cfg.credit_window), datagram_pulls=dgram)
        self.finished = False  # the last step's pushes were acknowledged
        self._early_recv = 0  # bytes of the next step's pull received early (set-up, eval_model)
        self.step, self._staleness = 0, -1
        self.version0 = self._start_version(resume)
        self.pulled = self.version0  # the version of the parameters last pulled
        if ctx.rank == 0:
            self._initialize_servers(resume)
        self.pull = self._send_pull(min_version=self.version0 if self.mode == "sync" else 0)
        # Start together: servers answer the first pulls once every worker has sent
        # one, so waiting here is the rendezvous torch.distributed does for allreduce
        # during set-up, outside the steps and the clock; its bytes belong to step 0.
        recv = self.client.bytes_recv
        self.pull.wait()
        self._early_recv = self.client.bytes_recv - recv
        return model

    def _start_version(self, resume: dict[str, torch.Tensor] | None) -> int:
        """The servers' version the run starts at: the checkpoint's (its momentum too);
        a worker that holds no copy of it (under torchrun, a host other than rank 0's)
        resumes at the agreed step, which a synchronous server's version equals."""
        if resume is not None:
            return int(resume["ps/version"])
        sync_resume = self.ctx.resume is not None and self.mode == "sync"
        return self.ctx.resume.step if sync_resume else 0

    def _flatten(self, resume: dict[str, torch.Tensor] | None) -> int:
        """The flat vector in bucket order: bucket i is one contiguous range of it. On a
        GPU it is a pinned host mirror copied to the device after each pull; on the CPU
        pulled pieces become the parameters' storage directly (see _apply_piece). Filled
        from the model, or from the checkpoint resumed; returns its length."""
        order = [p for b in self.buckets.buckets for p in b.params]
        total = sum(p.numel() for p in order)
        device = self.ctx.device
        cuda = device.type == "cuda"
        self.host_flat = torch.empty(total, dtype=torch.float32, pin_memory=cuda)
        self.dev_flat = torch.empty(total, dtype=torch.float32, device=device) \
            if cuda else self.host_flat
        if resume is not None and resume["ps/params"].numel() != total:
            raise PsringError(f"the checkpoint holds {resume['ps/params'].numel()} parameters, "
                              f"this model {total}: resume with the run's own settings")
        off = 0
        self.param_spans: list[tuple[int, int, nn.Parameter]] = []
        for p in order:
            n = p.numel()
            src = resume["ps/params"][off:off + n] if resume is not None else p.detach().reshape(-1)
            self.host_flat[off:off + n].copy_(src)
            self.dev_flat[off:off + n].copy_(src)
            p.data = self.dev_flat[off:off + n].view_as(p)
            self.param_spans.append((off, off + n, p))
            off += n
        self.span_starts = [a for a, _, _ in self.param_spans]
        self.bucket_start, start = [], 0
        for b in self.buckets.buckets:
            self.bucket_start.append(start)
            start += b.numel
        return total

    # -- servers ------------------------------------------------------------------
    def _initialize_servers(self, resume: dict[str, torch.Tensor] | None) -> None:
        cfg = self.ctx.cfg
        momentum = resume.get("ps/momentum") if resume is not None else None
        keys = [self.client.send(k, "init", {
            "lo": lo, "hi": hi, "workers": self.ctx.world, "mode": self.mode, "lr": cfg.lr,
            "momentum": cfg.momentum, "weight_decay": cfg.weight_decay,
            "max_staleness": cfg.max_staleness, "version": self.version0,
            # compressed pulls are rounded: the final model is taken from the servers'
            # float32 copy of the last version (final_state)
            "snapshot_every": cfg.checkpoint_every or (cfg.steps if self.compressed else 0),
            "snapshot_last": cfg.steps, "wire_dtype": DTYPE_NAMES[self.wire_dtype],
            **({"backups": self.backups} if self.backups else {}), **self._init_fields()},
            [self._server_values(lo, hi)] + ([momentum[lo:hi]] if momentum is not None else []))
            for k, (lo, hi) in enumerate(self.ranges)]
        # A server that is not there fails here, quickly, naming its address.
        mib = max(hi - lo for lo, hi in self.ranges) * 4 / 2**20
        self.client.wait(keys, f"initialization (shards of up to {mib:.1f} MiB; a server "
                               f"disconnects a peer whose frame exceeds its --max-frame-mb)",
                         timeout=min(self.ctx.cfg.timeout, 30.0))

    def _init_fields(self) -> dict:
        """Settings of the servers' run beyond the optimizer's (byteps: its groups)."""
        return {}

    def _server_values(self, lo: int, hi: int) -> torch.Tensor:
        """Flat elements [lo, hi) as the servers hold them (here: the bucket order)."""
        return self.host_flat[lo:hi]

    def _send_pull(self, min_version: int) -> Replies:
        self._pull_version: int | None = None  # the oldest version among its pieces
        keys = [self.client.pull(k, min_version, hi - lo, self._apply_piece, at=lo)
                for k, (lo, hi) in enumerate(self.ranges)]
        return Replies(self.client, keys, "a pull of parameters")

    def _apply_piece(self, msg: Message) -> None:
        # (backups: shards may answer one pull at versions a step apart, shard 0 having
        # chosen before the others learnt it; a gradient of such a mix is labelled with
        # the older one, and the newer shards drop it as late)
        v = msg.header["version"]
        self._pull_version = v if self._pull_version is None else min(self._pull_version, v)
        self.pulled = self._pull_version
        a = msg.header["offset"]
        b = a + msg.tensors[0].numel()
        if a < 0 or b > self.host_flat.numel():
            raise PsringError(f"worker {self.ctx.rank}: a parameter server sent elements "
                              f"[{a}, {b}) of a {self.host_flat.numel()}-element model")
        piece = msg.tensors[0]
        if self.ctx.stand_in is not None:  # (device mode: a GPU's copy of it back)
            self.ctx.stand_in.copy("h2d", (b - a) * 4)
        if self.dev_flat is not self.host_flat or piece.dtype != self.host_flat.dtype:
            # a GPU's parameters, or compressed ones (cast back to float32 here)
            self.host_flat[a:b].copy_(piece)
            if self.dev_flat is not self.host_flat:
                self.dev_flat[a:b].copy_(self.host_flat[a:b], non_blocking=True)
            else:
                self._point_params_at_flat(a, b)
            return
        # On the CPU a parameter that lies wholly inside the piece becomes a view of the
        # received frame (no copy; the frame lives as long as the view). One that the
        # piece only partly covers (cut by a shard boundary) is copied into the flat
        # vector and points there.
        i = max(0, bisect.bisect_right(self.span_starts, a) - 1)
        while i < len(self.param_spans) and self.param_spans[i][0] < b:
            pa, pb, p = self.param_spans[i]
            if a <= pa and pb <= b:
                p.data = piece[pa - a:pb - a].view_as(p)
            elif pb > a:
                lo, hi = max(a, pa), min(b, pb)
                self.host_flat[lo:hi].copy_(piece[lo - a:hi - a])
                p.data = self.host_flat[pa:pb].view_as(p)
            i += 1

    def _point_params_at_flat(self, a: int, b: int) -> None:
        """Parameters overlapping elements [a, b) become views of the flat vector (a
        received piece that could not be used as their storage was copied there)."""
        i = max(0, bisect.bisect_right(self.span_starts, a) - 1)
        while i < len(self.param_spans) and self.param_spans[i][0] < b:
            pa, pb, p = self.param_spans[i]
            if pb > a and p.data.data_ptr() != self.host_flat[pa:pb].data_ptr():
                p.data = self.host_flat[pa:pb].view_as(p)
            i += 1

    @property
    def compressed(self) -> bool:
        return self.wire_dtype != torch.float32

    @property
    def push_step(self) -> int:
        """The step this worker's gradients are for: the loop's, or with backup workers
        the version they were computed on (a dropped worker may have skipped one)."""
        return self.pulled if self.backups else self.step

    @property
    def run_over(self) -> bool:
        """(backups) The servers took the run's last step without this worker: the rest
        of its steps have nothing to push."""
        steps = self.ctx.cfg.steps  # (0: a script's run, which the script ends)
        return bool(self.backups) and bool(steps) and self.pulled >= steps

    def _push(self, bucket: Bucket) -> Handle:
        if self.run_over:
            return DONE
        start = self.bucket_start[bucket.index]
        data = bucket.buffer
        if self.host_buckets[bucket.index] is not None:  # GPU gradients go via the host
            data = self.host_buckets[bucket.index].copy_(bucket.buffer)
        elif self.ctx.stand_in is not None:  # (device mode: that copy's time)
            self.ctx.stand_in.copy("d2h", bucket.nbytes)
        if self.wire_buckets[bucket.index] is not None:  # --compress
            data = self.wire_buckets[bucket.index].copy_(data)
        tolerance = self.ctx.cfg.loss_tolerance
        keys = [self.client.push(k, {"step": self.push_step, "offset": s},
                                 data[s - start:e - start], tolerance)
                for k, s, e in overlaps(start, start + bucket.numel, self.ranges)]
        return Replies(self.client, keys, "a gradient push", self._on_acks)

    def _on_acks(self, msgs: list[Message]) -> None:
        for m in msgs:
            if m.header["shard"] == 0:
                self._staleness = max(self._staleness, m.header["staleness"])

    # -- the loop's hooks -------------------------------------------------------------
    def no_sync(self) -> ContextManager[None]:
        # --accumulate: earlier micro-batches only accumulate; the last one is pushed
        return self.buckets.paused()

    def begin_step(self, step: int) -> Handle:
        self.step = step
        self._staleness = -1
        self._at_start = self.client.mark(self._early_recv)
        self._early_recv = 0
        return self.pull

    def finish_backward(self) -> Handle:
        acks = self.buckets.finish()
        step, over = self.push_step, self.run_over
        # Right behind the pushes on every connection: a server sees the pull after
        # this worker's gradients, and answers it as soon as the rules allow.
        self.pull = self._send_pull((step + 1 if not over else step)
                                    if self.mode == "sync" else 0)
        if not self.backups:
            return WaitAll(acks, then=self._account)
        return WaitAll(acks, then=lambda: self._commit(step, over))

    def _commit(self, step: int, over: bool) -> None:
        """(backups) Every push of ``step`` is acknowledged: count this worker in with
        shard 0, and if the step took it, tell the other shards whom it took."""
        taken = False
        if not over:
            (chosen,) = self.client.wait([self.client.send(0, "commit", {"step": step})],
                                         f"the choice of step {step}'s workers")
            taken, workers = chosen.header["taken"], chosen.header["workers"]
            if taken and len(self.ranges) > 1:
                self.client.wait([self.client.send(k, "choose", {"step": step,
                                                                 "workers": workers})
                                  for k in range(1, len(self.ranges))],
                                 f"telling the servers step {step}'s workers")
        # which of the servers' steps it was (a worker dropped late may skip one, then
        # computes on a newer version), and whether its gradients were thrown away
        self.stats.extra.update(version=step, dropped=not taken)
        self._account()

    def _account(self) -> None:
        # the last step's pushes are acknowledged: this worker is done (see close)
        self.finished = self.step == self.ctx.cfg.steps - 1
        self.client.account(self.stats, self._at_start)
        if self.mode == "async":
            self.stats.extra["staleness"] = self._staleness

    def update(self, optimizer) -> None:
        """Nothing to do: the servers applied the update; the next pull brings it."""

    def eval_model(self, model: nn.Module) -> nn.Module:
        """The pull sent after this step's pushes brings the servers' parameters: in
        sync mode the version after this step's update, in async mode the latest one
        (the servers' state at that moment). The next step reuses the same pull."""
        recv = self.client.bytes_recv
        self.pull.wait()
        # the next step's begin_step would have received this pull: its bytes are that
        # step's, not lost between steps
        self._early_recv += self.client.bytes_recv - recv
        return model

    # -- checkpoints: the state is in the servers ------------------------------------
    def checkpoint_state(self, model, optimizer) -> dict[str, torch.Tensor]:
        """Worker 0 fetches every shard's copy of the same version (each server took it
        the moment its version reached the checkpoint's, see servers/handler.py), so the
        checkpoint is consistent without stopping the other workers. In async mode there
        is no shared version boundary: each shard is copied as it is when asked."""
        if self.ctx.rank != 0:
            return {}
        state = self._servers_state("a checkpoint")
        # buffers (batch norm's running statistics) are each worker's own, never sent to
        # the servers: the checkpoint keeps rank 0's, as the final model does
        state.update({"buffer/" + k: v.detach().cpu().clone()
                      for k, v in model.named_buffers()})
        return state

    def _servers_state(self, what: str, now: bool = False) -> dict[str, torch.Tensor]:
        """Every shard's float32 copy of the version after this step (sync; in async mode,
        as it is now): parameters, momentum, version. ``now`` (sync, between steps, this
        worker's pull waited for): the servers' state as it is, that version, since none
        goes on without this worker's next push (momentum double-buffered: servers.store)."""
        # the loop's step numbers are absolute (a resumed run continues them), and so are
        # the servers' versions: after step s a synchronous server is at version s + 1
        version = self.step + 1 if self.mode == "sync" and not now else SNAPSHOT_NOW
        if self.backups:
            # the servers go on without a late worker: worker 0 may trail them. Every
            # shard's newest copy, then the oldest of those from the shards past it
            # (they keep a few: psring.servers.snapshots.BACKUP_COPIES)
            msgs = self._snapshots(SNAPSHOT_NEWEST, range(len(self.ranges)), what)
            version = min(m.header["version"] for m in msgs)
            again = [k for k, m in enumerate(msgs) if m.header["version"] != version]
            for k, m in zip(again, self._snapshots(version, again, what)):
                msgs[k] = m
        else:
            msgs = self._snapshots(version, range(len(self.ranges)), what)
        params = torch.empty_like(self.host_flat, pin_memory=False)
        momentum = torch.empty_like(params) if len(msgs[0].tensors) == 2 else None
        for (lo, hi), m in zip(self.ranges, msgs):
            params[lo:hi].copy_(m.tensors[0])
            if momentum is not None:
                momentum[lo:hi].copy_(m.tensors[1])
        state = {"ps/params": params,
                 "ps/version": torch.tensor(min(m.header["version"] for m in msgs))}
        if momentum is not None:
            state["ps/momentum"] = momentum
        return state

    def _snapshots(self, version: int, shards, what: str) -> list[Message]:
        keys = [self.client.send(k, "snapshot", {"version": version}) for k in shards]
        return self.client.wait(keys, f"{what} of version {version}") if keys else []

    def checkpoint_step(self, done: int, state: dict[str, torch.Tensor]) -> int:
        """With backups, the servers' version the state is of (worker 0 may trail it:
        the run resumes there)."""
        return int(state["ps/version"]) if self.backups and state else done

    def restore_checkpoint(self, model, optimizer, state) -> None:
        """The parameters were put back in setup() (the servers were initialized from the
        checkpoint); the buffers are put back here, on every worker."""
        with torch.no_grad():
            for k, v in model.named_buffers():
                if "buffer/" + k in state:
                    v.copy_(state["buffer/" + k])

    def finish_run(self, model: nn.Module) -> None:
        """The parameters after the last step (its pull), and this worker done: it says
        goodbye to the servers when it closes."""
        self.eval_model(model)
        self.finished = True

    def server_momentum(self, model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
        """The servers' momentum of the version this worker holds (between steps, its
        pull waited for), each parameter's piece of the flat vector."""
        if self.mode != "sync" or self.backups:
            raise PsringError(f"{self.name}'s servers go on without this worker "
                              f"({'async' if self.mode != 'sync' else '--backup-workers'}): "
                              f"their momentum belongs to no version it holds.")
        self.eval_model(model)
        state = self._servers_state("the optimizer's state", now=True)
        if int(state["ps/version"]) != self.pulled:
            raise PsringError(f"worker {self.ctx.rank}: the servers are at version "
                              f"{int(state['ps/version'])}, this worker at {self.pulled}: "
                              f"their momentum is not of its parameters.")
        momentum = state.get("ps/momentum")
        if momentum is None:  # (SGD without momentum keeps no state)
            return {}
        flat, out, off = self._in_bucket_order(momentum), {}, 0
        for p in (p for b in self.buckets.buckets for p in b.params):
            out[p] = flat[off:off + p.numel()].view_as(p).to(p.device).clone()
            off += p.numel()
        return out

    def _in_bucket_order(self, flat: torch.Tensor) -> torch.Tensor:
        """The servers' flat vector in the workers' order (ps: the same one)."""
        return flat

    def final_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        self.pull.wait()  # the parameters after the last step
        if self.compressed:
            # the pulled parameters were rounded to the wire dtype: the model is the
            # servers' float32 master copy
            # (a script's run may end before --steps, where no copy was planned)
            self.host_flat.copy_(self._servers_state(
                "the final model", now=self.step + 1 != self.ctx.cfg.steps)["ps/params"])
            if self.dev_flat is not self.host_flat:
                self.dev_flat.copy_(self.host_flat)  # the GPU's parameters are its views
            else:
                self._point_params_at_flat(0, self.host_flat.numel())
        if self.dev_flat is not self.host_flat:
            torch.cuda.synchronize()
        return super().final_state(model)

    def close(self) -> None:
        if hasattr(self, "buckets"):
            self.buckets.remove_hooks()
        if hasattr(self, "client"):
            try:
                # Only a worker that finished says goodbye (so a bounded-staleness server
                # stops counting it); one stopped by a failure or a signal leaves at once,
                # instead of waiting for servers it may no longer reach.
                if not self.finished:
                    return
                keys = [self.client.send(k, "leave", {}) for k in range(len(self.ranges))]
                self.client.wait(keys, "leaving", timeout=min(self.ctx.cfg.timeout, 5.0))
            except PsringError:
                pass  # closing anyway; a server that is gone needs no goodbye
            finally:
                self.client.close()

    @classmethod
    def bytes_per_step(cls, param_bytes: int, world: int,
                       per_host: int = 1) -> tuple[int, int]:
        return param_bytes, param_bytes  # push every gradient, pull every parameter


@STRATEGIES.register("async-ps")
class AsyncParameterServer(ParameterServer):
    name = "async-ps"
    caps = replace(ParameterServer.caps, synchronous=False, supports_staleness_bound=True,
                   cost_model="ps-async", survives_lost_workers=True, supports_backups=False)
    mode = "async"

