"""A shard's copies for checkpoints and for a script's optimizer state: taken the
moment the shard's version becomes a checkpoint's (a multiple of ``snapshot_every``, or
``snapshot_last``) — nothing of the next step can be in it yet (in sync mode the next
step's first push changes the momentum buffer at once), so every shard's copy is of the
same version, taken without stopping anyone — or, asked for the shard as it is now
(``SNAPSHOT_NOW``: async, or sync between a worker's steps, psring.servers.store).

The last copy is kept, or with backup workers the last BACKUP_COPIES: worker 0 asks
every shard for its newest copy and then for the oldest of those, the shards being a
few versions apart, each waiting to learn whom a step took.
"""

from __future__ import annotations

import torch

from psring.servers.store import ShardStore

#: copies of the shard kept for checkpoints with backup workers (else one)
BACKUP_COPIES = 4


class Snapshots(dict):
    """version -> (parameters, momentum or None): a run's copies of its shard."""

    def __init__(self, every: int = 0, last: int = 0, backups: int = 0):
        super().__init__()
        self.every, self.last = every, last
        self.kept = BACKUP_COPIES if backups else 1

    def keep(self, store: ShardStore, version: int) -> None:
        """A copy of the shard (parameters and momentum) at ``version``; the oldest
        beyond those kept dropped."""
        buf = store.buf
        self[version] = (store.params.clone(), buf.clone() if buf is not None else None)
        for old in sorted(self)[:-self.kept]:
            del self[old]

    def at_version(self, store: ShardStore, version: int) -> None:
        """The shard's version just became ``version``: a copy if a checkpoint's."""
        if self.every and (version % self.every == 0 or version == self.last):
            self.keep(store, version)

    def tensors(self, version: int) -> list[torch.Tensor]:
        """Copy ``version``'s tensors as a state reply carries them."""
        params, buf = self[version]
        return [params] if buf is None else [params, buf]
