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
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from psring.errors import PsringError

if TYPE_CHECKING:  # (imported where used: it imports torch)
    from psring.library.sampler import GlobalBatchSampler

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
        self.done = 0  # steps recorded: the next step's number
        self.paused = False  # inside dist.no_sync()
        self.broken = ""  # why no step may follow (one failed half-way)
        #: the inputs the model first saw: ([(shape, dtype)], {name: (shape, dtype)})
        self.inputs: tuple | None = None
        self.weight: float | None = None  # --worker-batch's weight of this worker

    @classmethod
    def start(cls, cfg) -> Distributed:
        """Set up this process as a worker of ``cfg`` (validated)."""
        from psring.runtime import elastic
        from psring.runtime.process import set_process_name
        from psring.strategies import STRATEGIES
        from psring.workers import entry

        rank, local_rank = entry.env_int("RANK", 0), entry.env_int("LOCAL_RANK", 0)
        local_world = entry.env_int("LOCAL_WORLD_SIZE", cfg.workers)
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
        if not hasattr(self, "samples"):  # (the first sampler's: the training set's)
            self.samples = length
            if not uneven:  # the global batch is the script's (reports count by it)
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
        """One optimizer step: begins it (a PS pull), lets the script compute, and at
        its end finishes its communication (if optimizer.step() did not: a skipped
        update) and writes its steps.jsonl record."""
        scope = self._begin(step)
        try:
            yield scope
            self._end(scope)
        except BaseException as e:
            self.current = None
            self.broken = f"dist.step({step}) failed half-way ({type(e).__name__})"
            raise

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches whose gradients only accumulate: every backward of a step but
        the last runs inside it (the strategy's own no_sync: its buckets paused, DDP's
        reducer off)."""
        with self.strategy.no_sync():
            self.paused = True
            try:
                yield
            finally:
                self.paused = False

    def _begin(self, step: int) -> StepScope:
        if self.strategy is None:
            raise PsringError("dist.step() before dist.wrap(model, optimizer): wrap the "
                              "model first, so the strategy has its gradients to send.")
        if self.current is not None:
            raise PsringError(f"dist.step({step}) inside dist.step({self.current.step}): "
                              f"one step at a time.")
        if self.broken:
            raise PsringError(f"{self.broken}: its communication is not finished, so no "
                              f"step can follow; let the error end the script.")
        if step != self.done or step >= self.steps:
            raise PsringError(
                f"dist.step({step}): the run's steps are numbered 0..{self.steps - 1} in "
                f"order, and {self.done} is next (count one global step across epochs; "
                f"psring launch --steps N, or psring.init(steps=N), sets how many).")
        self.launch.stage("training", step)
        self.clock.begin(self.carried)
        self.timer.lap("data_s")
        self.strategy.begin_step(step).wait()
        self.timer.lap("comm_s")
        self.current = scope = StepScope(step, self.timer)
        return scope

    def _end(self, scope: StepScope) -> None:
        from psring.library.wrap import finish_backward
        from psring.workers.loop import step_record

        finish_backward(self, scope)  # (done, unless optimizer.step() was skipped)
        self.current = None
        scope.timer.lap("update_s")  # (what followed the update: zero_grad, say)
        loss = None if scope.loss is None else float(_plain(scope.loss))
        record = step_record(self.ctx, self.strategy, scope.timer, scope.step, loss,
                             self.grads)
        if not scope.stepped:  # (GradScaler found inf: where the workers update, none)
            record["updated"] = False
        self.steps_log.write(record)
        self.launch.stage("between steps", scope.step, waiting=False)
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
        self.launch.stage("evaluating", waiting=False)
        t = now()
        target = self.strategy.eval_model(self.model)
        fetch = now() - t  # the next step would have waited for it: its communication
        train_s = self.clock.elapsed()
        with self.clock.paused():
            t = now()
            metrics = dict(fn(target))
            taken = sorted({"step", "train_s", "eval_s", "time"} & set(metrics))
            if taken:
                raise PsringError(f"dist.evaluate(): the metric name(s) {', '.join(taken)} "
                                  f"are the record's own; call them something else.")
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
                if self.done != self.steps:
                    raise PsringError(
                        f"dist.finish() after {self.done} of the run's {self.steps} steps: "
                        f"a strategy ends on its last step (its servers' last pull, "
                        f"gather); pass --steps {self.done} to psring launch (or "
                        f"psring.init(steps={self.done})), or run them all.")
                save_final(self)
        finally:
            self.close()
        return self.run_dir

    def close(self) -> None:
        """Release everything (called by finish; also safe after a failure)."""
        from psring.runtime import rendezvous
        from psring.workers import entry

        if self.closed:
            return
        self.closed = True
        try:
            if self.evals is not None:
                self.evals.close()
            entry.teardown(self.steps_log, self.strategy, self.model)
        finally:
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
    loss into the step's record. The rest is the step's state (psring.library.hooks,
    psring.library.wrap)."""

    def __init__(self, step: int, timer):
        self.step, self.timer = step, timer
        self.loss = None
        self.stepped = False  # optimizer.step() ran
        self.synchronized = False  # the step's communication is finished
        self.in_backward = False
        self.sending_backwards = 0  # backwards outside dist.no_sync()
        self.weighed = False  # a gradient came back through the wrapped module's output


def _plain(v: Any) -> Any:
    """A metric as JSON takes it (a 0-d tensor as a float)."""
    item = getattr(v, "item", None)
    return item() if callable(item) else v  # (.item() of a 0-d tensor: no grad warning)

