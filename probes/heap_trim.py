"""Freed heap pages handed back to the kernel (glibc ``malloc_trim(0)``: every free page of
every arena, not only the heap top that glibc trims by itself). Used where a burst of
short-lived allocations would otherwise stay in RSS as free but resident heap: after a
trace is decoded (``probes.kineto_typed``) and after a fold spike in the agent
(``agent.allocator.SpikeTrim``). :func:`libc` is the C library both this and the agent's
``mallopt`` settings call."""
from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache


@cache
def libc() -> ctypes.CDLL | None:
    """The process's C library, loaded once (``find_library`` runs ``ldconfig``: not per
    call); None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def trim_heap() -> bool:
    """``malloc_trim(0)``; False where the C library has none (musl, other systems)."""
    trim = getattr(libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    trim(0)
    return True
