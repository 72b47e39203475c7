"""``dist.wrap(model, optimizer)``: the run's strategy around a script's model, and the
optimizer's ``step()`` as the loop's finish -> wait -> update.

    model, optimizer = dist.wrap(model, optimizer)
    loss.backward()              # gradient hooks start communication (buckets, pushes)
    optimizer.synchronize()      # optional: the averaged gradients, e.g. to clip them
    optimizer.step()             # finish_backward -> wait -> the update where it runs

Where the strategy updates on its servers (``ps``; ``byteps`` unless --update-on
worker) the servers apply SGD with the optimizer's lr, momentum and weight decay, taken
once here: another optimizer, or one a scheduler changes, is refused with the update
site to choose. Elsewhere the script's own optimizer steps on every worker.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from psring.errors import ConfigError, PsringError
from psring.library.hooks import StepHooks


def wrap(dist, model: nn.Module, optimizer: Any):
    """See the module's docstring; ``dist`` is the psring.library.session.Distributed."""
    from psring.train.shares import gradient_weight
    from psring.workers.timing import GradientClock, device_sync

    ctx, caps = dist.ctx, dist.strategy_cls.caps
    model.to(ctx.device)
    on_server = not caps.local_optimizer(dist.cfg.update_on)
    if optimizer is None:
        raise ConfigError("dist.wrap(model, optimizer) takes the optimizer too: its "
                          "step() is where the strategy finishes and applies the update.")
    if on_server:
        dist.server_sgd = server_sgd(optimizer, model, dist.cfg)
        dist.cfg = ctx.cfg = dist.cfg.replace(**dist.server_sgd)
    _make_equal(model)
    dist.strategy = strategy = dist.strategy_cls(ctx)
    dist.launch.stage(f"setting up {dist.cfg.strategy}")
    module = strategy.setup(model)
    dist.model, dist.on_server = model, on_server
    dist.sync = device_sync(ctx.device)
    dist.grads = (GradientClock(model, cuda=ctx.device.type == "cuda")
                  if dist.cfg.trace else None)
    dist.weight = gradient_weight(dist.cfg, dist.rank, dist.world)
    StepHooks(dist, module, dist.weight)
    _drive(optimizer, dist)
    if dist.rank == 0:
        write_script_manifest(dist)
    dist.timer = dist._new_timer()
    dist.launch.stage("training", waiting=False)
    return module, optimizer


def server_sgd(optimizer: Any, model: nn.Module, cfg) -> dict[str, float]:
    """The servers' SGD settings from the script's optimizer, or a ConfigError naming
    what the servers cannot do and the update site that can."""
    from psring.train.optim import SGD

    fix = ("; pass --update-on worker (psring launch, or psring.init(update_on='worker')) "
           "to run it on every worker" if "worker" in _sites(cfg) else
           f"; {cfg.strategy} updates only on its servers: use allreduce, or byteps "
           f"--update-on worker, for this optimizer")
    if not isinstance(optimizer, (torch.optim.SGD, SGD)):  # (psring's: torch's arithmetic)
        raise ConfigError(f"{cfg.strategy}'s servers apply SGD (lr, momentum, weight "
                          f"decay); the optimizer is {type(optimizer).__name__}{fix}.")
    if len(optimizer.param_groups) != 1:
        raise ConfigError(f"{cfg.strategy}'s servers apply one lr to every parameter; the "
                          f"optimizer has {len(optimizer.param_groups)} parameter "
                          f"groups{fix}.")
    g = optimizer.param_groups[0]
    if g.get("nesterov") or g.get("dampening", 0) or g.get("maximize"):
        raise ConfigError(f"{cfg.strategy}'s servers apply plain SGD with momentum (no "
                          f"Nesterov, dampening or maximize){fix}.")
    mine = {id(p) for p in g["params"]}
    if mine != {id(p) for p in model.parameters() if p.requires_grad}:
        raise ConfigError(f"{cfg.strategy}'s servers update every trainable parameter of "
                          f"the model; the optimizer holds another set of them{fix}.")
    return _hyper(g)


def _sites(cfg) -> tuple[str, ...]:
    from psring.strategies import STRATEGIES

    return STRATEGIES.get(cfg.strategy).caps.update_sites


def _hyper(group: dict) -> dict[str, float]:
    return {"lr": float(group["lr"]), "momentum": float(group.get("momentum", 0.0)),
            "weight_decay": float(group.get("weight_decay", 0.0))}


def _make_equal(model: nn.Module) -> None:
    """Every worker starts from rank 0's parameters and buffers (Horovod's
    broadcast_parameters), where the workers share a process group; a parameter
    server's first pull gives every worker the servers' copy, rank 0's, anyway."""
    import torch.distributed as tdist

    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            tdist.broadcast(t.data, src=0)


class _Inner:
    """The script's optimizer as the strategy's update sees it: its own step."""

    def __init__(self, optimizer: Any, step: Any):
        self.optimizer, self.step = optimizer, step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


def _drive(optimizer: Any, dist) -> None:
    """The optimizer's ``step()`` becomes the strategy's finish -> wait -> update, and
    ``synchronize()`` the first two alone (on the instance: an LR scheduler made after
    dist.wrap keeps working with it)."""
    inner = _Inner(optimizer, optimizer.step)

    def step(self: Any, closure: Any = None) -> None:
        if closure is not None:
            raise PsringError("optimizer.step(closure) re-evaluates the model, which a "
                              "strategy's communication cannot repeat: call step() "
                              "without a closure.")
        scope = _scope(dist, "optimizer.step()")
        if scope.stepped:
            raise PsringError(f"optimizer.step() twice in dist.step({scope.step}): one "
                              f"update a step.")
        finish_backward(dist, scope)
        if dist.on_server:
            _same_server_sgd(dist, optimizer)
        dist.strategy.update(None if dist.on_server else inner)
        scope.timer.lap("update_s")
        scope.stepped = True

    def synchronize() -> None:
        if dist.on_server:
            raise PsringError(
                f"optimizer.synchronize(): {dist.cfg.strategy} sums the gradients on its "
                f"servers, which also update the parameters; the workers never see the "
                f"averaged gradient (to clip it, say). Choose an update on the workers: "
                f"--update-on worker where the strategy has it (byteps), or allreduce.")
        finish_backward(dist, _scope(dist, "optimizer.synchronize()"))

    # bound methods, as a scheduler expects (it wraps step.__func__ to count calls)
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.synchronize = synchronize


def _scope(dist, what: str):
    if dist.current is None:
        raise PsringError(f"{what} outside `with dist.step(step):`; the step begins "
                          f"there (a parameter server's pull) and is recorded at its end.")
    return dist.current


def finish_backward(dist, scope) -> None:
    """The loop's end of backward (once a step): the communication started during it
    finished and waited for (comm_s). Where the strategy waits inside backward (DDP),
    what came after the backward's end was that wait."""
    if scope.synchronized:
        return
    if scope.in_backward:
        raise PsringError("optimizer.step() inside backward (a gradient hook?): call it "
                          "after loss.backward() returns.")
    if dist.weight is not None and scope.sending_backwards and not scope.weighed:
        raise PsringError(
            "--worker-batch weighs the gradient flowing back through the output of the "
            "module dist.wrap returned, and this step's backward never reached it: call "
            "that module (not its submodules) for the loss.")
    timer = scope.timer
    timer.lap("comm_s" if dist.strategy.caps.syncs_inside_backward
              and scope.sending_backwards else "backward_s")
    handle = dist.strategy.finish_backward()
    timer.lap("backward_s")
    handle.wait()
    timer.lap("comm_s")
    scope.synchronized = True


def _same_server_sgd(dist, optimizer: Any) -> None:
    now = _hyper(optimizer.param_groups[0])
    if now != dist.server_sgd:
        changed = ", ".join(f"{k} {dist.server_sgd[k]:g} -> {now[k]:g}" for k in now
                            if now[k] != dist.server_sgd[k])
        raise PsringError(
            f"the optimizer's settings changed ({changed}; an LR scheduler?), but "
            f"{dist.cfg.strategy}'s servers apply the ones dist.wrap took. Schedules need "
            f"the update on the workers: --update-on worker where the strategy has it "
            f"(byteps), or allreduce.")


def save_final(dist) -> None:
    """model.pt and the others waited for, as psring run's workers end
    (psring.workers.entry.save_and_wait); rank 0's manifest again, now with the inputs
    the model saw (its FLOPs per sample)."""
    from psring.workers.entry import save_and_wait

    if dist.rank == 0:
        write_script_manifest(dist)
    save_and_wait(dist.ctx, dist.strategy, dist.model, dist.launch)
    dist.launch.done()


def write_script_manifest(dist) -> None:
    """manifest.json for a script's run: psring run's facts, the data as the script
    fed it (the sampler's set, the model's inputs as seen)."""
    from psring.records.runlog import MANIFEST, atomic_write_json
    from psring.workers.manifest import run_facts

    flops = _flops_per_sample(dist)
    data = {"kind": "script", "samples": getattr(dist, "samples", None),
            "inputs": [list(shape) for shape, _ in (dist.inputs or ([], {}))[0]]}
    facts = run_facts(dist.cfg, dist.model, dist.strategy_cls, dist.threads, flops, data,
                      launch=dist.launch.describe(), per_host=dist.ctx.local_world)
    # the model is the script's, not --model's (which it never read)
    facts["config"]["model"] = f"script {Path(sys.argv[0]).name}"
    facts["script"] = [Path(sys.argv[0]).name, *sys.argv[1:]]
    atomic_write_json(dist.run_dir / MANIFEST, facts)


def _flops_per_sample(dist) -> float | None:
    """The model's FLOPs per sample, forward and backward: the forward's as
    torch.utils.flop_counter counts them on one sample of the inputs the model saw,
    times 3 (backward about twice forward; a backward here would fire the strategy's
    gradient hooks). None before the model has seen an input."""
    from psring.train.models import flop_counter

    if dist.inputs is None:
        return None
    args, kwargs = dist.inputs
    one = lambda shape, dtype: torch.zeros((1, *shape[1:]), dtype=dtype,  # noqa: E731
                                           device=dist.device)
    training = dist.model.training
    dist.model.eval()
    try:
        with torch.no_grad(), flop_counter() as counter:
            dist.model(*[one(*a) for a in args], **{k: one(*v) for k, v in kwargs.items()})
    except Exception:  # noqa: BLE001 - a model that needs more than zeros: no count
        return None
    finally:
        dist.model.train(training)
    return 3.0 * counter.get_total_flops()
