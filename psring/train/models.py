"""Models: the built-in ones, the field's (psring.zoo), and the user's own.

A model factory takes the run's :class:`ModelSettings` and returns the module and the
:class:`Inputs` it expects; psring generates synthetic data of that shape
(psring.train.data), or checks a user's ``.npz`` against it. Built-in names:

- ``mlp``: Linear+ReLU layers. Each weight is used once per sample, so FLOPs per
  parameter are low: communication-bound, the default (psring.zoo.simple).
- ``cnn``: a small convnet on the input viewed as a square image. Conv weights are
  reused at every pixel: compute-bound (psring.zoo.simple).
- ``resnet18``, ``resnet50``, ``vgg11``, ``vgg16``, ``mlstm``, ``gpt``: the seeds'
  workloads, built from their papers' layer tables (psring.zoo.vision, .text;
  ``psring models`` lists them with their sizes).

The vocabulary (:class:`Inputs`, :class:`ModelSettings`, the ``MODELS`` registry) is
defined in psring.zoo.base and re-exported here; this module builds, imports and
measures models.

The user's own model is ``--model package.module:factory``, a function written like
the built-ins (see examples/my_model.py):

    def factory(s: ModelSettings) -> tuple[nn.Module, Inputs]:
        return MyNet(s.classes), Inputs.image(3, s.image_size, s.classes)

``--width`` and ``--depth`` move a model between the regimes; ``psring run`` records
the resulting FLOPs per sample and bytes per step in ``manifest.json``.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import Any, Callable

import torch
from torch import nn

from psring.errors import ConfigError

# the model vocabulary lives with the models; re-exported here, where user factories
# import it from (examples/my_model.py)
from psring.zoo import KINDS as KINDS
from psring.zoo import MODELS, Factory, Inputs, ModelSettings


def model_factory(name: str) -> Factory:
    """A built-in model's factory, or ``package.module:function`` imported."""
    if ":" not in name:
        return MODELS.get(name)
    module_name, _, attr = name.partition(":")
    # as `python -m` does: the directory psring runs in is searched first (the `psring`
    # console script's own sys.path[0] is its bin directory)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"--model {name}: cannot import {module_name!r} ({e}); the module "
                          f"must be importable from the directory psring runs in (or "
                          f"installed), e.g. --model examples.my_model:build.") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"--model {name}: {module_name} has no function {attr!r}.")
    return fn


def build_model(name: str, settings: ModelSettings, seed: int) -> tuple[nn.Module, Inputs]:
    """Every rank builds the model from the same seed, so all start identical."""
    torch.manual_seed(seed)
    return _built(name, settings)


def _built(name: str, settings: ModelSettings) -> tuple[nn.Module, Inputs]:
    """The factory's model, checked; the random numbers are whoever's they are."""
    out = model_factory(name)(settings)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module)
            and isinstance(out[1], Inputs)):
        raise ConfigError(f"--model {name}: a model factory must return (nn.Module, "
                          f"psring.train.models.Inputs), got {type(out).__name__}; see "
                          f"examples/my_model.py.")
    return out


# ---------------------------------------------------------------------- measures
def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def loss_and_correct(out: torch.Tensor, y: torch.Tensor, loss: Loss | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean loss (``loss``, default cross-entropy), and the number of correct
    predictions, for a classifier's ``(batch, classes)`` or a sequence model's
    ``(batch, positions, vocab)`` output."""
    predicted = out.reshape(-1, out.shape[-1]).argmax(dim=1)
    return (loss or loss_of)(out, y), (predicted == y.reshape(-1)).sum()


Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The training loss: cross-entropy over the output's last dimension."""
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def loss_for(model: nn.Module) -> Loss:
    """The loss a model trains on: its own ``loss(out, y)`` method where it defines one
    (the linear SVM's hinge loss), else cross-entropy (:func:`loss_of`)."""
    own = getattr(model, "loss", None)
    return own if callable(own) and not isinstance(own, nn.Module) else loss_of


def _skip_dynamo(mode_cls: Any) -> None:
    """Let a torch dispatch mode run without importing torch._dynamo (~1 s).

    torch wraps some of its own functions (FlopCounterMode's ``__torch_dispatch__``)
    in ``torch._disable_dynamo``, which imports torch._dynamo on the first call, only
    to keep torch.compile from tracing into them. psring never compiles, and rank 0
    counts FLOPs in every run, so that import sat on every run's start-up. The wrapper
    calls a cached ``__dynamo_disable`` when the function has one: the function itself
    here. Where torch changes the wrapping, nothing is done and the import happens
    (tests/unit/test_optim.py notices)."""
    dispatch = getattr(mode_cls, "__torch_dispatch__", None)
    fn = getattr(dispatch, "__wrapped__", None)
    if fn is not None and getattr(fn, "__dynamo_disable", None) is None:
        setattr(fn, "__dynamo_disable", fn)


def flop_counter():
    """A torch.utils.flop_counter.FlopCounterMode that does not import torch._dynamo."""
    from torch.utils import flop_counter as fc

    _skip_dynamo(getattr(fc, "_FlopCounterMode", None))
    return fc.FlopCounterMode(display=False)


def _counted_pass(model: nn.Module, inputs: Inputs, batch: int
                  ) -> tuple[int, int, list[int | None]]:
    """One forward and backward of ``batch`` example rows under torch.utils.flop_counter:
    (forward FLOPs, all FLOPs, for each trainable parameter the FLOPs counted when its
    gradient was ready, None if it never was). Leaves no gradients behind."""
    params = [p for p in model.parameters() if p.requires_grad]
    counter = flop_counter()
    at: list[int | None] = [None] * len(params)

    def ready(i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if at[i] is None:
                at[i] = counter.get_total_flops()
        return hook

    hooks = [p.register_post_accumulate_grad_hook(ready(i)) for i, p in enumerate(params)]
    was_training = model.training
    try:
        with counter:
            out = model(inputs.example(batch, next(model.parameters()).device))
            forward = counter.get_total_flops()
            out.float().sum().backward()
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return forward, counter.get_total_flops(), at


def flops_per_sample(model: nn.Module, inputs: Inputs) -> float:
    """FLOPs of forward+backward for one sample, counted by torch.utils.flop_counter.

    Counts matmuls, convolutions and attention (what dominates); elementwise ops are
    not counted. Runs on the model's device; on the meta device nothing is computed.
    """
    return _counted_pass(model, inputs, batch=2)[1] / 2


def backward_shares(model: nn.Module, inputs: Inputs) -> list[float] | None:
    """For each trainable parameter (``model.parameters()`` order), the share of
    backward's FLOPs done when its gradient is ready: autograd's own order, timed by
    torch.utils.flop_counter (matmuls and convolutions). On the meta device nothing is
    computed. None when nothing is counted (a model of elementwise ops only).

    What an on-paper profile needs to place gradients in backward: in a VGG the fully
    connected layers hold three quarters of the bytes but a few percent of the FLOPs, so
    their gradients are ready early, not three quarters of the way through."""
    forward, total, at = _counted_pass(model, inputs, batch=2)
    backward = total - forward
    if backward <= 0 or None in at:
        return None
    return [(t - forward) / backward for t in at]


@functools.lru_cache(maxsize=32)
def meta_backward_shares(name: str, settings: ModelSettings) -> tuple[float, ...] | None:
    """:func:`backward_shares` of :func:`meta_build`'s model, counted once a process:
    FLOP-counting a seed's model on the meta device takes a second or more of Python,
    and the same model comes back in a sweep's profiles, advise's candidates and the
    tests' sweep definitions."""
    model, inputs = meta_build(name, settings)
    shares = backward_shares(model, inputs)
    return None if shares is None else tuple(shares)


@functools.lru_cache(maxsize=8)
def meta_build(name: str, settings: ModelSettings) -> tuple[nn.Module, Inputs]:
    """The model on the meta device (shapes only: no memory, no compute); a user's
    model is also checked by one forward pass on meta inputs of the shape its factory
    declares. The built-in models check their settings themselves and are trained by
    the tests, and skipping their pass keeps torch._dynamo (which meta kernels import,
    ~0.65 s) out of the launcher of every run. Cached and shared: config validation
    runs on every RunConfig.replace(), and building a ResNet on the meta device still
    takes ~0.7 s of Python; callers must not change it."""
    # (unseeded: on the meta device nothing is drawn, and a seed here would reseed the
    # caller's generators, a user script's among them: psring.library validates)
    with torch.device("meta"):
        model, inputs = _built(name, settings)
        if ":" not in name:
            return model, inputs
        try:
            model(inputs.example(2, "meta"))
        except Exception as e:  # noqa: BLE001 - a user factory's own mistake
            raise ConfigError(
                f"--model {name}: the model does not take the inputs its factory declares "
                f"({inputs.kind} of shape {inputs.shape}): {type(e).__name__}: "
                f"{str(e).splitlines()[0][:300] if str(e) else ''}") from None
    return model, inputs


def describe(name: str, settings: ModelSettings, batch: int) -> dict[str, Any]:
    """A model's size and cost, built on the meta device (no memory, no compute):
    parameters, gradient bytes (float32), FLOPs per sample (forward+backward), and
    arithmetic intensity: FLOPs of a batch per gradient byte (what a worker computes
    per byte a step must synchronize)."""
    model, inputs = meta_build(name, settings)
    fps = flops_per_sample(model, inputs)
    pbytes = parameter_bytes(model)
    return {"model": name, "parameters": parameter_count(model), "gradient_bytes": pbytes,
            "flops_per_sample": fps, "intensity": fps * batch / pbytes,
            "inputs": inputs}

