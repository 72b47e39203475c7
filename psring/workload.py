"""What a run trains: its model, the inputs the model takes, and the data split.

    from psring.workload import build_workload
    w = build_workload(cfg)              # model (seeded), inputs, train/held-out split

The order matters for a user's data: an ``.npz`` is loaded first, because its shape
sets the model's (features, classes, image size, sequence length); synthetic data is
generated after the model, in the shape the model asks for.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from . import data as datasets
from .errors import ConfigError
from .models import Inputs, ModelSettings, build_model


@dataclass
class Workload:
    model: nn.Module
    inputs: Inputs
    data: datasets.Split
    settings: ModelSettings


def model_settings(cfg) -> tuple[ModelSettings, datasets.Dataset | None]:
    """The settings the model is built with, and the loaded file (None if synthetic)."""
    settings = ModelSettings.from_config(cfg)
    if cfg.data == "synthetic":
        return settings, None
    loaded = datasets.load_file(cfg.data)
    return datasets.file_settings(loaded, settings), loaded


def build_workload(cfg) -> Workload:
    settings, loaded = model_settings(cfg)
    model, inputs = build_model(cfg.model, settings, cfg.seed)
    if loaded is None:
        split = datasets.synthetic(inputs, cfg.samples, cfg.eval_samples, cfg.seed)
    else:
        split = datasets.split_file(loaded, cfg.eval_samples, inputs, cfg.data, cfg.seed)
    return Workload(model, inputs, split, settings)


def meta_model(cfg) -> tuple[nn.Module, Inputs]:
    """The model built on the meta device: shapes and counts, no memory, no compute.
    Synthetic data only (a file's shape is known once it is loaded). Shared: callers
    read it, never change it."""
    return _meta_model(cfg.model, ModelSettings.from_config(cfg))


@functools.lru_cache(maxsize=8)
def _meta_model(name: str, settings: ModelSettings) -> tuple[nn.Module, Inputs]:
    # cached: a config is validated on every replace(), and building a ResNet on the
    # meta device still takes ~0.7 s of Python
    with torch.device("meta"):
        model, inputs = build_model(name, settings, 0)
        try:
            model(inputs.example(2, "meta"))  # shapes only: does it take its inputs?
        except Exception as e:  # noqa: BLE001 - a user factory's own mistake
            raise ConfigError(
                f"--model {name}: the model does not take the inputs its factory declares "
                f"({inputs.kind} of shape {inputs.shape}): {type(e).__name__}: "
                f"{str(e).splitlines()[0][:300] if str(e) else ''}") from None
        return model, inputs
