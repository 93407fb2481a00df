"""Whether a buffer kept for reuse has no live view: nothing made from its last use (a numpy
view, a field, a slice: each holds its owner) is alive anywhere, so writing into it again
changes nothing anyone sees.

Read from the reference count, which depends on how the interpreter counts its stack (from
Python 3.14 a borrowed local is not counted): the count of an unshared buffer, held by one
attribute and the caller's local as the two reuse sites hold it (the CUPTI server's body
buffer, ``probes.cupti.server``; the window fold's concatenation buffer,
``aggregator.windows.RecordBuffer``), is measured once at import in exactly that pattern,
not assumed.
"""
from __future__ import annotations

import sys

import numpy as np


def unshared(buf: np.ndarray) -> bool:
    """True when ``buf``, held by one attribute and the caller's local, has no other
    reference (call it as ``unshared(local)`` with the local just read from the attribute)."""
    return sys.getrefcount(buf) <= _UNSHARED


def _seen(buf: np.ndarray) -> int:
    """What :func:`unshared` reads, from a frame of the same depth."""
    return sys.getrefcount(buf)


class _Holder:
    __slots__ = ("buf",)


def _measure() -> int:
    h = _Holder()
    h.buf = np.empty(1, np.uint8)
    buf = h.buf
    return _seen(buf)


_UNSHARED = _measure()
