"""The model vocabulary: what a factory is given (:class:`ModelSettings`), what it
returns beside the module (:class:`Inputs`), and the registry of built-in factories.
psring.train.models re-exports these for users' own factories."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from psring.errors import ConfigError
from psring.registry import Registry

if TYPE_CHECKING:  # (psring.config sits above: it validates against the registries)
    from psring.config import RunConfig

#: the kinds of input psring can generate synthetic data for (psring.train.data)
KINDS = ("vector", "image", "tokens")


@dataclass(frozen=True)
class Inputs:
    """What a model takes and predicts. ``shape`` is one sample's: ``(features,)`` for
    a vector, ``(channels, side, side)`` for an image, ``(seq_len,)`` for a token
    sequence (int64), whose target is the next token at every position."""

    kind: str
    shape: tuple[int, ...]
    #: classes predicted per sample, or per position (the vocabulary) for tokens
    classes: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"Inputs.kind must be one of {', '.join(KINDS)} "
                              f"(got {self.kind!r}).")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @classmethod
    def vector(cls, features: int, classes: int) -> "Inputs":
        return cls("vector", (features,), classes)

    @classmethod
    def image(cls, channels: int, side: int, classes: int) -> "Inputs":
        return cls("image", (channels, side, side), classes)

    @classmethod
    def tokens(cls, seq_len: int, vocab: int) -> "Inputs":
        return cls("tokens", (seq_len,), vocab)

    def example(self, batch: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A batch of inputs of the right shape and dtype (values meaningless)."""
        if self.kind == "tokens":
            return torch.randint(0, self.classes, (batch, *self.shape), device=device)
        return torch.randn(batch, *self.shape, device=device)


@dataclass(frozen=True)
class ModelSettings:
    """The run's settings a model factory may use (a subset of RunConfig's flags; for
    an ``.npz`` data set, features, classes, channels, image size and sequence length
    are the data's)."""

    features: int = 256
    classes: int = 10
    image_size: int = 32
    channels: int = 3
    seq_len: int = 32
    #: 0 = the model's default (hidden units, base channels, embedding width)
    width: int = 0
    #: 0 = the model's default (hidden layers, conv blocks, recurrent or transformer layers)
    depth: int = 0

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "ModelSettings":
        return cls(features=cfg.features, classes=cfg.classes, image_size=cfg.image_size,
                   seq_len=cfg.seq_len, width=cfg.width, depth=cfg.depth)

    def replace(self, **kw: Any) -> "ModelSettings":
        return dataclasses.replace(self, **kw)


Factory = Callable[[ModelSettings], "tuple[nn.Module, Inputs]"]
MODELS: Registry = Registry("model")
