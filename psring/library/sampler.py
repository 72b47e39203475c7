"""This worker's slice of each global batch, as a ``torch.utils.data`` batch sampler.

    sampler = dist.sampler(dataset, batch_size=128, seed=1)  # 128: the global batch
    loader = DataLoader(dataset, batch_sampler=sampler)
    for step, (x, y) in enumerate(loader): ...               # dist.steps batches

Every worker draws the same permutation of the data set per epoch (seeded by ``seed``
and the epoch), cuts it into global batches, and takes its own rows of each: rank r of
n the r-th of n equal slices, or with uneven shares (``--worker-batch``) the r-th of
those. The workers' slices of one global batch are its rows exactly, so a synchronous
strategy's average of their gradients is the gradient one process computes on the
whole batch (what ``single`` does with the same seed).
"""

from __future__ import annotations

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
    """Yields lists of data set indices: this rank's rows of each global batch, for
    ``steps`` batches in all (epochs follow one another, each reshuffled), so that
    ``enumerate(loader)`` gives the run's step numbers."""

    def __init__(self, length: int, batch_size: int, rank: int, world: int, steps: int,
                 seed: int = 0, shuffle: bool = True, uneven: Sequence[int] | None = None):
        if length < batch_size:
            raise ConfigError(f"a data set of {length} samples holds no global batch of "
                              f"{batch_size}; pass a smaller batch_size.")
        self.length, self.batch_size, self.steps = length, batch_size, steps
        self.seed, self.shuffle = seed, shuffle
        self.sizes = shares(batch_size, world, uneven)
        self.offset = sum(self.sizes[:rank])
        self.rows = self.sizes[rank]
        #: global batches per epoch (a last partial one is dropped: it would not split)
        self.per_epoch = length // batch_size
        self.first_step = 0

    def __len__(self) -> int:
        return self.steps - self.first_step

    def start_at(self, step: int) -> "GlobalBatchSampler":
        """Begin at global batch ``step`` (a resumed run's data position)."""
        self.first_step = step
        return self

    def order(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s permutation of the data set (the same on every rank)."""
        if not self.shuffle:
            return torch.arange(self.length)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.length, generator=g)

    def batch(self, step: int) -> list[int]:
        """This rank's indices of global batch ``step``."""
        epoch, within = divmod(step, self.per_epoch)
        start = within * self.batch_size + self.offset
        return self.order(epoch)[start:start + self.rows].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        epoch, order = -1, None
        for step in range(self.first_step, self.steps):
            e, within = divmod(step, self.per_epoch)
            if e != epoch:
                epoch, order = e, self.order(e)
            start = within * self.batch_size + self.offset
            yield order[start:start + self.rows].tolist()
