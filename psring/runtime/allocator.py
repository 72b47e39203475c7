"""Keep freed memory in the process: glibc's malloc set for a training loop.

    from psring.runtime.allocator import keep_freed_memory
    keep_freed_memory()      # first thing in a worker or server process (their main())

Every step allocates and frees the same large tensors (gradients, activations, received
frames). glibc's malloc serves blocks above a threshold with mmap and gives the top of
its heap back to the kernel once more than a threshold is free; it adjusts both as a
program runs, and the layout decides whether a step's freed megabytes go back to the
kernel. When they do, the next step page-faults them in again, inside the matmuls that
write them: in separate ``allreduce`` runs of the default MLP that was 2000 minor faults
and ~5 ms per step in some runs and not others
(docs/results/2026-11-23-emulation-runs-and-prediction.md, issue 10). Fixing both
thresholds (mmap only above 32 MiB, the most glibc allows; trim only above 1 GiB
free) keeps that memory mapped from one step to the next, as PyTorch's CPU tuning
guide gets from jemalloc or tcmalloc. A user's own MALLOC_MMAP_THRESHOLD_ or
MALLOC_TRIM_THRESHOLD_ is left alone; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

# malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

#: blocks above this come from mmap (glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
MMAP_THRESHOLD = 32 * 2**20
#: free memory at the top of the heap kept before any is given back
TRIM_THRESHOLD = 2**30

_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Set glibc's thresholds (above); True if they are now in force."""
    if not sys.platform.startswith("linux") or any(k in os.environ for k in _ENV):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        # looked up only to raise AttributeError off glibc: musl has a mallopt that
        # does nothing
        _ = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
