"""What a run trains: its model, the inputs the model takes, and the data split.

    from psring.train.workload import build_workload
    w = build_workload(cfg)              # model (seeded), inputs, train/held-out split

The order matters for a user's data: an ``.npz`` is loaded first, because its shape
sets the model's (features, classes, image size, sequence length); synthetic data is
generated after the model, in the shape the model asks for.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from psring.train import data as datasets
from psring.train.elimination import check_model
from psring.train.models import Inputs, ModelSettings, build_model, meta_build


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
    check_model(model, cfg.eliminate_every)  # (psring run checked a synthetic set's)
    if loaded is None:
        # A device's forward reads only the batch's shape (psring.train.device): one worker's
        # batch of rows stands for the data set. --samples rows of 224 x 224 images
        # would be 2.4 GB per worker, and sixteen of them do not fit this machine.
        rows = min(cfg.samples, cfg.per_worker_batch) if cfg.compute == "device" \
            else cfg.samples
        split = datasets.synthetic(inputs, rows, cfg.eval_samples, cfg.seed)
    else:
        split = datasets.split_file(loaded, cfg.eval_samples, inputs, cfg.data, cfg.seed)
    return Workload(model, inputs, split, settings)


def meta_model(cfg) -> tuple[nn.Module, Inputs]:
    """The run's model on the meta device (psring.train.models.meta_build): shapes and
    counts, checked against its inputs. Synthetic data only (a file's shape is known
    once it is loaded)."""
    return meta_build(cfg.model, ModelSettings.from_config(cfg))
