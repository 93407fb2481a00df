"""Roofline position and verdict per phase, GPU idle gaps, launch latency, copy traffic.

All functions are pure and vectorised over the columnar arrays of a
:class:`probes.events.Trace` (no Python loop per kernel).

* :func:`phase_summary` -- per phase: the whole trace folded into the accumulator of
  :mod:`aggregator.phase_figures` (the live windows fill the same one) and read by its one
  figure function: kernel time, busy time, count, FLOPs, bytes, achieved FLOP/s and
  bytes/s over busy time, arithmetic intensity, % of each ceiling, verdict and evidence.
* :func:`decide_verdict` -- the verdict rule on plain numbers (thresholds below).
* :func:`idle_gaps` -- per device: total GPU idle between kernels and its distribution.
* :func:`launch_latency` -- API launch call start to kernel start, by correlation id.
* :func:`copy_traffic` -- memcpy/memset bytes, count and achieved bytes/s by direction.

Verdicts: ``memory-bound``, ``compute-bound``, ``latency/launch-bound``, ``host-bound``,
or ``undetermined`` when no FLOP/byte figure and no idle pattern supports one.
"""
from __future__ import annotations

import numpy as np

from ridgeline.probes.events import (
    API_GRAPH_LAUNCH,
    API_LAUNCH,
    COPY_DIRECTION_NAMES,
    COPY_KIND_MEMCPY,
    COPY_KIND_MEMSET,
    Trace,
)

from .ceilings import Ceilings
from .roofline_rules import (  # noqa: F401  (re-exported: the verdict rule's names)
    COMPUTE_BOUND,
    HOST_BOUND,
    IDLE_BOUND_RATIO,
    IMPLAUSIBLE_RATIO,
    LAUNCH_BOUND,
    LAUNCH_COVER_RATIO,
    LOW_FRACTION,
    MEMORY_BOUND,
    MIN_WORK_COVERAGE,
    SHAPES_PREFERRED_COVERAGE,
    SHORT_GAP_NS,
    SHORT_KERNEL_NS,
    UNDETERMINED,
    choose_work,
    decide_verdict,
)
from .work import KernelWork, StepWork

FOLD_SLICE_KERNELS = 65_536     # phase_sums folds a whole trace in slices of about this many

GAP_BUCKETS_NS = (10_000, 100_000, 1_000_000, 10_000_000)
GAP_BUCKET_NAMES = ("<10us", "10-100us", "100us-1ms", "1-10ms", ">=10ms")


# ---------------------------------------------------------------------------------
# Interval helpers
# ---------------------------------------------------------------------------------

def union_intervals(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge intervals into sorted disjoint ones (touching intervals merge)."""
    if len(start) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    order = np.argsort(start, kind="stable")
    s = np.asarray(start, np.int64)[order]
    e = np.maximum(np.asarray(end, np.int64)[order], s)
    run_end = np.maximum.accumulate(e)
    new = np.empty(len(s), bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new)
    ms = s[idx]
    me = run_end[np.append(idx[1:] - 1, len(s) - 1)]
    return ms, me


def busy_ns(start: np.ndarray, end: np.ndarray) -> int:
    s, e = union_intervals(start, end)
    return int((e - s).sum())


def covered_ns(q_start: np.ndarray, q_end: np.ndarray, ms: np.ndarray, me: np.ndarray) -> np.ndarray:
    """For each query interval, nanoseconds covered by the disjoint sorted intervals."""
    q_start = np.asarray(q_start, np.int64)
    q_end = np.asarray(q_end, np.int64)
    if len(ms) == 0 or len(q_start) == 0:
        return np.zeros(len(q_start), np.int64)
    lens = me - ms
    before = np.concatenate([[0], np.cumsum(lens)])

    def cum(x):
        i = np.searchsorted(ms, x, side="right") - 1
        ic = np.maximum(i, 0)
        inside = np.clip(x - ms[ic], 0, lens[ic])
        return np.where(i >= 0, before[ic] + inside, 0)

    return np.maximum(cum(q_end) - cum(q_start), 0)


def percentiles_ns(values: np.ndarray, qs=(50, 90, 99)) -> dict[str, float | None]:
    if len(values) == 0:
        return {f"p{q}": None for q in qs}
    p = np.percentile(values, qs)
    return {f"p{q}": float(v) for q, v in zip(qs, p)}


# ---------------------------------------------------------------------------------
# Idle gaps, launch latency, copies
# ---------------------------------------------------------------------------------

def _device_gaps(trace: Trace) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per device: merged busy intervals of kernels and the idle gaps between them."""
    k = trace.kernels
    out = {}
    for dev in np.unique(k["device"]).tolist():
        m = k["device"] == dev
        ms, me = union_intervals(k["start_ns"][m], k["end_ns"][m])
        out[dev] = (ms, me, me[:-1], ms[1:])
    return out


def idle_gaps(trace: Trace, gaps: dict | None = None) -> dict:
    """GPU idle between kernels, per device: span, busy, idle, gap count, percentiles,
    and a histogram by duration bucket. Copies are not counted as busy: they run on copy
    engines while the SMs idle."""
    gaps = _device_gaps(trace) if gaps is None else gaps
    out = {}
    for dev, (ms, me, gs, ge) in gaps.items():
        d = ge - gs
        span = int(me[-1] - ms[0]) if len(ms) else 0
        busy = int((me - ms).sum())
        hist = np.bincount(np.searchsorted(GAP_BUCKETS_NS, d, side="right"),
                           minlength=len(GAP_BUCKET_NAMES)) if len(d) else np.zeros(5, int)
        out[str(dev)] = {
            "span_ns": span, "busy_ns": busy, "idle_ns": int(d.sum()),
            "idle_ratio": (float(d.sum()) / span) if span else None,
            "gaps": int(len(d)), **{f"gap_{k}_ns": v for k, v in percentiles_ns(d).items()},
            "gap_max_ns": int(d.max()) if len(d) else None,
            "gap_histogram": dict(zip(GAP_BUCKET_NAMES, map(int, hist))),
        }
    return out


def launch_join(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Per kernel: index of its launch API record (by correlation id) and hit mask."""
    k, api = trace.kernels, trace.api
    launch = np.flatnonzero((api["category"] == API_LAUNCH) | (api["category"] == API_GRAPH_LAUNCH)) \
        if len(api) else np.empty(0, np.int64)
    if not len(launch) or not len(k):
        return np.zeros(len(k), np.int64), np.zeros(len(k), bool)
    corr = api["correlation_id"][launch]
    order = np.argsort(corr, kind="stable")
    sc = corr[order]
    pos = np.minimum(np.searchsorted(sc, k["correlation_id"]), len(sc) - 1)
    hit = (sc[pos] == k["correlation_id"]) & (k["correlation_id"] >= 0)
    return launch[order[pos]], hit


def launch_latency(trace: Trace, mask: np.ndarray | None = None, join=None) -> dict:
    """API launch call start to kernel start (ns), percentiles over kernels with a launch
    record. Graph-launched kernels count from the graph launch call. The percentiles are
    read from the same 8-bins-per-octave histogram as every phase's and every live window's
    launch figure (:func:`aggregator.phase_figures.fine_percentile_ns`), so the report's
    launch line and a phase's evidence give one number for the same kernels."""
    from .phase_figures import FINE_BINS, fine_bins, fine_percentile_ns
    idx, hit = launch_join(trace) if join is None else join
    if mask is not None:
        hit = hit & mask
    lat = trace.kernels["start_ns"][hit] - trace.api["start_ns"][idx[hit]]
    neg = int((lat < 0).sum())
    lat = lat[lat >= 0]
    hist = np.bincount(fine_bins(lat), minlength=FINE_BINS) if len(lat) else np.zeros(FINE_BINS, np.int64)
    out = {"kernels": int(len(lat)), **{f"p{q}_ns": fine_percentile_ns(hist, q) for q in (50, 90, 99)},
           "mean_ns": float(lat.mean()) if len(lat) else None}
    if neg:
        out["negative_skipped"] = neg    # clock mismatch between host and device records
    return out


def copy_traffic(trace: Trace) -> list[dict]:
    """Memcpy and memset traffic by kind and direction."""
    c = trace.copies
    out = []
    if not len(c):
        return out
    key = c["kind"].astype(np.int64) * 256 + c["direction"]
    for kv in np.unique(key).tolist():
        m = key == kv
        kind, direction = divmod(kv, 256)
        dur = np.maximum(c["end_ns"][m] - c["start_ns"][m], 0)
        b = int(np.maximum(c["bytes"][m], 0).sum())
        t = int(dur.sum())
        out.append({"kind": "memset" if kind == COPY_KIND_MEMSET else "memcpy",
                    "direction": COPY_DIRECTION_NAMES.get(direction, str(direction)) if kind == COPY_KIND_MEMCPY else "-",
                    "count": int(m.sum()), "bytes": b, "time_ns": t,
                    "achieved_bytes_per_s": (b / (t * 1e-9)) if t > 0 else None})
    out.sort(key=lambda r: -r["bytes"])
    return out


# ---------------------------------------------------------------------------------
# Per phase
# ---------------------------------------------------------------------------------

def top_kernels(trace: Trace, mask: np.ndarray, kernel_work: KernelWork | None, limit: int = 10) -> list[dict]:
    """The kernel names with the most time among ``mask``, with count, time and, where
    shapes gave figures, FLOPs, bytes and achieved rates over their summed duration.
    Vectorised: one bincount per column over name ids."""
    k = trace.kernels
    idx = np.flatnonzero(mask)
    if not len(idx):
        return []
    nid = k["name_id"][idx].astype(np.int64)
    nid = np.where(nid < 0, len(trace.names), nid)
    dur = np.maximum(k["end_ns"][idx] - k["start_ns"][idx], 0).astype(np.float64)
    size = int(nid.max()) + 1
    t = np.bincount(nid, weights=dur, minlength=size)
    cnt = np.bincount(nid, minlength=size)
    if kernel_work is not None:
        fl, by = kernel_work.flops[idx], kernel_work.bytes[idx]
        known = ~np.isnan(fl)
        f_sum = np.bincount(nid, weights=np.nan_to_num(fl), minlength=size)
        b_sum = np.bincount(nid, weights=np.nan_to_num(by), minlength=size)
        k_cnt = np.bincount(nid, weights=known.astype(np.float64), minlength=size)
        k_t = np.bincount(nid, weights=np.where(known, dur, 0.0), minlength=size)
        cats = np.zeros(size, np.int64)
        cats[nid] = kernel_work.category[idx]
    order = np.argsort(-t)[:limit]
    out = []
    for i in order.tolist():
        if cnt[i] == 0:
            break
        row = {"name": trace.names[i] if i < len(trace.names) else "", "count": int(cnt[i]),
               "time_ns": int(t[i]), "flops": None, "bytes": None,
               "achieved_flops_per_s": None, "achieved_bytes_per_s": None, "category": None}
        if kernel_work is not None and k_cnt[i] > 0:
            from .work import CATEGORY_NAMES
            row.update(flops=float(f_sum[i]), bytes=float(b_sum[i]), category=CATEGORY_NAMES[int(cats[i])],
                       shapes_coverage_ratio=float(k_cnt[i] / cnt[i]))
            if k_t[i] > 0:
                row["achieved_flops_per_s"] = float(f_sum[i] / (k_t[i] * 1e-9))
                row["achieved_bytes_per_s"] = float(b_sum[i] / (k_t[i] * 1e-9))
        out.append(row)
    return out


def phase_sums(trace: Trace, kernel_phase: np.ndarray, steps: list, kernel_work: KernelWork | None = None,
               step_work: dict[int, StepWork] | None = None, kernel_step: np.ndarray | None = None,
               join=None):
    """The whole trace folded at once into a :class:`aggregator.phase_figures.PhaseSums`
    (the accumulator the live windows fill batch by batch). ``join``: :func:`launch_join`
    of the trace, when the caller has it (the launch latencies are read from it)."""
    from .phase_figures import PhaseSums, fold_kernels, group_key, host_intervals
    k = trace.kernels
    sums = PhaseSums()
    if not len(k):
        return sums
    ks = (np.asarray(kernel_step, np.int64) if kernel_step is not None
          else np.full(len(k), -1, np.int64))
    st = k["start_ns"]
    # Kernels by (step, start), as a stream's fold sees them (kernels in no step first).
    order = np.argsort(((ks + 1) << 40) | np.minimum(st - st.min(), (1 << 40) - 1), kind="stable")
    by_index = {int(s.index): s for s in steps}
    ks = np.where(np.isin(ks, list(by_index)), ks, -1) if len(by_index) else np.full(len(k), -1, np.int64)
    dcol, pcol = k["device"], k["pid"]
    one = dcol.min() == dcol.max() and pcol.min() == pcol.max()
    gk = int(group_key(dcol[0], pcol[0])) if one else group_key(dcol, pcol)[order]
    lat = _kernel_launch_latency_ns(trace, join)
    host = host_intervals(trace.api)
    flops = np.where(kernel_work.known, kernel_work.flops, np.nan) if kernel_work is not None else None
    kp = np.asarray(kernel_phase)
    ks_o = ks[order]
    # Folded in slices cut where a step ends (sums add; a step is never cut), so the
    # fold's temporaries stay bounded whatever the trace's size.
    cuts = [0]
    while len(ks_o) - cuts[-1] > FOLD_SLICE_KERNELS:
        at = cuts[-1] + FOLD_SLICE_KERNELS
        nxt = np.flatnonzero(ks_o[at:] != ks_o[at - 1])
        if not len(nxt):
            break
        cuts.append(at + int(nxt[0]))
    cuts.append(len(ks_o))
    for a, b in zip(cuts[:-1], cuts[1:]):
        o = order[a:b]
        fold_kernels(sums, start_ns=st[o], end_ns=k["end_ns"][o], phase=kp[o], step=ks_o[a:b],
                     gkey=gk if one else gk[a:b], steps=by_index, latency_ns=lat[o],
                     shape_flops=flops[o] if flops is not None else None,
                     shape_bytes=kernel_work.bytes[o] if kernel_work is not None else None,
                     shape_dtype=kernel_work.dtype_code[o] if kernel_work is not None else None,
                     step_work=(lambda s: step_work.get(int(s.index))) if step_work else None, host=host)
    return sums


def _kernel_launch_latency_ns(trace: Trace, join) -> np.ndarray:
    """phase_figures.launch_latency_ns of the trace's kernels, read from ``join`` (its
    :func:`launch_join`) where that is the same join: whenever the launch records do not
    number one per kernel. With one per kernel launch_latency_ns pairs kernel i with the
    i-th launch record in correlation order (a native pass, or its numpy fast path), not the
    first record of a repeated correlation id as the join does, so it runs itself."""
    from .phase_figures import LAUNCH_RECORD_U8, launch_latency_ns
    k, api = trace.kernels, trace.api
    if join is None or not len(k) or not len(api) or len(k) == len(api) \
            or np.count_nonzero(LAUNCH_RECORD_U8[api["category"]]) == len(k):
        return launch_latency_ns(k, api)
    idx, hit = join
    lat = k["start_ns"] - api["start_ns"][idx]
    np.maximum(lat, 0, out=lat)
    lat[~hit] = -1
    return lat


def phase_summary(trace: Trace, kernel_phase: np.ndarray, steps: list, phase_names: dict[int, str],
                  ceilings: Ceilings | None, kernel_work: KernelWork | None = None,
                  step_work: dict[int, StepWork] | None = None,
                  kernel_step: np.ndarray | None = None, model_dtype: str | None = None,
                  gaps: dict | None = None, join=None) -> dict[str, dict]:
    """Per-phase figures, keyed by phase name: the whole trace folded into the accumulator
    the live windows fill (:func:`phase_sums`), summed over devices, and read by the one
    figure function (:func:`aggregator.phase_figures.phase_figures`; keys and definitions
    there), plus each phase's ``top_kernels``.

    ``kernel_phase``: phase code per kernel; ``steps``: objects with ``index, start_ns,
    end_ns, device, phase`` (and token counts, evidence); ``kernel_work``: per-kernel
    shapes work (or None); ``step_work``: model work per step index; ``kernel_step``: step
    index per kernel. ``gaps`` is accepted for callers that computed it (the figures no
    longer need it); ``join``, :func:`launch_join` of the trace, saves the fold its own join.
    """
    from .phase_figures import figures_by_phase
    sums = phase_sums(trace, kernel_phase, steps, kernel_work, step_work, kernel_step, join=join)
    out = figures_by_phase(sums.by_phase(), phase_names, ceilings=ceilings, model_dtype=model_dtype)
    codes = {v: c for c, v in phase_names.items()}
    kp = np.asarray(kernel_phase)
    for name, f in out.items():
        c = codes.get(name, int(name) if name.isdigit() else -1)
        f["top_kernels"] = top_kernels(trace, kp == c, kernel_work)
    return out
