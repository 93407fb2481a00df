"""The agent's heap: freed memory is kept for reuse instead of returned to the kernel.

Each fold allocates temporaries of a few MB (a batch's records concatenated, per-kernel
columns). glibc serves blocks over its mmap threshold with a fresh mmap and unmaps them on
free, and trims the heap top back to the kernel: every fold then touches new pages, one minor
page fault per 4 KiB (about 2,500 faults, 10 MB, per 1-s window at 50k kernels/s, which was a
quarter of the agent's CPU; bench/bench_scale.py, docs/benchmarks.md). With the mmap
threshold at glibc's maximum and trimming only past ``TRIM_BYTES`` free, the same pages
serve fold after fold. Peak RSS is unchanged (the temporaries were resident at their peak
anyway); the agent's steady RSS stays at that peak instead of dipping between folds.

What a spike leaves is given back (:class:`SpikeTrim`): a fold far larger than the usual
ones (a starved agent's backlog, a held step cut near its bound) would otherwise keep its
tens of MB for the agent's life. A CPU-capped agent (30% of a core, 10-minute replay at 3x,
when the replay still handed over a whole second's catch-up per poll) kept 133-164 MiB this
way, of which 46-52 MiB were live (what a trim leaves); CI's loaded hosts failed the
bounded-RSS test on it (tests/test_agent_stream.py). After a spike, and now and then in
any case, ``malloc_trim`` hands the free pages back; the usual folds' pages are faulted in
again once.
"""
from __future__ import annotations

import ctypes
import logging

from ridgeline.probes.heap_trim import libc

log = logging.getLogger("ridgeline.allocator")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # glibc malloc.h
MMAP_BYTES = 32 << 20        # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc: larger is refused
TRIM_BYTES = 128 << 20
SPIKE_BYTES = 32 << 20       # RSS this far above the steady level is a spike's leftover
SETTLE_WINDOWS = 4           # windows after start-up or a trim before the steady level is read
MIN_TRIM_WINDOWS = 20        # at most one trim per this many windows on a spike (a trim costs faults)
PERIOD_WINDOWS = 120         # and one per this many windows whatever RSS shows


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for this process; False (logged once) where the
    C library has no ``mallopt`` (musl) or refuses the values."""
    mallopt = getattr(libc(), "mallopt", None)
    if mallopt is None:
        log.info("allocator: no glibc mallopt here; freed memory goes back to the kernel")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
    if not ok:
        log.info("allocator: mallopt refused the thresholds; freed memory goes back to the kernel")
    return ok


class SpikeTrim:
    """When to give freed heap back: :meth:`observe` takes the RSS after each window and
    says whether to trim now. The kept heap never shrinks by itself, so RSS alone cannot
    tell the usual folds' working set from what a spike left; it is read ``SETTLE_WINDOWS``
    windows after each trim (the usual folds' pages in again). A trim comes when RSS stands
    ``SPIKE_BYTES`` over that level (at most once per ``MIN_TRIM_WINDOWS``), and every
    ``PERIOD_WINDOWS`` whatever it shows, the first ``SETTLE_WINDOWS`` after start-up: a
    level read during a spike (a starved agent's catch-up read 130 MiB where its windows
    then needed 75) would otherwise stand for the agent's life. A working set that has
    really grown (more devices) is the new level after its trim. Each trim costs the usual
    folds' pages faulted in once (about 2,500 faults, a few ms, for 10 MB)."""

    def __init__(self, spike_bytes: int = SPIKE_BYTES, settle_windows: int = SETTLE_WINDOWS,
                 min_trim_windows: int = MIN_TRIM_WINDOWS, period_windows: int = PERIOD_WINDOWS):
        self.spike_bytes = spike_bytes
        self.settle_windows = settle_windows
        self.min_trim_windows = min_trim_windows
        self.period_windows = period_windows
        self.steady_bytes: int | None = None
        self.trims = 0
        self._settle = 0
        self._n = 0
        self._last_trim = settle_windows - period_windows     # the first trim: after start-up

    def observe(self, rss_bytes: int) -> bool:
        self._n += 1
        since = self._n - self._last_trim
        if since >= self.period_windows:
            return self._trim()
        if self._settle:
            self._settle -= 1
            if not self._settle:
                self.steady_bytes = rss_bytes
            return False
        if self.steady_bytes is None:
            return False
        self.steady_bytes = min(self.steady_bytes, rss_bytes)
        return (since >= self.min_trim_windows and rss_bytes > self.steady_bytes + self.spike_bytes
                and self._trim())

    def _trim(self) -> bool:
        self._last_trim = self._n
        self._settle = self.settle_windows
        self.trims += 1
        return True
