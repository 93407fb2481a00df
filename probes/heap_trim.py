"""Freed heap pages handed back to the kernel (glibc ``malloc_trim(0)``: every free page of
every arena, not only the heap top that glibc trims by itself). Used where a burst of
short-lived allocations would otherwise stay in RSS as free but resident heap: after a
trace is decoded (``probes.kineto_typed``) and after a fold spike in the agent
(``agent.allocator.SpikeTrim``)."""
from __future__ import annotations

import ctypes
import ctypes.util


def trim_heap() -> bool:
    """``malloc_trim(0)``; False where the C library has none (musl, other systems)."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    trim(0)
    return True
