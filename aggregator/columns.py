"""Small column helpers of the agent's per-kernel hot path (pure numpy).

A live stream's device, process and thread columns nearly always hold one value per
batch (one GPU, one served process, one launch thread): :func:`distinct` checks that
with one min/max pass before falling back to ``np.unique``'s sort.
"""
from __future__ import annotations

import numpy as np


def distinct(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` (sorted distinct values), one pass when all are equal."""
    v = np.asarray(values)
    if len(v) and v.min() == v.max():
        return v[:1].copy()
    return np.unique(v)


def distinct_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` (inverse flat), one pass when all are equal."""
    v = np.asarray(values)
    if len(v) and v.min() == v.max():
        return v[:1].copy(), np.zeros(len(v), dtype=np.intp)
    u, inv = np.unique(v, return_inverse=True)
    return u, inv.reshape(-1)
