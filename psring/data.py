"""Data sets, generated or loaded up front so data time per step is negligible.

The synthetic task is learnable and deterministic: inputs are Gaussian, labels are
the argmax of a fixed random "teacher" network, both drawn from ``--seed``. Every
worker builds the same data set; :func:`worker_batch` hands worker ``r`` of ``n`` the
``r``-th slice of global batch ``t``, so any strategy and any worker count train on
the same stream of global batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .errors import ConfigError


@dataclass
class Dataset:
    x: torch.Tensor  # (samples, features) float32
    y: torch.Tensor  # (samples,) int64
    classes: int

    @property
    def features(self) -> int:
        return self.x.shape[1]

    def __len__(self) -> int:
        return self.x.shape[0]


def synthetic(samples: int, features: int, classes: int, seed: int) -> Dataset:
    g = torch.Generator().manual_seed(seed + 1_000_003)
    x = torch.randn(samples, features, generator=g)
    hidden = 64
    w1 = torch.randn(features, hidden, generator=g) / features ** 0.5
    w2 = torch.randn(hidden, classes, generator=g) / hidden ** 0.5
    y = torch.tanh(x @ w1) @ w2
    return Dataset(x, y.argmax(dim=1), classes)


def digits() -> Dataset:
    from sklearn.datasets import load_digits  # bundled with scikit-learn, no download

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    return Dataset(x, torch.tensor(d.target, dtype=torch.int64), 10)


def from_npz(path: str) -> Dataset:
    # allow_pickle=False: an .npz may come from anywhere; object arrays are refused.
    try:
        with np.load(path, allow_pickle=False) as f:
            if "x" not in f or "y" not in f:
                raise ConfigError(f"{path}: an .npz data set needs arrays named 'x' and 'y' "
                                  f"(found {sorted(f.files)}).")
            x, y = f["x"], f["y"]
    except (ValueError, OSError) as e:
        raise ConfigError(f"{path}: not a readable .npz of numeric arrays ({e}).") from None
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y) or not np.issubdtype(y.dtype, np.integer):
        raise ConfigError(f"{path}: expected x of shape (samples, ...) and integer labels y "
                          f"of shape (samples,), got x{x.shape} and y{y.shape} {y.dtype}.")
    x = torch.tensor(x.reshape(len(x), -1), dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    return Dataset(x, y, int(y.max()) + 1)


def load(data: str, samples: int, features: int, classes: int, seed: int) -> Dataset:
    if data == "synthetic":
        return synthetic(samples, features, classes, seed)
    if data == "digits":
        return digits()
    return from_npz(data)


def worker_batch(ds: Dataset, global_batch: int, index: int, rank: int, world: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of global batch ``index`` that belong to ``rank``.

    Global batch ``index`` is rows ``[index*B, (index+1)*B)`` of the data set, wrapping
    around at the end; rank ``r`` of ``n`` takes the ``r``-th of ``n`` equal slices.
    """
    per = global_batch // world
    start = (index * global_batch + rank * per) % len(ds)
    end = start + per
    if end <= len(ds):
        return ds.x[start:end], ds.y[start:end]
    idx = torch.arange(start, end) % len(ds)
    return ds.x[idx], ds.y[idx]
