"""One worker of a run, inside the user's own training script.

    import psring
    dist = psring.init()                           # the run psring launch (or torchrun) set
    sampler = dist.sampler(dataset, batch_size=128, seed=1)
    loader = DataLoader(dataset, batch_sampler=sampler)
    model, optimizer = dist.wrap(model, optimizer)
    for step, (x, y) in enumerate(loader):
        with dist.step(step) as s:                 # timed phases -> steps.jsonl
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step(); optimizer.zero_grad()
            s.loss = loss
    dist.finish()                                  # model.pt, as psring run writes it

The worker is set up as ``python -m psring.workers`` sets up its own (psring.workers.entry:
its context, the rendezvous, the process group when the strategy asks for one) and runs
the same strategy objects; what psring's loop does in its step (psring.workers.loop) is
done here by the calls the script makes: ``dist.step`` begins the step (a PS pull) and
writes its record, the wrapped optimizer's ``step()`` finishes backward's communication,
waits for it and applies the update where the strategy says (``--update-on``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from psring.errors import ConfigError, PsringError
from psring.runtime import launch

if TYPE_CHECKING:  # (imported where used: it imports torch)
    from psring.library.sampler import GlobalBatchSampler

#: the run's flags that ``psring launch`` gives each process it starts (a JSON list)
ENV = launch.ENV


def init(strategy: str | None = None, **settings: Any) -> Distributed:
    """This process's worker of a run: under ``psring launch`` the run it started (any
    argument given must agree with it); under torchrun, or alone (one worker), the run
    the arguments describe (``strategy`` and any ``psring run`` setting by field name:
    ``out``, ``steps``, ``update_on``, ...)."""
    import torch

    from psring.config import validate

    # the script's random numbers stay its own: validating a config builds psring's
    # model on the meta device, seeded, and would reseed torch's generator
    with torch.random.fork_rng(devices=[]):
        cfg = validate(_config(strategy, settings))
        return Distributed.start(cfg)


def _config(strategy: str | None, settings: dict[str, Any]):
    from psring.config import RunConfig, config_from_args
    from psring.runtime import rendezvous

    if strategy is not None:
        settings = {"strategy": strategy, **settings}
    world = int(os.environ.get("WORLD_SIZE") or 1)
    if launched():
        cfg = config_from_args(_parse_flags(os.environ[ENV]),
                               **({"workers": world} if rendezvous.under_torchrun() else {}))
        _agree(cfg, settings)
        if not cfg.out:
            raise ConfigError(f"under torchrun each host writes its workers' records to a "
                              f"run directory: add --out DIR to {ENV}.")
        return cfg
    if not settings and not rendezvous.under_torchrun():
        raise ConfigError(
            "psring.init() was called outside a launch and without arguments: start the "
            "script with `psring launch --strategy S --workers N -- python SCRIPT`, under "
            "torchrun with psring.init(strategy=..., out=DIR), or alone with "
            "psring.init(strategy='single').")
    unknown = sorted(set(settings) - set(RunConfig.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"psring.init() takes psring run's settings by field name; "
                          f"{', '.join(unknown)} is not one (psring run --help lists them, "
                          f"--batch-size as batch_size).")
    if settings.get("workers", world) != world:
        raise ConfigError(f"psring.init(workers={settings['workers']}) in a process of a "
                          f"launch of {world}; start N workers with `psring launch "
                          f"--workers N -- python SCRIPT` (or torchrun --nproc-per-node N).")
    if not rendezvous.under_torchrun() and world == 1:
        # alone: the process group (allreduce of one) meets itself on loopback
        from psring.runtime.process import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port("127.0.0.1")))
    cfg = RunConfig(**{**settings, "workers": world})
    if not cfg.out:
        if world > 1:
            raise ConfigError("under torchrun each host writes its workers' records to a "
                              "run directory: pass psring.init(..., out=DIR).")
        cfg = cfg.replace(out=launch.default_out(cfg))
    return cfg


def launched() -> bool:
    """Whether this process was given a run's flags: by psring launch, or by the user
    under torchrun (``PSRING_RUN_ARGS="--strategy allreduce --out runs/x" torchrun ...``)."""
    return bool(os.environ.get(ENV))


def _parse_flags(text: str):
    """The run's flags as psring launch writes them (a JSON list) or a user does (a
    shell-quoted string), parsed as psring run parses its own."""
    import argparse
    import shlex

    from psring.config import add_config_flags

    argv = json.loads(text) if text.lstrip().startswith("[") else shlex.split(text)
    parser = argparse.ArgumentParser(prog=f"{ENV}", exit_on_error=False)
    add_config_flags(parser)
    try:
        return parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        raise ConfigError(f"{ENV} holds flags psring run does not take ({e}): "
                          f"{text[:200]}") from None


def _agree(cfg, settings: dict[str, Any]) -> None:
    """Under psring launch the launch's flags set the run; an argument of the script's
    that says otherwise is refused rather than silently overruled."""
    for name, value in settings.items():
        if getattr(cfg, name, value) != value:
            raise ConfigError(
                f"psring.init({name}={value!r}) disagrees with the launch's "
                f"--{name.replace('_', '-')} {getattr(cfg, name)!r}: psring launch sets "
                f"the run; drop the argument, or pass the flag to psring launch.")


class Distributed:
    """A worker of the run: the sampler, wrap, step, evaluate and finish that a script
    calls (see the module's docstring). Attributes: ``rank``, ``world``, ``device``,
    ``run_dir``, ``steps`` (the run's number of optimizer steps), ``cfg``."""

    def __init__(self, cfg, ctx, launch, strategy_cls, threads: int):
        from psring.records.runlog import EVALS, StepLog
        from psring.workers.timing import TrainingClock

        self.cfg, self.ctx, self.launch = cfg, ctx, launch
        self.strategy_cls, self.threads = strategy_cls, threads
        self.rank, self.world, self.device = ctx.rank, ctx.world, ctx.device
        self.run_dir: Path = ctx.run_dir
        self.steps: int = cfg.steps
        self.strategy = None
        self.model = None
        self.steps_log = StepLog(ctx.run_dir)
        self.evals = StepLog(ctx.run_dir, EVALS) if ctx.rank == 0 else None
        self.clock = TrainingClock()
        self.carried = 0.0
        self.timer = None
        self.current: StepScope | None = None
        self.closed = False
        self.input_shapes: list | None = None

    @classmethod
    def start(cls, cfg) -> Distributed:
        """Set up this process as a worker of ``cfg`` (validated)."""
        from psring.runtime import elastic
        from psring.runtime.process import set_process_name
        from psring.strategies import STRATEGIES
        from psring.workers import entry

        script_refusals(cfg)
        rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
        local_world = _env_int("LOCAL_WORLD_SIZE", cfg.workers)
        prefix = f"[worker {rank}/{cfg.workers}]"
        set_process_name(f"worker-{rank}")
        log = logging.getLogger("psring.worker")
        if not log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix} %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
        ctx, threads = entry.worker_context(cfg, rank, cfg.workers, local_rank, local_world,
                                            log)
        strategy_cls = STRATEGIES.get(cfg.strategy)
        launch, net = entry.join_run(ctx, prefix)
        elastic.after_join(ctx, launch, strategy_cls.caps.uses_servers)
        if strategy_cls.caps.uses_process_group:
            entry.start_process_group(ctx, launch, net)
        launch.stage("waiting for the model (dist.wrap)", waiting=False)
        return cls(cfg, ctx, launch, strategy_cls, threads)

    # -- data ----------------------------------------------------------------------
    def sampler(self, dataset: Any, batch_size: int, seed: int = 0,
                shuffle: bool = True) -> GlobalBatchSampler:
        """A batch sampler of this worker's rows of each global batch of ``batch_size``
        (a ``DataLoader``'s ``batch_sampler``), ``steps`` batches long: see
        psring.library.sampler."""
        from psring.library.sampler import GlobalBatchSampler

        length = dataset if isinstance(dataset, int) else len(dataset)
        uneven = self.cfg.worker_batches if self.cfg.worker_batch else None
        self.samples = length
        if not uneven:  # the global batch is the script's (reports count samples by it)
            self.cfg = self.ctx.cfg = self.cfg.replace(batch_size=batch_size)
        return GlobalBatchSampler(length, batch_size, self.rank, self.world, self.steps,
                                  seed=seed, shuffle=shuffle, uneven=uneven)

    # -- the model -----------------------------------------------------------------
    def wrap(self, model, optimizer=None):
        """The model to run forward on and the optimizer to step, under the run's
        strategy (psring.library.wrap): parameters made equal on every worker, gradient
        hooks installed, the servers initialized. Returns ``(module, optimizer)``."""
        from psring.library.wrap import wrap

        if self.strategy is not None:
            raise PsringError("dist.wrap() was called twice: a run trains one model.")
        return wrap(self, model, optimizer)

    # -- steps -----------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[StepScope]:
        """One optimizer step: begins it (a PS pull), lets the script compute, and once
        the wrapped optimizer has stepped writes its steps.jsonl record."""
        scope = self._begin(step)
        try:
            yield scope
        except BaseException:
            self.current = None
            raise
        self._end(scope)

    def _begin(self, step: int) -> StepScope:
        if self.strategy is None:
            raise PsringError("dist.step() before dist.wrap(model, optimizer): wrap the "
                              "model first, so the strategy has its gradients to send.")
        if self.current is not None:
            raise PsringError(f"dist.step({step}) inside dist.step({self.current.step}): "
                              f"one step at a time.")
        if not 0 <= step < self.steps:
            raise PsringError(f"dist.step({step}): the run has {self.steps} steps "
                              f"(0..{self.steps - 1}); set another number with psring "
                              f"launch --steps N (or psring.init(steps=N)).")
        self.clock.begin(self.carried)
        self.timer.lap("data_s")
        self.strategy.begin_step(step).wait()
        self.timer.lap("comm_s")
        self.current = scope = StepScope(step, self.timer)
        return scope

    def _end(self, scope: StepScope) -> None:
        from psring.workers.loop import step_record

        self.current = None
        if not scope.stepped:
            raise PsringError(f"dist.step({scope.step}) ended without optimizer.step(): "
                              f"call the optimizer dist.wrap returned inside the step.")
        loss = None if scope.loss is None else float(_plain(scope.loss))
        self.steps_log.write(step_record(self.ctx, self.strategy, scope.timer, scope.step,
                                         loss, self.grads))
        self.launch.stage("training", scope.step)
        self.carried = 0.0
        self.timer = self._new_timer()
        self.done = scope.step + 1

    def _new_timer(self, carried: float = 0.0):
        from psring.workers.timing import PhaseTimer

        return PhaseTimer(self.sync, self.cfg.trace, carried)

    # -- evaluation ----------------------------------------------------------------------
    def evaluate(self, done: int, fn: Callable[[Any], dict]) -> dict:
        """Evaluate after ``done`` steps, outside the steps' timing: every worker calls
        it at the same steps (synchronous workers stay in step); ``fn(model)`` (the
        model holding the parameters the next step starts from) returns metrics, and
        rank 0 writes them to evals.jsonl. An ``accuracy`` among them is what time to
        accuracy reads (psring report, --target-accuracy)."""
        from psring.workers.timing import now

        if self.model is None or self.current is not None:
            raise PsringError("dist.evaluate() goes between steps, after dist.wrap().")
        t = now()
        target = self.strategy.eval_model(self.model)
        fetch = now() - t  # the next step would have waited for it: its communication
        train_s = self.clock.elapsed()
        with self.clock.paused():
            t = now()
            metrics = dict(fn(target))
            if self.evals is not None:
                self.evals.write({"step": done, "train_s": round(train_s, 6),
                                  **{k: _plain(v) for k, v in metrics.items()},
                                  "eval_s": round(now() - t, 6), "time": time.time()})
        self.carried += fetch
        self.timer = self._new_timer(self.carried)
        return metrics

    # -- the end -------------------------------------------------------------------------
    def finish(self) -> Path | None:
        """The run's end: rank 0 writes the trained parameters as model.pt (what psring
        run writes), every worker waits for the others, and the strategy, the logs and
        the process group are closed. Returns the run directory."""
        from psring.library.wrap import save_final

        if self.closed:
            return self.run_dir
        try:
            if self.strategy is not None:
                save_final(self)
        finally:
            self.close()
        return self.run_dir

    def close(self) -> None:
        """Release everything (called by finish; also safe after a failure)."""
        from psring.workers import entry

        if self.closed:
            return
        self.closed = True
        if self.evals is not None:
            self.evals.close()
        entry.teardown(self.steps_log, self.strategy, self.model)
        from psring.runtime import rendezvous

        rendezvous.current().close()

    def __enter__(self) -> Distributed:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.finish()
        else:
            self.close()


class StepScope:
    """What ``with dist.step(step) as s`` gives: ``s.loss = loss`` puts this worker's
    loss into the step's record."""

    def __init__(self, step: int, timer):
        self.step, self.timer = step, timer
        self.loss = None
        self.stepped = False
        self.synchronized = False


def script_refusals(cfg) -> None:
    """What psring's own loop does that a script's run cannot: refused by name (psring
    launch before anything starts, psring.init in each worker)."""
    if cfg.compute == "device":
        raise ConfigError("--compute device times psring's own models from their "
                          "profiles; a script's model has none: drop --compute device "
                          "(your script computes for real).")
    if cfg.accumulate != 1:
        raise ConfigError("--accumulate belongs to psring's own loop; in your script, "
                          "accumulate micro-batches inside one dist.step (use "
                          "model.no_sync() where the strategy has it).")
    if cfg.checkpoint_every or cfg.resume or cfg.max_restarts:
        raise ConfigError("--checkpoint-every, --resume and --max-restarts restart "
                          "psring's own loop from its checkpoints; a script's run has "
                          "none yet: drop them.")


def _plain(v: Any) -> Any:
    """A metric as JSON takes it (a 0-d tensor as a float)."""
    item = getattr(v, "item", None)
    return item() if callable(item) else v  # (.item() of a 0-d tensor: no grad warning)


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default
