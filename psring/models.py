"""Built-in models, chosen to span arithmetic intensity (FLOPs per byte communicated).

- ``mlp``: a plain stack of Linear+ReLU layers. Each weight is used once per sample,
  so FLOPs per parameter are low: communication-bound, the default.
- ``cnn``: a small convnet. Each conv weight is reused at every pixel, so FLOPs per
  parameter are high: compute-bound.

``--width`` and ``--depth`` move a model between the regimes; ``psring run`` records
the resulting FLOPs per sample and bytes per step in ``manifest.json``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .errors import ConfigError
from .registry import Registry

MODELS: Registry = Registry("model")


@MODELS.register("mlp")
def mlp(features: int, classes: int, width: int = 0, depth: int = 0) -> nn.Module:
    width = width or 1024
    depth = depth or 3
    layers: list[nn.Module] = []
    d = features
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, classes))
    return nn.Sequential(*layers)


class _SquareImage(nn.Module):
    """Views flat feature vectors as 1-channel square images."""

    def __init__(self, side: int):
        super().__init__()
        self.side = side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], 1, self.side, self.side)


@MODELS.register("cnn")
def cnn(features: int, classes: int, width: int = 0, depth: int = 0) -> nn.Module:
    side = math.isqrt(features)
    if side * side != features:
        raise ConfigError(f"model cnn views inputs as square images, so --features must be "
                          f"a perfect square (got {features}); try --features {side * side or 1}.")
    width = width or 32
    depth = depth or 2
    layers: list[nn.Module] = [_SquareImage(side)]
    c = 1
    for i in range(depth):
        layers += [nn.Conv2d(c, width, 3, padding=1), nn.ReLU()]
        c = width
        if i < depth - 1 and side >= 4:
            layers.append(nn.MaxPool2d(2))
            side //= 2
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes)]
    return nn.Sequential(*layers)


def build_model(name: str, features: int, classes: int, width: int, depth: int,
                seed: int) -> nn.Module:
    """Every rank builds the model from the same seed, so all start identical."""
    torch.manual_seed(seed)
    return MODELS.get(name)(features, classes, width=width, depth=depth)


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def flops_per_sample(model: nn.Module, features: int) -> float:
    """FLOPs of forward+backward for one sample, counted by torch.utils.flop_counter.

    Counts matmuls and convolutions (what dominates); elementwise ops are not counted.
    """
    from torch.utils.flop_counter import FlopCounterMode

    batch = 8
    x = torch.randn(batch, features)
    counter = FlopCounterMode(display=False)
    with counter:
        out = model(x)
        out.sum().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / batch
