"""Kernel names of each injected process matched against the signatures when they are
interned, on the CUPTI probe's pump thread, within a CPU-time budget per process and per
user (issue 18.1).

The matching itself belongs to the aggregator (``aggregator.signatures``), which this
layer may not import: the agent hands the probe a :class:`NameClassifier` (built in
``agent.registry``). Rows are "dict of column -> array, one row per name", as
``aggregator.signatures.classify_names`` returns them; this module only keeps them per
process (:class:`ProcessRows`) until the probe moves the names into its probe-wide table
and stores them there.

Without a classifier (tests, or a probe built outside the agent) nothing is matched here,
and the phase mapper matches names itself when it first meets them.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

#: Names matched per call between two budget checks: at most about 64 x 0.3 ms of CPU
#: (4 kB names) is spent past a budget that ran out mid-chunk.
CHUNK_NAMES = 64


class NameClassifier(Protocol):
    def classify(self, strings: list[str]) -> dict[str, np.ndarray]:
        """Rows of these names (one per string)."""

    def unclassified(self, n: int) -> dict[str, np.ndarray]:
        """Rows of ``n`` names not matched (the budget was spent)."""

    def store(self, names, ids: np.ndarray, rows: dict[str, np.ndarray], provisional: np.ndarray) -> None:
        """Record rows for name ids of a name table (``provisional``: stand-ins a real
        row may replace later)."""


class ProcessRows:
    """The rows of one process's local name ids ``0..n-1``, with, per id, whether it is a
    stand-in for a match not made (``provisional``). Grows by doubling."""

    def __init__(self):
        self.n = 0
        self.rows: dict[str, np.ndarray] = {}
        self.provisional = np.zeros(0, bool)

    def append(self, rows: dict[str, np.ndarray], provisional: bool) -> None:
        k = len(next(iter(rows.values()))) if rows else 0
        if not k:
            return
        need = self.n + k
        if need > len(self.provisional):
            cap = max(2 * need, 64)
            p = np.zeros(cap, bool)
            p[:self.n] = self.provisional[:self.n]
            self.provisional = p
            for f, a in rows.items():
                g = np.empty(cap, a.dtype)
                old = self.rows.get(f)
                if old is not None:
                    g[:self.n] = old[:self.n]
                self.rows[f] = g
        for f, a in rows.items():
            self.rows[f][self.n:need] = a
        self.provisional[self.n:need] = provisional
        self.n = need

    def take(self, lo: int, hi: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Rows and provisional flags of local ids ``lo..hi-1`` (all below :attr:`n`)."""
        return {f: a[lo:hi] for f, a in self.rows.items()}, self.provisional[lo:hi]
