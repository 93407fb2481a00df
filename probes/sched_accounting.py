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


# The cumulative u64 fields of THREAD_DTYPE, contiguous from oncpu_ns: viewed as one matrix so
# a window costs a handful of numpy operations whatever the thread count.
_U64 = ("oncpu_ns", "runq_ns", "runq_preempt_ns", "blocked_ns", "unattributed_ns", "runq_max_ns",
        "nvcsw", "nivcsw", "migrations", "wakeups", "slices", "gaps")
_C = {name: i for i, name in enumerate(_U64)}
_OFF = THREAD_DTYPE.fields["oncpu_ns"][1]
assert all(THREAD_DTYPE.fields[n][1] == _OFF + 8 * i for i, n in enumerate(_U64))
_TIMES = [_C[f] for f in ("oncpu_ns", "runq_ns", "blocked_ns")]
_COUNTS = [_C[f] for f in COUNT_FIELDS]


def _matrix(rows: np.ndarray, now_ns: int) -> np.ndarray:
    """(n, 12) int64 effective totals (see :func:`effective_totals`)."""
    rows = np.ascontiguousarray(rows)
    m = np.ndarray((len(rows), len(_U64)), dtype="<u8", buffer=rows, offset=_OFF,
                   strides=(THREAD_DTYPE.itemsize, 8)).astype(np.int64) if len(rows) else \
        np.zeros((0, len(_U64)), np.int64)
    if len(rows) and now_ns is not None:
        open_ns = np.maximum(np.int64(now_ns) - rows["ts"].astype(np.int64), 0)
        st = rows["state"]
        runq = np.where(st == S_RUNNABLE, open_ns, 0)
        m[:, _C["oncpu_ns"]] += np.where(st == S_ONCPU, open_ns, 0)
        m[:, _C["runq_ns"]] += runq
        m[:, _C["runq_preempt_ns"]] += np.where(rows["preempted"] != 0, runq, 0)
        m[:, _C["blocked_ns"]] += np.where(st == S_BLOCKED, open_ns, 0)
    return m


def effective_totals(rows: np.ndarray, now_ns: int) -> np.ndarray:
    """Cumulative totals as of ``now_ns``: closed intervals plus each thread's open one.

    The open interval ``now_ns - ts`` goes to on-CPU, run-queue (and run-queue after
    preemption) or blocked time by the thread's state; in the unknown state it is not
    counted. Times the kernel stamped after ``now_ns`` (a race with the read) count 0.
    """
    out = rows.copy()
    m = _matrix(rows, now_ns)
    for f in ("oncpu_ns", "runq_ns", "runq_preempt_ns", "blocked_ns"):
        out[f] = m[:, _C[f]]
    return out


def _keys(rows: np.ndarray) -> np.ndarray:
    return (rows["tgid"].astype(np.uint64) << np.uint64(32)) | rows["tid"].astype(np.uint64)


def diff(prev: np.ndarray, cur: np.ndarray, hprev: np.ndarray, hcur: np.ndarray,
         ident: np.ndarray, exited: np.ndarray) -> np.ndarray:
    """WINDOW_DTYPE rows from aligned effective-total matrices (zeros in ``prev``: first read).

    ``ident``: THREAD_DTYPE rows giving tid, tgid, comm and runq_max_ns. A time that went
    down (an open interval reclassified as unattributed after a gap) is reported as 0 and
    the excess is taken from ``unattributed_ns``, so the sum over windows of every field
    equals the thread's final totals.
    """
    out = np.zeros(len(cur), dtype=WINDOW_DTYPE)
    if len(cur) == 0:
        return out
    d = cur - prev
    t = d[:, _TIMES]
    excess = -np.minimum(t, 0).sum(axis=1)
    d[:, _TIMES] = np.maximum(t, 0)
    d[:, _C["runq_preempt_ns"]] = np.clip(d[:, _C["runq_preempt_ns"]], 0, d[:, _C["runq_ns"]])
    d[:, _C["unattributed_ns"]] = np.maximum(d[:, _C["unattributed_ns"]] - excess, 0)
    d[:, _COUNTS] = np.maximum(d[:, _COUNTS], 0)
    out["tid"], out["tgid"], out["comm"] = ident["tid"], ident["tgid"], ident["comm"]
    out["exited"] = exited
    out["runq_max_ns"] = ident["runq_max_ns"]
    for name, src in _OUT_OF.items():
        out[name] = d[:, _C[src]]
    out["runq_hist"] = np.maximum(hcur - hprev, 0)
    return out


class WindowAccountant:
    """Turns successive map reads (+ exit records) into per-window per-thread rows.

    ``window(rows, exits, now_ns)`` takes the map content read at ``now_ns`` and the
    exit records received since the last call; returns a WINDOW_DTYPE array with one row
    per thread that was tracked during the window (a thread with nothing new still gets
    a row when it is tracked, e.g. blocked the whole window). Threads are identified by
    ``(tid, tgid)``. Vectorised: the cost per poll grows with the thread count only
    through numpy operations.
    """

    def __init__(self):
        self._keys = np.zeros(0, np.uint64)
        self._m = np.zeros((0, len(_U64)), np.int64)
        self._h = np.zeros((0, RQ_SLOTS), np.int64)
        self._tgid = np.zeros(0, np.uint32)

    def forget_tgid(self, tgid: int) -> None:
        """Drop the state of a target removed by the user (its rows end silently)."""
        keep = self._tgid != tgid
        self._keys, self._m, self._h, self._tgid = self._keys[keep], self._m[keep], self._h[keep], self._tgid[keep]

    def window(self, rows: np.ndarray, exits: np.ndarray, now_ns: int) -> np.ndarray:
        ekeys, rkeys = _keys(exits), _keys(rows)
        if len(ekeys):
            live = ~np.isin(rkeys, ekeys)      # an exited thread read again before deletion
            rows, rkeys = rows[live], rkeys[live]
        ident = np.concatenate([exits, rows]) if len(exits) else rows
        keys = np.concatenate([ekeys, rkeys]) if len(exits) else rkeys
        m_rows = _matrix(rows, now_ns)
        m = np.concatenate([_matrix(exits, None), m_rows]) if len(exits) else m_rows
        h = ident["hist"].astype(np.int64)
        prev = np.zeros_like(m)
        hprev = np.zeros_like(h)
        if len(self._keys) and len(keys):
            idx = np.minimum(np.searchsorted(self._keys, keys), len(self._keys) - 1)
            found = self._keys[idx] == keys
            prev[found] = self._m[idx[found]]
            hprev[found] = self._h[idx[found]]
        exited = np.zeros(len(keys), bool)
        exited[:len(ekeys)] = True
        out = diff(prev, m, hprev, h, ident, exited)
        order = np.argsort(rkeys)
        n_ex = len(ekeys)
        self._keys, self._m = rkeys[order], m[n_ex:][order]
        self._h, self._tgid = h[n_ex:][order], rows["tgid"][order]
        return out


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
