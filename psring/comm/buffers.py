"""Memory for the bounded-loss transport's transfers, kept from one to the next: a
worker's blocks of datagrams (psring.comm.lossy) and a receiver's transfers as they
arrive (psring.comm.ingress) are the same sizes every step.

    buffers = Buffers()          # keeps at most KEPT_BYTES
    buf = buffers.take(nbytes)   # memory no one else holds: a kept one, or new

Why not fresh memory each time: on Linux its first write costs the kernel's page
faults, and numpy asks for transparent huge pages for large arrays, whose faults at
times stall on the kernel's compaction (benchmarks/diag_datagrams.py: a receive's CPU
0.30-0.37 of a core per Gbit/s with fresh buffers, 0.06 with kept ones).
"""

from __future__ import annotations

import sys
import threading

import numpy as np

#: bytes of transfers' memory a pool keeps, in use or free: a step's transfers for most
#: models (a worker's pushes of ResNet-50's 98 MB of gradients), part of a larger one's
#: (VGG-16's 553 MB: the rest is used once, as before); beyond it a worker or a server
#: would hold memory it no longer uses. One pool a process (:data:`SHARED`): its
#: senders and its ingress draw on it
KEPT_BYTES = 256 << 20


def _refs(kept: list, i: int) -> int:
    """References to ``kept[i]``, as counted from here: compared only with the count
    of a buffer no one else holds, taken by this same call (an interpreter's own
    counting, borrowed references and all, is the same for both)."""
    return sys.getrefcount(kept[i])


class Buffers:
    """Transfers' memory, kept for the next transfers of the same size. A kept buffer
    is free again once nothing but this pool refers to it (a received push's tensor,
    which takes its transfer's buffer over, is gone; a sent transfer is done). At most
    ``most`` bytes are kept; beyond them a buffer is used once."""

    def __init__(self, most: int = KEPT_BYTES):
        self.most = most
        self.kept: list[np.ndarray] = []
        self.lock = threading.Lock()  # (a process's senders and receivers share one)
        #: what :func:`_refs` counts for a buffer only the pool holds
        self.free = _refs([np.empty(0, np.uint8)], 0)

    def _free(self, i: int) -> bool:
        return _refs(self.kept, i) == self.free

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of memory no one else holds (its contents whatever they were)."""
        with self.lock:
            return self._take(nbytes)

    def _take(self, nbytes: int) -> np.ndarray:
        for i in range(len(self.kept)):  # (by index: a loop variable would hold it)
            if self.kept[i].nbytes == nbytes and self._free(i):
                return self.kept[i]
        buf = np.empty(nbytes, np.uint8)
        # (touched now, in one pass: the pages a transfer's datagrams would otherwise
        # fault in one by one, between them, cost ten times as much)
        buf.fill(0)
        # room for it: free buffers go, the oldest first, only as far as the bound asks
        total, i = sum(b.nbytes for b in self.kept), 0
        while total + nbytes > self.most and i < len(self.kept):
            if self._free(i):
                total -= self.kept.pop(i).nbytes
            else:
                i += 1
        if total + nbytes <= self.most:
            self.kept.append(buf)
        return buf


#: the process's pool (a worker's senders, one per server or peer, and a receiver's
#: ingress): at most KEPT_BYTES a process
SHARED = Buffers()
