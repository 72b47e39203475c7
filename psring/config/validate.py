"""The one validation step that needs more than the values: the strategy and model
registries (torch), the files a run reads (data, secret, an earlier run's steps, a
device profile), CUDA, and the model itself, built on torch's meta device.

The launcher calls it before starting any process, the worker entry once (through
``config_from_args``), and ``psring run`` before anything starts, so a bad flag is
one paragraph and exit status 2 (psring.errors):

    >>> from psring.config import RunConfig, validate
    >>> validate(RunConfig(strategy="ps", workers=4, workers_per_host=2)).hosts
    2
"""

from __future__ import annotations

import os
import sys
from typing import Any

from psring.cluster.spec import host_address, in_network, worker_counts
from psring.comm.endpoints import ABSTRACT_IPC, HOW_TO_SET_A_SECRET, is_local, load_secret
from psring.config.run import RunConfig
from psring.errors import ConfigError, PsringError
from psring.train.shares import proportional_shares
from psring.units import parse_window

#: configs validated in this process, each with its validated self: the CLI validates
#: before printing what it runs and the launcher again before starting processes; the
#: files read are those of one command, which does not change them in between
_VALID: dict[RunConfig, RunConfig] = {}


def validate(cfg: RunConfig) -> RunConfig:
    """``cfg`` checked against its strategy, its model and the files it names; returns
    it with the derived values filled in (``RunConfig.derived``, and --worker-batch
    proportional:DIR resolved into each worker's batch). Raises ConfigError."""
    if cfg in _VALID:
        return _VALID[cfg]
    # Imported here: both registries import torch, which a RunConfig alone does not.
    from psring.strategies import STRATEGIES
    from psring.train.models import model_factory

    strategy_cls = STRATEGIES.get(cfg.strategy)
    model_factory(cfg.model)  # an unknown name or a module that won't import fails here
    caps = strategy_cls.caps
    given = cfg
    if cfg.worker_batch.startswith("proportional:"):
        # resolved once, here: the manifest and every worker see the shares
        cfg = cfg.replace(worker_batch=",".join(map(str, proportional_shares(
            cfg.worker_batch.split(":", 1)[1], cfg.batch_size, cfg.workers))))
    _check_strategy(cfg, caps)
    _check_files(cfg)
    _check_reduce(cfg, caps)
    cfg = cfg.replace(**cfg.derived())
    _check_cluster(cfg, caps)
    _check_servers(cfg, caps)
    _check_model(cfg, strategy_cls)
    _VALID[given] = _VALID[cfg] = cfg
    return cfg


def _check_strategy(cfg: RunConfig, caps: Any) -> None:
    """What the strategy can do: its workers, uneven batches, checkpoints, compression."""
    if caps.max_workers is not None and cfg.workers > caps.max_workers:
        raise ConfigError(
            f"strategy {cfg.strategy!r} runs at most {caps.max_workers} worker(s) "
            f"(got --workers {cfg.workers}); use --workers 1, or a distributed strategy "
            f"such as allreduce.")
    if cfg.worker_batch and not caps.synchronous:
        raise ConfigError(f"--worker-batch weighs gradients by samples within one "
                          f"synchronous step; {cfg.strategy!r} applies each worker's "
                          f"update alone. Use allreduce, hallreduce, ddp or ps.")
    if (cfg.checkpoint_every or cfg.resume or cfg.max_restarts) \
            and not caps.supports_checkpoint:
        raise ConfigError(f"strategy {cfg.strategy!r} cannot checkpoint or resume; "
                          f"drop --checkpoint-every/--resume/--max-restarts, or use a "
                          f"strategy that can (see docs/reliability.md).")
    if cfg.device != "auto" and cfg.device not in caps.devices:
        raise ConfigError(f"--device {cfg.device}: {cfg.strategy!r} computes on "
                          f"{' or '.join(caps.devices)} only (hogwild's workers share the "
                          f"model in CPU memory); use --device cpu (or auto).")
    if cfg.device == "cuda" and cfg.compute == "device":
        raise ConfigError("--compute device emulates the accelerator on the CPU: its "
                          "times come from --device-profile, and the workers run on "
                          "the CPU. Drop --device cuda (auto picks the CPU), or drop "
                          "--compute device to compute on the GPU.")
    if cfg.compress != "none" and not caps.supports_compression:
        raise ConfigError(
            f"--compress applies to strategies that send gradients (allreduce, ddp, ps, "
            f"async-ps); {cfg.strategy!r} sends nothing to compress. Drop --compress.")


def _check_files(cfg: RunConfig) -> None:
    """The data set's file (or the digits' extra) and CUDA, if asked for."""
    if cfg.data == "digits":
        try:
            import sklearn  # noqa: F401 - installed is all that is asked
        except ImportError:
            raise ConfigError(
                "--data digits needs scikit-learn; install the optional extra "
                "with `pip install 'psring[digits]'`.") from None
    elif cfg.data != "synthetic" and not os.path.isfile(cfg.data):
        raise ConfigError(f"--data {cfg.data!r}: no such file.")
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "--device cuda was asked for but torch sees no CUDA device on this "
                "machine (torch.cuda.is_available() is False, torch "
                f"{torch.__version__}); use --device cpu (or auto), or install a CUDA "
                "build of torch on a machine with a GPU.")


def _check_reduce(cfg: RunConfig, caps: Any) -> None:
    """--update-on and --reduce against the strategy's sites and reductions; Adasum's
    power of two; hosts of equal workers where the strategy shards over them."""
    sites = caps.update_sites
    if cfg.update_on and cfg.update_on not in sites:
        raise ConfigError(
            f"--update-on {cfg.update_on}: {cfg.strategy!r} updates on the "
            f"{' or '.join(sites)}s only. Updates on the workers from servers that only "
            f"sum need every worker's gradient of a step summed first (synchronous): "
            f"--strategy byteps --update-on worker; drop --update-on otherwise.")
    if cfg.reduce not in caps.reductions:
        raise ConfigError(
            f"--reduce {cfg.reduce} is not a reduction of {cfg.strategy!r} (it has "
            f"{', '.join(caps.reductions)}); --reduce adasum is for allreduce "
            f"and hallreduce.")
    hosts = cfg.derived()["hosts"]
    if cfg.reduce == "adasum":
        _check_adasum(cfg, ("--hosts", hosts) if caps.needs_equal_hosts
                      else ("--workers", cfg.workers))
    counts = worker_counts(cfg.workers, hosts, cfg.workers_per_host)
    if caps.needs_equal_hosts and len(set(counts)) > 1:
        raise ConfigError(
            f"--strategy {cfg.strategy} shards each bucket over a host's workers "
            f"and reduces shard l across the hosts' l-th workers, so every host "
            f"needs as many workers: these hosts have {counts}. Make --workers a "
            f"multiple of --hosts (or of --workers-per-host).")


def _check_adasum(cfg: RunConfig, counted: tuple[str, int]) -> None:
    """``counted``: what Adasum combines pairwise (hallreduce: the hosts' averages)."""
    from psring.comm.adasum import is_power_of_two  # (torch; see validate)

    what, n = counted
    if not is_power_of_two(n):
        lower = 1 << (n.bit_length() - 1)
        raise ConfigError(
            f"--reduce adasum combines the {what[2:]} pairwise, then pairs of pairs "
            f"(recursive halving, as Horovod's Adasum), so {what} must be a power "
            f"of two (got {n}); use {what} {lower} or {2 * lower}.")
    if cfg.compress != "none":
        raise ConfigError("--reduce adasum combines float32 gradients (its dot products "
                          "and norms); drop --compress.")


def _check_cluster(cfg: RunConfig, caps: Any) -> None:
    """The cluster flags: what the strategy allows, then the cluster itself
    (psring.cluster.spec validates hosts, links and placement)."""
    if caps.max_hosts is not None and cfg.hosts > caps.max_hosts:
        raise ConfigError(
            f"strategy {cfg.strategy!r} runs on one host by definition (its workers share "
            f"memory), so --hosts {cfg.hosts} cannot apply; drop --hosts, or use a "
            f"message-passing strategy (allreduce, ps, async-ps) across hosts.")
    if cfg.server_placement != "colocated" and not caps.uses_servers:
        raise ConfigError(f"--server-placement applies to parameter-server strategies "
                          f"(ps, async-ps, byteps), not {cfg.strategy!r}.")
    if not cfg.cluster.emulated:  # (reading it validates the cluster flags themselves)
        return
    # worker 0 is always on host-0, the network's first address
    if cfg.master_addr not in ("127.0.0.1", host_address(0)):
        raise ConfigError("--master-addr is chosen by the emulated cluster (worker 0's "
                          "host); drop it.")
    wrong = [a for a in cfg.server_addr_list if not in_network(a)]
    if wrong:
        raise ConfigError(
            f"--server-addrs {', '.join(wrong)}: emulated hosts reach only each other "
            f"(198.18.0.0/15); with --hosts the launcher starts the servers itself "
            f"(drop --server-addrs).")


def _check_servers(cfg: RunConfig, caps: Any) -> None:
    """The parameter-server flags against the strategy; the secret a server beyond
    loopback needs, and the secret file itself."""
    addrs = cfg.server_addr_list
    if (cfg.servers != 1 or addrs) and not caps.uses_servers:
        raise ConfigError(f"--servers and --server-addrs apply to parameter-server "
                          f"strategies (ps, async-ps, byteps), not {cfg.strategy!r}.")
    if cfg.transport != "auto":
        _check_transport(cfg, caps)
    if cfg.max_staleness != -1 and not caps.supports_staleness_bound:
        raise ConfigError(f"--max-staleness applies to async-ps, not {cfg.strategy!r}.")
    if cfg.backup_workers and not caps.supports_backups:
        raise ConfigError(f"--backup-workers lets a synchronous parameter server drop its "
                          f"slowest workers' gradients; {cfg.strategy!r} has no such step "
                          f"(async-ps never waits for a worker anyway): use --strategy ps, "
                          f"or drop --backup-workers.")
    if cfg.backup_workers and cfg.worker_batch:
        raise ConfigError("--backup-workers averages whichever N - B workers come first, "
                          "and --worker-batch weighs each worker by its own share: the two "
                          "do not make the global batch's mean. Drop one of them.")
    if cfg.loss_tolerance:
        _check_loss_tolerance(cfg, caps)
    if cfg.credit_window:
        _check_credit_window(cfg, caps)
    if cfg.switch == "priority" and not cfg.loss_tolerance:
        raise ConfigError("--switch priority ranks bounded-loss datagrams by their marks; "
                          "without --loss-tolerance every byte goes over TCP, which has no "
                          "priorities to rank (the switch would drop as fifo does): add "
                          "--loss-tolerance F (ps, async-ps, byteps, allreduce), or drop "
                          "--switch.")
    if cfg.kill_server and not caps.uses_servers:
        raise ConfigError(f"--kill-server kills a parameter server; {cfg.strategy!r} uses "
                          f"none: drop --kill-server, or use --kill-worker.")

    # an emulated cluster's own servers are reachable only inside it
    remote = [a for a in addrs if not is_local(a)
              and not (cfg.cluster.emulated and in_network(a))]
    if remote and load_secret(cfg.secret_file) is None:
        raise ConfigError(f"--server-addrs: {', '.join(remote)} lie(s) beyond loopback, "
                          f"where servers accept only signed messages: "
                          f"{HOW_TO_SET_A_SECRET}.")
    if caps.uses_servers and cfg.secret_file:
        load_secret(cfg.secret_file)  # a missing or too short file fails here, early


def _check_loss_tolerance(cfg: RunConfig, caps: Any) -> None:
    f = cfg.loss_tolerance
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1:
        raise ConfigError(f"--loss-tolerance is the fraction of a push's gradient that may "
                          f"be lost, in [0, 1): e.g. 0.01 (got {f!r}; 0 = reliable).")
    if not caps.loss_tolerant:
        from psring.strategies import STRATEGIES  # (torch, as above)

        able = [n for n in STRATEGIES.names() if STRATEGIES.get(n).caps.loss_tolerant]
        raise ConfigError(f"--loss-tolerance covers the gradient pushes of "
                          f"{', '.join(able)}; {cfg.strategy!r} has none: use one of "
                          f"those, or drop --loss-tolerance.")
    if not caps.uses_servers and (cfg.reduce != "sum" or cfg.compress != "none"
                                  or cfg.device_link):
        raise ConfigError("--loss-tolerance with allreduce reduces each bucket by a "
                          "transpose all-reduce of float32 sums over datagrams "
                          "(psring.comm.transpose), which --reduce adasum, --compress and "
                          "--device-link do not fit: drop those, or --loss-tolerance.")
    if cfg.transport == "ipc" or any(a.startswith("ipc://") for a in cfg.server_addr_list):
        raise ConfigError("--loss-tolerance sends gradients as UDP datagrams to the "
                          "servers' address and port, which an ipc:// server has not: "
                          "use --transport tcp (or auto), or tcp:// --server-addrs.")


def _check_credit_window(cfg: RunConfig, caps: Any) -> None:
    parse_window(cfg.credit_window)
    if not cfg.loss_tolerance:
        raise ConfigError("--credit-window paces bounded-loss datagrams (each receiver, "
                          "a parameter server or a transpose all-reduce's rank, grants "
                          "its senders): give --loss-tolerance F (ps, async-ps, byteps, "
                          "allreduce), or drop --credit-window (TCP paces itself).")


def _check_transport(cfg: RunConfig, caps: Any) -> None:
    if not caps.uses_servers:
        raise ConfigError(f"--transport applies to parameter-server strategies (ps, "
                          f"async-ps), not {cfg.strategy!r}; drop it.")
    if cfg.server_addr_list:
        raise ConfigError("--transport applies to the servers psring starts; the "
                          "--server-addrs already say how to reach yours (tcp:// or "
                          "ipc://): drop --transport.")
    if cfg.transport == "ipc" and cfg.cluster.emulated:
        raise ConfigError("--transport ipc reaches only this host's own processes; "
                          "emulated hosts talk over their links: drop --transport "
                          "(or use tcp).")

    if cfg.transport == "ipc" and not ABSTRACT_IPC:
        raise ConfigError("--transport ipc uses Linux's abstract Unix sockets; on "
                          f"{sys.platform} use --transport tcp (or auto).")


def _check_model(cfg: RunConfig, strategy_cls: Any) -> None:
    """The model, built on the meta device (no memory, no compute) so that one that
    can't take these inputs is refused before any process starts; then the device
    settings against it (psring.train.device)."""
    meta = None
    if cfg.data == "synthetic":
        from psring.train.workload import meta_model  # (torch, as above)

        try:
            meta = meta_model(cfg)[0]
        except PsringError:
            raise
        except Exception as e:  # noqa: BLE001 - a user factory's own failure
            raise ConfigError(
                f"--model {cfg.model}: building the model failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:300] if str(e) else ''}). psring builds it once "
                f"on torch's meta device (shapes only) to check it before starting any "
                f"process: a factory must build from the settings it is given, without "
                f"reading tensor values.") from None
    from psring.train import device, elimination  # (torch, as above)

    if meta is not None:
        elimination.check_model(meta, cfg.eliminate_every)
    if cfg.eliminate_every and cfg.compute == "device":
        raise ConfigError("--eliminate-every scores the training set with the model, and "
                          "--compute device computes nothing: drop one of them.")
    device.check(cfg, strategy_cls, meta)  # (a data file's model: in the worker)
