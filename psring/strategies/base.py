"""The strategy protocol: what the one worker loop calls, and nothing else.

A strategy is everything that differs between data-parallel algorithms; the loop
(``psring.workers.loop``) is what they share. The loop never asks which strategy it
runs: it calls these hooks in this order every optimizer step and reads what the
strategy declares it can do (its ``caps``, a :class:`Capabilities`).

    handle = strategy.begin_step(step)     # e.g. a PS pull of fresh parameters
    handle.wait()                          # timed as comm_s
    for each micro-batch:
        with strategy.no_sync() unless it is the last one:
            forward, backward              # gradient hooks may start communication
    handle = strategy.finish_backward()    # covers everything started during backward
    handle.wait()                          # timed as comm_s (blocked time only)
    strategy.update(optimizer)             # timed as update_s

The handle-and-wait shape is ps-lite's Push/Pull -> timestamp -> Wait and Horovod's
async handle + synchronize: communication starts as early as the data exists, and the
loop blocks only where the next computation needs the result.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ClassVar,
    ContextManager,
    Iterable,
    Literal,
    Protocol,
)

import torch
from torch import nn

from psring.errors import PsringError
from psring.registry import Registry
from psring.train.optim import SGD

if TYPE_CHECKING:  # (psring.config sits above: it validates against the registries)
    from psring.config import RunConfig

STRATEGIES: Registry = Registry("strategy")


class Handle(Protocol):
    def wait(self) -> None: ...


class Done:
    """A handle for work that is already complete."""

    def wait(self) -> None:
        return None


DONE = Done()


class WaitAll:
    """A handle over several handles (one per bucket, shard, ...), and optionally what
    to do once they are all complete."""

    def __init__(self, handles: Iterable[Handle], then: Callable[[], None] | None = None):
        self.handles = list(handles)
        self.then = then

    def wait(self) -> None:
        for h in self.handles:
            h.wait()
        if self.then is not None:
            self.then()


@dataclass
class WorkerContext:
    """What a strategy may know about the process it runs in."""

    #: the run's config, validated (a type-only import: psring.config's validate() checks
    #: it against this registry, so the import at run time goes that way only)
    cfg: RunConfig
    rank: int
    world: int
    local_rank: int
    local_world: int
    device: torch.device
    run_dir: Path
    log: logging.Logger
    #: the checkpoint this run resumes from (psring.train.checkpoint.Checkpoint), or None
    resume: Any = None
    #: the host this worker runs on (an emulated host's name, or the machine's)
    host: str = ""
    #: --compute device: the device stand-in (psring.train.device.DeviceCompute), else None
    stand_in: Any = None
    #: under torchrun, this rank writes its host's run directory's checkpoints too (the
    #: lowest rank there: psring.runtime.elastic); rank 0 always writes them
    writes_checkpoints: bool = False


@dataclass
class StepStats:
    """Per-step communication facts a strategy reports to the loop's step record.

    Times are ``time.perf_counter()`` values (CLOCK_MONOTONIC: one clock for all
    processes on a host); the loop turns them into offsets from the step's start.
    """

    bytes_sent: int = 0
    bytes_recv: int = 0
    bucket_launch: list[float] = field(default_factory=list)
    bucket_done: list[float] = field(default_factory=list)
    #: more fields for the step record; a name ending in ``_s`` is a duration in
    #: seconds, recorded on the described cluster's clock as the loop's own (/ --time-scale)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Capabilities:
    """What a strategy can do, declared once per strategy (``caps``) and read by the
    config checks, the launcher, the loop, sweeps, the simulator and advise. A
    strategy derived from another states what differs with ``dataclasses.replace``."""

    #: largest --workers the strategy supports (None = any)
    max_workers: int | None = None
    #: largest --hosts allowed (None = any): a strategy whose workers share memory runs
    #: on one host
    max_hosts: int | None = None
    #: the worker entry point must initialize torch.distributed before setup()
    uses_process_group: bool = False
    #: the launcher starts --servers parameter-server processes (unless --server-addrs
    #: names running ones) and passes their addresses to the workers
    uses_servers: bool = False
    #: --max-staleness means something to this strategy
    supports_staleness_bound: bool = False
    #: gradient communication is waited on inside backward() (DDP's reducer does this);
    #: the loop then splits backward at the last gradient hook so comm_s stays honest
    syncs_inside_backward: bool = False
    #: the simulator's cost model for it, by name (psring.predict.sim.cost_models.COST_MODELS: a
    #: plugin may register its own); None when it sends no messages (one process,
    #: shared memory): its step is its compute
    cost_model: str | None = None
    #: what a worker blocked in communication waits for (named when --timeout expires)
    waits_for: str = "communication"
    #: --checkpoint-every and --resume work (checkpoint_state/restore_checkpoint below)
    supports_checkpoint: bool = True
    #: the run goes on when a worker other than 0 dies (its updates never waited for:
    #: async-ps without --max-staleness, whose bound would wait for it), the survivors
    #: finishing it; False: a lost worker fails the run (or restarts it, --max-restarts)
    survives_lost_workers: bool = False
    #: --backup-workers B: each step takes the first N - B workers' gradients (the
    #: synchronous PS's servers choose them); the run then goes on past B lost workers
    supports_backups: bool = False
    #: --compress fp16/bf16 means something: the strategy sends gradients
    #: (psring.comm.compress)
    supports_compression: bool = False
    #: every host must hold the same number of workers (hallreduce's shards)
    needs_equal_hosts: bool = False
    #: every step averages all workers' gradients (so --worker-batch can weigh them by
    #: samples); False where each worker's update lands alone (async-ps, hogwild)
    synchronous: bool = True
    #: the values --reduce may take (how the workers' gradients combine)
    reductions: tuple[str, ...] = ("sum",)
    #: where the optimizer may run (--update-on), the default first: "server" where a
    #: server updates the parameters, "worker" where each worker does
    update_sites: tuple[str, ...] = ("worker",)
    #: --compute device can stand in for each worker's accelerator (psring.train.device);
    #: False where the workers share memory on one host and have no device of their own
    emulates_device: bool = True
    #: what of its traffic inside a host of several workers --device-link can time as a
    #: device interconnect's: "collectives" (a reduce-scatter and all-gather among the
    #: host's workers: psring.comm.interconnect), "ring-hops" (a flat ring's hops between
    #: two workers of one host: psring.comm.hostring), "host-copies" (a parameter
    #: server's worker's copies of gradients to host memory and parameters back, at the
    #: host's PCIe: psring.comm.interconnect.on_host), "" (none: the flag is refused)
    inside_host: Literal["", "collectives", "ring-hops", "host-copies"] = ""
    #: --loss-tolerance F: its gradient pushes can go as datagrams of which at most F
    #: may be lost (psring.comm.lossy); its pulls stay reliable
    loss_tolerant: bool = False
    #: the devices its workers compute on (--device; auto picks CUDA where torch sees a
    #: GPU and it is listed): hogwild's workers share the model in CPU memory
    devices: tuple[str, ...] = ("cpu", "cuda")

    def update_site(self, update_on: str) -> str:
        """Where the optimizer runs for a run's --update-on ("" = the default)."""
        return update_on or self.update_sites[0]

    def may_lose(self, cfg: RunConfig, process: str, lost: int = 0) -> bool:
        """Whether the run goes on without ``process`` (a worker's or server's name) when
        it dies, ``lost`` workers being gone already: a worker other than worker 0, which
        writes the model and evaluations, where the strategy survives lost workers and
        nothing else would wait for it, or one of --backup-workers B."""
        if not process.startswith("worker-") or process == "worker-0":
            return False
        if self.survives_lost_workers and cfg.max_staleness < 0:
            return True
        return self.supports_backups and lost < cfg.backup_workers

    def local_optimizer(self, update_on: str) -> bool:
        """Whether each worker builds and applies the optimizer (the loop's update);
        False where a server applies it and workers only receive parameters."""
        return self.update_site(update_on) == "worker"


class Strategy:
    """Base class: a no-communication strategy. Subclasses override what differs."""

    name: ClassVar[str] = ""
    #: what the strategy can do (see Capabilities)
    caps: ClassVar[Capabilities] = Capabilities()

    def __init_subclass__(cls, **kw: Any) -> None:
        # A strategy written for the flags Capabilities replaced (uses_servers = True,
        # comm_model = "ring", ...) would silently get the defaults: refuse it by name.
        super().__init_subclass__(**kw)
        stale = sorted(({f.name for f in fields(Capabilities)}
                        | {"comm_model", "local_optimizer", "costed"}) & set(vars(cls)))
        if stale:
            raise TypeError(
                f"strategy {cls.__name__} sets {', '.join(stale)} on the class; what a "
                f"strategy can do is declared once, in caps = Capabilities(...) (or "
                f"dataclasses.replace(Parent.caps, ...)); comm_model is caps.cost_model.")

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.stats = StepStats()

    # -- lifecycle ---------------------------------------------------------------
    def setup(self, model: nn.Module) -> nn.Module:
        """Called once with the initialized model; returns the module to run forward on."""
        return model

    def close(self) -> None:
        """Release sockets, process groups, shared memory. Called even after a failure."""

    # -- per step ----------------------------------------------------------------
    def begin_step(self, step: int) -> Handle:
        return DONE

    def no_sync(self) -> ContextManager[None]:
        """Context for micro-batches whose gradients must only accumulate locally."""
        return contextlib.nullcontext()

    def finish_backward(self) -> Handle:
        return DONE

    def update(self, optimizer: SGD | None) -> None:
        assert optimizer is not None
        optimizer.step()

    def take_stats(self) -> StepStats:
        """This step's communication facts; resets them for the next step."""
        stats, self.stats = self.stats, StepStats()
        return stats

    def eval_model(self, model: nn.Module) -> nn.Module:
        """The module holding the parameters to evaluate after an update (outside the
        step timing): the parameters the next step starts from. Default: the local
        model (synchronous strategies end a step with it; hogwild's is the shared one).
        A strategy whose parameters live elsewhere brings them here first; the loop
        charges the time this takes to the next step's communication."""
        return model

    # -- checkpoints ---------------------------------------------------------------
    def checkpoint_state(self, model: nn.Module,
                         optimizer: SGD | None) -> dict[str, torch.Tensor]:
        """The tensors of a checkpoint, taken after a step's update. Called on every
        worker at the same step (a strategy may communicate here); rank 0's result is
        written (psring.train.checkpoint). Default: the model's state_dict and the local
        optimizer's momentum buffers, by parameter name."""
        state = {"model/" + k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        if optimizer is not None:
            for name, p in model.named_parameters():
                buf = optimizer.state.get(p, {}).get("momentum_buffer")
                if buf is not None:
                    state["momentum/" + name] = buf.detach().cpu().clone()
        return state

    def checkpoint_step(self, done: int, state: dict[str, torch.Tensor]) -> int:
        """The step a checkpoint of ``state``, taken after ``done`` steps of this worker's
        loop, resumes at: ``done``, unless the strategy's state may be ahead of worker
        0's loop (ps with backup workers: the servers go on without a late worker)."""
        return done

    def restore_checkpoint(self, model: nn.Module, optimizer: SGD | None,
                           state: dict[str, torch.Tensor]) -> None:
        """Put a checkpoint back, after setup(): what checkpoint_state took."""
        model.load_state_dict({k[len("model/"):]: v for k, v in state.items()
                               if k.startswith("model/")})
        if optimizer is not None:
            for name, p in model.named_parameters():
                buf = state.get("momentum/" + name)
                if buf is not None:
                    optimizer.state[p]["momentum_buffer"] = buf.to(p.device).clone()

    # -- end of run ----------------------------------------------------------------
    def finish_run(self, model: nn.Module) -> None:
        """This worker's last step is done (after any number of steps: a script's run
        ends where the script says): called on every worker before rank 0's
        final_state, so what the end needs from all of them happens here (a parameter
        server's last pull, a host's gather). Default: nothing."""

    def server_momentum(self, model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
        """Where the servers update: each parameter's momentum buffer as the servers
        hold it for the parameters this worker holds (between steps), for a script's
        ``optimizer.state_dict()``."""
        raise PsringError(f"{self.name} keeps no optimizer state on servers to fetch.")

    def final_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The trained parameters as a CPU state_dict (rank 0 saves it as model.pt)."""
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    @classmethod
    def cleanup_run(cls, cfg: RunConfig) -> None:
        """Remove what the run left outside its directory (shared memory files). The
        launcher calls it once the run's processes are gone, whether it failed or not."""

    # -- facts for the manifest ------------------------------------------------------
    @classmethod
    def bytes_per_step(cls, param_bytes: int, world: int,
                       per_host: int = 1) -> tuple[int, int]:
        """(sent, received) bytes per worker per synchronized step, by the algorithm, for
        ``param_bytes`` of gradients as they are sent (compressed, with --compress), on
        hosts of ``per_host`` workers each."""
        return 0, 0
