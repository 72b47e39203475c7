"""Data sets, generated or loaded up front so data time per step is negligible, each
with a held-out split that is never trained on (``--eval-samples`` rows).

The synthetic tasks are learnable, deterministic (drawn from ``--seed``) and shaped
for the model (psring.train.models.Inputs):

- ``vector``: Gaussian classes in ``--features`` dimensions, their centres far enough
  apart that the default MLP goes from chance to over 90% held-out accuracy within
  ``psring compare``'s 30 steps (tests/multiproc/test_learning.py checks).
- ``image``: every class a smooth random colour pattern (4x4 upsampled to the image
  size) under per-pixel noise.
- ``tokens``: sequences from a Markov chain in which each token is followed by its own
  successor 90% of the time and by a uniformly random token otherwise; the targets are
  the next tokens, so the best possible accuracy is 0.9 + 0.1/vocabulary.

Every worker builds the same data set; :func:`worker_batch` hands worker ``r`` of
``n`` the ``r``-th slice of global batch ``t``, so any strategy and any worker count
train on the same stream of global batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch.nn import functional as F

from psring.errors import ConfigError
from psring.train.models import Inputs

#: distance between the vector task's class centres, in units of the noise (chosen so
#: the default MLP reaches 90% within 30 steps of 64 samples, and not in the first few)
VECTOR_SEPARATION = 6.0
#: the image task's pattern amplitude over its per-pixel noise
IMAGE_SIGNAL = 1.5
#: how often the token task's successor rule holds
TOKEN_RULE = 0.9


@dataclass
class Dataset:
    x: torch.Tensor  # (samples, ...) float32, or int64 tokens
    y: torch.Tensor  # (samples,) or (samples, positions) int64
    classes: int

    @property
    def features(self) -> int:
        return math.prod(self.x.shape[1:])

    def __len__(self) -> int:
        return self.x.shape[0]


@dataclass
class Split:
    train: Dataset
    held_out: Dataset  # never trained on; may be empty (--eval-samples 0)


def _split(ds: Dataset, n: int) -> Split:
    return Split(Dataset(ds.x[:len(ds) - n], ds.y[:len(ds) - n], ds.classes),
                 Dataset(ds.x[len(ds) - n:], ds.y[len(ds) - n:], ds.classes))


def synthetic(inputs: Inputs, samples: int, held_out: int, seed: int) -> Split:
    """``samples`` training rows and ``held_out`` more from the same distribution."""
    g = torch.Generator().manual_seed(seed + 1_000_003)
    n = samples + held_out
    make = {"vector": _vectors, "image": _images, "tokens": _tokens}[inputs.kind]
    x, y = make(n, inputs.shape, inputs.classes, g)
    return _split(Dataset(x, y, inputs.classes), held_out)


def _vectors(n: int, shape: tuple[int, ...], classes: int, g: torch.Generator):
    (features,) = shape
    centres = torch.randn(classes, features, generator=g) * VECTOR_SEPARATION / features ** 0.5
    y = torch.randint(0, classes, (n,), generator=g)
    return centres[y] + torch.randn(n, features, generator=g), y


def _images(n: int, shape: tuple[int, ...], classes: int, g: torch.Generator):
    c, h, w = shape
    low = torch.randn(classes, c, 4, 4, generator=g)

    def pattern(of: torch.Tensor) -> torch.Tensor:  # a smooth image per row of ``of``
        return F.interpolate(of, size=(h, w), mode="bilinear", align_corners=False)

    # Everything in pieces of about 16 MB (1024 rows at 32 x 32): one pattern per
    # class held at once would be 600 MB at 1000 classes of 224 x 224, and twice that
    # while scaled, in every worker (2 GB peaks killed 16-worker runs for memory). A
    # multiple of 16 rows: torch's CPU randn draws in blocks of 16 values, so the noise
    # is the one 1024-row pieces drew, whatever the image size.
    piece = max(16, min(1024, 2**24 // (c * h * w * 4)) // 16 * 16)
    total = squares = 0.0  # the patterns' standard deviation, over every class
    for a in range(0, classes, piece):
        p = pattern(low[a:a + piece]).double()
        total += float(p.sum())
        squares += float((p * p).sum())
    count = classes * c * h * w
    std = ((squares - total * total / count) / (count - 1)) ** 0.5
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.empty(n, c, h, w)
    for a in range(0, n, piece):
        b = min(n, a + piece)
        x[a:b] = pattern(low[y[a:b]]) / std * IMAGE_SIGNAL + \
            torch.randn(b - a, c, h, w, generator=g)
    return x, y


def _tokens(n: int, shape: tuple[int, ...], vocab: int, g: torch.Generator):
    (t,) = shape
    successor = torch.randperm(vocab, generator=g)
    seq = torch.empty(n, t + 1, dtype=torch.int64)
    seq[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for i in range(t):
        keep = torch.rand(n, generator=g) < TOKEN_RULE
        seq[:, i + 1] = torch.where(keep, successor[seq[:, i]],
                                    torch.randint(0, vocab, (n,), generator=g))
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def digits() -> Dataset:
    from sklearn.datasets import load_digits  # bundled with scikit-learn, no download

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    return Dataset(x, torch.tensor(d.target, dtype=torch.int64), 10)


def from_npz(path: str) -> Dataset:
    """x of shape (samples, ...) (float features or images, or int64 tokens with y of
    the same shape: a sequence task) and integer labels y."""
    # allow_pickle=False: an .npz may come from anywhere; object arrays are refused.
    try:
        with np.load(path, allow_pickle=False) as f:
            if "x" not in f or "y" not in f:
                raise ConfigError(f"{path}: an .npz data set needs arrays named 'x' and 'y' "
                                  f"(found {sorted(f.files)}).")
            x, y = f["x"], f["y"]
    except (ValueError, OSError) as e:
        raise ConfigError(f"{path}: not a readable .npz of numeric arrays ({e}).") from None
    tokens = np.issubdtype(x.dtype, np.integer) and y.shape == x.shape and x.ndim == 2
    if x.ndim < 2 or len(x) != len(y) or not np.issubdtype(y.dtype, np.integer) or \
            not (y.ndim == 1 or tokens):
        raise ConfigError(f"{path}: expected x of shape (samples, ...) and integer labels y "
                          f"of shape (samples,) (or integer token sequences x and y of "
                          f"the same shape), got x{x.shape} {x.dtype} and y{y.shape} "
                          f"{y.dtype}.")
    if y.min(initial=0) < 0 or (tokens and x.min(initial=0) < 0):
        raise ConfigError(f"{path}: labels and tokens must be >= 0.")
    y_t = torch.tensor(y, dtype=torch.int64)
    classes = int(y_t.max()) + 1
    if tokens:
        x_t = torch.tensor(x, dtype=torch.int64)
        classes = max(classes, int(x_t.max()) + 1)
    else:
        x_t = torch.tensor(x, dtype=torch.float32)
    return Dataset(x_t, y_t, classes)


def load_file(data: str) -> Dataset:
    return digits() if data == "digits" else from_npz(data)


def file_settings(ds: Dataset, settings):
    """The model settings a loaded data set implies: its features, classes, and the
    image or sequence shape of its rows."""
    kw = {"features": ds.features, "classes": ds.classes}
    if ds.x.ndim == 4 and ds.x.shape[2] == ds.x.shape[3]:
        kw.update(channels=ds.x.shape[1], image_size=ds.x.shape[2])
    if ds.x.dtype == torch.int64 and ds.x.ndim == 2:
        kw["seq_len"] = ds.x.shape[1]
    return settings.replace(**kw)


def split_file(ds: Dataset, held_out: int, inputs: Inputs, path: str, seed: int) -> Split:
    """Check a loaded data set against what the model takes, and hold out
    ``min(held_out, a fifth)`` of its rows, chosen by ``--seed`` (the rest keep their
    order)."""
    sample = tuple(ds.x.shape[1:])
    if sample != inputs.shape:
        if inputs.kind == "vector" and math.prod(sample) == math.prod(inputs.shape):
            ds = Dataset(ds.x.reshape(len(ds), -1), ds.y, ds.classes)
        else:
            raise ConfigError(f"{path}: rows of shape {sample} do not fit the model, which "
                              f"takes {inputs.kind} inputs of shape {inputs.shape}; reshape "
                              f"the data or choose a model for it.")
    if (inputs.kind == "tokens") != (ds.x.dtype == torch.int64):
        raise ConfigError(f"{path}: the model takes {inputs.kind} but x is "
                          f"{str(ds.x.dtype).replace('torch.', '')}.")
    n = min(held_out, len(ds) // 5)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed + 7))
    out = torch.zeros(len(ds), dtype=torch.bool)
    out[order[:n]] = True
    return Split(Dataset(ds.x[~out], ds.y[~out], ds.classes),
                 Dataset(ds.x[out], ds.y[out], ds.classes))


def worker_batch(ds: Dataset, global_batch: int, index: int, rank: int, world: int,
                 sizes: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of global batch ``index`` that belong to ``rank``.

    Global batch ``index`` is rows ``[index*B, (index+1)*B)`` of the data set, wrapping
    around at the end; rank ``r`` of ``n`` takes the ``r``-th of ``n`` equal slices, or
    with ``sizes`` (each rank's share, adding up to B) the ``r``-th of those slices.
    """
    if sizes is None:
        per, offset = global_batch // world, rank * (global_batch // world)
    else:
        per, offset = sizes[rank], sum(sizes[:rank])
    start = (index * global_batch + offset) % len(ds)
    end = start + per
    if end <= len(ds):
        return ds.x[start:end], ds.y[start:end]
    idx = torch.arange(start, end) % len(ds)
    return ds.x[idx], ds.y[idx]
