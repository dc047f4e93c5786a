"""The memory allocator of a worker that runs torch.

Dask's nanny starts workers with ``MALLOC_TRIM_THRESHOLD_`` set
(``distributed.nanny.pre-spawn-environ``). Setting any glibc malloc threshold turns off glibc's
adaptive mmap threshold, which then stays at 128 KiB: every tensor above that size is mapped and
unmapped again on each use, and each use pays its page faults. Training steps of the default
policy run about 1.8x slower so. Raising the mmap threshold to glibc's maximum restores the
heap for tensors up to 32 MiB; the trim threshold Dask chose (returning freed memory) stays.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024
"""glibc's upper limit for the mmap threshold on 64-bit systems."""
FIXING = {"MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"}
"""Variables that turn the adaptive threshold off (an explicit ``MALLOC_MMAP_THRESHOLD_`` is the
user's choice and is kept)."""


def tune_allocator() -> bool:
    """Raise glibc's mmap threshold in this process when a malloc variable fixed it; True when
    it was raised (False on other C libraries or when nothing fixed the threshold)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or not FIXING.intersection(os.environ):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False
