"""Device stand-in (``--compute device``): a worker's compute as time, its communication
real.

    psring profile --model resnet18 --batch-size 32 --out runs/prof-r18
    psring run --strategy allreduce --workers 8 --hosts 4 --link 10gbit --model resnet18 \\
        --batch-size 256 --compute device --device-profile runs/prof-r18 --device-speed 4

On the clusters psring answers about, forward and backward run on each worker's own
accelerator while the host's CPU and NIC move the gradients. On one small machine every
worker's compute shares its few cores with everything else, so a run of many workers
measures CPU contention. In device mode each worker's forward, backward and optimizer
step take the profile's times (psring.records.profile) divided by ``--device-speed``, as
sleeps that leave the cores free, while every byte that moves stays real: gradients
copied into buckets and frames, gloo, ZeroMQ, the servers' sums and updates, the
emulated links.

How (:class:`DeviceCompute`, installed on the model before the strategy sees it):

- **forward** sleeps the profile's forward time and returns logits built from a chain
  of cheap autograd nodes, one per trainable parameter, in the order the profile's
  backward made their gradients final; the loss (:meth:`DeviceCompute.loss`) is the
  chain's end, with no work over the logits;
- **backward** walks that chain: each node sleeps until its parameter's ready time
  (from the start of backward), then hands autograd a gradient for it, which goes
  through the parameter's own AccumulateGrad, so every gradient hook fires then: psring's
  buckets launch, and torch DDP's reducer hooks fire, in the device's order;
- the **optimizer step** is :class:`DeviceSGD`: a sleep of the profile's update time.
  Parameters on a worker are not changed by it (a device would update its own copy; the
  host never sees that work). Parameter servers still sum and update for real.

Gradients are deterministic per (seed, worker, step, parameter) and finite (each
parameter's gradient is one value, filled). Nothing is learnt: a device-mode run is
*timing only* (its manifest says so; reports show no loss or accuracy for it).

The profile's times are for its batch (``profile.batch_size``); a run with another
per-worker batch scales them in proportion (stated in the manifest).
"""

from __future__ import annotations

import math
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from psring.comm.interconnect import check as check_device_link
from psring.comm.interconnect import on_host
from psring.errors import ConfigError
from psring.records.profile import PROFILE_FILE, Profile
from psring.records.runlog import usable_cores

if TYPE_CHECKING:  # (psring.config sits above: it validates against the registries)
    from psring.config import RunConfig

MODES = ("real", "device")

#: What this machine was measured to carry in device mode (docs/emulation.md, "Device
#: mode"; benchmarks/bench_device_capacity.py, 2 cores): the workers' host-side work on
#: their gradients (the stand-in's fill, the copy into buckets, the reduction: about 3
#: passes a step) held the device's time within 0.1% at 1.2 GB per core-second (16
#: ResNet-50 workers), within 4% at 3, and was 18% off at 2.2 with 8 VGG-16 workers
#: whose 4 Gbit/s of links also loaded the cores, 4x off at 11: so 1.5, conservative;
#: links, summed over the hosts, carried 90-95% of their rate up to 4 Gbit/s emulated
#: on 2 cores while the host work was light.
HOST_BYTES_PER_CORE_S = 1.5e9
LINK_BITS_PER_CORE = 2e9
PASSES = 3


def load_profile(path: str) -> Profile:
    """The profile a --device-profile names (a profile directory or its profile.json),
    or a ConfigError that says how to make one."""
    p = Path(path)
    if p.is_dir():
        p = p / PROFILE_FILE
    try:
        return Profile.load(p)
    except ConfigError as e:
        raise ConfigError(f"--device-profile {path}: {e}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"--device-profile {path}: not a readable profile ({e}). Make one with "
            f"`psring profile --model M ... --out DIR` (on this machine, or with --device "
            f"cuda on a GPU machine) and pass DIR.") from None


def check(cfg: RunConfig, strategy_cls: Any, model: nn.Module | None) -> Profile | None:
    """Validate the device settings of ``cfg`` against its strategy and (meta) model,
    when known; the profile, or None for --compute real. Before any process starts."""
    if cfg.compute not in MODES:
        raise ConfigError(f"--compute must be one of {', '.join(MODES)} (got {cfg.compute!r}).")

    check_device_link(cfg, strategy_cls)
    if cfg.compute == "real":
        if cfg.device_profile or cfg.device_speed != 1.0 or cfg.time_scale != 1.0:
            raise ConfigError("--device-profile, --device-speed and --time-scale apply to "
                              "--compute device (this machine's own compute cannot be "
                              "slowed down); add --compute device, or drop them.")
        return None
    if not strategy_cls.caps.emulates_device:
        raise ConfigError(f"--compute device has nothing to emulate for {cfg.strategy!r}: its "
                          f"workers share memory on one host, with no device of their own. "
                          f"Use --compute real, or a strategy that sends its gradients.")
    if not cfg.device_profile:
        raise ConfigError("--compute device needs the device's times: --device-profile DIR, "
                          "a profile from `psring profile` (docs/emulation.md).")
    if not (cfg.device_speed > 0 and cfg.device_speed != float("inf")):
        raise ConfigError(f"--device-speed must be a positive number, the device's speed "
                          f"relative to the profile's (got {cfg.device_speed}).")
    prof = load_profile(cfg.device_profile)
    if model is None:
        return prof
    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    if sizes != prof.param_bytes:
        what = prof.source.get("model") or "another model"
        raise ConfigError(
            f"--device-profile {cfg.device_profile} is of {what} with {len(prof.param_bytes)} "
            f"parameters ({sum(prof.param_bytes)} bytes), but --model {cfg.model} here has "
            f"{len(sizes)} ({sum(sizes)} bytes): profile this model with the same --width, "
            f"--depth and data shape.")
    return prof


@dataclass(frozen=True)
class DeviceTimes:
    """The times one worker's device takes, per micro-batch, in seconds."""

    forward_s: float
    #: when each parameter's gradient is final, from the start of backward (parameter order)
    ready_s: tuple[float, ...]
    backward_s: float
    update_s: float
    #: how the profile's times became these (for the manifest)
    rule: str
    #: the data phase, at least: a GPU's includes copying the batch to the device,
    #: which the host's own slicing here does not (scaled by batch, not device speed)
    data_s: float = 0.0
    #: the profile, whose host copies :meth:`DeviceCompute.copy` spends (Profile.copy_s)
    profile: Any = None

    @classmethod
    def of(cls, prof: Profile, speed: float, batch: int, time_scale: float = 1.0) -> "DeviceTimes":
        scale = (batch / prof.batch_size) if prof.batch_size else 1.0
        f = scale / speed * time_scale
        rule = (f"profile times x {scale:g} (batch {batch} / profile's {prof.batch_size}) "
                f"/ --device-speed {speed:g}; update / {speed:g}"
                + (f"; all x --time-scale {time_scale:g}" if time_scale != 1 else ""))
        return cls(prof.forward_s * f, tuple(t * f for t in prof.ready_s),
                   prof.backward_s * f, prof.update_s / speed * time_scale, rule,
                   data_s=prof.data_s * scale * time_scale, profile=prof)


class OnTime:
    """Sleeps that end on time on average: each wakes its process's typical lateness
    early. A sleep wakes late by the timer's slack and, on cores shared by a run's
    workers, servers and links, by the wait for a core: a few per cent of each phase,
    which a device's compute does not take and the prediction of a device-mode run
    does not price. The lateness is learnt from the sleeps themselves (each moves the
    estimate by GAIN of its error), so a process's phases keep the profile's length on
    average while the load on its cores changes slowly against its steps; a phase
    shorter than the lateness learnt returns at once."""

    #: the share of a sleep's error that moves the estimate
    GAIN = 0.25

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        self.clock, self.sleep = clock, sleep
        #: seconds a sleep is started early by
        self.early = 0.0

    def until(self, t: float) -> None:
        """Return at ``t`` (a ``clock`` time), on average."""
        left = t - self.clock()
        if left <= self.early:
            return  # (past, or too close to sleep at all: nothing learnt)
        self.sleep(left - self.early)
        self.early = max(0.0, self.early + self.GAIN * (self.clock() - t))

    def take(self, seconds: float) -> None:
        """Last ``seconds`` from now, on average."""
        if seconds > 0:
            self.until(self.clock() + seconds)


class _Release(torch.autograd.Function):
    """One link of the backward chain: in backward, wait for parameter ``i``'s ready
    time, then give it its gradient (and pass the chain's gradient on)."""

    @staticmethod
    def forward(ctx, prev: torch.Tensor, param: torch.Tensor, i: int,
                dev: "DeviceCompute") -> torch.Tensor:
        ctx.i, ctx.dev = i, dev
        return prev.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, ctx.dev.release(ctx.i), None, None


class DeviceCompute:
    def __init__(self, times: DeviceTimes, seed: int, rank: int, kind: str, classes: int,
                 time_scale: float = 1.0):
        self.times, self.seed, self.rank = times, seed, rank
        #: --time-scale: the loop records times divided by it (the cluster's own clock)
        self.time_scale = time_scale
        self.kind, self.classes = kind, classes
        self.params: list[nn.Parameter] = []
        self.step = 0
        self._grads: dict[int, torch.Tensor] = {}  # the gradients' memory, kept
        self._backward_start: float | None = None
        self._forward_start: float | None = None
        self._last = -1
        self.on_time = OnTime()  # every phase of this worker's device: one lateness

    def install(self, model: nn.Module) -> None:
        """Replace ``model``'s forward by the device's (the parameters stay the model's:
        strategies, DDP and servers see their real sizes)."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        if len(self.params) != len(self.times.ready_s):
            raise ConfigError(f"the device profile has {len(self.times.ready_s)} parameters, "
                              f"the model {len(self.params)}.")
        # the chain is built from the loss backwards: the first gradient final comes first
        self.order = sorted(range(len(self.params)), key=lambda i: self.times.ready_s[i])
        self._last = self.order[-1]
        model.forward = types.MethodType(lambda _m, x: self.forward(x), model)

    def record(self) -> dict[str, Any]:
        """For the step record: a digest of the parameters and of the gradients as the
        update saw them (each parameter's first element, summed: O(parameters), not
        O(bytes)). Synchronous ranks must agree on both, step by step; the gradients
        differ per rank before they are reduced, so agreeing shows they were (not under
        --device-link, whose collectives inside a host move no values:
        psring.comm.interconnect)."""
        with torch.no_grad():
            params = sum(float(p.reshape(-1)[0]) for p in self.params)
            grads = sum(float(p.grad.reshape(-1)[0]) for p in self.params
                        if p.grad is not None)
        return {"device_digest": [params, grads]}

    def optimizer(self) -> "DeviceSGD":
        return DeviceSGD(self.times.update_s, self.on_time)

    def loaded(self, start: float) -> None:
        """The micro-batch's data phase, begun at ``start``, lasts the device's (its
        input copy; on average: :class:`OnTime`) or the host's own slicing if longer.
        The forward that follows is timed from here: the call into the model is the
        device's time too."""
        self.on_time.until(start + self.times.data_s)
        self._forward_start = time.perf_counter()

    def copy(self, direction: str, nbytes: int) -> None:
        """A GPU's copy between device and host ("d2h": a gradient out before a push,
        "h2d": parameters back after a pull), as the profile's host_copy times it; a
        parameter server's worker makes them where psring makes them on a GPU."""
        t = self.times.profile.copy_s(direction, nbytes) if self.times.profile else 0.0
        if t:
            self.on_time.take(t * self.time_scale)

    def begin_backward(self) -> None:
        """The loop starts backward now: the gradients' ready times count from here, so
        autograd's walk to the first of them is inside the device's time, not added."""
        self._backward_start = time.perf_counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = self._forward_start or time.perf_counter()
        self._forward_start = None  # (an evaluation's forward is timed from its call)
        self.step += 1  # (a micro-batch: gradients differ per forward, deterministically)
        self._backward_start = None
        chain = torch.zeros((), device=x.device)
        for i in reversed(self.order):  # the last link built is the first walked back
            chain = _Release.apply(chain, self.params[i], i, self)
        rows = x.numel() if self.kind == "tokens" else x.shape[0]
        self.on_time.until(start + self.times.forward_s)
        return chain.reshape(1, 1).expand(rows, self.classes)

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of uniform logits, ln(classes), joined to backward's chain without
        touching ``out``'s rows: torch's cross-entropy over the (rows x classes) logits
        would be real host work a device does not leave to the host (an mLSTM's 65 536
        tokens x 256 classes a step: 15% over the device's compute at 8 workers)."""
        return out[0, 0] * 0.0 + math.log(self.classes)

    def release(self, i: int) -> torch.Tensor:
        now = time.perf_counter()
        if self._backward_start is None:
            self._backward_start = now
        t = self.times.ready_s[i]
        if i == self._last:
            t = max(t, self.times.backward_s)
        self.on_time.until(self._backward_start + t)
        # one deterministic, finite value per (seed, worker, step, parameter)
        v = ((self.seed * 1_000_003 + self.rank * 7_919 + self.step * 104_729 + i * 31)
             % 9_973) / 9_973 * 1e-3 + 1e-4
        if self.params[i].grad is not None:  # a later micro-batch: accumulated into it
            return torch.full_like(self.params[i], v)
        # The step's first gradient: filled into memory kept from step to step, which
        # autograd takes as the parameter's .grad without a copy. A fresh tensor each step
        # costs the kernel's page faults on top of the fill (VGG-16's fc6, 411 MB: 0.24 s
        # against 0.03 s here), all at the start of backward for 8 workers on 2 cores:
        # host work a device does not have, which held every link idle for ~60 ms of a
        # VGG-16 step at time scale 20.
        buf = self._grads.get(i)
        if buf is None:
            buf = self._grads[i] = torch.empty_like(self.params[i])
        buf.fill_(v)
        return buf.detach()


class DeviceSGD:
    """The optimizer step on the device: its time, no change to the host's parameters."""

    def __init__(self, update_s: float, on_time: OnTime | None = None):
        self.update_s = update_s
        self.on_time = on_time or OnTime()
        self.state: dict = {}

    def step(self) -> None:
        self.on_time.take(self.update_s)


def host_profile(cfg: RunConfig) -> Profile:
    """The run's --device-profile on the host --device-link describes: its copies to host
    memory at the host's PCIe rate (psring.comm.interconnect.on_host)."""

    return on_host(load_profile(cfg.device_profile), cfg.device_link)


def for_worker(cfg: RunConfig, rank: int, inputs: Any) -> DeviceCompute | None:
    """The device stand-in of one worker (None for --compute real)."""
    if cfg.compute != "device":
        return None
    prof = host_profile(cfg)
    # (--worker-batch: each device computes its own share)
    times = DeviceTimes.of(prof, cfg.device_speed, cfg.worker_batches[rank], cfg.time_scale)
    return DeviceCompute(times, cfg.seed, rank, inputs.kind, inputs.classes, cfg.time_scale)


def _limits(cfg: RunConfig, cores: int) -> tuple[float, float, float, float, Any]:
    """(host work in core-seconds a step, the device's step in wall seconds, the emulated
    links' sum in bit/s, its limit, the profile) for the rule of :func:`capacity`."""
    prof = load_profile(cfg.device_profile)
    t = DeviceTimes.of(prof, cfg.device_speed, cfg.per_worker_batch, cfg.time_scale)
    step = (t.forward_s + t.backward_s) * cfg.accumulate + t.update_s  # wall seconds
    need = cfg.workers * PASSES * sum(prof.param_bytes) / HOST_BYTES_PER_CORE_S
    cl = cfg.cluster
    links = cl.emulated_link_bits * len(cl.host_list) \
        if cl.emulated and cl.emulated_link_bits else 0.0
    return need, step, links, LINK_BITS_PER_CORE * cores, prof


def required_time_scale(cfg: RunConfig, cores: int | None = None) -> int:
    """The smallest whole --time-scale at which :func:`capacity`'s rule holds for ``cfg``
    (what `advise --verify` runs at)."""
    cores = cores or usable_cores()
    need, step, links, link_limit, _ = _limits(cfg, cores)
    s = cfg.time_scale
    return max(1, math.ceil(max(s * need / (cores * step), s * links / link_limit) - 1e-9))


def capacity(cfg: RunConfig, cores: int | None = None) -> list[str]:
    """Why this machine may not emulate ``cfg``'s cluster faithfully ([] when it should):
    the rule of :data:`HOST_BYTES_PER_CORE_S` and :data:`LINK_BITS_PER_CORE`, each with
    the --time-scale that would meet it."""
    if cfg.compute != "device":
        return []
    cores = cores or usable_cores()
    need, step, total, link_limit, prof = _limits(cfg, cores)
    out = []
    if need > cores * step:
        scale = cfg.time_scale * need / (cores * step)
        out.append(f"the workers' own work on their gradients ({cfg.workers} x {PASSES} passes "
                   f"over {sum(prof.param_bytes) / 1e6:.0f} MB a step, about {need:.2f} "
                   f"core-seconds here) exceeds the {cores * step:.2f} core-seconds the "
                   f"device's step leaves on {cores} cores, so the recorded compute would be "
                   f"this machine's, not the device's: raise --time-scale to at least "
                   f"{math.ceil(scale)}")
    if total > link_limit:
        scale = cfg.time_scale * total / link_limit
        out.append(f"the emulated links add up to {total / 1e9:.1f} Gbit/s, more than "
                   f"this machine carries ({link_limit / 1e9:.0f} Gbit/s on {cores} "
                   f"cores): raise --time-scale to at least {math.ceil(scale)}")
    return out


def describe(cfg: RunConfig) -> dict[str, Any]:
    """For the manifest: how compute was done, and whether the run learnt anything."""
    if cfg.compute != "device":
        return {"mode": "real"}
    prof = host_profile(cfg)
    times = DeviceTimes.of(prof, cfg.device_speed, cfg.per_worker_batch, cfg.time_scale)
    return {"mode": "device", "timing_only": True, "profile": str(cfg.device_profile),
            "profile_source": prof.source, "speed": cfg.device_speed, "rule": times.rule,
            # the step records' times are the wall clock's divided by this
            "time_scale": cfg.time_scale,
            # per micro-batch, on the described cluster's clock (as the step records)
            "forward_s": times.forward_s / cfg.time_scale,
            "backward_s": times.backward_s / cfg.time_scale,
            "update_s": times.update_s / cfg.time_scale,
            # --device-link: the host's own collectives as that interconnect's time
            "device_link": cfg.device_link or "loopback",
            # a parameter server's worker's copies to host memory and back (None: not
            # made): the profile's, or the PCIe of the host --device-link describes
            "host_copy": prof.host_copy,
            # what the launcher warned of (psring.train.device.capacity): [] when faithful
            "capacity_warnings": capacity(cfg)}
