"""This worker's slice of each global batch, as a ``torch.utils.data`` batch sampler that
behaves like ``DistributedSampler``: one epoch per iteration, ``set_epoch``.

    sampler = dist.sampler(dataset, batch_size=128, seed=1)  # 128: the global batch
    loader = DataLoader(dataset, batch_sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader: ...                              # len(loader) batches

Every worker draws the same permutation of the data set per epoch (seeded by ``seed``
and the epoch), cuts it into global batches, and takes its own rows of each: rank r of
n the r-th of n equal slices, or with uneven shares (``--worker-batch``) the r-th of
those. The workers' slices of one global batch are its rows exactly, so a synchronous
strategy's average of their gradients is the gradient one process computes on the
whole batch (what ``single`` does with the same seed). Epoch e's batch i is global
batch ``e * per_epoch + i`` of the run, whichever worker count reads it.

With ``--accumulate K`` each optimizer step reads K global batches (micro-batches, as
``psring run``'s --batch-size is per micro-step): an epoch holds whole steps, and the
loader yields K of this worker's slices per step. ``--steps N`` caps the run: the
sampler yields no more than N steps' batches in all, whatever the epochs.
"""

from __future__ import annotations

import sys
from typing import Iterator, Sequence

import torch

from psring.errors import ConfigError


def shares(batch_size: int, world: int, uneven: Sequence[int] | None = None) -> list[int]:
    """Each rank's rows of a global batch of ``batch_size``: ``uneven`` (which must add
    up to it), else equal shares (which must divide it)."""
    if uneven:
        if len(uneven) != world or sum(uneven) != batch_size:
            raise ConfigError(
                f"the run's --worker-batch shares {','.join(map(str, uneven))} do not "
                f"split a global batch of {batch_size} among {world} workers; pass the "
                f"sampler batch_size={sum(uneven)}, or shares that add up to {batch_size}.")
        return list(uneven)
    if batch_size < world or batch_size % world:
        raise ConfigError(
            f"a global batch of {batch_size} does not split evenly among {world} workers; "
            f"pass a batch_size that is a multiple of {world} (or uneven shares with "
            f"psring launch --worker-batch).")
    return [batch_size // world] * world


class GlobalBatchSampler(torch.utils.data.Sampler):
    """Yields lists of data set indices: this rank's rows of each global batch of one
    epoch (see the module's docstring). ``max_steps``: the run's cap in optimizer steps
    (0: none); ``accumulate``: global batches an optimizer step reads."""

    def __init__(self, length: int, batch_size: int, rank: int, world: int,
                 max_steps: int = 0, seed: int = 0, shuffle: bool = True,
                 uneven: Sequence[int] | None = None, accumulate: int = 1):
        if length < batch_size * accumulate:
            raise ConfigError(f"a data set of {length} samples holds no optimizer step of "
                              f"{accumulate} global batch(es) of {batch_size}; pass a "
                              f"smaller batch_size.")
        self.length, self.batch_size, self.accumulate = length, batch_size, accumulate
        self.max_steps, self.seed, self.shuffle = max_steps, seed, shuffle
        self.sizes = shares(batch_size, world, uneven)
        self.offset = sum(self.sizes[:rank])
        self.rows = self.sizes[rank]
        #: optimizer steps per epoch (a last partial one is dropped: it would not split)
        self.per_epoch = length // (batch_size * accumulate)
        #: the epoch the next iteration reads (set_epoch; else each iteration the next)
        self.epoch = 0
        self._epoch_set = False
        #: global batches yielded so far, in all (the cap counts them)
        self.yielded = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration reads (``DistributedSampler.set_epoch``): its
        permutation, and its place in the run's sequence of global batches."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"sampler.set_epoch({epoch!r}): an epoch is a number >= 0.")
        self.epoch, self._epoch_set = epoch, True

    def __len__(self) -> int:
        """The batches the next iteration yields: an epoch's, or fewer where --steps
        ends the run."""
        batches = self.per_epoch * self.accumulate
        if self.max_steps:
            batches = min(batches, max(0, self.max_steps * self.accumulate - self.yielded))
        return batches

    def order(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s permutation of the data set (the same on every rank)."""
        if not self.shuffle:
            return torch.arange(self.length)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.length, generator=g)

    def batch(self, step: int, micro: int = 0) -> list[int]:
        """This rank's indices of the run's optimizer step ``step`` (micro-batch
        ``micro`` of it)."""
        epoch, within = divmod(step, self.per_epoch)
        return self._rows(self.order(epoch), within * self.accumulate + micro)

    def _rows(self, order: torch.Tensor, index: int) -> list[int]:
        start = index * self.batch_size + self.offset
        return order[start:start + self.rows].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        _refuse_as_plain_sampler(sys._getframe(1))
        epoch, count = self.epoch, len(self)
        if not self._epoch_set:  # (DistributedSampler would read epoch 0 again)
            self.epoch += 1
        return self._epoch(epoch, count)

    def _epoch(self, epoch: int, count: int) -> Iterator[list[int]]:
        order = self.order(epoch)
        for index in range(count):
            self.yielded += 1
            yield self._rows(order, index)


def _refuse_as_plain_sampler(caller) -> None:
    """``DataLoader(ds, sampler=dist.sampler(...))`` would treat each list of indices as
    one sample (a batch of batches): refused, the caller being the BatchSampler that
    DataLoader wraps a plain sampler in."""
    if caller is not None and caller.f_code is torch.utils.data.BatchSampler.__iter__.__code__:
        raise ConfigError("dist.sampler(...) yields whole batches (lists of indices): pass it "
                          "as DataLoader(dataset, batch_sampler=sampler), not sampler=.")
