"""One worker of a run, inside the user's own training script.

    import psring
    dist = psring.init()                           # the run psring launch (or torchrun) set
    sampler = dist.sampler(dataset, batch_size=128, seed=1)
    loader = DataLoader(dataset, batch_sampler=sampler)
    model, optimizer = dist.wrap(model, optimizer)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            with dist.step() as s:                 # timed phases -> steps.jsonl
                loss = loss_fn(model(x), y.to(dist.device))
                loss.backward()                    # p.grad: the average, as with DDP
                optimizer.step(); optimizer.zero_grad()
                s.loss = loss
    dist.finish()                                  # model.pt, as psring run writes it

The worker is set up as ``python -m psring.workers`` sets up its own (psring.workers.entry:
its context, the rendezvous, the process group when the strategy asks for one) and runs
the same strategy objects; what psring's loop does in its step (psring.workers.loop) is
done here by the calls the script makes: ``dist.step`` begins the step (a PS pull) and
at its end writes the record and brings the parameters the next step starts from (the
servers' pull, byteps's gather: between steps the model is one version), the end of
each backward finishes its communication (psring.library.hooks), the wrapped
optimizer's ``step()`` applies the update where the strategy says (``--update-on``).
The script owns the loop's length: ``--steps`` is a cap, and ``dist.finish()`` ends
the run after any number of steps.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from torch import nn

from psring.errors import PsringError
from psring.library.hooks import finish_backward, gradients_as_sent, to_device
from psring.library.sampler import GlobalBatchSampler
from psring.library.wrap import save_final, wrap
from psring.records.runlog import EVALS, StepLog
from psring.runtime import elastic, forking, rendezvous
from psring.runtime.process import set_process_name
from psring.strategies import STRATEGIES
from psring.workers import entry
from psring.workers.loop import step_record
from psring.workers.timing import PhaseTimer, TrainingClock, now


class Distributed:
    """A worker of the run: the sampler, wrap, step, accumulate, evaluate and finish
    that a script calls (see the module's docstring). Attributes: ``rank``,
    ``world``, ``device``, ``run_dir``, ``steps`` (the run's cap on optimizer steps,
    --steps; None: the script decides), ``done`` (steps taken), ``cfg``."""

    def __init__(self, cfg, ctx, launch, strategy_cls, threads: int):
        self.cfg, self.ctx, self.launch = cfg, ctx, launch
        self.strategy_cls, self.threads = strategy_cls, threads
        self.rank, self.world, self.device = ctx.rank, ctx.world, ctx.device
        self.run_dir: Path = ctx.run_dir
        self.steps: int | None = cfg.steps or None
        self.strategy = None
        self.model = None
        self.module = None
        self.steps_log = StepLog(ctx.run_dir)
        self.evals = StepLog(ctx.run_dir, EVALS) if ctx.rank == 0 else None
        self.clock = TrainingClock()
        self.carried = 0.0
        self.timer = None
        self.current: StepScope | None = None
        self.closed = False
        self.finished_at: int | None = None  # the steps dist.finish() ended the run after
        self.done = 0  # steps recorded: the next step's number
        self.paused = False  # inside dist.no_sync()
        self.micro = 0  # (dist.accumulate) micro-batches of the open step so far
        self.broken = ""  # why no step may follow (one failed half-way)
        #: the inputs the model first saw: ([(shape, dtype)], {name: (shape, dtype)})
        self.inputs: tuple | None = None
        self.weight: float | None = None  # --worker-batch's weight of this worker
        self.samples: int | None = None  # the first sampler's data set (the training set)

    @classmethod
    def start(cls, cfg) -> Distributed:
        """Set up this process as a worker of ``cfg`` (validated)."""
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
        dist = cls(cfg, ctx, launch, strategy_cls, threads)
        dist._watch_exit()
        return dist

    # -- data ----------------------------------------------------------------------
    def sampler(self, dataset: Any, batch_size: int, seed: int = 0, shuffle: bool = True,
                drop_last: bool = True) -> GlobalBatchSampler:
        """A batch sampler of this worker's rows of each global batch of ``batch_size``
        (a ``DataLoader``'s ``batch_sampler``), an epoch per iteration, ``set_epoch``
        as ``DistributedSampler`` has it: see psring.library.sampler."""
        length = dataset if isinstance(dataset, int) else len(dataset)
        if not drop_last:
            raise PsringError(
                f"dist.sampler(drop_last=False): the last {length % batch_size} sample(s) "
                f"of an epoch make no whole global batch of {batch_size}, which the "
                f"workers could not split as `single` reads it; the sampler drops them "
                f"(drop_last=True, the default).")
        uneven = self.cfg.worker_batches if self.cfg.worker_batch else None
        if self.samples is None:  # (the first sampler's: the training set's)
            self.samples = length
            if not uneven:  # the global batch is the script's (reports count by it)
                self.cfg = self.ctx.cfg = self.cfg.replace(batch_size=batch_size)
        return GlobalBatchSampler(length, batch_size, self.rank, self.world,
                                  self.steps or 0, seed=seed, shuffle=shuffle,
                                  uneven=uneven, accumulate=self.cfg.accumulate)

    def to_device(self, obj: Any) -> Any:
        """``obj`` (a batch: tensors in tuples, lists, dicts, dataclasses) with every
        tensor on this worker's device, as the wrapped model moves its own inputs."""
        return to_device(obj, self.device)

    # -- the model -----------------------------------------------------------------
    def wrap(self, model: nn.Module, optimizer: Any = None):
        """The model to run forward on and the optimizer to step, under the run's
        strategy (psring.library.wrap): parameters made equal on every worker, gradient
        hooks installed, the servers initialized. Returns ``(module, optimizer)``."""
        if self.strategy is not None:
            raise PsringError("dist.wrap() was called twice: a run trains one model.")
        self._open("dist.wrap()")
        return wrap(self, model, optimizer)

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The script's own model (what dist.wrap was given), from the module dist.wrap
        returned (DDP's ``.module``; the model itself elsewhere)."""
        if self.model is None or module not in (self.model, self.module):
            raise PsringError("dist.unwrap(module) takes the module dist.wrap returned.")
        return self.model

    # -- steps -----------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int | None = None) -> Iterator[StepScope]:
        """One optimizer step (numbered by the run: 0, 1, ... across epochs; a number
        given must be that one): begins it (a PS pull), lets the script compute, and at
        its end finishes its communication (if no backward did), writes its
        steps.jsonl record and brings the parameters the next step starts from."""
        if self.cfg.accumulate > 1:
            raise PsringError(
                f"--accumulate {self.cfg.accumulate}: the sampler yields "
                f"{self.cfg.accumulate} micro-batches an optimizer step; run each inside "
                f"`with dist.accumulate(model):`, which begins and ends the steps.")
        with self._stepping(self._begin(step)) as scope:
            yield scope

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module | None = None) -> Iterator[StepScope]:
        """One micro-batch of ``--accumulate K`` (Accelerate's ``accumulate``): the
        first begins an optimizer step, all but the K-th accumulate only (the strategy's
        no_sync; ``optimizer.step()`` and ``zero_grad()`` do nothing), the K-th sends
        and updates, and the step is recorded when its context ends. Every backward's
        gradient is weighed by 1/K (Accelerate's ``backward`` divides the loss)."""
        if model is not None and model is not self.module and model is not self.model:
            raise PsringError("dist.accumulate(model) takes the module dist.wrap returned.")
        k = self.cfg.accumulate
        scope = self._begin(None) if self.micro == 0 else self.current
        last = self.micro == k - 1
        scope.factor = (self.weight or 1.0) / k
        scope.sync_gradients = last
        self.micro += 1
        try:
            with contextlib.nullcontext() if last else self.no_sync():
                yield scope
            if last:
                self.micro = 0
                self._end(scope)
        except BaseException:
            self.micro = 0
            self._fail(scope)
            raise

    @property
    def sync_gradients(self) -> bool:
        """Whether this micro-batch's backward sends the gradients (Accelerate's name):
        the last of ``--accumulate`` K, and every step without accumulation. Step an
        LR scheduler only then."""
        scope = self.current
        return scope is None or scope.sync_gradients

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches whose gradients only accumulate: every backward of a step but
        the last runs inside it (the strategy's own no_sync: its buckets paused, DDP's
        reducer off)."""
        if self.strategy is None:
            raise PsringError("dist.no_sync() before dist.wrap(model, optimizer).")
        with self.strategy.no_sync():
            self.paused = True
            try:
                yield
            finally:
                self.paused = False

    @contextlib.contextmanager
    def _stepping(self, scope: StepScope) -> Iterator[StepScope]:
        """The step's body, then its end; a failure in either leaves it broken."""
        try:
            yield scope
            self._end(scope)
        except BaseException:
            self._fail(scope)
            raise

    def _fail(self, scope: StepScope) -> None:
        self.current = None
        self.broken = f"dist.step({scope.step}) failed half-way"

    def _open(self, what: str) -> None:
        if self.finished_at is not None:
            raise PsringError(f"{what} after dist.finish(): the run ended there, after "
                              f"{self.finished_at} steps.")
        if self.closed:
            raise PsringError(f"{what} after the worker was closed (dist.close()).")

    def _begin(self, step: int | None) -> StepScope:
        self._open("dist.step()")
        if self.strategy is None:
            raise PsringError("dist.step() before dist.wrap(model, optimizer): wrap the "
                              "model first, so the strategy has its gradients to send.")
        if self.current is not None:
            raise PsringError(f"dist.step() inside dist.step({self.current.step}): one "
                              f"step at a time.")
        if self.broken:
            raise PsringError(f"{self.broken}: its communication is not finished, so no "
                              f"step can follow; let the error end the script.")
        step = self.done if step is None else step
        if step != self.done:
            raise PsringError(
                f"dist.step({step}): the run numbers its steps 0, 1, ... across epochs, "
                f"and {self.done} is next; call dist.step() without a number (it counts "
                f"them), or pass the run's count.")
        if self.steps is not None and step >= self.steps:
            raise PsringError(
                f"dist.step({step}): the launch's --steps {self.steps} is the most this run "
                f"takes, and they are done. dist.sampler stops there by itself; a loop "
                f"of your own can stop at dist.steps, or drop --steps (the script decides).")
        self.launch.stage("training", step)
        self.clock.begin(self.carried)
        self.timer.lap("data_s")
        self.strategy.begin_step(step).wait()
        self.timer.lap("comm_s")
        self.current = scope = StepScope(step, self.timer, self.weight or 1.0)
        return scope

    def _end(self, scope: StepScope) -> None:
        finish_backward(self, scope)  # (done, unless no backward reached the parameters)
        if not scope.stepped:  # (optimizer.step() checked it, before zero_grad)
            self._unchanged_since_sent(scope)
        self.current = None
        scope.timer.lap("update_s")  # (what followed the update: zero_grad, say)
        loss = None if scope.loss is None else float(_plain(scope.loss))
        record = step_record(self.ctx, self.strategy, scope.timer, scope.step, loss,
                             self.grads)
        if not scope.stepped:  # (GradScaler found inf: where the workers update, none)
            record["updated"] = False
        self.steps_log.write(record)
        self.launch.stage("between steps", scope.step, waiting=False)
        self.done = scope.step + 1
        # one view: from here on the model holds the parameters the next step starts
        # from (the servers' pull, byteps's gather); the next step's wait, done now
        t = now()
        self.strategy.eval_model(self.model)
        self.carried = now() - t
        self.timer = self._new_timer(self.carried)

    def _unchanged_since_sent(self, scope: StepScope) -> None:
        """Where the servers update, the gradients they had are the model's: a change
        after backward (a clip, GradScaler's unscale_) would be silently lost."""
        if not self.on_server or scope.sent is None:
            return
        if gradients_as_sent(self.model) != scope.sent:
            self.broken = f"dist.step({scope.step}) changed the gradients after sending them"
            raise PsringError(
                f"p.grad changed after backward in dist.step({scope.step}) (a "
                f"clip_grad_norm_, GradScaler's unscale_, zero_grad before step, an "
                f"edit of your own), but {self.cfg.strategy}'s servers had received the "
                f"gradients by then and update with what they got: the change would be "
                f"lost. Edit gradients where the workers update (--update-on worker where "
                f"the strategy has it, or allreduce), or drop the edit.")

    def _new_timer(self, carried: float = 0.0) -> PhaseTimer:
        return PhaseTimer(self.sync, self.cfg.trace, carried)

    # -- evaluation ----------------------------------------------------------------------
    def evaluate(self, done: int, fn: Callable[[Any], dict]) -> dict:
        """Evaluate after ``done`` steps, outside the steps' timing: every worker calls
        it at the same steps (synchronous workers stay in step); ``fn(model)`` (the
        model holding the parameters the next step starts from) returns metrics, and
        rank 0 writes them to evals.jsonl. An ``accuracy`` among them is what time to
        accuracy reads (psring report, --target-accuracy)."""
        if self.model is None or self.current is not None:
            raise PsringError("dist.evaluate() goes between steps, after dist.wrap().")
        self._open("dist.evaluate()")
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
    def finish(self) -> Path:
        """The run's end, after any number of steps: every worker ends the strategy
        there (the servers' last version, byteps's gather), rank 0 writes the trained
        parameters as model.pt and the manifest, every worker waits for the others, and
        the strategy, the logs and the process group are closed. Returns the run
        directory."""
        self._open("dist.finish()")
        if self.current is not None:
            raise PsringError(
                f"dist.finish() inside dist.step({self.current.step})"
                + (f", after {self.micro} of its {self.cfg.accumulate} micro-batches"
                   if self.micro else "")
                + ": finish after the last step's context has ended.")
        try:
            if self.strategy is not None:
                save_final(self)
            self.finished_at = self.done
        finally:
            self.close()
        return self.run_dir

    def close(self) -> None:
        """Release everything (called by finish; also safe after a failure)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self._at_exit)
        try:
            if self.evals is not None:
                self.evals.close()
            entry.teardown(self.steps_log, self.strategy, self.model)
        finally:
            rendezvous.current().close()

    def __enter__(self) -> Distributed:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None and not self.closed:
            self.finish()
        else:
            self.close()

    # -- a script that ends without finish ---------------------------------------------
    def _watch_exit(self) -> None:
        """At the process's exit: a worker that was wrapped and never called
        dist.finish() fails, naming the call (its run has no model.pt; the others may
        wait for it), unless it is failing already."""
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        if self.closed:
            return
        # failing already: an uncaught error (the interpreter keeps it in sys.last_value),
        # or a forked script's non-zero exit (a script started anew does not say)
        failing = getattr(sys, "last_value", None) is not None or forking.exiting_with
        self.close()
        if failing or self.strategy is None:
            return
        print(f"psring: error: worker {self.rank} ended after {self.done} step(s) without "
              f"dist.finish(): the run's end (the strategy's last exchange, model.pt, the "
              f"manifest) happens there. Call dist.finish() after the last step.",
              file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(1)


class StepScope:
    """What ``with dist.step() as s`` gives: ``s.loss = loss`` puts this worker's loss
    into the step's record; ``s.step`` is its number. The rest is the step's state
    (psring.library.hooks, psring.library.wrap)."""

    def __init__(self, step: int, timer: PhaseTimer, factor: float = 1.0):
        self.step, self.timer = step, timer
        self.loss = None
        #: what each backward's gradients are multiplied by (--worker-batch, accumulate)
        self.factor = factor
        self.sync_gradients = True  # (dist.accumulate) this micro-batch sends
        self.stepped = False  # optimizer.step() ran
        self.synchronized = False  # the step's communication is finished
        self.in_backward = False
        self.sending = False  # the backward under way sends (not under no_sync)
        self.gradients = False  # it reached a parameter
        self.sending_backwards = 0  # backwards outside dist.no_sync()
        #: where the servers update: the gradients as they were sent (hooks.gradients_as_sent)
        self.sent: list | None = None


def _plain(v: Any) -> Any:
    """A metric as JSON takes it (a 0-d tensor as a float)."""
    item = getattr(v, "item", None)
    return item() if callable(item) else v  # (.item() of a 0-d tensor: no grad warning)
