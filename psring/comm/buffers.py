"""Memory for the bounded-loss transport's transfers, kept from one to the next: a
worker's blocks of datagrams (psring.comm.lossy) and a receiver's transfers as they
arrive (psring.comm.ingress) are the same sizes every step.

    buffers = Buffers(1 << 30)
    buf = buffers.take(nbytes)   # memory no one else holds: a kept one, or new

Why not fresh memory each time: on Linux its first write costs the kernel's page
faults, and numpy asks for transparent huge pages for large arrays, whose faults at
times stall on the kernel's compaction (benchmarks/diag_datagrams.py: a receive's CPU
0.30-0.37 of a core per Gbit/s with fresh buffers, 0.06 with kept ones).
"""

from __future__ import annotations

import sys

import numpy as np


class Buffers:
    """Transfers' memory, kept for the next transfers of the same size. A kept buffer
    is free again once nothing but this pool refers to it (a received push's tensor,
    which takes its transfer's buffer over, is gone; a sent transfer is done). At most
    ``most`` bytes are kept; beyond them a buffer is used once."""

    def __init__(self, most: int):
        self.most = most
        self.kept: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of memory no one else holds (its contents whatever they were)."""
        for buf in self.kept:
            # (references: the list's, the loop's and getrefcount's own argument)
            if buf.nbytes == nbytes and sys.getrefcount(buf) == 3:
                return buf
        buf = np.empty(nbytes, np.uint8)
        # (touched now, in one pass: the pages a transfer's datagrams would otherwise
        # fault in one by one, between them, cost ten times as much)
        buf.fill(0)
        self.kept = [b for b in self.kept if sys.getrefcount(b) > 3]  # (free ones go)
        if sum(b.nbytes for b in self.kept) + nbytes <= self.most:
            self.kept.append(buf)
        return buf
