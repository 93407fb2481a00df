"""Per-phase figures: one columnar accumulator and the one function that derives them.

Both ``ridgeline analyze`` (:func:`aggregator.roofline.phase_summary`, the whole trace in
one fold) and the live windows (:class:`aggregator.windows.SourceFold`, batch by batch)
fill a :class:`PhaseSums` with :func:`fold_kernels`, and both read their per-phase dicts
from :func:`phase_figures`: the two cannot disagree on the same kernels by construction
(``tests/test_phase_figures.py`` feeds the same kernels through both and compares).

:class:`PhaseSums` is columnar: one row per (device, pid, phase) key, integer sums in one
int64 matrix, FLOP/byte sums in one float64 matrix, three histograms (kernel duration,
idle gap inside a phase's windows, launch latency) in one int64 cube, the shapes' FLOPs by
data type in one float64 matrix. A fold adds a batch with one native pass over its kernels
(aggregator/fold_native.py; no Python object per kernel), sums over its units vectorised,
and a small Python loop per step for what only a step object holds (its evidence line, the
model's work). Rows add, so folding a trace in batches gives the sums of
folding it at once, as long as each step is folded whole (the window's carry does that).

Definitions (what both paths publish):

* a *unit* is a run of kernels of one (device, pid, step, phase) in (step, start) order;
  a phase's busy time is the sum of its units' busy times (union of each unit's kernels);
* a phase's *windows* are its steps (``start_ns`` to ``end_ns`` of each step of that
  phase) and, for its kernels outside any step of that phase, the extent of each unit;
  idle = windows - the busy time of the kernels inside them;
* *gaps* are the idle gaps inside a unit (between its merged runs of kernels); the host's
  launch (kernel, graph, memcpy, memset calls) and synchronisation calls of the same fold
  cover part of them (``idle_in_launch_calls_ratio``, ``idle_in_sync_calls_ratio``);
* medians and percentiles are read from histograms of ``SUB_BINS`` bins per octave: the
  geometric middle of the bin that holds the percentile, within ``2 ** (1 / 16)`` (4.4%)
  of the exact value; means and sums are exact.
"""
from __future__ import annotations

import math
import re
from functools import lru_cache

import numpy as np

from ridgeline.probes.events import API_GRAPH_LAUNCH, API_LAUNCH, API_MEMCPY, API_MEMSET, API_SYNC
from ridgeline.probes.records import PHASE_NAMES

from . import fold_native
from .work import DTYPE_KEYS, SOURCE_MODEL, SOURCE_SHAPES

SUB_BITS = 3                          # mantissa bits kept: 8 bins per octave
SUB_BINS = 1 << SUB_BITS
OCTAVES = 48                          # up to 2**47 ns (39 hours): longer values share the last bin
FINE_BINS = OCTAVES * SUB_BINS
H_KERNEL, H_GAP, H_LAUNCH = 0, 1, 2   # histogram planes

# Integer sums per row (columns of PhaseSums.ints).
INT_FIELDS = ("kernels", "kernel_time_ns", "busy_ns", "steps", "window_ns", "window_busy_ns", "gaps",
              "gap_ns", "gap_launch_ns", "gap_sync_ns", "launch_kernels", "launch_latency_ns",
              "model_kernel_time_ns", "model_busy_ns", "model_steps",
              "shape_kernel_time_ns", "shape_busy_ns", "shape_kernels",
              # model steps whose token counts came from kernel grids (an estimate)
              "model_estimated_steps")
FLOAT_FIELDS = ("model_flops", "model_bytes", "shape_flops", "shape_bytes")
I = {f: i for i, f in enumerate(INT_FIELDS)}
F = {f: i for i, f in enumerate(FLOAT_FIELDS)}
MAX_EVIDENCE = 8                      # distinct step evidence lines kept per row

_LAUNCHING = np.zeros(256, dtype=bool)
_LAUNCHING[[API_LAUNCH, API_GRAPH_LAUNCH, API_MEMCPY, API_MEMSET]] = True
_SYNCING = np.zeros(256, dtype=bool)
_SYNCING[API_SYNC] = True
_HOST_KIND = (_LAUNCHING + 2 * _SYNCING).astype(np.uint8)    # 1 launch, 2 sync call (fold_native.host_unions)
_LAUNCH_RECORD = np.zeros(256, dtype=bool)     # the records launch_latency_ns joins to
_LAUNCH_RECORD[[API_LAUNCH, API_GRAPH_LAUNCH]] = True


#: uint8 per API category: the records launch_latency_ns joins to (fold_native.ingest_pass)
LAUNCH_RECORD_U8 = _LAUNCH_RECORD.view(np.uint8)


def launch_latency_ns(k: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Per kernel: launch API call start to kernel start (ns), -1 where the batch holds
    no launch record of that correlation id (same join as
    :func:`aggregator.roofline.launch_join`). One native pass when the records are
    aligned with the kernels (fold_native.launch_latency_aligned), else
    :func:`launch_latency_join_ns`, its reference."""
    if not fold_native.REFERENCE and len(k) and len(k) == len(a):
        lat = np.empty(len(k), np.int64)
        if fold_native.launch_latency_aligned(k, a, _LAUNCH_RECORD, lat):
            # Only launch records, record i kernel i's (the common case): one native pass
            # over both, the answer of the reference join.
            return lat
    return launch_latency_join_ns(k, a)


def launch_latency_join_ns(k: np.ndarray, a: np.ndarray) -> np.ndarray:
    """:func:`launch_latency_ns` by the numpy join (the reference of its native passes:
    fold_native.launch_latency_aligned and ingest_pass), for a caller whose native pass
    found the records not aligned already. The sort is skipped when the records come in
    correlation order, as CUPTI and the simulator deliver them."""
    lat = np.full(len(k), -1, np.int64)
    if not len(k) or not len(a):
        return lat
    cat = a["category"]
    launch = np.flatnonzero((cat == API_LAUNCH) | (cat == API_GRAPH_LAUNCH))
    if not len(launch):
        return lat
    every = len(launch) == len(a)          # only launch records (a kernel stream): no gather
    corr = a["correlation_id"] if every else a["correlation_id"][launch]
    if len(corr) > 1 and not (corr[1:] >= corr[:-1]).all():
        o = np.argsort(corr, kind="stable")
        corr, launch = corr[o], launch[o]
        every = False
    kc = k["correlation_id"]
    if len(kc) == len(corr) and np.array_equal(kc, corr):
        # One launch record per kernel, in the same order (the common case): no search.
        d = k["start_ns"] - (a["start_ns"] if every else a["start_ns"][launch])
        np.maximum(d, 0, out=d)
        lat[:] = np.where(kc >= 0, d, -1) if int(kc.min()) < 0 else d
        return lat
    pos = np.minimum(np.searchsorted(corr, kc), len(corr) - 1)
    hit = (corr[pos] == kc) & (kc >= 0)
    lat[hit] = np.maximum(k["start_ns"][hit] - a["start_ns"][launch[pos[hit]]], 0)
    return lat


def fine_bins(values_ns: np.ndarray) -> np.ndarray:
    """Bin per value: 0 for < 1 ns, else octave and the top ``SUB_BITS`` mantissa bits,
    read from the float64 bits (no logarithm per value)."""
    v = np.asarray(values_ns).astype(np.float64)          # a fresh array: worked on in place
    np.maximum(v, 0.5, out=v)
    b = v.view(np.int64)
    b >>= 52 - SUB_BITS
    b -= 1022 << SUB_BITS            # 0.5 -> bin 0, 1 -> SUB_BINS
    return np.minimum(b, FINE_BINS - 1, out=b)


def duration_text(ns: float) -> str:
    """A duration in the unit the report's tables use for it (ns, us, ms, s), so a phase's
    evidence and the report's launch line print one figure the same way."""
    if ns >= 1e9:
        return f"{ns / 1e9:.2f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.1f} us"
    return f"{ns:.0f} ns"


def fine_percentile_ns(hist: np.ndarray, q: float) -> float | None:
    """The q-th percentile of a :func:`fine_bins` histogram: the geometric middle of its bin."""
    cum = np.cumsum(hist)
    total = int(cum[-1]) if len(cum) else 0
    if total == 0:
        return None
    b = int(np.searchsorted(cum, q / 100.0 * total, side="left"))
    if b < SUB_BINS:
        return 0.0
    octave, sub = divmod(b, SUB_BINS)
    lo = 2.0 ** (octave - 1) * (1 + sub / SUB_BINS)
    hi = 2.0 ** (octave - 1) * (1 + (sub + 1) / SUB_BINS)
    return math.sqrt(lo * hi)


def group_key(device: np.ndarray | int, pid: np.ndarray | int):
    """(device, pid) as one int64: device in the high 32 bits."""
    return (np.asarray(device).astype(np.int64) << 32) | (np.asarray(pid).astype(np.int64) & 0xFFFFFFFF)


def split_group_key(gk: int) -> tuple[int, int]:
    """(device, pid) of a :func:`group_key` (the pid as the signed 32-bit value it was)."""
    gk = int(gk)
    pid = gk & 0xFFFFFFFF
    return gk >> 32, pid - (1 << 32) if pid >= 1 << 31 else pid


class PhaseSums:
    """The accumulator: rows keyed by ``group_key << 3 | phase``, kept sorted."""

    def __init__(self):
        self.keys = np.empty(0, np.int64)
        self.ints = np.zeros((0, len(INT_FIELDS)), np.int64)
        self.floats = np.zeros((0, len(FLOAT_FIELDS)), np.float64)
        self.hists = np.zeros((0, 3, FINE_BINS), np.int64)
        self.dtype_flops = np.zeros((0, len(DTYPE_KEYS)), np.float64)
        # Per row (not per kernel): the model's notes and the steps' evidence lines.
        self.notes: dict[int, set] = {}
        self.evidence: dict[int, dict[str, int]] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def rows(self, keys: np.ndarray) -> np.ndarray:
        """Row index of each of ``keys`` (distinct), adding rows for new keys."""
        keys = np.asarray(keys, np.int64)
        pos = np.searchsorted(self.keys, keys)
        hit = pos < len(self.keys)
        hit[hit] = self.keys[pos[hit]] == keys[hit]
        if not hit.all():
            new = np.union1d(self.keys, keys[~hit])
            at = np.searchsorted(new, self.keys)
            for name, cols in (("ints", self.ints), ("floats", self.floats), ("hists", self.hists),
                               ("dtype_flops", self.dtype_flops)):
                grown = np.zeros((len(new),) + cols.shape[1:], cols.dtype)
                grown[at] = cols
                setattr(self, name, grown)
            self.keys = new
            pos = np.searchsorted(self.keys, keys)
        return pos

    def add(self, other: "PhaseSums") -> None:
        """Add another accumulator's rows into this one."""
        if not len(other):
            return
        r = self.rows(other.keys)
        self.ints[r] += other.ints
        self.floats[r] += other.floats
        self.hists[r] += other.hists
        self.dtype_flops[r] += other.dtype_flops
        for i, k in enumerate(other.keys.tolist()):
            row_key = int(self.keys[r[i]])
            if k in other.notes:
                self.notes.setdefault(row_key, set()).update(other.notes[k])
            for line, n in other.evidence.get(k, {}).items():
                _evidence_add(self.evidence.setdefault(row_key, {}), line, n)

    def by_phase(self) -> "PhaseSums":
        """The rows summed over devices and processes: one row per phase (key = phase)."""
        out = PhaseSums()
        if not len(self):
            return out
        ph = self.keys & 7
        u, inv = np.unique(ph, return_inverse=True)
        inv = inv.reshape(-1)
        out.keys = u.astype(np.int64)
        for name in ("ints", "floats", "hists", "dtype_flops"):
            cols = getattr(self, name)
            acc = np.zeros((len(u),) + cols.shape[1:], cols.dtype)
            np.add.at(acc, inv, cols)
            setattr(out, name, acc)
        for k, v in self.notes.items():
            out.notes.setdefault(k & 7, set()).update(v)
        for k, ev in self.evidence.items():
            for line, n in ev.items():
                _evidence_add(out.evidence.setdefault(k & 7, {}), line, n)
        return out

    def select(self, rows: np.ndarray) -> "PhaseSums":
        """The given rows as an accumulator of their own."""
        out = PhaseSums()
        out.keys = self.keys[rows]
        out.ints, out.floats = self.ints[rows], self.floats[rows]
        out.hists, out.dtype_flops = self.hists[rows], self.dtype_flops[rows]
        keys = set(out.keys.tolist())
        out.notes = {k: v for k, v in self.notes.items() if k in keys}
        out.evidence = {k: v for k, v in self.evidence.items() if k in keys}
        return out

    def groups(self) -> list[int]:
        """The distinct (device, pid) group keys, sorted."""
        return np.unique(self.keys >> 3).tolist()

    def group_rows(self, gk: int) -> np.ndarray:
        return np.flatnonzero((self.keys >> 3) == gk)


def _evidence_add(ev: dict[str, int], line: str, n: int) -> None:
    if line and (len(ev) < MAX_EVIDENCE or line in ev):
        ev[line] = ev.get(line, 0) + int(n)


def host_intervals(api: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Merged intervals of the host's launch calls (kernel, graph, memcpy, memset) and of
    its synchronisation calls."""
    e = np.empty(0, np.int64)
    if not len(api):
        return (e, e), (e, e)
    if not fold_native.REFERENCE:
        # One native pass over the records for both kinds; a kind not in start order
        # (several threads' calls) sorted once there, not masked and copied field by field.
        return fold_native.host_unions(api, _HOST_KIND)
    cat = api["category"]
    lm, sm = _LAUNCHING[cat], _SYNCING[cat]
    # Contiguous copies first: the record's fields are unaligned (50-byte records), and
    # numpy's arithmetic on unaligned strided views is several times slower.
    st, en = np.ascontiguousarray(api["start_ns"]), np.ascontiguousarray(api["end_ns"])
    if lm.all():                    # a kernel stream's launch records: no mask, no sync
        return _union(st, en), (e, e)
    return _union(st[lm], en[lm]), (_union(st[sm], en[sm]) if sm.any() else (e, e))


def _union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted disjoint intervals covering the given ones. No sort when they come in start
    order (one thread's calls, a stream's records)."""
    s = np.asarray(start, np.int64)
    e = np.maximum(np.asarray(end, np.int64), s)
    if len(s) < 2:
        return s, e
    if not (s[1:] >= s[:-1]).all():
        o = np.argsort(s, kind="stable")
        s, e = s[o], e[o]
    e = np.maximum.accumulate(e)
    new = np.empty(len(s), bool)
    new[0] = True
    np.greater(s[1:], e[:-1], out=new[1:])
    idx = np.flatnonzero(new)
    if len(idx) == len(s):
        return s, e
    return s[idx], e[np.r_[idx[1:] - 1, len(s) - 1]]


def _coverage_at(xs: tuple[np.ndarray, ...], ms: np.ndarray, me: np.ndarray) -> list[np.ndarray]:
    """Nanoseconds covered by sorted disjoint intervals up to each x of each array in xs
    (float64, counted from ``ms[0]``). The covered length is piecewise linear in x (rising
    inside an interval, flat between), so ``np.interp`` reads it, O(1) per x when the x
    come nearly sorted (exact in float64 for spans under 104 days)."""
    t0 = int(ms[0])
    xp = np.empty(2 * len(ms))
    xp[0::2] = ms - t0
    xp[1::2] = me - t0
    fp = np.empty(2 * len(ms))
    fp[0] = 0.0
    np.cumsum(me - ms, out=fp[1::2])
    fp[2::2] = fp[1:-1:2]
    return [np.interp(x, xp, fp) for x in xs]


def _bincount_rows(index: np.ndarray, weights, size: int) -> np.ndarray:
    return np.bincount(index, weights=weights, minlength=size) if len(index) else np.zeros(size)


def _hist_rows(row: np.ndarray | None, values: np.ndarray, nrows: int) -> np.ndarray:
    """(nrows, FINE_BINS) histogram of ``values`` by row (``row`` None: all in row 0)."""
    if row is None:
        return np.bincount(fine_bins(values), minlength=FINE_BINS).reshape(1, FINE_BINS)
    return np.bincount(row * FINE_BINS + fine_bins(values),
                       minlength=nrows * FINE_BINS).reshape(nrows, FINE_BINS)


_STREAM_LINE = re.compile(r"^(?:%s): (.*?)(?:; (?:%s): .*)?$" % (("|".join(PHASE_NAMES.values()),) * 2), re.S)


def evidence_line(step) -> str:
    """The deciding evidence line of a step. A mapped step (:mod:`aggregator.phases`) has a
    list, the deciding line first; a stream step (:mod:`aggregator.stream_phases`) one string,
    ``"phase: line"``, a relabelled one ``"mixed: line; prefill: line"``: its first line,
    without the phase name (the figures are keyed by phase), so both read the same."""
    ev = step.evidence
    if not isinstance(ev, str):
        return ev[0] if ev else ""
    return _stream_line(ev)


@lru_cache(maxsize=4096)
def _stream_line(ev: str) -> str:
    m = _STREAM_LINE.match(ev)
    return m.group(1) if m else ev


class Units:
    """Contiguous runs of one (device, pid, step, phase) of a fold, for the caller's
    per-device figures (extent, idle between units)."""
    __slots__ = ("start_ns", "end_ns", "busy_ns", "kernels", "kernel_time_ns", "gkey", "gap_ns", "gap_unit",
                 "gap_log2_by_group")

    def __init__(self, start_ns, end_ns, busy_ns, kernels, kernel_time_ns, gkey, gap_ns, gap_unit,
                 gap_log2_by_group=None):
        self.start_ns, self.end_ns, self.busy_ns = start_ns, end_ns, busy_ns
        self.kernels, self.kernel_time_ns, self.gkey = kernels, kernel_time_ns, gkey
        self.gap_ns, self.gap_unit = gap_ns, gap_unit
        # {group key: log2 histogram (windows.log2_bins) of its gaps}, when the pass made it
        # (fold_records' native pass); None: the caller bins gap_ns itself.
        self.gap_log2_by_group = gap_log2_by_group


def _units_reference(s, e_in, ph, stp, gk, gkey):
    """The numpy reference of ``rl_fold_units`` (aggregator/native/ridgeline_fold.c): units
    (runs of one group key, step and phase), their merged runs and the gaps between those."""
    n = len(s)
    e = np.maximum(e_in, s)
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    if gk is None:
        # One GPU and process: a unit breaks where (step, phase) does, one comparison.
        sp = (stp << 3) | ph
        np.not_equal(sp[1:], sp[:-1], out=brk[1:])
        first = np.flatnonzero(brk)
        u_ukey = (np.full(len(first), int(gkey), np.int64) << 3) | ph[first]
    else:
        ukey = (gk << 3) | ph
        np.not_equal(ukey[1:], ukey[:-1], out=brk[1:])
        brk[1:] |= stp[1:] != stp[:-1]
        first = np.flatnonzero(brk)
        u_ukey = ukey[first]
    nu = len(first)
    unit = np.cumsum(brk) - 1
    # Merged runs inside each unit: shifting each unit by unit * width keeps units apart.
    t0 = int(s.min())
    width = int(e.max()) - t0 + 1
    off = unit * width - t0
    so, eo = s + off, e + off
    run_end = np.maximum.accumulate(eo)
    new = np.empty(n, dtype=bool)
    new[0] = True
    np.greater(so[1:], run_end[:-1], out=new[1:])
    ri = np.flatnonzero(new)
    r_s = so[ri]
    r_e = run_end[np.r_[ri[1:] - 1, n - 1]]
    r_unit = unit[ri]
    u_busy = np.bincount(r_unit, weights=(r_e - r_s), minlength=nu).astype(np.int64)
    u_kt = np.add.reduceat(e - s, first)
    u_start = s[first]
    u_end = np.maximum.reduceat(e, first)
    same = r_unit[1:] == r_unit[:-1]
    gap_len = (r_s[1:] - r_e[:-1])[same]
    gap_unit = r_unit[1:][same]
    gi = np.flatnonzero(same)
    gap_start = r_e[gi] - off[ri[gi]]           # in the kernels' own clock
    return first, u_start, u_end, u_busy, u_kt, u_ukey, gap_start, gap_len, gap_unit


def _rows_reference(add, h, s, e_in, lat, first, u_cnt, u_busy, u_kt, row_of_unit, gap_start, gap_len, gap_unit,
                    host) -> None:
    """The numpy reference of ``rl_fold_rows``: each row's kernel, busy, gap and launch
    sums and histograms, and the host's calls inside the gaps, added into ``add``, ``h``."""
    ng = len(add)
    e = np.maximum(e_in, s)
    dur = e - s
    row_of_kernel = None if ng == 1 else np.repeat(row_of_unit, u_cnt)
    add[:, I["kernels"]] += np.bincount(row_of_unit, weights=u_cnt, minlength=ng).astype(np.int64)
    add[:, I["kernel_time_ns"]] += np.bincount(row_of_unit, weights=u_kt, minlength=ng).astype(np.int64)
    add[:, I["busy_ns"]] += np.bincount(row_of_unit, weights=u_busy, minlength=ng).astype(np.int64)
    g_row = row_of_unit[gap_unit]
    add[:, I["gaps"]] += np.bincount(g_row, minlength=ng)
    add[:, I["gap_ns"]] += _bincount_rows(g_row, gap_len, ng).astype(np.int64)
    h[:, H_KERNEL] += _hist_rows(row_of_kernel, dur, ng)
    h[:, H_GAP] += _hist_rows(None if ng == 1 else g_row, gap_len, ng)
    lat_ok = lat >= 0
    if bool(lat_ok.all()):
        h[:, H_LAUNCH] += _hist_rows(row_of_kernel, lat, ng)
        add[:, I["launch_kernels"]] += add[:, I["kernels"]]
        add[:, I["launch_latency_ns"]] += (np.bincount(row_of_kernel, weights=lat, minlength=ng).astype(np.int64)
                                           if row_of_kernel is not None else int(lat.sum()))
    elif lat_ok.any():
        lr = row_of_kernel[lat_ok] if row_of_kernel is not None else np.zeros(int(lat_ok.sum()), np.intp)
        h[:, H_LAUNCH] += _hist_rows(lr, lat[lat_ok], ng)
        add[:, I["launch_kernels"]] += np.bincount(lr, minlength=ng)
        add[:, I["launch_latency_ns"]] += np.bincount(lr, weights=lat[lat_ok], minlength=ng).astype(np.int64)
    # The host during the gaps: the covered length up to each end of each gap, from one
    # interpolation table per kind of host call; a gap's cover is the difference.
    if host is not None and len(gap_len):
        for col, (hs, he) in ((I["gap_launch_ns"], host[0]), (I["gap_sync_ns"], host[1])):
            if len(hs):
                x0 = (gap_start - int(hs[0])).astype(np.float64)
                cs, ce = _coverage_at((x0 + gap_len, x0), hs, he)
                cs -= ce
                add[:, col] += np.rint(cs.sum() if ng == 1 else _bincount_rows(g_row, cs, ng)).astype(np.int64)


def _steps_reference(sums, add, addf, ins, u_step, row_of_unit, u_busy, u_kt, u_cnt, u_gkey, ugp, steps, step_work,
                     on_steps) -> None:
    """The reference of fold_kernels' vectorised per-step sums: one step at a time, in unit
    order (what fold_kernels did before)."""
    seen: set[int] = set()
    with_work: set[int] = set()
    logged, logged_gk = [], []
    for u in ins.tolist():
        si = int(u_step[u])
        r = int(row_of_unit[u])
        add[r, I["window_busy_ns"]] += int(u_busy[u])
        if si in seen:
            # Another run of the same step and phase (kernels of two phases interleaved).
            if si in with_work:
                add[r, I["model_kernel_time_ns"]] += int(u_kt[u])
                add[r, I["model_busy_ns"]] += int(u_busy[u])
            continue
        seen.add(si)
        st = steps[si]
        add[r, I["steps"]] += 1
        add[r, I["window_ns"]] += int(st.end_ns - st.start_ns)
        row_key = int(ugp[r])
        _evidence_add(sums.evidence.setdefault(row_key, {}), evidence_line(st), int(u_cnt[u]))
        logged.append(st)
        logged_gk.append(int(u_gkey[u]))
        w = step_work(st) if step_work is not None else None
        if w is not None:
            with_work.add(si)
            addf[r, F["model_flops"]] += w.flops
            addf[r, F["model_bytes"]] += w.bytes
            add[r, I["model_kernel_time_ns"]] += int(u_kt[u])
            add[r, I["model_busy_ns"]] += int(u_busy[u])
            add[r, I["model_steps"]] += 1
            add[r, I["model_estimated_steps"]] += int(w.estimate)
            if w.notes:
                sums.notes.setdefault(row_key, set()).update(w.notes)
    if on_steps is not None and logged:
        on_steps(logged, np.array(logged_gk, np.int64))


def fold_kernels(sums: PhaseSums, *, start_ns: np.ndarray, end_ns: np.ndarray, phase: np.ndarray,
                 step: np.ndarray, gkey: np.ndarray | int, steps: list, latency_ns: np.ndarray,
                 shape_flops: np.ndarray | None = None, shape_bytes: np.ndarray | None = None,
                 shape_dtype: np.ndarray | None = None, step_work=None, host=None,
                 on_steps=None, reference: bool | None = None) -> Units | None:
    """Fold kernels into ``sums``. Arrays are aligned, in (step, start) order: kernel
    start/end, phase code, step index into ``steps`` (-1: none), group key (one int when
    every kernel has the same), launch latency (-1: unknown), shapes work (NaN: unknown)
    and dtype code (-1: unknown). ``step_work(step)``: the model's work of a step or None;
    ``host``: :func:`host_intervals` of the same fold's API records; ``on_steps(steps,
    gkeys)``: called once with the steps folded, in unit order, and the group key of each
    (the window's step log); ``reference``: the
    per-kernel pass in numpy (:func:`_units_reference`, :func:`_rows_reference`) instead of
    the native library, for the tests that compare the two (None: ``fold_native.REFERENCE``).
    Returns the units."""
    n = len(start_ns)
    if not n:
        return None
    s = np.ascontiguousarray(start_ns, np.int64)
    e_in = np.ascontiguousarray(end_ns, np.int64)
    ph = np.ascontiguousarray(phase, np.int64)
    stp = np.ascontiguousarray(step, np.int64)
    one_group = np.ndim(gkey) == 0
    gk = None if one_group else np.ascontiguousarray(gkey, np.int64)
    lat = np.ascontiguousarray(latency_ns, np.int64)
    if reference is None:
        reference = fold_native.REFERENCE
    # The per-kernel pass: native (aggregator/fold_native.py), or its numpy reference.
    if reference:
        first, u_start, u_end, u_busy, u_kt, u_ukey, gap_start, gap_len, gap_unit = _units_reference(
            s, e_in, ph, stp, gk, gkey)
    else:
        first, u_start, u_end, u_busy, u_kt, u_ukey, gap_start, gap_len, gap_unit = fold_native.fold_units(
            s, e_in, ph, stp, gk, 0 if gk is not None else int(gkey))
    nu = len(first)
    u_cnt = np.diff(np.r_[first, n])
    u_step = stp[first]
    u_ph = ph[first]
    u_gkey = gk[first] if gk is not None else np.full(nu, int(gkey), np.int64)
    # Rows of the (group, phase) pairs.
    ugp, row_of_unit = np.unique(u_ukey, return_inverse=True)
    row_of_unit = row_of_unit.reshape(-1)
    ng = len(ugp)
    rows = sums.rows(ugp)
    add = np.zeros((ng, len(INT_FIELDS)), np.int64)
    addf = np.zeros((ng, len(FLOAT_FIELDS)), np.float64)
    h = np.zeros((ng, 3, FINE_BINS), np.int64)
    if reference:
        _rows_reference(add, h, s, e_in, lat, first, u_cnt, u_busy, u_kt, row_of_unit, gap_start, gap_len, gap_unit,
                        host)
    else:
        fold_native.fold_rows(add, h, s, e_in, lat, first, u_busy, u_kt, row_of_unit, gap_start, gap_len, gap_unit,
                              host)
    row_of_kernel = None
    dur = None
    if shape_flops is not None:
        e = np.maximum(e_in, s)
        dur = e - s
        row_of_kernel = None if ng == 1 else np.repeat(row_of_unit, u_cnt)
    # Operator-shape work per kernel.
    if shape_flops is not None:
        known = ~np.isnan(shape_flops)
        if known.any():
            kr = row_of_kernel[known] if row_of_kernel is not None else np.zeros(int(known.sum()), np.intp)
            addf[:, F["shape_flops"]] = _bincount_rows(kr, shape_flops[known], ng)
            addf[:, F["shape_bytes"]] = _bincount_rows(kr, np.nan_to_num(shape_bytes[known]), ng)
            skt = _bincount_rows(kr, dur[known], ng)
            add[:, I["shape_kernel_time_ns"]] = skt
            add[:, I["shape_kernels"]] = np.bincount(kr, minlength=ng)
            # Busy time of the kernels with shapes: their share of the row's kernel time.
            kt = add[:, I["kernel_time_ns"]]
            add[:, I["shape_busy_ns"]] = np.where(kt > 0, add[:, I["busy_ns"]] * (skt / np.maximum(kt, 1)), 0)
            if shape_dtype is not None:
                dc = np.asarray(shape_dtype)[known].astype(np.int64)
                ok = dc >= 0
                if ok.any():
                    df = np.bincount(kr[ok] * len(DTYPE_KEYS) + dc[ok], weights=shape_flops[known][ok],
                                     minlength=ng * len(DTYPE_KEYS)).reshape(ng, len(DTYPE_KEYS))
                    sums.dtype_flops[rows] += df
    return _fold_units_in(sums, steps, u_start, u_end, u_busy, u_kt, u_cnt, u_step, u_ph, u_gkey, ugp, row_of_unit,
                          rows, add, addf, h, gap_len, gap_unit, step_work, on_steps, reference)


def _fold_units_in(sums, steps, u_start, u_end, u_busy, u_kt, u_cnt, u_step, u_ph, u_gkey, ugp, row_of_unit, rows,
                   add, addf, h, gap_len, gap_unit, step_work, on_steps, reference) -> Units:
    """What fold_kernels and fold_records do once the per-kernel pass has made the units and
    each row's per-kernel sums (``add``, ``h``; ``addf`` the shapes' work): the windows, the
    per-step sums, evidence and model work, then the rows added into ``sums``."""
    ng = len(ugp)
    nu = len(u_start)
    # Windows: a unit outside any step of its phase is its own window.
    u_in_step = np.zeros(nu, dtype=bool)
    sidx = np.flatnonzero(u_step >= 0)
    if len(sidx):
        st_phase = np.fromiter((steps[i].phase for i in u_step[sidx].tolist()), np.int64, len(sidx))
        u_in_step[sidx] = st_phase == u_ph[sidx]
    loose = ~u_in_step
    if loose.any():
        add[:, I["window_ns"]] += np.bincount(row_of_unit[loose], weights=(u_end - u_start)[loose],
                                              minlength=ng).astype(np.int64)
        add[:, I["window_busy_ns"]] += np.bincount(row_of_unit[loose], weights=u_busy[loose],
                                                   minlength=ng).astype(np.int64)
    # Per step (a few per batch): the step's window once, its busy time, evidence and the
    # model's work from its token counts. Vectorised over the units: each unit adds its busy
    # time to its row, the first unit of each step (in unit order) counts the step, its
    # window and its evidence; only the model's work and the evidence lines are per step.
    ins = np.flatnonzero(u_in_step)
    if reference:
        _steps_reference(sums, add, addf, ins, u_step, row_of_unit, u_busy, u_kt, u_cnt, u_gkey, ugp, steps,
                         step_work, on_steps)
    elif len(ins):
        i_row = row_of_unit[ins]
        np.add.at(add[:, I["window_busy_ns"]], i_row, u_busy[ins])
        i_step = u_step[ins]
        _, fi = np.unique(i_step, return_index=True)
        fi.sort()
        fu = ins[fi]                       # the unit that opens each step, in unit order
        f_row = row_of_unit[fu]
        f_steps = [steps[i] for i in u_step[fu].tolist()]
        np.add.at(add[:, I["steps"]], f_row, 1)
        np.add.at(add[:, I["window_ns"]], f_row,
                  np.fromiter((st.end_ns - st.start_ns for st in f_steps), np.int64, len(f_steps)))
        f_key = ugp[f_row].tolist()
        ev_of: dict[int, dict] = {}
        for st, rk, c in zip(f_steps, f_key, u_cnt[fu].tolist()):
            ev = ev_of.get(rk)
            if ev is None:
                ev = ev_of[rk] = sums.evidence.setdefault(rk, {})
            _evidence_add(ev, evidence_line(st), c)
        if on_steps is not None:
            on_steps(f_steps, u_gkey[fu])
        if step_work is not None:
            has = np.zeros(len(steps), dtype=bool)
            for j, (st, r, rk) in enumerate(zip(f_steps, f_row.tolist(), f_key)):
                w = step_work(st)
                if w is None:
                    continue
                has[int(u_step[fu[j]])] = True
                addf[r, F["model_flops"]] += w.flops
                addf[r, F["model_bytes"]] += w.bytes
                add[r, I["model_steps"]] += 1
                add[r, I["model_estimated_steps"]] += int(w.estimate)
                if w.notes:
                    sums.notes.setdefault(rk, set()).update(w.notes)
            m = has[i_step]                # every unit of a step with work
            if m.any():
                np.add.at(add[:, I["model_kernel_time_ns"]], i_row[m], u_kt[ins[m]])
                np.add.at(add[:, I["model_busy_ns"]], i_row[m], u_busy[ins[m]])
    sums.ints[rows] += add
    sums.floats[rows] += addf
    sums.hists[rows] += h
    return Units(u_start, u_end, u_busy, u_cnt, u_kt, u_gkey, gap_len, gap_unit)


def fold_records(sums: PhaseSums, k: np.ndarray, order: np.ndarray, *, phase: np.ndarray, step: np.ndarray,
                 steps: list, latency_ns: np.ndarray, step_work=None, host=None, on_steps=None,
                 reference: bool | None = None) -> Units | None:
    """:func:`fold_kernels` of the kernel records ``k[order]`` (``order``: in (step, start)
    order), ``phase``, ``step`` and ``latency_ns`` per record, the group key of each read
    from its device and pid (no operator shapes): one native pass over the records
    (``fold_native.fold_batch``). Its reference (``reference``, None:
    ``fold_native.REFERENCE``), and the path of a fold with more rows than that pass takes:
    the columns gathered and :func:`fold_kernels` (the same units and sums)."""
    if not len(order):
        return None
    if reference is None:
        reference = fold_native.REFERENCE
    if not reference:
        r = fold_native.fold_batch(k, order, phase, step, latency_ns, host, len(INT_FIELDS), FINE_BINS)
        if r is not None:
            u, gap_len, gap_unit, ugp, add, h, gap_log2 = r
            u_first, u_start, u_end, u_busy, u_kt, u_ukey, u_step, u_gkey, u_cnt, row_of_unit = u
            rows = sums.rows(ugp)
            addf = np.zeros((len(ugp), len(FLOAT_FIELDS)), np.float64)
            units = _fold_units_in(sums, steps, u_start, u_end, u_busy, u_kt, u_cnt, u_step, u_ukey & 7, u_gkey, ugp,
                                   row_of_unit, rows, add, addf, h, gap_len, gap_unit, step_work, on_steps, False)
            by_group: dict[int, np.ndarray] = {}
            for gk, hg in zip((ugp >> 3).tolist(), gap_log2):
                by_group[gk] = by_group[gk] + hg if gk in by_group else hg
            units.gap_log2_by_group = by_group
            return units
    d0, d1 = fold_native.field_range(k, "device")
    p0, p1 = fold_native.field_range(k, "pid")
    # One GPU and process (the common case): no per-kernel key to gather.
    gkey = int(group_key(d0, p0)) if d0 == d1 and p0 == p1 else group_key(k["device"][order], k["pid"][order])
    return fold_kernels(sums, start_ns=fold_native.gather(k, "start_ns", order),
                        end_ns=fold_native.gather(k, "end_ns", order), phase=phase[order], step=step[order],
                        gkey=gkey, steps=steps, latency_ns=latency_ns[order], step_work=step_work, host=host,
                        on_steps=on_steps, reference=reference)


def phase_figures(sums: PhaseSums, row: int, *, total_busy_ns: int, total_kernel_time_ns: int,
                  ceilings=None, model_dtype: str | None = None) -> dict:
    """Every per-phase figure of one row of ``sums``: counts and times, windows and idle,
    gaps and what the host did in them, FLOPs and bytes with their source, the roofline
    position, launch latency, the verdict and its evidence. ``total_*``: the sums over the
    rows the phase shares a GPU with (its group, or all phases of a trace)."""
    from . import roofline_rules
    iv = sums.ints[row]
    fv = sums.floats[row]
    hv = sums.hists[row]
    key = int(sums.keys[row])
    g = {f: int(iv[i]) for f, i in I.items()}
    kt = g["kernel_time_ns"]
    by_source: dict[str, dict] = {}
    shapes_cov = (g["shape_kernel_time_ns"] / kt) if kt and g["shape_kernels"] else 0.0
    model_cov = (g["model_kernel_time_ns"] / kt) if kt and g["model_steps"] else 0.0
    if g["shape_kernels"]:
        w = sums.dtype_flops[row]
        dt = DTYPE_KEYS[int(np.argmax(w))] if w.sum() > 0 else None
        by_source[SOURCE_SHAPES] = {"flops": float(fv[F["shape_flops"]]), "bytes": float(fv[F["shape_bytes"]]),
                                    "busy_ns": g["shape_busy_ns"], "coverage_ratio": shapes_cov, "dtype": dt,
                                    "kernels": g["shape_kernels"]}
    if g["model_steps"]:
        by_source[SOURCE_MODEL] = {"flops": float(fv[F["model_flops"]]), "bytes": float(fv[F["model_bytes"]]),
                                   "busy_ns": g["model_busy_ns"], "coverage_ratio": model_cov,
                                   "dtype": model_dtype, "steps": g["model_steps"],
                                   "estimated_steps": g["model_estimated_steps"],
                                   "notes": sorted(sums.notes.get(key, ()))}
    wc = roofline_rules.choose_work(by_source, shapes_cov, model_cov, ceilings, model_dtype)
    src, chosen, cov = wc["work_source"], wc["chosen"], wc["work_coverage_ratio"]
    span = g["window_ns"]
    idle = max(0, span - g["window_busy_ns"])
    idle_ratio = (idle / span) if span > 0 else None
    gap_total = g["gap_ns"]
    launch_cover = (g["gap_launch_ns"] / gap_total) if gap_total > 0 else None
    sync_cover = (g["gap_sync_ns"] / gap_total) if gap_total > 0 else None
    med_gap = fine_percentile_ns(hv[H_GAP], 50)
    med_k = fine_percentile_ns(hv[H_KERNEL], 50)
    verdict, evidence = roofline_rules.decide_verdict(
        idle_ratio=idle_ratio, launch_cover_ratio=launch_cover, sync_cover_ratio=sync_cover,
        median_gap_ns=med_gap, median_kernel_ns=med_k, arithmetic_intensity=wc["arithmetic_intensity"],
        ridge_point=wc["ridge_point"], pct_of_peak_flops=wc["pct_of_peak_flops"],
        pct_of_peak_bytes=wc["pct_of_peak_bytes"], work_coverage_ratio=cov)
    for name_ in wc["implausible"]:
        r = by_source[name_]["exceeds_ceilings_ratio"]
        evidence.append(
            f"{name_} figures would need {r:.1f}x the GPU's ceilings in the traced kernel time"
            + (": the trace holds only part of the step's kernels; model figures not used"
               if name_ == SOURCE_MODEL else ": shape bytes exceed DRAM traffic (cache reuse)"))
    # Model figures over token counts read from kernel grids are an estimate (flag and text).
    estimated = bool(chosen) and src == SOURCE_MODEL and g["model_estimated_steps"] > 0
    if chosen:
        evidence.append(f"work from {src}, covering {100 * cov:.0f}% of kernel time"
                        + (f" (an estimate: token counts from kernel grids in {g['model_estimated_steps']} of "
                           f"{g['model_steps']} steps)" if estimated else ""))
        evidence.extend(chosen.get("notes", []))
    elif g["kernels"]:
        evidence.append("no FLOP/byte source (no operator shapes; pass --model for the analytic model)")
    nl = g["launch_kernels"]
    lat = {"kernels": nl, "p50_ns": fine_percentile_ns(hv[H_LAUNCH], 50),
           "p90_ns": fine_percentile_ns(hv[H_LAUNCH], 90), "p99_ns": fine_percentile_ns(hv[H_LAUNCH], 99),
           "mean_ns": (g["launch_latency_ns"] / nl) if nl else None}
    if lat["p50_ns"] is not None:
        evidence.append(f"launch latency p50 {duration_text(lat['p50_ns'])} over {nl:,} kernels")
    ev = sums.evidence.get(key, {})
    evidence.extend(sorted(ev, key=lambda x: -ev[x])[:3])
    return {
        "kernels": g["kernels"], "kernel_time_ns": kt, "busy_ns": g["busy_ns"],
        "time_share_pct": 100.0 * kt / total_kernel_time_ns if total_kernel_time_ns else 0.0,
        "share_of_gpu_time_ratio": (g["busy_ns"] / total_busy_ns) if total_busy_ns else None,
        "steps": g["steps"], "window_ns": span, "idle_ns": idle, "idle_ratio": idle_ratio,
        "gaps": g["gaps"], "median_gap_ns": med_gap, "median_kernel_ns": med_k,
        "idle_in_launch_calls_ratio": launch_cover, "idle_in_sync_calls_ratio": sync_cover,
        "flops": wc["flops"], "bytes": wc["bytes"], "work_source": src, "work_estimated": estimated,
        "work_coverage_ratio": cov,
        "work_busy_ns": wc["work_busy_ns"], "work_by_source": by_source,
        "achieved_flops_per_s": wc["achieved_flops_per_s"], "achieved_bytes_per_s": wc["achieved_bytes_per_s"],
        "arithmetic_intensity": wc["arithmetic_intensity"], "ridge_point": wc["ridge_point"],
        "ceiling_dtype": wc["ceiling_dtype"], "peak_flops_per_s": wc["peak_flops_per_s"],
        "peak_bytes_per_s": ceilings.hbm_bytes_per_s if ceilings is not None else None,
        "pct_of_peak_flops": wc["pct_of_peak_flops"], "pct_of_peak_bytes": wc["pct_of_peak_bytes"],
        "launch_latency": lat, "verdict": verdict, "evidence": evidence,
    }


def figures_by_phase(sums: PhaseSums, phase_names: dict[int, str], *, ceilings=None,
                     model_dtype: str | None = None) -> dict[str, dict]:
    """Per-phase figures of rows that share a GPU (one group, or a whole trace summed over
    its devices), keyed by phase name."""
    if not len(sums):
        return {}
    totals = sums.ints.sum(axis=0)
    out = {}
    for r in range(len(sums)):
        ph = int(sums.keys[r]) & 7
        out[phase_names.get(ph, str(ph))] = phase_figures(
            sums, r, total_busy_ns=int(totals[I["busy_ns"]]),
            total_kernel_time_ns=int(totals[I["kernel_time_ns"]]), ceilings=ceilings, model_dtype=model_dtype)
    return out
