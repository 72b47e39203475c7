"""RunConfig: the composition of the sections (psring.config.sections), flat, frozen,
and checked for values only.

``RunConfig(...)`` refuses values that are wrong on their face: ranges, choices, and
combinations that need neither torch nor a file. What needs them (the strategy and model
registries, the data file, the secret file, CUDA, a meta model) is
:func:`psring.config.validate`, which also fills in the derived values.

    >>> cfg = RunConfig(strategy="allreduce", workers=4, workers_per_host=2)
    >>> cfg.hosts, cfg.derived()["hosts"], cfg.to_dict()["hosts"]
    (1, 2, 2)
"""

from __future__ import annotations

import dataclasses
import math
from functools import cached_property
from typing import Any, Literal, get_args, get_origin, get_type_hints

from psring.cluster.spec import Cluster, derived_hosts
from psring.config.sections import SECTIONS
from psring.errors import ConfigError
from psring.records.runlog import shares_of
from psring.train.shares import check_global_batch


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _either(choices: tuple[str, ...]) -> str:
    named = [c for c in choices if c]  # "" is "the default", not a value to give
    return ", ".join(named[:-1]) + " or " + named[-1]


# Dataclasses collect the fields of the bases in reverse MRO order: the sections are
# listed last first so that the fields keep the manifests' order.
@dataclasses.dataclass(frozen=True)
class RunConfig(*reversed(SECTIONS)):
    """One run's settings; every field is a flag of ``psring run``.

    Fields hold what was given. Values derived from others (``hosts`` from
    --workers-per-host, ``servers`` from --server-addrs, ``eval_samples`` in device mode)
    are :meth:`derived`'s, and filled in by :func:`psring.config.validate`, which
    ``psring run`` and :func:`psring.runs.launch.launch` call: read them from a
    validated config (or from ``cfg.cluster`` and ``to_dict()``, which derive them)."""

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_training()
        self._check_choices()
        self._check_combinations()
        self._check_servers()
        self._check_slow_worker()
        self._check_faults()

    def _check_counts(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1 (got {self.workers}).")
        if not self.worker_batch:
            check_global_batch(self.batch_size, self.workers)
        elif not self.worker_batch.startswith("proportional:"):  # (read by validate)
            self._check_worker_batch()
        if self.steps < 0:
            raise ConfigError(f"--steps must be at least 1 (0: as many as a script trains, "
                              f"psring launch; got {self.steps}).")
        for name in ("accumulate", "samples", "features", "classes", "image_size",
                     "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag_name(name)} must be at least 1 "
                                  f"(got {getattr(self, name)}).")
        if self.eliminate_every < 0:
            raise ConfigError(f"--eliminate-every must be >= 0 (0 = off; got "
                              f"{self.eliminate_every}).")
        if self.classes < 2:
            raise ConfigError(f"--classes must be at least 2 (got {self.classes}).")
        if self.width < 0 or self.depth < 0 or self.threads < 0:
            raise ConfigError("--width, --depth and --threads must be >= 0 (0 = default).")
        if self.eval_samples < 0 or self.eval_every < 0:
            raise ConfigError("--eval-samples and --eval-every must be >= 0 (0 = none, and "
                              "about ten evaluations per run, respectively).")
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every must be >= 0 (0 = never; got "
                              f"{self.checkpoint_every}).")

    def _check_training(self) -> None:
        if not 0 <= self.target_accuracy <= 1:
            raise ConfigError(f"--target-accuracy is a fraction of the held-out rows in "
                              f"[0, 1], e.g. 0.9 (got {self.target_accuracy}); 0 = none.")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"--lr must be a positive number (got {self.lr}).")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be in [0, 1) (got {self.momentum}).")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ConfigError(f"--weight-decay must be >= 0 (got {self.weight_decay}).")
        if not self.bucket_mb > 0:
            raise ConfigError(f"--bucket-mb must be positive (got {self.bucket_mb}).")
        if not self.timeout > 0:
            raise ConfigError(f"--timeout must be positive seconds (got {self.timeout}).")
        if not 0 <= self.master_port < 65536:
            raise ConfigError(f"--master-port must be 0..65535 (got {self.master_port}).")

    def _check_choices(self) -> None:
        for name, choices in literal_choices().items():
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(f"{flag_name(name)} must be {_either(choices)} "
                                  f"(got {value!r}).")
        if self.data in ("synthetic", "digits"):
            return
        if not self.data.endswith(".npz"):
            raise ConfigError(f"--data must be synthetic, digits or a path to an .npz file "
                              f"(got {self.data!r}).")

    def _check_combinations(self) -> None:
        if self.worker_batch and self.reduce == "adasum":
            raise ConfigError("--worker-batch weighs gradients by samples; --reduce adasum "
                              "weighs them by their directions. Use one of the two.")
        if self.compute == "device" and self.target_accuracy:
            raise ConfigError("--compute device is timing only: nothing is learnt, so "
                              "there is no accuracy to reach; drop --target-accuracy.")

    def _check_servers(self) -> None:
        if self.servers < 1:
            raise ConfigError(f"--servers must be at least 1 (got {self.servers}).")
        if self.max_staleness < -1:
            raise ConfigError(f"--max-staleness must be >= 0, or -1 for no bound "
                              f"(got {self.max_staleness}).")
        from urllib.parse import urlparse

        addrs = self.server_addr_list
        for a in addrs:
            u = urlparse(a)
            if u.scheme not in ("tcp", "ipc") or (u.scheme == "tcp" and not u.port):
                raise ConfigError(f"--server-addrs entry {a!r} is not an address like "
                                  f"tcp://127.0.0.1:5555.")
        if addrs and self.servers not in (1, len(addrs)):
            raise ConfigError(f"--servers {self.servers} disagrees with the "
                              f"{len(addrs)} --server-addrs; give one or the other.")

    def _check_worker_batch(self) -> None:
        try:
            sizes = list(self.worker_batches)
        except ValueError:
            raise ConfigError(f"--worker-batch {self.worker_batch!r} must be each worker's "
                              f"batch, comma-separated in rank order, e.g. 48,16.") from None
        if len(sizes) != self.workers:
            raise ConfigError(f"--worker-batch names {len(sizes)} batch(es) for --workers "
                              f"{self.workers}: give one per worker, in rank order.")
        if min(sizes) < 1:
            raise ConfigError(f"--worker-batch {self.worker_batch}: every worker needs at "
                              f"least one sample a step (a 0 would leave it idle); drop "
                              f"that worker with a smaller --workers instead.")
        if sum(sizes) != self.batch_size:
            raise ConfigError(f"--worker-batch {self.worker_batch} adds up to {sum(sizes)}, "
                              f"not --batch-size {self.batch_size} (the global batch it "
                              f"splits); make them agree.")

    def _check_slow_worker(self) -> None:
        if not self.slow_worker:
            return
        try:
            rank, factor = self.slow_worker.split(":")
            rank_i, factor_f = int(rank), float(factor)
        except ValueError:
            raise ConfigError(f"--slow-worker {self.slow_worker!r} must be I:FACTOR, e.g. "
                              f"1:3 for worker 1 three times slower.") from None
        if not 0 <= rank_i < self.workers or not factor_f >= 1:
            raise ConfigError(f"--slow-worker {self.slow_worker!r}: I must be a worker "
                              f"(0..{self.workers - 1}) and FACTOR >= 1.")

    def _check_faults(self) -> None:
        for name, count, what in (("kill_worker", self.workers, "worker"),
                                  ("kill_server", self.derived()["servers"], "server")):
            entries = _entries(getattr(self, name), flag_name(name))
            twice = sorted({i for i, _ in entries if [j for j, _ in entries].count(i) > 1})
            if twice:
                raise ConfigError(f"{flag_name(name)} names {what} {twice[0]} more than once: "
                                  f"a process dies once; give it one step.")
            for index, step in entries:
                if not 0 <= index < count or not 1 <= step < self.steps:
                    raise ConfigError(
                        f"{flag_name(name)} {index}:{step} names no {what} and step of this "
                        f"run: the {what} is 0..{count - 1} and the step 1..{self.steps - 1} "
                        f"(the run has {self.steps} steps; a fault at step STEP lets step "
                        f"STEP - 1 finish).")
        if not 0 <= self.backup_workers < self.workers:
            raise ConfigError(f"--backup-workers {self.backup_workers}: each step takes the "
                              f"first N - B of the {self.workers} workers, so B is 0.."
                              f"{self.workers - 1}; give a smaller B (or more --workers).")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0 (got {self.max_restarts}).")
        if self.max_restarts and not self.checkpoint_every:
            raise ConfigError(f"--max-restarts {self.max_restarts} restarts the run from its "
                              f"last checkpoint, and this run writes none: add "
                              f"--checkpoint-every N (steps between checkpoints).")

    @property
    def faults(self) -> tuple[tuple[str, int, int], ...]:
        """("worker" or "server", index, step) of every --kill-worker and --kill-server."""
        return tuple((what, i, s) for what in ("worker", "server")
                     for i, s in _entries(getattr(self, f"kill_{what}"), f"--kill-{what}"))

    # ------------------------------------------------------------------ derived
    def derived(self) -> dict[str, Any]:
        """The settings that other settings decide, as the manifest records them: the
        hosts --workers-per-host takes, one server per --server-addrs entry, and no
        held-out rows under --compute device (nothing is learnt, nothing to evaluate)."""
        return {"hosts": derived_hosts(self.workers, self.hosts, self.workers_per_host),
                "servers": len(self.server_addr_list) or self.servers,
                "eval_samples": 0 if self.compute == "device" else self.eval_samples}

    @cached_property
    def cluster(self) -> Cluster:
        """Where this run's processes live (psring.cluster.spec), from the derived
        values; computed once and kept."""
        # the registry imports torch, which constructing a RunConfig does not
        from psring.strategies import STRATEGIES

        return Cluster.from_config(self.to_dict(),
                                   STRATEGIES.get(self.strategy).caps.uses_servers)

    @property
    def server_addr_list(self) -> list[str]:
        return [a.strip() for a in self.server_addrs.split(",") if a.strip()]

    @property
    def slow(self) -> tuple[int, float]:
        """(worker, factor) of --slow-worker; (-1, 1.0) when none is slowed."""
        if not self.slow_worker:
            return -1, 1.0
        rank, factor = self.slow_worker.split(":")
        return int(rank), float(factor)

    @property
    def eval_interval(self) -> int:
        """Steps between evaluations (0: no evaluation)."""
        if not self.derived()["eval_samples"]:
            return 0
        return self.eval_every or max(1, self.steps // 10)

    @property
    def worker_batches(self) -> tuple[int, ...]:
        """Each worker's share of the global batch, in rank order (--worker-batch, else
        equal shares)."""
        return tuple(shares_of({"worker_batch": self.worker_batch,
                                "batch_size": self.batch_size, "workers": self.workers}))

    @property
    def per_worker_batch(self) -> int:
        """The largest worker's batch (all of them, with equal shares): what sizes one
        worker's device time and data."""
        return max(self.worker_batches)

    @property
    def resolved_device(self) -> str:
        """--device, with auto resolved: CUDA where torch sees a GPU, unless the run
        computes on the CPU whatever the machine has: device mode (--compute device
        emulates the accelerator on the CPU) and strategies whose workers compute on
        the CPU only (their caps.devices: hogwild shares CPU memory)."""
        if self.device != "auto":
            return self.device
        if self.compute == "device":
            return "cpu"
        from psring.strategies import STRATEGIES

        if "cuda" not in STRATEGIES.get(self.strategy).caps.devices:
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field, derived values as derived (the manifest's ``config``)."""
        return {**dataclasses.asdict(self), **self.derived()}

    def to_argv(self) -> list[str]:
        """Flags that parse back to this config (used to start worker processes)."""
        argv: list[str] = []
        for name, value in self.to_dict().items():
            if isinstance(value, bool):  # --trace / --no-trace, never "--trace False"
                argv.append(flag_name(name) if value else "--no-" + name.replace("_", "-"))
            else:
                argv += [flag_name(name), str(value)]
        return argv


def _entries(text: str, flag: str) -> list[tuple[int, int]]:
    """The I:STEP entries of a repeatable fault flag (comma-separated once parsed)."""
    out = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        try:
            index, step = (int(x) for x in entry.split(":"))
        except ValueError:
            raise ConfigError(f"{flag} {entry!r} must be I:STEP, e.g. {flag} 1:5 (the "
                              f"{flag.split('-')[-1]} numbered 1, at step 5).") from None
        out.append((index, step))
    return out


_CHOICES: dict[str, tuple[str, ...]] = {}


def literal_choices() -> dict[str, tuple[str, ...]]:
    """The choices of every ``Literal`` field of RunConfig, by field name."""
    if not _CHOICES:
        for name, hint in get_type_hints(RunConfig).items():
            if get_origin(hint) is Literal:
                _CHOICES[name] = get_args(hint)
    return _CHOICES


def cluster_of(cfg: RunConfig) -> Cluster:
    """The cluster of a RunConfig, or of a run's config as its manifest stores it (a
    dict, perhaps from before a cluster setting existed: psring.cluster.spec.DEFAULTS)."""
    if isinstance(cfg, RunConfig):
        return cfg.cluster
    # the registry imports torch; see RunConfig.cluster
    from psring.strategies import STRATEGIES

    return Cluster.from_config(cfg, STRATEGIES.get(cfg.get("strategy", "single")).caps.uses_servers)
