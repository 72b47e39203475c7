"""A model's profile: what the step-time simulator (psring.predict.sim.simulate) needs to
know of it.

    psring profile --model resnet18 --batch-size 32 --out runs/prof-r18   # one short run
    python -c "from psring.records.profile import Profile; print(Profile.load('runs/prof-r18'))"

A profile is taken from one short ``single`` run with ``--trace``: the loop then stamps
the moment each parameter's gradient becomes final in backward (``grad_ready_s``), and
the manifest lists each parameter's gradient bytes (``parameter_sizes``). Kept are the
medians, over the steps after warm-up, of the data, forward, backward and update
(optimizer) times and of each parameter's ready time (seconds after backward starts).
Kept per parameter, not per bucket, so the simulator can bucket the gradients at any
``--bucket-mb``, as DDP would (psring.comm.partition.bucket_assignment).

:meth:`Profile.from_run` also reads a run of any strategy (what ``psring report`` does
to replay a measured run, as dPRO replays a profiled trace): its own phase times, and
the buckets' launch times standing in for the gradients' ready times when it was not
traced. :meth:`Profile.on_paper` builds one from published per-device times, for
clusters no one here has (docs/prediction.md).

The file is ``profile.json`` (atomically written, versioned, validated on load).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from psring.comm.partition import bucket_assignment, bucket_caps
from psring.errors import ConfigError, PsringError
from psring.records.runlog import (
    atomic_write_json,
    read_manifest,
    read_steps,
    shares_of,
    warmup_steps,
)

# Taking a profile (a run: psring.config, psring.runs.launch) is psring.runs.profiling;
# reading and using one (the simulator, advise, replay, --compute device) needs neither.

PROFILE_FILE = "profile.json"
#: bumped when the file's meaning changes; load() refuses other formats
FORMAT = 1
_MB = 1024 * 1024


@dataclass
class Profile:
    """One worker's step on its own device: phase times and when each gradient is ready."""

    #: gradient bytes of each trainable parameter, in ``model.parameters()`` order
    param_bytes: list[int]
    #: seconds after backward starts at which each parameter's gradient is final
    ready_s: list[float]
    forward_s: float
    backward_s: float
    #: the local optimizer's step (SGD with momentum) over all parameters
    update_s: float
    data_s: float = 0.0
    #: samples per worker per step (the profile's batch)
    batch_size: int = 0
    #: torch threads the profiled process ran with
    threads: int = 0
    #: where it comes from: model settings, run directory, host, time
    source: dict[str, Any] = field(default_factory=dict)
    #: a GPU worker's copies between its device and pinned host memory, which a
    #: parameter server's worker makes of every gradient and parameter: {"d2h": [alpha
    #: s, bytes/s], "h2d": [...], "source": ...} (:func:`load_host_copy`); None: the
    #: worker computes in host memory, or the copies are not known
    host_copy: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.param_bytes:
            raise ValueError("a profile needs at least one parameter")
        if len(self.ready_s) != len(self.param_bytes):
            raise ValueError(f"{len(self.ready_s)} ready times for {len(self.param_bytes)} "
                             f"parameters")
        def seconds(v: object) -> bool:
            return (not isinstance(v, bool) and isinstance(v, (int, float))
                    and math.isfinite(v) and v >= 0)

        for name in ("forward_s", "backward_s", "update_s", "data_s"):
            if not seconds(getattr(self, name)):
                raise ValueError(f"{name} is {getattr(self, name)!r}, not a time in seconds")
        if not all(seconds(t) for t in self.ready_s):
            raise ValueError("ready_s must be finite, non-negative seconds")
        for name in ("batch_size", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} is {v!r}, not a count")
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 0
               for b in self.param_bytes):
            raise ValueError("param_bytes must be non-negative integers")
        if self.host_copy is not None:
            _check_host_copy(self.host_copy)

    # -- what the simulator reads ---------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(self.param_bytes)

    @property
    def compute_s(self) -> float:
        """One step without communication: what ``single`` takes."""
        return self.data_s + self.forward_s + self.backward_s + self.update_s

    def buckets(self, bucket_mb: float) -> list[tuple[int, float]]:
        """(bytes, ready seconds after backward starts) of each gradient bucket at
        ``bucket_mb``, by the strategies' own rule (psring.strategies.buckets.bucket_caps):
        a bucket is ready when its last gradient is."""
        cap, first = bucket_caps(bucket_mb)
        return [(sum(self.param_bytes[i] for i in g), max(self.ready_s[i] for i in g))
                for g in bucket_assignment(self.param_bytes, cap, first)]

    # -- building one -----------------------------------------------------------------
    @classmethod
    def from_run(cls, run_dir: str | os.PathLike, worker: int | None = 0) -> "Profile":
        """From a run directory: its worker's median phase times after warm-up, and each
        parameter's ready time — traced (``--trace``), else interpolated from when its
        bucket was launched (a bucket launches once its last gradient is ready), else
        spread over backward in proportion to the bytes already produced.

        ``worker=None``: each step's slowest worker (the most compute), the one a
        synchronous step waits for; on shared cores the workers' compute jitters, and
        the step follows the maximum, not the median."""
        run_dir = Path(run_dir)
        try:
            manifest = read_manifest(run_dir)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{run_dir}: not a psring run directory ({e}); profile a "
                              f"model with `psring profile --model M`.") from None
        cfg = manifest["config"]
        sizes = manifest.get("parameter_sizes")
        if not sizes:
            raise ConfigError(f"{run_dir}: its manifest lacks parameter_sizes (a run made "
                              f"before profiles existed); run it again.")
        records = read_steps(run_dir)
        if worker is not None:
            records = [r for r in records if r.get("worker") == worker]
        else:
            slowest: dict[int, dict] = {}
            for r in records:
                if r["step"] not in slowest or _compute(r) > _compute(slowest[r["step"]]):
                    slowest[r["step"]] = r
            records = [slowest[k] for k in sorted(slowest)]
        skip = warmup_steps(cfg["steps"])
        kept = [r for r in records if r["step"] >= skip] or records
        if not kept:
            raise ConfigError(f"{run_dir}: no step records"
                              f"{'' if worker is None else f' of worker {worker}'}; the run "
                              f"did not get through a step.")
        med = lambda key: statistics.median(r.get(key, 0.0) for r in kept)  # noqa: E731
        backward = med("backward_s")
        traced = [r["grad_ready_s"] for r in kept
                  if len(r.get("grad_ready_s", ())) == len(sizes)]
        if traced:
            ready = [statistics.median(t[i] for t in traced) for i in range(len(sizes))]
        else:
            ready = _ready_from_device(cfg, sizes, backward) or \
                _ready_from_buckets(kept, sizes, cfg.get("bucket_mb", 25.0), backward)
        return cls(param_bytes=list(sizes), ready_s=[round(t, 7) for t in ready],
                   forward_s=med("forward_s"), backward_s=backward,
                   update_s=med("update_s"), data_s=med("data_s"),
                   # (--worker-batch: the largest share, the slowest worker's as a rule)
                   batch_size=max(shares_of(cfg)) * cfg.get("accumulate", 1),
                   threads=int(manifest.get("threads_per_process") or 0),
                   source={"run": str(run_dir), "strategy": cfg["strategy"],
                           "model": cfg["model"], "traced": bool(traced),
                           "steps": len(kept), "host": manifest.get("host", {}),
                           "device": manifest.get("device", "cpu"),
                           "accelerator": manifest.get("accelerator"),
                           **{k: cfg.get(k) for k in MODEL_KEYS}})

    @classmethod
    def on_paper(cls, param_bytes: list[int], forward_s: float, backward_s: float,
                 update_s: float = 0.0, batch_size: int = 0,
                 source: dict[str, Any] | None = None,
                 shares: list[float] | None = None) -> "Profile":
        """A profile from published figures. ``shares``: for each parameter, the share
        of backward done when its gradient is ready (psring.train.models.backward_shares:
        backward's FLOPs in autograd's order); without them, gradients become ready in
        proportion to the bytes already produced, last parameter first."""
        if shares is not None and len(shares) != len(param_bytes):
            raise ValueError("one share per parameter")
        ready = (_spread(param_bytes, backward_s) if shares is None else
                 [round(backward_s * min(max(x, 0.0), 1.0), 7) for x in shares])
        return cls(list(param_bytes), ready, forward_s, backward_s, update_s,
                    batch_size=batch_size, source=dict(source or {}, on_paper=True))

    def scaled(self, speed: float) -> "Profile":
        """This profile on a device ``speed`` times as fast (--device-speed)."""
        if not (speed > 0 and math.isfinite(speed)):
            raise ConfigError(f"--device-speed must be a positive number, the device's speed "
                              f"relative to the profile's (got {speed}).")
        # (the host copies are the bus's: a faster chip moves them no faster)
        return Profile(list(self.param_bytes), [t / speed for t in self.ready_s],
                       self.forward_s / speed, self.backward_s / speed, self.update_s / speed,
                       self.data_s, self.batch_size, self.threads,
                       dict(self.source, device_speed=speed * self.source.get("device_speed", 1)),
                       self.host_copy)

    def copy_s(self, direction: str, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` between the device and the host ("d2h" or "h2d");
        0 without :attr:`host_copy`."""
        if self.host_copy is None:
            return 0.0
        alpha, rate = self.host_copy[direction]
        return alpha + nbytes / rate

    # -- the file -----------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically to ``path`` (a directory gets ``profile.json``)."""
        path = Path(path)
        if path.is_dir() or not path.suffix:
            path = path / PROFILE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"format": FORMAT, **asdict(self)})
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Profile":
        """Read and validate ``profile.json`` (or a directory holding one); a run
        directory without one is read with :meth:`from_run`."""
        path = Path(path)
        if path.is_dir():
            if (path / PROFILE_FILE).is_file():
                path = path / PROFILE_FILE
            else:
                return cls.from_run(path)
        fix = "make one with `psring profile --model M --out DIR`"
        try:
            obj = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no profile at {path}; {fix}.") from None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ConfigError(f"profile {path} is unreadable or not JSON ({e}); {fix}.") \
                from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ConfigError(f"profile {path} is not a format-{FORMAT} psring profile; {fix}.")
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in obj.items() if k in known})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"profile {path}: {e}; {fix}.") from None

    def describe(self) -> str:
        return (f"{len(self.param_bytes)} parameters, {self.total_bytes / 1e6:.2f} MB of "
                f"gradients; forward {self.forward_s * 1e3:.1f} ms, backward "
                f"{self.backward_s * 1e3:.1f} ms, update {self.update_s * 1e3:.1f} ms at "
                f"batch {self.batch_size}, {self.threads} thread(s)")


def _check_host_copy(hc: Any) -> None:
    if not isinstance(hc, dict):
        raise ValueError(f"host_copy is {hc!r}, not a mapping")
    for d in ("d2h", "h2d"):
        v = hc.get(d)
        if not (isinstance(v, (list, tuple)) and len(v) == 2
                and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                        and math.isfinite(x) for x in v) and v[0] >= 0 and v[1] > 0):
            raise ValueError(f"host_copy[{d!r}] is {v!r}, not [alpha seconds, bytes/s > 0]")


def load_host_copy(path: str | os.PathLike) -> dict[str, Any]:
    """A GPU's pinned copy rates from ``benchmarks/gpu_copy.py``'s JSON, as a profile's
    :attr:`Profile.host_copy`."""
    fix = "measure them with `python benchmarks/gpu_copy.py --out FILE` on the GPU"
    try:
        obj = json.loads(Path(path).read_text())
        copies = obj["copies"]
        hc = {d: [float(copies[f"{d}_pinned"]["alpha_s"]),
                  float(copies[f"{d}_pinned"]["rate_Bps"])] for d in ("d2h", "h2d")}
        hc["source"] = f"{obj.get('gpu', 'a GPU')}, pinned memory ({Path(path).name})"
        _check_host_copy(hc)
    except FileNotFoundError:
        raise ConfigError(f"--host-copy {path}: no such file; {fix}.") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--host-copy {path}: not a copy-rate file ({e}); {fix}.") from None
    return hc


#: the run settings that say which model a profile is of
MODEL_KEYS = ("width", "depth", "classes", "image_size", "seq_len", "features")


def _compute(r: dict) -> float:
    return sum(r.get(k, 0.0) for k in ("data_s", "forward_s", "backward_s", "update_s"))


def _spread(param_bytes: list[int], backward_s: float) -> list[float]:
    """Ready times with backward producing bytes at a constant rate, last parameter first."""
    total = sum(param_bytes) or 1
    ready = [0.0] * len(param_bytes)
    done = 0
    for i in reversed(range(len(param_bytes))):
        done += param_bytes[i]
        ready[i] = round(backward_s * done / total, 7)
    return ready


def _ready_from_device(cfg: dict, sizes: list[int], backward_s: float) -> list[float] | None:
    """A device-mode run's ready times: its device profile's, which the run replayed
    (scaled to the run's backward); None for a real run or an unreadable profile. (A
    strategy that records no bucket launches, ddp, is then still placed right.)"""
    if cfg.get("compute") != "device" or not cfg.get("device_profile"):
        return None
    try:
        prof = Profile.load(cfg["device_profile"])
    except (OSError, ValueError, KeyError, PsringError):
        return None
    if len(prof.ready_s) != len(sizes) or not prof.backward_s:
        return None
    return [t * backward_s / prof.backward_s for t in prof.ready_s]


def _ready_from_buckets(records: list[dict], sizes: list[int], bucket_mb: float,
                        backward_s: float) -> list[float]:
    """Per-parameter ready times from a run's bucket launches (offsets from the step's
    start), measured from backward's start (its end less its length). Inside a bucket
    the gradients are spread in proportion to bytes, from the previous bucket's launch
    to this one's."""
    cap, first = bucket_caps(bucket_mb)
    groups = bucket_assignment(sizes, cap, first)
    launches = [r for r in records if len(r.get("bucket_launch_s", ())) == len(groups)]
    if not launches:
        return _spread(sizes, backward_s)
    per_bucket = []
    for k in range(len(groups)):
        per_bucket.append(statistics.median(
            max(0.0, r["bucket_launch_s"][k] - (r["backward_end_s"] - r["backward_s"]))
            for r in launches))
    ready = [0.0] * len(sizes)
    prev = 0.0
    for g, at in zip(groups, per_bucket):
        at = max(at, prev)
        total = sum(sizes[i] for i in g) or 1
        done = 0
        for i in g:
            done += sizes[i]
            ready[i] = prev + (at - prev) * done / total
        prev = at
    return ready
