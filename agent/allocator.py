"""The agent's heap: freed memory is kept for reuse instead of returned to the kernel.

Each fold allocates temporaries of a few MB (a batch's records concatenated, per-kernel
columns). glibc serves blocks over its mmap threshold with a fresh mmap and unmaps them on
free, and trims the heap top back to the kernel: every fold then touches new pages, one minor
page fault per 4 KiB (about 2,500 faults, 10 MB, per 1-s window at 50k kernels/s, which was a
quarter of the agent's CPU; bench/bench_scale.py, docs/benchmarks.md). With the mmap
threshold at glibc's maximum and trimming only past ``TRIM_BYTES`` free, the same pages
serve fold after fold. Peak RSS is unchanged (the temporaries were resident at their peak
anyway); the agent's steady RSS stays at that peak instead of dipping between folds.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("ridgeline.allocator")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # glibc malloc.h
MMAP_BYTES = 32 << 20        # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc: larger is refused
TRIM_BYTES = 128 << 20


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for this process; False (logged once) where the
    C library has no ``mallopt`` (musl) or refuses the values."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as exc:
        log.info("allocator: no glibc mallopt here (%s); freed memory goes back to the kernel", exc)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
    if not ok:
        log.info("allocator: mallopt refused the thresholds; freed memory goes back to the kernel")
    return ok
