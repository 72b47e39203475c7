"""psring's own models: the regimes' ends, ``mlp`` (communication-bound: each weight
is used once per sample) and ``cnn`` (compute-bound: conv weights are reused at every
pixel); and ``svm``, the seeds' parallel linear SVM (hinge loss)."""

from __future__ import annotations

import math

import torch
from torch import nn

from psring.errors import ConfigError
from psring.zoo.base import MODELS, Inputs, ModelSettings


@MODELS.register("mlp")
def mlp(s: ModelSettings) -> tuple[nn.Module, Inputs]:
    width = s.width or 1024
    depth = s.depth or 3
    layers: list[nn.Module] = []
    d = s.features
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, s.classes))
    return nn.Sequential(*layers), Inputs.vector(s.features, s.classes)


class _SquareImage(nn.Module):
    """Views flat feature vectors as 1-channel square images."""

    def __init__(self, side: int):
        super().__init__()
        self.side = side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], 1, self.side, self.side)


@MODELS.register("cnn")
def cnn(s: ModelSettings) -> tuple[nn.Module, Inputs]:
    side = math.isqrt(s.features)
    if side * side != s.features:
        raise ConfigError(f"model cnn views inputs as square images, so --features must be "
                          f"a perfect square (got {s.features}); try --features "
                          f"{side * side or 1}.")
    width = s.width or 32
    depth = s.depth or 2
    layers: list[nn.Module] = [_SquareImage(side)]
    c = 1
    for i in range(depth):
        layers += [nn.Conv2d(c, width, 3, padding=1), nn.ReLU()]
        c = width
        if i < depth - 1 and side >= 4:
            layers.append(nn.MaxPool2d(2))
            side //= 2
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, s.classes)]
    return nn.Sequential(*layers), Inputs.vector(s.features, s.classes)


class LinearSVM(nn.Module):
    """A linear SVM: a weight vector and a bias per class, scored one against the rest,
    trained on the multi-class hinge loss (Weston and Watkins: the mean over the other
    classes of max(0, 1 - (score of the true class - score of another)); with two
    classes, half the binary hinge loss max(0, 1 - y f(x)) of the score difference).
    Its L2 regularisation is --weight-decay. The loop finds the loss through
    :meth:`loss` (psring.train.models.loss_for)."""

    def __init__(self, features: int, classes: int):
        super().__init__()
        self.linear = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    @staticmethod
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.multi_margin_loss(out, y)

    @staticmethod
    def margins(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each sample's margin: its true class's score less the best other one (1 or
        more: a zero hinge loss; --eliminate-every, psring.train.elimination)."""
        true = out.gather(1, y[:, None]).squeeze(1)
        return true - out.scatter(1, y[:, None], float("-inf")).max(dim=1).values


@MODELS.register("svm")
def svm(s: ModelSettings) -> tuple[nn.Module, Inputs]:
    if s.classes < 2:
        raise ConfigError(f"--model svm separates classes: --classes must be 2 or more "
                          f"(got {s.classes}).")
    return LinearSVM(s.features, s.classes), Inputs.vector(s.features, s.classes)
