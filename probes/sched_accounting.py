"""Per-thread scheduling accounting: decoding the BPF map and turning cumulative totals into windows.

Pure functions on numpy arrays (no bcc, no /proc), so they are tested with literals.

The kernel side (``probes/sched_bpf.c``) keeps, per thread, cumulative *closed* intervals
plus the thread's current state and the time it entered it. A window read therefore
counts the still-open interval up to the read time (:func:`effective_totals`): a thread
blocked for the whole window shows the whole window as blocked, not zero. Differences of
effective totals between two reads give the window (:class:`WindowAccountant`). When an
open interval that a previous window counted as, say, blocked later turns out to have
no observed opening event (a *gap*), the kernel files it as unattributed; the window
difference then moves the amount already reported into ``unattributed_ns`` instead of
going negative, so per-thread totals over all windows stay exact.
"""
from __future__ import annotations

import numpy as np

S_UNKNOWN, S_ONCPU, S_RUNNABLE, S_BLOCKED = 0, 1, 2, 3
EV_EXIT, EV_FORK, EV_SLOW_RUNQ = 1, 2, 3
RQ_SLOTS = 32

# Layout of `struct thread_t` in sched_bpf.c (little-endian, no implicit padding).
THREAD_DTYPE = np.dtype([
    ("ev_type", "<u4"), ("tid", "<u4"), ("tgid", "<u4"), ("cpu", "<u4"),
    ("ts", "<u8"),
    ("oncpu_ns", "<u8"), ("runq_ns", "<u8"), ("runq_preempt_ns", "<u8"), ("blocked_ns", "<u8"),
    ("unattributed_ns", "<u8"), ("runq_max_ns", "<u8"),
    ("nvcsw", "<u8"), ("nivcsw", "<u8"), ("migrations", "<u8"), ("wakeups", "<u8"),
    ("slices", "<u8"), ("gaps", "<u8"),
    ("state", "u1"), ("preempted", "u1"), ("exiting", "u1"), ("pad", "u1", (5,)),
    ("comm", "S16"),
    ("hist", "<u4", (RQ_SLOTS,)),
])
assert THREAD_DTYPE.itemsize == 272

# `struct ev_t` (EV_FORK, EV_SLOW_RUNQ).
EVENT_DTYPE = np.dtype([("ev_type", "<u4"), ("tid", "<u4"), ("tgid", "<u4"), ("cpu", "<u4"),
                        ("ts", "<u8"), ("value", "<u8")])

# Fields that are cumulative and differenced per window.
TIME_FIELDS = ("oncpu_ns", "runq_ns", "runq_preempt_ns", "blocked_ns", "unattributed_ns")
COUNT_FIELDS = ("nvcsw", "nivcsw", "migrations", "wakeups", "slices", "gaps")

# One row per thread per window: what the probe publishes (names carry units).
WINDOW_DTYPE = np.dtype([
    ("tid", "<i4"), ("tgid", "<i4"), ("comm", "S16"),
    ("on_cpu_ns", "<i8"), ("runq_wait_ns", "<i8"), ("runq_preempt_ns", "<i8"),
    ("blocked_ns", "<i8"), ("unattributed_ns", "<i8"),
    ("voluntary_switches", "<i8"), ("involuntary_switches", "<i8"), ("migrations", "<i8"),
    ("wakeups", "<i8"), ("gaps", "<i8"), ("runq_max_ns", "<i8"),
    ("exited", "?"),
    ("runq_hist", "<i8", (RQ_SLOTS,)),
])
_OUT_OF = {"on_cpu_ns": "oncpu_ns", "runq_wait_ns": "runq_ns", "runq_preempt_ns": "runq_preempt_ns",
           "blocked_ns": "blocked_ns", "unattributed_ns": "unattributed_ns",
           "voluntary_switches": "nvcsw", "involuntary_switches": "nivcsw", "migrations": "migrations",
           "wakeups": "wakeups", "gaps": "gaps"}


def decode_threads(buf: bytes | np.ndarray) -> np.ndarray:
    """Decode raw ``struct thread_t`` records (bytes, or a uint8/void array) into THREAD_DTYPE rows."""
    if isinstance(buf, np.ndarray):
        if buf.dtype == THREAD_DTYPE:
            return buf
        buf = buf.tobytes()
    if len(buf) % THREAD_DTYPE.itemsize:
        raise ValueError(f"thread record buffer of {len(buf)} bytes is not a multiple of {THREAD_DTYPE.itemsize}")
    return np.frombuffer(buf, dtype=THREAD_DTYPE).copy()


def effective_totals(rows: np.ndarray, now_ns: int) -> np.ndarray:
    """Cumulative totals as of ``now_ns``: closed intervals plus each thread's open one.

    The open interval ``now_ns - ts`` goes to on-CPU, run-queue (and run-queue after
    preemption) or blocked time by the thread's state; in the unknown state it is not
    counted. Times the kernel stamped after ``now_ns`` (a race with the read) count 0.
    """
    out = rows.copy()
    if len(out) == 0:
        return out
    ts = out["ts"].astype(np.int64)
    open_ns = np.maximum(np.int64(now_ns) - ts, 0).astype(np.uint64)
    st = out["state"]
    out["oncpu_ns"] += np.where(st == S_ONCPU, open_ns, 0).astype(np.uint64)
    runq = np.where(st == S_RUNNABLE, open_ns, 0).astype(np.uint64)
    out["runq_ns"] += runq
    out["runq_preempt_ns"] += np.where(out["preempted"] != 0, runq, 0).astype(np.uint64)
    out["blocked_ns"] += np.where(st == S_BLOCKED, open_ns, 0).astype(np.uint64)
    return out


def close_exit(row: np.ndarray) -> np.ndarray:
    """Totals of an exit record: the kernel already closed every interval (its last switch-out)."""
    out = row.copy()
    out["state"] = S_UNKNOWN
    return out


def diff_rows(prev: np.ndarray | None, cur: np.ndarray, exited: bool = False) -> np.ndarray:
    """One WINDOW_DTYPE row from two effective-total rows of the same thread (``prev`` None: first read).

    A time field that went down (an open interval reclassified as unattributed after a
    gap) is reported as 0 and the excess is taken from ``unattributed_ns``, so the sum
    over windows of every field equals the thread's final totals.
    """
    out = np.zeros((), dtype=WINDOW_DTYPE)
    out["tid"] = int(cur["tid"])
    out["tgid"] = int(cur["tgid"])
    out["comm"] = cur["comm"]
    out["exited"] = exited
    out["runq_max_ns"] = int(cur["runq_max_ns"])
    deltas = {}
    for f in TIME_FIELDS + COUNT_FIELDS:
        deltas[f] = int(cur[f]) - (int(prev[f]) if prev is not None else 0)
    # runq_preempt is part of runq: reclassify runq first, then its preempt share.
    excess = 0
    for f in ("oncpu_ns", "runq_ns", "blocked_ns"):
        if deltas[f] < 0:
            excess += -deltas[f]
            deltas[f] = 0
    deltas["runq_preempt_ns"] = min(max(deltas["runq_preempt_ns"], 0), deltas["runq_ns"])
    deltas["unattributed_ns"] -= excess
    if deltas["unattributed_ns"] < 0:
        deltas["unattributed_ns"] = 0
    for f in COUNT_FIELDS:
        deltas[f] = max(deltas[f], 0)
    for name, src in _OUT_OF.items():
        out[name] = deltas[src]
    h = cur["hist"].astype(np.int64) - (prev["hist"].astype(np.int64) if prev is not None else 0)
    out["runq_hist"] = np.maximum(h, 0)
    return out


class WindowAccountant:
    """Turns successive map reads (+ exit records) into per-window per-thread rows.

    ``window(rows, exits, now_ns)`` takes the map content read at ``now_ns`` and the
    exit records received since the last call; returns a WINDOW_DTYPE array with one row
    per thread that was tracked during the window (a thread with nothing new still gets
    a row when it is tracked, e.g. blocked the whole window). Threads are identified by
    ``(tid, tgid)``.
    """

    def __init__(self):
        self._last: dict[tuple[int, int], np.ndarray] = {}

    def forget_tgid(self, tgid: int) -> None:
        """Drop the state of a target removed by the user (its rows end silently)."""
        for k in [k for k in self._last if k[1] == tgid]:
            del self._last[k]

    def window(self, rows: np.ndarray, exits: np.ndarray, now_ns: int) -> np.ndarray:
        eff = effective_totals(rows, now_ns)
        out = []
        seen = set()
        for rec in exits:
            key = (int(rec["tid"]), int(rec["tgid"]))
            fin = close_exit(rec)
            out.append(diff_rows(self._last.pop(key, None), fin, exited=True))
            seen.add(key)
        new_last = {}
        for r in eff:
            key = (int(r["tid"]), int(r["tgid"]))
            if key in seen:     # exited and already reported; a stale read of it
                continue
            out.append(diff_rows(self._last.get(key), r))
            new_last[key] = r
        self._last = new_last
        if not out:
            return np.zeros(0, dtype=WINDOW_DTYPE)
        return np.array(out, dtype=WINDOW_DTYPE)


def hist_by_tgid(window_rows: np.ndarray) -> dict[int, np.ndarray]:
    """Run-queue latency histogram per process: the sum of its threads' log2 slots."""
    out: dict[int, np.ndarray] = {}
    for tgid in np.unique(window_rows["tgid"]):
        out[int(tgid)] = window_rows["runq_hist"][window_rows["tgid"] == tgid].sum(axis=0)
    return out


def hist_slot_bounds_us(slot: int) -> tuple[int, int]:
    """Microsecond range of a bcc log2 slot: slot s holds [2^(s-1), 2^s - 1] (slot 0 and 1 hold 0..1)."""
    if slot <= 0:
        return (0, 0)
    return ((1 << slot) >> 1 if slot > 1 else 0, (1 << slot) - 1)


def hist_rows(hist: np.ndarray) -> list[dict]:
    """Non-empty histogram slots as ``{"lo_us", "hi_us", "count"}`` dicts (for reports and JSON)."""
    rows = []
    for slot, n in enumerate(hist):
        if n:
            lo, hi = hist_slot_bounds_us(slot)
            rows.append({"lo_us": lo, "hi_us": hi, "count": int(n)})
    return rows
