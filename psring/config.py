"""One validated dataclass per run, and the command-line flags generated from it.

Every field of :class:`RunConfig` is a flag of ``psring run`` (``batch_size`` is
``--batch-size``), so the CLI, the worker entry point (which ``torchrun`` can start
directly) and ``manifest.json`` can never disagree about what a run is. Validation
happens in ``__post_init__``; a bad value raises :class:`ConfigError` with a message
that names the fix.

    >>> RunConfig(strategy="allreduce", workers=2, batch_size=64).per_worker_batch
    32
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any
from urllib.parse import urlparse

from psring.cluster.spec import (
    PLACEMENTS,
    Cluster,
    derived_hosts,
    host_address,
    in_network,
    worker_counts,
)
from psring.errors import ConfigError, PsringError
from psring.train.shares import check_global_batch, proportional_shares, shares_of


def _flag(help: str, **kw: Any) -> dict:
    return {"help": help, **kw}


@dataclass(frozen=True)
class RunConfig:
    strategy: str = field(default="single", metadata=_flag(
        "training strategy (see `psring strategies`)"))
    workers: int = field(default=1, metadata=_flag(
        "number of worker processes (data-parallel ranks); under torchrun taken from WORLD_SIZE"))
    model: str = field(default="mlp", metadata=_flag(
        "mlp, cnn, resnet18, resnet50, resnet101, vgg11, vgg16, mlstm, gpt (`psring models` lists "
        "them), or your own as package.module:factory (examples/my_model.py)"))
    width: int = field(default=0, metadata=_flag(
        "model width: hidden units (mlp, mlstm), channels (cnn), base channels (resnet, "
        "vgg; 64 = the paper's), embedding (gpt); 0 = the model's default"))
    depth: int = field(default=0, metadata=_flag(
        "model depth: hidden layers (mlp), conv blocks (cnn), layers (mlstm), blocks "
        "(gpt); 0 = the model's default"))
    data: str = field(default="synthetic", metadata=_flag(
        "data set: synthetic, digits (needs the [digits] extra) or a path to an .npz with arrays x and y"))
    samples: int = field(default=4096, metadata=_flag("rows in the synthetic data set"))
    features: int = field(default=256, metadata=_flag(
        "input features of the synthetic data set (a perfect square for cnn)"))
    classes: int = field(default=10, metadata=_flag(
        "classes of the synthetic data set (the vocabulary, for token models)"))
    image_size: int = field(default=32, metadata=_flag(
        "side of the synthetic images for image models (resnet, vgg; 224 = ImageNet's)"))
    seq_len: int = field(default=32, metadata=_flag(
        "tokens per sequence for sequence models (mlstm, gpt)"))
    eval_samples: int = field(default=1024, metadata=_flag(
        "held-out rows, never trained on, that evaluations use (a synthetic set gets them "
        "on top of --samples; a file gives up to a fifth of its rows); 0 = no evaluation"))
    eval_every: int = field(default=0, metadata=_flag(
        "evaluate on the held-out rows before the first step and every N optimizer steps "
        "(and after the last), outside the step timing, into evals.jsonl; 0 = about ten "
        "times per run (every max(1, steps // 10) steps)"))
    target_accuracy: float = field(default=0.0, metadata=_flag(
        "held-out accuracy whose first evaluation at or above it ends the time to "
        "accuracy (MLPerf's definition); reports show it per strategy; 0 = none"))
    batch_size: int = field(default=64, metadata=_flag(
        "GLOBAL batch per micro-step, split evenly across the workers"))
    steps: int = field(default=20, metadata=_flag("optimizer steps to run"))
    accumulate: int = field(default=1, metadata=_flag(
        "micro-batches per optimizer step; gradients are synchronized only on the last one"))
    lr: float = field(default=0.05, metadata=_flag("learning rate"))
    momentum: float = field(default=0.9, metadata=_flag("SGD momentum"))
    weight_decay: float = field(default=0.0, metadata=_flag("SGD weight decay"))
    seed: int = field(default=0, metadata=_flag("seed for the data and the initial parameters"))
    device: str = field(default="auto", metadata=_flag(
        "cpu, cuda, or auto (cuda when available)", choices=("auto", "cpu", "cuda")))
    bucket_mb: float = field(default=25.0, metadata=_flag(
        "gradient bucket size in MB for bucketed strategies (DDP's bucket_cap_mb)"))
    servers: int = field(default=1, metadata=_flag(
        "parameter servers the launcher starts for ps/async-ps/byteps (parameters sharded across them)"))
    server_addrs: str = field(default="", metadata=_flag(
        "comma-separated addresses of running parameter servers (psring server) to use "
        "instead of starting them, e.g. tcp://10.0.0.5:5555,tcp://10.0.0.6:5555"))
    transport: str = field(default="auto", metadata=_flag(
        "ps/async-ps/byteps: how workers reach the servers psring starts: ipc (Unix domain sockets, "
        "one host; less kernel work per message than TCP), tcp (loopback TCP, as across hosts), auto = ipc "
        "on Linux without emulated hosts, else tcp", choices=("auto", "tcp", "ipc")))
    secret_file: str = field(default="", metadata=_flag(
        "ps/async-ps/byteps: file holding the servers' shared secret; every message is then signed "
        "(HMAC-SHA256). Default: the environment variable PSRING_SECRET, else none. Needed "
        "for --server-addrs beyond loopback"))
    max_staleness: int = field(default=-1, metadata=_flag(
        "async-ps: most updates a worker's gradient may be behind (-1 = unbounded)"))
    compress: str = field(default="none", metadata=_flag(
        "cast what is sent to fp16 or bf16 (half the bytes; allreduce, ddp, ps, async-ps; "
        "computation and the servers' state stay float32)", choices=("none", "fp16", "bf16")))
    worker_batch: str = field(default="", metadata=_flag(
        "uneven workers (HetSeq): each worker's share of --batch-size, comma-separated in "
        "rank order (e.g. 48,16 for a worker 3x as fast), or proportional:RUN_DIR for "
        "shares in proportion to the speeds measured in an earlier run (its workers' "
        "median forward + backward); gradients are weighed by samples, so a synchronous "
        "strategy still trains what single trains on the global batch. Default: equal "
        "shares"))
    reduce: str = field(default="sum", metadata=_flag(
        "allreduce, hallreduce: how the workers' gradients combine: sum (their average, what single "
        "computes on the global batch) or adasum (Maleki et al.'s adaptive sum, as in "
        "Horovod: orthogonal gradients add, equal ones average; a power-of-two --workers; "
        "psring.comm.adasum); with hallreduce, Adasum across a power-of-two number of hosts of "
        "each host's average", choices=("sum", "adasum")))
    update_on: str = field(default="", metadata=_flag(
        "byteps: where the optimizer runs: server (the servers update the parameters, as "
        "for ps) or worker (BytePS's summation servers only add; every worker updates its "
        "own copy). Default: the strategy's only choice (byteps: server)"))
    hosts: int = field(default=1, metadata=_flag(
        "emulated hosts to spread the workers over: Linux network namespaces joined by one "
        "switch, each host's link shaped to --link (docs/emulation.md); 1 = this machine's "
        "own network"))
    workers_per_host: int = field(default=0, metadata=_flag(
        "workers on each emulated host, filled in rank order (without --hosts: as many "
        "hosts as that takes); 0 = spread evenly over --hosts"))
    link: str = field(default="", metadata=_flag(
        "rate of every emulated host's link, each direction, in tc's syntax: 100mbit, 1gbit, "
        "10gbit, ...; empty = unshaped (as fast as the CPU moves packets)"))
    delay: str = field(default="", metadata=_flag(
        "one-way delay added to each direction of every emulated link, e.g. 100us, 2ms "
        "(needs the kernel's netem)"))
    server_placement: str = field(default="colocated", metadata=_flag(
        "ps/async-ps/byteps with --hosts: colocated (servers spread over the workers' hosts, "
        "sharing their links) or own-hosts (each server on a host of its own, with its "
        "own link)", choices=("colocated", "own-hosts")))
    slow_worker: str = field(default="", metadata=_flag(
        "I:FACTOR makes worker I's compute FACTOR times slower (straggler experiments)"))
    out: str = field(default="", metadata=_flag(
        "run directory (default: runs/<strategy>-w<workers>-<time>)"))
    timeout: float = field(default=300.0, metadata=_flag(
        "seconds any blocking wait may take before the run fails"))
    master_addr: str = field(default="127.0.0.1", metadata=_flag(
        "address of rank 0's rendezvous store"))
    master_port: int = field(default=0, metadata=_flag(
        "port of rank 0's rendezvous store; 0 = pick a free one"))
    threads: int = field(default=0, metadata=_flag(
        "torch threads per worker; 0 = cores divided by workers on this host (at least 1)"))
    checkpoint_every: int = field(default=0, metadata=_flag(
        "write a checkpoint every N optimizer steps (and at the end) into DIR/checkpoints; "
        "0 = never"))
    resume: str = field(default="", metadata=_flag(
        "continue the run in this directory from its last complete checkpoint; its other "
        "settings are the run's own unless given again"))
    compute: str = field(default="real", metadata=_flag(
        "real: each worker computes on this machine; device: each worker's forward, "
        "backward and optimizer step take a device's times (--device-profile) as waits, "
        "its communication real: a timing-only run of an accelerator cluster "
        "(docs/emulation.md)", choices=("real", "device")))
    device_profile: str = field(default="", metadata=_flag(
        "--compute device: the device's times, a profile directory from `psring profile`"))
    device_speed: float = field(default=1.0, metadata=_flag(
        "--compute device: the device's speed relative to the profile's (2 = twice as fast)"))
    time_scale: float = field(default=1.0, metadata=_flag(
        "--compute device: run S times slower than the cluster described, the device's "
        "times x S and every emulated link's rate / S, for links faster than this machine "
        "can carry; step times are recorded divided by S (docs/emulation.md)"))
    device_link: str = field(default="", metadata=_flag(
        "--compute device, byteps and hallreduce: the hosts' own interconnect (nvlink, or "
        "a rate such as 1200gbit): the collectives among a host's workers take its time, "
        "as on GPUs, instead of running over this machine's loopback and cores "
        "(psring.comm.interconnect). Default: loopback"))
    trace: bool = field(default=False, metadata=_flag(
        "record spans of every step and write trace.json (Chrome trace / Perfetto) in the "
        "run directory; `psring trace DIR` renders it as a PNG"))

    def __post_init__(self) -> None:
        # Imported here: both registries import torch, and config must stay importable
        # without building models or strategies.
        from psring.train.models import model_factory
        from psring.strategies import STRATEGIES

        strategy_cls = STRATEGIES.get(self.strategy)
        model_factory(self.model)  # an unknown name or a module that won't import fails here
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1 (got {self.workers}).")
        if strategy_cls.caps.max_workers is not None and self.workers > strategy_cls.caps.max_workers:
            raise ConfigError(
                f"strategy {self.strategy!r} runs at most {strategy_cls.caps.max_workers} worker(s) "
                f"(got --workers {self.workers}); use --workers 1, or a distributed strategy "
                f"such as allreduce.")
        if self.worker_batch:
            self._check_worker_batch(strategy_cls)
        else:
            check_global_batch(self.batch_size, self.workers)
        for name in ("steps", "accumulate", "samples", "features", "classes", "image_size",
                     "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1 "
                                  f"(got {getattr(self, name)}).")
        if self.classes < 2:
            raise ConfigError(f"--classes must be at least 2 (got {self.classes}).")
        if self.width < 0 or self.depth < 0 or self.threads < 0:
            raise ConfigError("--width, --depth and --threads must be >= 0 (0 = default).")
        if self.eval_samples < 0 or self.eval_every < 0:
            raise ConfigError("--eval-samples and --eval-every must be >= 0 (0 = none, and "
                              "about ten evaluations per run, respectively).")
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
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda (got {self.device!r}).")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(
                    "--device cuda was asked for but torch sees no CUDA device on this "
                    "machine (torch.cuda.is_available() is False, torch "
                    f"{torch.__version__}); use --device cpu (or auto), or install a CUDA "
                    "build of torch on a machine with a GPU.")
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every must be >= 0 (0 = never; got "
                              f"{self.checkpoint_every}).")
        if (self.checkpoint_every or self.resume) and not strategy_cls.caps.supports_checkpoint:
            raise ConfigError(f"strategy {self.strategy!r} cannot checkpoint or resume; "
                              f"drop --checkpoint-every/--resume, or use a strategy that "
                              f"can (see docs/reliability.md).")
        self._check_data()
        if self.compress not in ("none", "fp16", "bf16"):
            raise ConfigError(f"--compress must be none, fp16 or bf16 (got {self.compress!r}).")
        if self.compress != "none" and not strategy_cls.caps.supports_compression:
            raise ConfigError(
                f"--compress applies to strategies that send gradients (allreduce, ddp, ps, "
                f"async-ps); {self.strategy!r} sends nothing to compress. Drop --compress.")
        self._check_reduce(strategy_cls)
        if strategy_cls.caps.needs_equal_hosts:
            counts = worker_counts(self.workers, derived_hosts(
                self.workers, self.hosts, self.workers_per_host), self.workers_per_host)
            if len(set(counts)) > 1:
                raise ConfigError(
                    f"--strategy {self.strategy} shards each bucket over a host's workers "
                    f"and reduces shard l across the hosts' l-th workers, so every host "
                    f"needs as many workers: these hosts have {counts}. Make --workers a "
                    f"multiple of --hosts (or of --workers-per-host).")
        object.__setattr__(self, "hosts", derived_hosts(self.workers, self.hosts,
                                                        self.workers_per_host))
        self._check_cluster(strategy_cls)
        self._check_servers(strategy_cls)
        self._check_slow_worker()
        if self.compute == "device":
            if self.target_accuracy:
                raise ConfigError("--compute device is timing only: nothing is learnt, so "
                                  "there is no accuracy to reach; drop --target-accuracy.")
            object.__setattr__(self, "eval_samples", 0)  # (nothing to evaluate either)
        meta = None
        if self.data == "synthetic":
            # Build the model on the meta device (no memory, no compute) so a model that
            # can't take these inputs is refused here, before any process starts.
            from psring.train.workload import meta_model

            try:
                meta = meta_model(self)[0]
            except PsringError:
                raise
            except Exception as e:  # noqa: BLE001 - a user factory's own failure
                raise ConfigError(
                    f"--model {self.model}: building the model failed ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:300] if str(e) else ''}). psring builds it once "
                    f"on torch's meta device (shapes only) to check it before starting any "
                    f"process: a factory must build from the settings it is given, without "
                    f"reading tensor values.") from None
        from psring.train import device

        device.check(self, strategy_cls, meta)  # (a data file's model: in the worker)

    def _check_cluster(self, strategy_cls) -> None:
        """The cluster flags: what the strategy allows, then the cluster itself
        (psring.cluster.spec validates hosts, links and placement), kept as ``cluster``."""
        if strategy_cls.caps.max_hosts is not None and self.hosts > strategy_cls.caps.max_hosts:
            raise ConfigError(
                f"strategy {self.strategy!r} runs on one host by definition (its workers share "
                f"memory), so --hosts {self.hosts} cannot apply; drop --hosts, or use a "
                f"message-passing strategy (allreduce, ps, async-ps) across hosts.")
        if self.server_placement != "colocated" and not strategy_cls.caps.uses_servers:
            if self.server_placement not in PLACEMENTS:
                raise ConfigError(f"--server-placement must be one of {', '.join(PLACEMENTS)} "
                                  f"(got {self.server_placement!r}).")
            raise ConfigError(f"--server-placement applies to parameter-server strategies "
                              f"(ps, async-ps, byteps), not {self.strategy!r}.")
        cluster = self.cluster  # validates the cluster flags themselves
        if cluster.emulated:
            # worker 0 is always on host-0, the network's first address
            if self.master_addr not in ("127.0.0.1", host_address(0)):
                raise ConfigError("--master-addr is chosen by the emulated cluster (worker 0's "
                                  "host); drop it.")
            wrong = [a for a in self.server_addr_list if not in_network(a)]
            if wrong:
                raise ConfigError(
                    f"--server-addrs {', '.join(wrong)}: emulated hosts reach only each other "
                    f"(198.18.0.0/15); with --hosts the launcher starts the servers itself "
                    f"(drop --server-addrs).")

    @cached_property
    def cluster(self) -> Cluster:
        """Where this run's processes live (psring.cluster.spec): derived from the config
        once (validation computes it first) and kept."""
        # the registry imports torch; see __post_init__
        from psring.strategies import STRATEGIES

        return Cluster.from_config(self, STRATEGIES.get(self.strategy).caps.uses_servers)

    def _check_servers(self, strategy_cls) -> None:
        if self.servers < 1:
            raise ConfigError(f"--servers must be at least 1 (got {self.servers}).")
        addrs = self.server_addr_list
        if (self.servers != 1 or addrs) and not strategy_cls.caps.uses_servers:
            raise ConfigError(f"--servers and --server-addrs apply to parameter-server "
                              f"strategies (ps, async-ps, byteps), not {self.strategy!r}.")
        if self.transport not in ("auto", "tcp", "ipc"):
            raise ConfigError(f"--transport must be auto, tcp or ipc (got {self.transport!r}).")
        if self.transport != "auto":
            if not strategy_cls.caps.uses_servers:
                raise ConfigError(f"--transport applies to parameter-server strategies (ps, "
                                  f"async-ps), not {self.strategy!r}; drop it.")
            if addrs:
                raise ConfigError("--transport applies to the servers psring starts; the "
                                  "--server-addrs already say how to reach yours (tcp:// or "
                                  "ipc://): drop --transport.")
            if self.transport == "ipc" and self.cluster.emulated:
                raise ConfigError("--transport ipc reaches only this host's own processes; "
                                  "emulated hosts talk over their links: drop --transport "
                                  "(or use tcp).")
            from psring.comm.protocol import ABSTRACT_IPC

            if self.transport == "ipc" and not ABSTRACT_IPC:
                raise ConfigError("--transport ipc uses Linux's abstract Unix sockets; on "
                                  f"{sys.platform} use --transport tcp (or auto).")
        if self.max_staleness != -1 and not strategy_cls.caps.supports_staleness_bound:
            raise ConfigError(f"--max-staleness applies to async-ps, not {self.strategy!r}.")
        if self.max_staleness < -1:
            raise ConfigError(f"--max-staleness must be >= 0, or -1 for no bound "
                              f"(got {self.max_staleness}).")
        if addrs:
            for a in addrs:
                u = urlparse(a)
                if u.scheme not in ("tcp", "ipc") or (u.scheme == "tcp" and not u.port):
                    raise ConfigError(f"--server-addrs entry {a!r} is not an address like "
                                      f"tcp://127.0.0.1:5555.")
            from psring.comm.protocol import HOW_TO_SET_A_SECRET, is_local, load_secret

            # an emulated cluster's own servers are reachable only inside it
            remote = [a for a in addrs if not is_local(a)
                      and not (self.cluster.emulated and in_network(a))]
            if remote and load_secret(self.secret_file) is None:
                raise ConfigError(f"--server-addrs: {', '.join(remote)} lie(s) beyond loopback, "
                                  f"where servers accept only signed messages: "
                                  f"{HOW_TO_SET_A_SECRET}.")
            if self.servers not in (1, len(addrs)):
                raise ConfigError(f"--servers {self.servers} disagrees with the "
                                  f"{len(addrs)} --server-addrs; give one or the other.")
            object.__setattr__(self, "servers", len(addrs))
            self.__dict__.pop("cluster", None)  # derived from servers: again when next read
        if strategy_cls.caps.uses_servers and self.secret_file:
            from psring.comm.protocol import load_secret

            load_secret(self.secret_file)  # a missing or too short file fails here, early

    def _check_worker_batch(self, strategy_cls) -> None:
        if self.worker_batch.startswith("proportional:"):
            # resolved once, here: the manifest and every worker see the shares
            object.__setattr__(self, "worker_batch", ",".join(map(str, proportional_shares(
                self.worker_batch.split(":", 1)[1], self.batch_size, self.workers))))
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
        if not strategy_cls.caps.synchronous:
            raise ConfigError(f"--worker-batch weighs gradients by samples within one "
                              f"synchronous step; {self.strategy!r} applies each worker's "
                              f"update alone. Use allreduce, hallreduce, ddp or ps.")
        if self.reduce == "adasum":
            raise ConfigError("--worker-batch weighs gradients by samples; --reduce adasum "
                              "weighs them by their directions. Use one of the two.")

    def _check_reduce(self, strategy_cls) -> None:
        sites = strategy_cls.caps.update_sites
        if self.update_on and self.update_on not in sites:
            raise ConfigError(
                f"--update-on {self.update_on}: {self.strategy!r} updates on the "
                f"{' or '.join(sites)}s only. Updates on the workers from servers that only "
                f"sum need every worker's gradient of a step summed first (synchronous): "
                f"--strategy byteps --update-on worker; drop --update-on otherwise."
                if self.update_on in ("server", "worker") else
                f"--update-on must be server or worker (got {self.update_on!r}).")
        if self.reduce not in strategy_cls.caps.reductions:
            raise ConfigError(
                f"--reduce {self.reduce} is not a reduction of {self.strategy!r} (it has "
                f"{', '.join(strategy_cls.caps.reductions)}); --reduce adasum is for allreduce "
                f"and hallreduce.")
        if self.reduce != "adasum":
            return
        from psring.comm.adasum import is_power_of_two

        # hallreduce: Adasum across the hosts (each host's average), so the hosts count
        what, n = ("--hosts", derived_hosts(self.workers, self.hosts, self.workers_per_host)) \
            if strategy_cls.caps.needs_equal_hosts else ("--workers", self.workers)
        if not is_power_of_two(n):
            lower = 1 << (n.bit_length() - 1)
            raise ConfigError(
                f"--reduce adasum combines the {what[2:]} pairwise, then pairs of pairs "
                f"(recursive halving, as Horovod's Adasum), so {what} must be a power "
                f"of two (got {n}); use {what} {lower} or {2 * lower}.")
        if self.compress != "none":
            raise ConfigError("--reduce adasum combines float32 gradients (its dot products "
                              "and norms); drop --compress.")

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

    def _check_data(self) -> None:
        if self.data in ("synthetic", "digits"):
            if self.data == "digits":
                try:
                    import sklearn  # noqa: F401
                except ImportError:
                    raise ConfigError(
                        "--data digits needs scikit-learn; install the optional extra "
                        "with `pip install 'psring[digits]'`.") from None
            return
        if not self.data.endswith(".npz"):
            raise ConfigError(f"--data must be synthetic, digits or a path to an .npz file "
                              f"(got {self.data!r}).")
        if not os.path.isfile(self.data):
            raise ConfigError(f"--data {self.data!r}: no such file.")

    # ------------------------------------------------------------------ derived
    @property
    def eval_interval(self) -> int:
        """Steps between evaluations (0: no evaluation)."""
        if not self.eval_samples:
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
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_argv(self) -> list[str]:
        """Flags that parse back to this config (used to start worker processes)."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):  # --trace / --no-trace, never "--trace False"
                argv.append(_flag_name(f.name) if value else "--no-" + f.name.replace("_", "-"))
            else:
                argv += [_flag_name(f.name), str(value)]
        return argv


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def cluster_of(cfg: Any) -> Cluster:
    """The cluster of a RunConfig, or of a run's config as its manifest stores it (a
    dict, perhaps from before a cluster setting existed: psring.cluster.spec.DEFAULTS)."""
    if isinstance(cfg, RunConfig):
        return cfg.cluster
    # the registry imports torch; see RunConfig.__post_init__
    from psring.strategies import STRATEGIES

    return Cluster.from_config(cfg, STRATEGIES.get(cfg.get("strategy", "single")).caps.uses_servers)


def add_config_flags(parser: argparse.ArgumentParser, defaults: RunConfig | None = None,
                     suppress: bool = False, only: tuple[str, ...] | None = None) -> None:
    """Add one flag per RunConfig field, typed from the field's default. With
    ``suppress`` a flag not given is absent from the parsed namespace (which flags a
    user gave; see :func:`given_fields`); ``only`` adds just those fields' flags (a
    command that takes some of psring run's)."""
    for f in fields(RunConfig):
        if only is not None and f.name not in only:
            continue
        default = getattr(defaults, f.name) if defaults else f.default
        if suppress:
            default = argparse.SUPPRESS
        kw = dict(f.metadata)
        if isinstance(f.default, bool):
            # --flag / --no-flag: a string boolean ("--trace False") would mean True
            parser.add_argument(_flag_name(f.name), dest=f.name, default=default,
                                action=argparse.BooleanOptionalAction, **kw)
            continue
        parser.add_argument(_flag_name(f.name), dest=f.name, type=type(f.default),
                            default=default, metavar=f.name.upper().split("_")[0], **kw)


def given_fields(argv: list[str]) -> set[str]:
    """The RunConfig fields set explicitly in a `psring run` argv."""
    parser = argparse.ArgumentParser(add_help=False)
    add_config_flags(parser, suppress=True)
    known, _ = parser.parse_known_args(argv)
    return set(vars(known))


def config_from_args(args: argparse.Namespace, **overrides: Any) -> RunConfig:
    values = {f.name: getattr(args, f.name) for f in fields(RunConfig)}
    values.update(overrides)
    return RunConfig(**values)
