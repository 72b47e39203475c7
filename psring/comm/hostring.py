"""A flat ring all-reduce built from point-to-point sends, in NCCL's ring order, whose
hops inside a host can take a device interconnect's time (``--device-link``) while its
hops between hosts really cross the emulated links.

    psring run --strategy allreduce --workers 8 --hosts 2 --link 20gbit --compute device \\
        --device-profile runs/prof-vgg16 --time-scale 20 --device-link nvlink

On a GPU host a flat ring (NCCL's, under Horovod or DDP) passes through every device of
a host over NVLink or PCIe before it crosses to the next host: of its N hops per step,
H cross hosts and N - H stay inside one. Here a host's workers are processes on the
same 2 cores, and gloo's ring runs every hop over loopback, so in device mode the hops
inside a host would be the one part of the devices' work done by this machine's cores.
:class:`HostRing` runs the ring itself, rank r sending to r + 1 (ranks h*G .. h*G+G-1 on
host h, the order NCCL's rings take through a node): 2(N - 1) steps of 1/N of the
tensor each (``tensor_split``'s chunks: the first ones one element larger where N does
not divide it), the first N - 1 adding what arrives (the reduce-scatter), the rest
copying it (the all-gather).

- Without a link every hop is a real send (the values reduced: the sum, as
  ``dist.all_reduce``; tests check it against it).
- With ``link`` (α seconds, bytes per second), a hop inside a host sends a one-element
  token holding when it left (one clock for a host's processes), and the receiver holds
  the step until ``α + chunk / rate`` (x ``time_scale`` on the wall) after the later of
  when it left and when the link finished the chunk before (one chunk at a time);
  a hop between hosts sends the chunk's real bytes. Nothing is added (device mode learns
  nothing: psring.train.device), so no host CPU is spent where a device would sum.

One ring at a time, in launch order, on the worker's :class:`DeviceStream` (a device's
communication stream), in a process group of its own.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from psring.comm.interconnect import DeviceStream, StreamHandle, group_timeout, host_layout, parse


class HostRing:
    """Ring all-reduces of ``world`` ranks, hosts of ``per_host`` consecutive ranks (see
    the module's doc). ``send``/``recv`` start a point-to-point message and return its
    Work (parameters for tests; by default ``dist.isend``/``dist.irecv`` in ``group``)."""

    def __init__(self, group: Any, rank: int, world: int, per_host: int,
                 link: tuple[float, float] | None = None, time_scale: float = 1.0,
                 send: Callable | None = None, recv: Callable | None = None) -> None:
        import torch.distributed as dist

        self.rank, self.world = rank, world
        self.next, self.prev = (rank + 1) % world, (rank - 1) % world
        host = rank // per_host
        self.timed_out = link is not None and self.next // per_host == host
        self.timed_in = link is not None and self.prev // per_host == host
        self.link, self.time_scale = link, time_scale
        self.send = send or (lambda t, dst: dist.isend(t, dst, group=group))
        self.recv = recv or (lambda t, src: dist.irecv(t, src, group=group))
        # a token carries when its step left (perf_counter: CLOCK_MONOTONIC, one clock
        # for every process of a host)
        self.token_out = torch.zeros(1, dtype=torch.float64)
        self.token_in = torch.zeros(1, dtype=torch.float64)
        self._link_free = 0.0  # when the link from the previous rank is free (timed)
        self._buf: torch.Tensor | None = None
        self.stream = DeviceStream("psring-host-ring", stop_on_error=True)

    def all_reduce(self, tensor: torch.Tensor,
                   then: Callable[[BaseException | None], None] | None = None) -> StreamHandle:
        """Sum ``tensor`` (contiguous) over every rank, in place, on the stream (with a
        link: take the ring's time, the values left as they are); the handle's
        ``wait()`` returns once it is done, and ``then(error)`` is called."""
        return self.stream.submit(lambda: self._ring(tensor.view(-1)), then)

    def hop_s(self, nbytes: int) -> float:
        """A timed hop's wall seconds for a chunk of ``nbytes``."""
        alpha, rate = self.link
        return self.time_scale * (alpha + nbytes / rate)

    def _ring(self, flat: torch.Tensor) -> None:
        n = self.world
        if n == 1:
            return
        chunks = flat.tensor_split(n)  # (the larger ones first: buf fits every one)
        buf = self._buffer(chunks[0])
        for s in range(2 * (n - 1)):
            out = chunks[(self.rank - s) % n]
            into = chunks[(self.rank - s - 1) % n]
            self._step(out, into, buf[:into.numel()], add=s < n - 1)

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        """Where a chunk from the previous rank lands (kept from ring to ring)."""
        if self.timed_in:
            return like[:0]  # (a token comes instead)
        if self._buf is None or self._buf.numel() < like.numel() or \
                self._buf.dtype != like.dtype:
            self._buf = torch.empty_like(like)
        return self._buf

    def _step(self, out: torch.Tensor, into: torch.Tensor, buf: torch.Tensor,
              add: bool) -> None:
        if self.timed_out:
            self.token_out[0] = time.perf_counter()
        sent = self.send(self.token_out if self.timed_out else out, self.next)
        got = self.recv(self.token_in if self.timed_in else buf, self.prev)
        got.wait()
        if self.timed_in:
            # the chunk is in once the device link has carried it from when it left, after
            # the chunks before it (one link, first in first out)
            left = max(float(self.token_in[0]), self._link_free)
            self._link_free = left + self.hop_s(into.numel() * into.element_size())
            sent.wait()
            time.sleep(max(0.0, self._link_free - time.perf_counter()))
            return
        if self.link is None and add:  # a real reduction (no link: nothing is timed)
            into.add_(buf)
        elif self.link is None:
            into.copy_(buf)
        sent.wait()

    def close(self) -> None:
        self.stream.close()


def flat_ring(ctx: Any) -> HostRing | None:
    """The worker's timed flat ring under --device-link, else None (torch's own
    all-reduce). Collective: every rank creates the ring's process group here."""

    link = parse(getattr(ctx.cfg, "device_link", ""))
    if link is None:
        return None
    import torch.distributed as dist

    g, _, _, _ = host_layout(ctx, ctx.cfg.strategy)
    group = dist.new_group(list(range(ctx.world)), timeout=group_timeout(ctx))
    return HostRing(group, ctx.rank, ctx.world, g, link, time_scale=ctx.cfg.time_scale)
