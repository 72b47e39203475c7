"""``dist.wrap(model, optimizer)``: the run's strategy around a script's model, and the
optimizer as the strategy's update.

    model, optimizer = dist.wrap(model, optimizer)
    loss.backward()              # returns with p.grad the average (psring.library.hooks)
    clip_grad_norm_(...)         # where the workers update: the average is clipped
    optimizer.step()             # the update where it runs

The module returned is what DDP's users know: ``.module`` (the model) and
``.no_sync()`` on every strategy, and a ``state_dict()`` with the model's own keys
(DDP's ``module.`` prefix dropped and accepted). Where the strategy updates on its
servers (``ps``; ``byteps`` unless --update-on worker) the servers apply SGD with the
optimizer's lr, momentum and weight decay, taken once here: another optimizer, one a
scheduler changes, or gradients edited after backward are refused with the update
site to choose. Elsewhere the script's own optimizer steps on every worker.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from psring.errors import ConfigError, PsringError
from psring.library.hooks import StepHooks, finish_backward
from psring.records.runlog import MANIFEST, atomic_write_json
from psring.strategies import STRATEGIES
from psring.train.models import flop_counter
from psring.train.optim import SGD
from psring.train.shares import gradient_weight
from psring.workers.entry import save_and_wait
from psring.workers.manifest import run_facts
from psring.workers.timing import GradientClock, device_sync


def wrap(dist, model: nn.Module, optimizer: Any):
    """See the module's docstring; ``dist`` is the psring.library.session.Distributed."""
    ctx, caps = dist.ctx, dist.strategy_cls.caps
    if optimizer is None:
        raise ConfigError("dist.wrap(model, optimizer) takes the optimizer too: its "
                          "step() is where the strategy finishes and applies the update.")
    model.to(ctx.device)
    on_server = not caps.local_optimizer(dist.cfg.update_on)
    if on_server:
        dist.server_sgd = server_sgd(optimizer, model, dist.cfg)
        dist.cfg = ctx.cfg = dist.cfg.replace(**dist.server_sgd)
    _make_equal(model)
    dist.strategy = strategy = dist.strategy_cls(ctx)
    dist.launch.stage(f"setting up {dist.cfg.strategy}")
    module = strategy.setup(model)
    dist.model, dist.module, dist.on_server = model, module, on_server
    dist.sync = device_sync(ctx.device)
    dist.grads = (GradientClock(model, cuda=ctx.device.type == "cuda")
                  if dist.cfg.trace else None)
    dist.weight = gradient_weight(dist.cfg, dist.rank, dist.world)
    StepHooks(dist, module, model)
    _as_ddp_has_it(dist, module, model)
    _drive(optimizer, dist)
    if dist.rank == 0:
        write_script_manifest(dist)
    dist.timer = dist._new_timer()
    dist.launch.stage("training", waiting=False)
    return module, optimizer


def server_sgd(optimizer: Any, model: nn.Module, cfg) -> dict[str, float]:
    """The servers' SGD settings from the script's optimizer, or a ConfigError naming
    what the servers cannot do and the update site that can."""
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
    if any(state for state in optimizer.state.values()):
        raise ConfigError(f"the optimizer already holds a state (momentum buffers: a "
                          f"loaded optimizer.state_dict()?), which {cfg.strategy}'s servers "
                          f"cannot take: they start from zero momentum{fix}.")
    return _hyper(g)


def _sites(cfg) -> tuple[str, ...]:
    return STRATEGIES.get(cfg.strategy).caps.update_sites


def _hyper(group: dict) -> dict[str, float]:
    return {"lr": float(group["lr"]), "momentum": float(group.get("momentum", 0.0)),
            "weight_decay": float(group.get("weight_decay", 0.0))}


def _make_equal(model: nn.Module) -> None:
    """Every worker starts from rank 0's parameters and buffers (Horovod's
    broadcast_parameters), where the workers share a process group; a parameter
    server's first pull gives every worker the servers' copy, rank 0's, anyway."""
    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            tdist.broadcast(t.data, src=0)


def _as_ddp_has_it(dist, module: nn.Module, model: nn.Module) -> None:
    """What DDP's users reach for on the module, on every strategy: ``.module`` (the
    model), ``.no_sync()`` (psring's: it also tells the step's hooks), and, for DDP's
    own wrapper, a state_dict with the model's keys (its ``module.`` prefix dropped,
    and added back to what is loaded), so a state saved under one strategy loads under
    any other and into the plain model."""
    if module is model:
        if not hasattr(model, "module"):  # (a name of the model's own stays its own)
            object.__setattr__(model, "module", model)  # (not a submodule: no cycle)
        if not hasattr(model, "no_sync"):
            object.__setattr__(model, "no_sync", dist.no_sync)
    else:  # DDP's wrapper: its no_sync would not tell the step's hooks
        object.__setattr__(module, "no_sync", dist.no_sync)
        module.register_state_dict_post_hook(_drop_prefix)
        module.register_load_state_dict_pre_hook(_add_prefix)


def _drop_prefix(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    inner = prefix + "module."
    for key in [k for k in state if k.startswith(inner)]:
        state[prefix + key[len(inner):]] = state.pop(key)
    meta = getattr(state, "_metadata", None)
    if meta is not None:
        for key in [k for k in meta if k == inner[:-1] or k.startswith(inner)]:
            meta[prefix + key[len(inner):]] = meta.pop(key)


def _add_prefix(module: nn.Module, state: dict, prefix: str, *_: Any) -> None:
    inner = prefix + "module."
    for key in [k for k in state if k.startswith(prefix) and not k.startswith(inner)]:
        state[inner + key[len(prefix):]] = state.pop(key)


def _drive(optimizer: Any, dist) -> None:
    """The optimizer's ``step()`` becomes the strategy's update (the communication is
    finished when backward returns; psring.library.hooks), ``synchronize()`` a no-op
    kept for Horovod's habit, ``zero_grad()`` and ``step()`` nothing inside
    dist.accumulate's micro-batches but the last; where the servers update, the state
    is theirs (on the instance: an LR scheduler made after dist.wrap keeps working)."""
    step_own, zero_grad_own = optimizer.step, optimizer.zero_grad

    def step(self: Any, closure: Any = None) -> None:
        if closure is not None:
            raise PsringError("optimizer.step(closure) re-evaluates the model, which a "
                              "strategy's communication cannot repeat: call step() "
                              "without a closure.")
        scope = _scope(dist, "optimizer.step()")
        if not scope.sync_gradients:
            return  # (a micro-batch of dist.accumulate's that only accumulates)
        if scope.stepped:
            raise PsringError(f"optimizer.step() twice in dist.step({scope.step}): one "
                              f"update a step.")
        finish_backward(dist, scope)  # (done when backward returned, unless none was seen)
        if dist.on_server:
            dist._unchanged_since_sent(scope)
            _same_server_sgd(dist, optimizer)
        dist.strategy.update(None if dist.on_server else _Inner(optimizer, step_own))
        scope.timer.lap("update_s")
        scope.stepped = True

    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        scope = dist.current
        if scope is not None and not scope.sync_gradients:
            return  # (dist.accumulate: the micro-batches' gradients add up)
        zero_grad_own(set_to_none=set_to_none)

    def synchronize() -> None:
        finish_backward(dist, _scope(dist, "optimizer.synchronize()"))

    # bound methods, as a scheduler expects (it wraps step.__func__ to count calls)
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
    optimizer.synchronize = synchronize
    if dist.on_server:
        _servers_hold_the_state(optimizer, dist)


class _Inner:
    """The script's optimizer as the strategy's update sees it: its own step."""

    def __init__(self, optimizer: Any, step: Any):
        self.optimizer, self.step = optimizer, step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


def _servers_hold_the_state(optimizer: Any, dist) -> None:
    """Where the servers update, the optimizer's state is theirs: ``state_dict()``
    gives their momentum, as of the parameters the worker holds (between steps);
    ``load_state_dict()`` is refused (the servers took the optimizer's state at
    dist.wrap). (An optimizer without them, psring's own SGD, gets none.)"""
    state_dict_own = getattr(optimizer, "state_dict", None)
    if state_dict_own is None:
        return

    def state_dict(self: Any) -> dict:
        if dist.current is not None:
            raise PsringError("optimizer.state_dict() inside dist.step(): the servers' "
                              "momentum is one version between steps; ask after it.")
        momentum = dist.strategy.server_momentum(dist.model)
        for p, buf in momentum.items():
            self.state[p]["momentum_buffer"] = buf
        return state_dict_own()

    def load_state_dict(self: Any, state: dict) -> None:
        raise PsringError(f"optimizer.load_state_dict() after dist.wrap: "
                          f"{dist.cfg.strategy}'s servers hold the optimizer's state, "
                          f"which they took at dist.wrap (zero momentum). Resume where the "
                          f"workers update (--update-on worker where the strategy has it, "
                          f"or allreduce).")

    optimizer.state_dict = types.MethodType(state_dict, optimizer)
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)


def _scope(dist, what: str):
    if dist.current is None:
        raise PsringError(f"{what} outside `with dist.step():`; the step begins there (a "
                          f"parameter server's pull) and is recorded at its end.")
    return dist.current


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
    """The run's end after the script's last step, as psring run's workers end
    (psring.workers.entry.save_and_wait: the strategy ended on every worker, model.pt,
    the others waited for); rank 0's manifest again, now with the steps taken and the
    inputs the model saw (its FLOPs per sample)."""
    if dist.rank == 0:
        write_script_manifest(dist)
    save_and_wait(dist.ctx, dist.strategy, dist.model, dist.launch)
    dist.launch.done()


def write_script_manifest(dist) -> None:
    """manifest.json for a script's run: psring run's facts, the data as the script
    fed it (the sampler's set, the model's inputs as seen), the steps taken so far."""
    flops = _flops_per_sample(dist)
    data = {"kind": "script", "samples": dist.samples,
            "inputs": [list(shape) for shape, _ in (dist.inputs or ([], {}))[0]]}
    facts = run_facts(dist.cfg.replace(steps=max(dist.done, 1)), dist.model,
                      dist.strategy_cls, dist.threads, flops, data,
                      launch=dist.launch.describe(), per_host=dist.ctx.local_world)
    # the model is the script's, not --model's (which it never read)
    facts["config"]["model"] = f"script {Path(sys.argv[0]).name}"
    facts["config"]["max_steps"] = dist.cfg.steps
    facts["script"] = [Path(sys.argv[0]).name, *sys.argv[1:]]
    atomic_write_json(dist.run_dir / MANIFEST, facts)


def _flops_per_sample(dist) -> float | None:
    """The model's FLOPs per sample, forward and backward: the forward's as
    torch.utils.flop_counter counts them on one sample of the inputs it saw, times 3
    (backward about twice forward; a backward here would fire the strategy's gradient
    hooks). None before the model has seen an input."""
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
