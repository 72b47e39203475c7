"""A host's own interconnect: the collectives among the workers of one host (byteps's and
hallreduce's reduce-scatter and all-gather), behind one seam, :func:`host_comm`.

    psring run --strategy byteps --workers 8 --hosts 2 --link 20gbit --servers 2 \\
        --server-placement own-hosts --update-on worker --compute device \\
        --device-profile runs/prof-vgg16 --time-scale 20 --device-link nvlink

On a GPU host these collectives run from device to device (NCCL over NVLink or PCIe):
they take neither the host's cores nor its NIC. Here a host's workers are processes on
the same 2 cores, and the collectives are gloo over loopback: in device mode, where
every worker's compute is already time, they would be the one part of the devices' work
still done by this machine's cores (a VGG-16 byteps step on 2 hosts of 4 spent 2.7 s of
real time in its all-gathers alone). ``--device-link`` (device mode only) makes them
time as well:

- :class:`GroupComm` (default): the host's torch process group (gloo here, NCCL where
  CUDA is): the real collective, the reduced values.
- :class:`TimedComm` (``--device-link nvlink`` or a rate such as ``1200gbit``): each
  collective first waits for every worker of the host to start it (a one-element
  all-reduce in the host's group, so a late worker holds its host back as it would on
  the devices), then takes a ring's time on the described clock, ``(G - 1) (α + B/G /
  rate)`` for B bytes in, x ``--time-scale`` on the wall, one collective after another
  as on a device's stream. Only this worker's own part moves (the reduce-scatter hands
  on its own part of its own gradient, the all-gather puts the part in place): nothing
  is learnt in device mode, and what crosses the emulated links (the pushes, the pulls,
  the rings across hosts) keeps its real size.

A flat ring (``allreduce``, ``ddp``) has no collective inside a host: its hops between
two workers of one host are timed by psring.comm.hostring, on the same link.

A parameter server's worker (``ps``, ``async-ps``, ``byteps``) copies each gradient from
its device to host memory before a push and the parameters back after a pull: the
host's PCIe, which a named interconnect carries beside its own rate (:data:`LINKS`; a
rate alone describes a host whose devices reach each other and host memory at that
rate). ``--device-link`` sets those copies (:func:`on_host`, the profile's
``host_copy``), in the run's device stand-in as in the simulator's replay and advise;
what then crosses to a server on the worker's own host is host memory's, real here.
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from psring.errors import ConfigError
from psring.units import parse_rate

if TYPE_CHECKING:  # (psring.config sits above: it validates against the registries)
    from psring.config import RunConfig

#: a ring step's start-up on a device interconnect (NCCL's order of magnitude)
DEVICE_ALPHA_S = 10e-6
#: NVLink 2.0 on a V100 (6 links x 25 GB/s each way: 150 GB/s)
NVLINK = (DEVICE_ALPHA_S, 150e9)
#: PCIe 3.0 x16 each way (8 GT/s x 16 lanes, 128b/130b): a V100 host's bus to host memory
PCIE3 = 15.75e9
#: named interconnects: (bytes per second each way per device among the host's devices,
#: bytes per second each way between a device and host memory (its PCIe), what it is):
#: the vendors' figures (what NCCL and cudaMemcpy reach is lower); ``nvlink`` is a
#: V100's, the seeds' (BytePS, Horovod) hosts. Sources: NVIDIA's DGX-1 (V100) and DGX
#: A100 system architecture white papers, the HGX H100 datasheet, PCI-SIG's rates.
LINKS: dict[str, tuple[float, float, str]] = {
    "nvlink": (150e9, PCIE3, "NVLink 2.0, V100 (DGX-1): 6 links x 25 GB/s; PCIe 3.0 x16"),
    "nvlink2": (150e9, PCIE3, "NVLink 2.0, V100 (DGX-1): 6 links x 25 GB/s; PCIe 3.0 x16"),
    "nvlink3": (300e9, 2 * PCIE3, "NVLink 3, A100 (DGX A100): 12 links x 25 GB/s; PCIe 4.0 x16"),
    "nvlink4": (450e9, 4 * PCIE3, "NVLink 4, H100 SXM (HGX H100): 18 x 25 GB/s; PCIe 5.0 x16"),
    "pcie": (PCIE3, PCIE3, "PCIe 3.0 x16, an 8-GPU PCIe host of the V100 era"),
    "pcie3": (PCIE3, PCIE3, "PCIe 3.0 x16"),
    "pcie4": (2 * PCIE3, 2 * PCIE3, "PCIe 4.0 x16"),
    "pcie5": (4 * PCIE3, 4 * PCIE3, "PCIe 5.0 x16"),
}


def parse(text: str) -> tuple[float, float] | None:
    """(α seconds, bytes per second) of a --device-link value: a name in LINKS or a
    rate such as 1200gbit; None for ''."""
    if not text:
        return None
    return DEVICE_ALPHA_S, _rates(text)[0]


def _rates(text: str) -> tuple[float, float]:
    """(device-to-device, device-to-host) bytes per second of a non-empty --device-link."""
    if text.lower() in LINKS:
        return LINKS[text.lower()][:2]
    try:
        rate = parse_rate(text, "--device-link")
    except ConfigError as e:
        names = ", ".join(f"{n} ({b / 1e9:g} GB/s)" for n, (b, _, _) in LINKS.items())
        raise ConfigError(f"{e} Or name the interconnect: --device-link {names}.") from None
    return rate / 8, rate / 8


def host_copy(text: str) -> dict[str, Any] | None:
    """A device's copies to and from host memory on the host --device-link ``text``
    describes, as a profile's ``host_copy`` (:class:`psring.records.profile.Profile`);
    None for ''."""
    if not text:
        return None
    rate = _rates(text)[1]
    what = LINKS[text.lower()][2] if text.lower() in LINKS else "a rate given"
    return {"d2h": [DEVICE_ALPHA_S, rate], "h2d": [DEVICE_ALPHA_S, rate],
            "source": f"--device-link {text}: {rate / 1e9:g} GB/s each way ({what})"}


def on_host(prof: Any, text: str) -> Any:
    """``prof`` (a Profile) with its host copies at the PCIe rate of the host --device-link
    ``text`` describes, in place of its own; ``prof`` itself without the flag. The one
    rule the run's device stand-in, the replay and advise follow."""
    from dataclasses import replace

    copies = host_copy(text)
    return prof if copies is None else replace(prof, host_copy=copies)


def alpha_beta(link: tuple[float, float]) -> tuple[float, float]:
    """(α, β seconds per byte) of a (α, bytes per second) link: the simulator's ``inside``."""
    return link[0], 1 / link[1]


def check(cfg: RunConfig, strategy_cls: Any) -> None:
    """--device-link's settings, before any process starts."""
    link = parse(cfg.device_link)  # (a bad rate raises, naming the flag)
    if link is None:
        return
    if cfg.compute != "device":
        raise ConfigError("--device-link times the collectives inside a host as a device "
                          "interconnect's, which only a timing-only run may do (the "
                          "gradients are not reduced): add --compute device, or drop "
                          "--device-link.")
    why = not_timed(strategy_cls.caps, cfg.reduce)
    if why:
        raise ConfigError(f"--device-link times a strategy's traffic among the workers of "
                          f"one host; {cfg.strategy!r} {why}")
    check_hosts(cfg.workers, cfg.cluster.hosts)


def not_timed(caps: Any, reduce: str = "sum") -> str:
    """Why --device-link has nothing to time for a strategy of ``caps`` under --reduce
    ``reduce`` (with the fix), or '' where it applies: the one rule psring run's check,
    sweeps and advise --verify follow."""
    if not caps.inside_host:
        # (the strategies whose caps declare inside_host: tests/unit/test_capabilities.py)
        return ("has none it can time. Use allreduce, ddp, hallreduce, byteps, ps or "
                "async-ps, or drop --device-link.")
    if caps.inside_host == "ring-hops" and reduce == "adasum":
        return ("runs a flat ring, whose hops it times, and --reduce adasum swaps halves "
                "between workers instead (those stay loopback): use --strategy hallreduce "
                "--reduce adasum (Adasum across hosts, the host's collectives timed), or "
                "drop one of the flags.")
    return ""


def check_hosts(workers: int, hosts: int) -> None:
    """--device-link needs a host of several workers (psring run's and psring advise's)."""
    if workers <= hosts:
        raise ConfigError(f"--device-link times the collectives among the workers of one "
                          f"host, and {workers} worker(s) on {hosts} host(s) leave one a "
                          f"host: nothing to time. Put several workers on a host "
                          f"(--workers-per-host), or drop --device-link.")


def collective_s(workers: int, nbytes: float, alpha: float, rate: float) -> float:
    """A ring reduce-scatter's (or all-gather's) time among ``workers`` devices, for
    ``nbytes`` in (out): G - 1 steps of B/G bytes each."""
    if workers <= 1:
        return 0.0
    return (workers - 1) * (alpha + nbytes / workers / rate)


def flat_collectives() -> tuple[Any, Any]:
    """torch.distributed's (reduce-scatter, all-gather) of one flat tensor: the
    ``*_single`` names where torch has them (2.13 deprecates ``reduce_scatter_tensor``
    and ``all_gather_into_tensor`` for them, same arguments), else the older ones."""
    import torch.distributed as dist

    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor,
            getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)


def gloo_group(group: Any) -> bool:
    """Whether ``group`` runs on gloo, which takes CUDA tensors for all_reduce and
    broadcast only (torch.distributed's backend table)."""
    import torch.distributed as dist

    return str(dist.get_backend(group)) == "gloo"


class Staged:
    """A collective of CUDA tensors run on host copies (gloo): :meth:`wait` waits for it
    and copies the result back to the device tensor."""

    def __init__(self, work: Any, host_out: torch.Tensor, out: torch.Tensor) -> None:
        self.work, self.host_out, self.out = work, host_out, out

    def wait(self) -> bool:
        self.work.wait()
        self.out.copy_(self.host_out)
        return True


def all_reduce(t: torch.Tensor, group: Any = None):
    """dist.all_reduce(t) started (its Work). gloo's CUDA all-reduce has no bfloat16
    (pytorch/pytorch#111131: "Invalid scalar type"): on a gloo group such a tensor is
    summed in a host copy (:class:`Staged`)."""
    import torch.distributed as dist

    if t.is_cuda and t.dtype == torch.bfloat16 and gloo_group(group):
        host = t.cpu()
        return Staged(dist.all_reduce(host, group=group, async_op=True), host, t)
    return dist.all_reduce(t, group=group, async_op=True)


class GroupComm:
    """The host's collectives as torch runs them, each returning its async Work. On a
    gloo group, CUDA tensors go through host memory (:class:`Staged`): a host that
    runs more workers than it has GPUs shares them over gloo (NCCL takes one rank per
    GPU; workers.entry.process_group_backend)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._rs, self._ag = flat_collectives()
        self.staged = gloo_group(group)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor):
        return self._run(self._rs, out, inp)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor):
        return self._run(self._ag, out, inp)

    def _run(self, op, out: torch.Tensor, inp: torch.Tensor):
        if not (self.staged and out.is_cuda):
            return op(out, inp, group=self.group, async_op=True)
        host_out = torch.empty(out.shape, dtype=out.dtype)
        return Staged(op(host_out, inp.cpu(), group=self.group, async_op=True),
                      host_out, out)

    def close(self) -> None:
        pass


class StreamHandle:
    """A job's handle on a DeviceStream (a timed collective, a ring): done when it has
    run (or failed)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> bool:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return True


class DeviceStream:
    """A device's communication stream: jobs run one after another on one thread, in
    the order they were submitted (as collectives on a CUDA stream), each completing
    its handle; ``then(error)``, if given, is called once a job is done.
    ``stop_on_error``: after a job fails every later one fails with its error, unrun
    (a ring whose ranks went out of step must not pair one step's messages with
    another's)."""

    def __init__(self, name: str, stop_on_error: bool = False) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._broken: BaseException | None = None
        self._stop_on_error = stop_on_error
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def check_open(self) -> None:
        if self._closed:  # (a reduction still on a communication thread after close)
            raise RuntimeError("the host's timed interconnect was closed")

    def submit(self, job, then=None) -> StreamHandle:
        self.check_open()
        handle = StreamHandle()
        self._queue.put((job, handle, then))
        return handle

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, handle, then = item
            handle.error = self._do(job)
            handle.done.set()
            if then is not None:
                try:
                    then(handle.error)
                except BaseException as e:  # noqa: BLE001 -- the stream must go on
                    handle.error = handle.error or e

    def _do(self, job) -> BaseException | None:
        if self._closed:  # queued when the worker closed: never run
            return RuntimeError("the host's timed interconnect was closed")
        if self._broken is not None:
            return self._broken
        try:
            job()
        except BaseException as e:  # noqa: BLE001 -- handed to whoever waits on it
            if self._stop_on_error:
                self._broken = e
            return e
        return None

    def close(self, wait_s: float = 1.0) -> None:
        """Stop taking jobs; fail the queued ones. Waits up to ``wait_s`` for one under
        way (a ring blocked on a peer that is gone ends with the process: daemon)."""
        self._closed = True
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(wait_s)


class TimedComm:
    """The host's collectives as a device interconnect's time (see the module's doc).
    ``enter`` starts the one-element collective that every worker of the host must join
    and returns its Work (a parameter for tests; by default an all-reduce in ``group``)."""

    def __init__(self, group: Any, workers: int, local: int, alpha: float, rate: float,
                 time_scale: float = 1.0, enter=None) -> None:
        self.workers, self.local = workers, local
        self.alpha, self.rate, self.time_scale = alpha, rate, time_scale
        if enter is None:
            import torch.distributed as dist

            token = torch.zeros(1)
            enter = lambda: dist.all_reduce(token, group=group, async_op=True)  # noqa: E731
        self.enter = enter
        self._free_at = 0.0  # when the device's stream is free (perf_counter)
        self.stream = DeviceStream("psring-device-link")

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> StreamHandle:
        n = out.numel()
        part = inp[self.local * n:(self.local + 1) * n]
        return self._submit(inp.numel() * inp.element_size(), lambda: out.copy_(part))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> StreamHandle:
        n = inp.numel()
        part = out[self.local * n:(self.local + 1) * n]
        return self._submit(out.numel() * out.element_size(), lambda: part.copy_(inp))

    def _submit(self, nbytes: int, move) -> StreamHandle:
        self.stream.check_open()
        # entered here, on the caller's thread: the host's workers issue the one-element
        # collectives in the order they issue the real ones, as torch requires
        work = self.enter()
        return self.stream.submit(lambda: self._take_time(work, nbytes, move))

    def _take_time(self, work: Any, nbytes: int, move) -> None:
        work.wait()
        start = max(time.perf_counter(), self._free_at)
        self._free_at = start + self.time_scale * collective_s(
            self.workers, nbytes, self.alpha, self.rate)
        move()
        time.sleep(max(0.0, self._free_at - time.perf_counter()))

    def close(self) -> None:
        self.stream.close()


def group_timeout(ctx: Any) -> timedelta:
    """A process group's timeout: the run's --timeout, as the default group's (torch's
    new_group would wait its own 30 minutes)."""
    return timedelta(seconds=float(getattr(ctx.cfg, "timeout", 300.0)))


def host_layout(ctx: Any, who: str) -> tuple[int, int, int, int]:
    """(G workers per host, H hosts, this worker's host, its local rank), ranks h*G ..
    h*G+G-1 on host h (as torchrun and psring's launcher number them)."""
    g = ctx.local_world
    if g < 1 or ctx.world % g:
        raise RuntimeError(f"{who}: {ctx.world} workers do not make hosts of {g} "
                           f"(LOCAL_WORLD_SIZE) each")
    return (g, ctx.world // g, *divmod(ctx.rank, g))


def host_comm(ctx: Any, who: str) -> GroupComm | TimedComm | None:
    """This worker's host collectives (None with one worker per host). Collective: every
    rank creates every host's process group, in the same order, as torch requires."""
    import torch.distributed as dist

    g, hosts, host, local = host_layout(ctx, who)
    mine = None
    for h in range(hosts):
        grp = dist.new_group(list(range(h * g, (h + 1) * g)), timeout=group_timeout(ctx))
        if h == host:
            mine = grp
    if g == 1:
        return None
    link = parse(getattr(ctx.cfg, "device_link", ""))
    if link is None:
        return GroupComm(mine)
    return TimedComm(mine, g, local, *link, time_scale=ctx.cfg.time_scale)
