"""Roofline position and verdict per phase, GPU idle gaps, launch latency, copy traffic.

All functions are pure and vectorised over the columnar arrays of a
:class:`probes.events.Trace` (no Python loop per kernel).

* :func:`phase_summary` -- per phase: kernel time and busy time (union of kernel
  intervals), count, FLOPs, bytes, achieved FLOP/s and bytes/s over busy time,
  arithmetic intensity, % of each ceiling, verdict and evidence strings.
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
    API_MEMCPY,
    API_MEMSET,
    API_SYNC,
    COPY_DIRECTION_NAMES,
    COPY_KIND_MEMCPY,
    COPY_KIND_MEMSET,
    Trace,
)

from .ceilings import Ceilings
from .work import DTYPE_KEYS, NO_SOURCE, SOURCE_MODEL, SOURCE_SHAPES, KernelWork, StepWork

MEMORY_BOUND = "memory-bound"
COMPUTE_BOUND = "compute-bound"
LAUNCH_BOUND = "latency/launch-bound"
HOST_BOUND = "host-bound"
UNDETERMINED = "undetermined"

# Thresholds of the verdict rule (documented in docs/analyze.md).
IDLE_BOUND_RATIO = 0.5          # GPU idle for at least half of the phase's windows
LAUNCH_COVER_RATIO = 0.5        # host inside launch calls for at least half of that idle
LOW_FRACTION = 0.10             # achieved < 10% of the roof that applies
SHORT_KERNEL_NS = 20_000        # median kernel shorter than 20 us
SHORT_GAP_NS = 20_000           # median idle gap shorter than 20 us
MIN_WORK_COVERAGE = 0.5         # figures must cover half of the phase's kernel time
SHAPES_PREFERRED_COVERAGE = 0.8  # shapes win over the model when they cover this much
IMPLAUSIBLE_RATIO = 1.5         # figures implying > 1.5x a ceiling are not this work

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
    record. Graph-launched kernels count from the graph launch call."""
    idx, hit = launch_join(trace) if join is None else join
    if mask is not None:
        hit = hit & mask
    lat = trace.kernels["start_ns"][hit] - trace.api["start_ns"][idx[hit]]
    neg = int((lat < 0).sum())
    lat = lat[lat >= 0]
    out = {"kernels": int(len(lat)), **{f"{k}_ns": v for k, v in percentiles_ns(lat).items()},
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
# Verdict
# ---------------------------------------------------------------------------------

def decide_verdict(*, idle_ratio: float | None, launch_cover_ratio: float | None,
                   sync_cover_ratio: float | None, median_gap_ns: float | None,
                   median_kernel_ns: float | None, arithmetic_intensity: float | None,
                   ridge_point: float | None, pct_of_peak_flops: float | None,
                   pct_of_peak_bytes: float | None, work_coverage_ratio: float) -> tuple[str, list[str]]:
    """The verdict of one phase from plain numbers, and the evidence that decided it.

    1. GPU idle >= IDLE_BOUND_RATIO of the phase's windows: the GPU waits for the host.
       Host inside launch calls for >= LAUNCH_COVER_RATIO of the idle, or short gaps
       between short kernels -> latency/launch-bound; otherwise host-bound (the thread is
       busy elsewhere or blocked in a synchronisation).
    2. Otherwise, with FLOP/byte figures covering >= MIN_WORK_COVERAGE of kernel time:
       both achieved fractions below LOW_FRACTION with short kernels ->
       latency/launch-bound; else intensity >= ridge point -> compute-bound, below ->
       memory-bound.
    3. Otherwise undetermined.
    """
    ev: list[str] = []
    pct = lambda x: f"{100 * x:.0f}%"   # noqa: E731
    if idle_ratio is not None and idle_ratio >= IDLE_BOUND_RATIO:
        ev.append(f"GPU idle {pct(idle_ratio)} of the phase's time")
        if launch_cover_ratio is not None:
            ev.append(f"host in launch calls during {pct(launch_cover_ratio)} of the idle")
        if sync_cover_ratio:
            ev.append(f"host blocked in synchronisation during {pct(sync_cover_ratio)} of the idle")
        short = (median_gap_ns is not None and median_gap_ns < SHORT_GAP_NS
                 and median_kernel_ns is not None and median_kernel_ns < SHORT_KERNEL_NS)
        if median_gap_ns is not None:
            ev.append(f"median idle gap {median_gap_ns / 1e3:.1f} us, median kernel "
                      f"{(median_kernel_ns or 0) / 1e3:.1f} us")
        if (launch_cover_ratio or 0) >= LAUNCH_COVER_RATIO or short:
            return LAUNCH_BOUND, ev
        return HOST_BOUND, ev
    if idle_ratio is not None:
        ev.append(f"GPU busy {pct(1 - idle_ratio)} of the phase's time")
    known = (arithmetic_intensity is not None and ridge_point is not None
             and work_coverage_ratio >= MIN_WORK_COVERAGE)
    if not known:
        ev.append("no FLOP/byte figures for most of the kernel time" if work_coverage_ratio
                  < MIN_WORK_COVERAGE else "no ceilings for this GPU")
        return UNDETERMINED, ev
    pf, pb = pct_of_peak_flops or 0.0, pct_of_peak_bytes or 0.0
    ev.append(f"intensity {arithmetic_intensity:.1f} FLOP/B vs ridge {ridge_point:.0f}")
    ev.append(f"{pf:.0f}% of peak FLOP/s, {pb:.0f}% of peak bytes/s")
    if max(pf, pb) < 100 * LOW_FRACTION and median_kernel_ns is not None \
            and median_kernel_ns < SHORT_KERNEL_NS:
        ev.append(f"median kernel {median_kernel_ns / 1e3:.1f} us: neither roof approached")
        return LAUNCH_BOUND, ev
    if arithmetic_intensity >= ridge_point:
        return COMPUTE_BOUND, ev
    return MEMORY_BOUND, ev


def choose_work(by_source: dict[str, dict], shapes_cov: float, model_cov: float,
                ceilings: Ceilings | None, model_dtype: str | None) -> dict:
    """Pick the FLOP/byte source of one phase and derive its roofline figures.

    ``by_source``: source name -> ``{"flops", "bytes", "busy_ns", optional "dtype"}``
    (sources whose figures exceed the ceilings get ``exceeds_ceilings_ratio`` set in
    place). Returns ``implausible`` (source names), ``work_source``, ``chosen`` (the
    chosen source's dict or None), ``flops``, ``bytes``, ``work_coverage_ratio``,
    ``work_busy_ns``, ``achieved_flops_per_s``, ``achieved_bytes_per_s``,
    ``arithmetic_intensity``, ``ridge_point``, ``peak_flops_per_s``, ``ceiling_dtype``,
    ``pct_of_peak_flops``, ``pct_of_peak_bytes`` (None where unknown).
    """
    # A figure implying more than IMPLAUSIBLE_RATIO x a ceiling over the traced
    # kernel time cannot be the work those kernels did: for the model it means the
    # trace holds only part of the step (e.g. unexpanded CUDA-graph replays).
    implausible: list[str] = []
    if ceilings is not None:
        for name_, w in by_source.items():
            if w["busy_ns"] <= 0:
                continue
            sec = w["busy_ns"] * 1e-9
            pk = ceilings.peak_flops_per_s(w.get("dtype") or model_dtype)[0]
            r = max(w["flops"] / sec / pk, w["bytes"] / sec / ceilings.hbm_bytes_per_s)
            if r > IMPLAUSIBLE_RATIO:
                w["exceeds_ceilings_ratio"] = r
                implausible.append(name_)
    usable_model = SOURCE_MODEL in by_source and SOURCE_MODEL not in implausible
    if SOURCE_SHAPES in by_source and (shapes_cov >= SHAPES_PREFERRED_COVERAGE
                                       or model_cov <= shapes_cov or not usable_model):
        src = SOURCE_SHAPES
    elif usable_model:
        src = SOURCE_MODEL
    else:
        src = NO_SOURCE
    chosen = by_source.get(src)
    flops = chosen["flops"] if chosen else None
    bytes_ = chosen["bytes"] if chosen else None
    wbusy = chosen["busy_ns"] if chosen else 0
    afl = (flops / (wbusy * 1e-9)) if chosen and wbusy > 0 else None
    aby = (bytes_ / (wbusy * 1e-9)) if chosen and wbusy > 0 else None
    dtype = (chosen or {}).get("dtype") or model_dtype
    ridge = peak_f = pct_f = pct_b = None
    used_dtype = None
    if ceilings is not None:
        peak_f, used_dtype = ceilings.peak_flops_per_s(dtype)
        ridge = peak_f / ceilings.hbm_bytes_per_s
        if afl is not None:
            pct_f = 100.0 * afl / peak_f
            pct_b = 100.0 * aby / ceilings.hbm_bytes_per_s
    return {"implausible": implausible, "work_source": src, "chosen": chosen,
            "flops": flops, "bytes": bytes_,
            "work_coverage_ratio": chosen["coverage_ratio"] if chosen else 0.0,
            "work_busy_ns": wbusy, "achieved_flops_per_s": afl, "achieved_bytes_per_s": aby,
            "arithmetic_intensity": (flops / bytes_) if chosen and bytes_ else None,
            "ridge_point": ridge, "peak_flops_per_s": peak_f, "ceiling_dtype": used_dtype,
            "pct_of_peak_flops": pct_f, "pct_of_peak_bytes": pct_b}


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


def _phase_windows(trace: Trace, kernel_phase: np.ndarray, phase: int, steps: list) -> list[tuple[int, int, int]]:
    """(device, start, end) windows of a phase: its steps, else the extent of its kernels
    per device."""
    w = [(int(s.device), int(s.start_ns), int(s.end_ns)) for s in steps if s.phase == phase]
    if w:
        return w
    k = trace.kernels
    m = kernel_phase == phase
    out = []
    for dev in np.unique(k["device"][m]).tolist():
        md = m & (k["device"] == dev)
        out.append((dev, int(k["start_ns"][md].min()), int(k["end_ns"][md].max())))
    return out


def _host_intervals(trace: Trace, categories) -> tuple[np.ndarray, np.ndarray]:
    api = trace.api
    if not len(api):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    m = np.isin(api["category"], categories)
    return union_intervals(api["start_ns"][m], api["end_ns"][m])


def phase_summary(trace: Trace, kernel_phase: np.ndarray, steps: list, phase_names: dict[int, str],
                  ceilings: Ceilings | None, kernel_work: KernelWork | None = None,
                  step_work: dict[int, StepWork] | None = None,
                  kernel_step: np.ndarray | None = None, model_dtype: str | None = None,
                  gaps: dict | None = None, join=None) -> dict[str, dict]:
    """Per-phase figures, keyed by phase name.

    ``kernel_phase``: phase code per kernel; ``steps``: objects with ``index, start_ns,
    end_ns, device, phase``; ``kernel_work``: per-kernel shapes work (or None);
    ``step_work``: model work per step index; ``kernel_step``: step index per kernel.

    Each phase dict has ``kernel_time_ns, busy_ns, kernels, share_of_gpu_time_ratio,
    flops, bytes, work_source, work_coverage_ratio, work_by_source, achieved_flops_per_s,
    achieved_bytes_per_s, arithmetic_intensity, ridge_point, ceiling_dtype,
    pct_of_peak_flops, pct_of_peak_bytes, idle_ratio, verdict, evidence``.
    """
    k = trace.kernels
    dur = np.maximum(k["end_ns"] - k["start_ns"], 0)
    gaps = _device_gaps(trace) if gaps is None else gaps
    total_busy = sum(int((me - ms).sum()) for ms, me, _, _ in gaps.values())
    launch_s, launch_e = _host_intervals(trace, [API_LAUNCH, API_GRAPH_LAUNCH, API_MEMCPY, API_MEMSET])
    sync_s, sync_e = _host_intervals(trace, [API_SYNC])
    join = launch_join(trace) if join is None else join
    present = sorted(set(np.unique(kernel_phase).tolist()) | {int(s.phase) for s in steps})
    out: dict[str, dict] = {}
    for ph in present:
        m = kernel_phase == ph
        cnt = int(m.sum())
        ktime = int(dur[m].sum())
        # Busy time of this phase's kernels, per device.
        pbusy = 0
        for dev in np.unique(k["device"][m]).tolist():
            md = m & (k["device"] == dev)
            pbusy += busy_ns(k["start_ns"][md], k["end_ns"][md])
        # Windows, idle inside them, gaps inside them, and what the host did meanwhile.
        windows = _phase_windows(trace, kernel_phase, ph, steps) if cnt or steps else []
        span = idle = 0
        gap_lens, gap_launch, gap_sync = [], 0, 0
        by_dev: dict[int, list] = {}
        for dev, ws, we in windows:
            by_dev.setdefault(dev, []).append((ws, we))
        for dev, wl in by_dev.items():
            w = np.array(sorted(wl), dtype=np.int64).reshape(-1, 2)
            ws, we = w[:, 0], w[:, 1]
            span += int((we - ws).sum())
            if dev not in gaps:
                idle += int((we - ws).sum())
                continue
            ms, me, gs, ge = gaps[dev]
            idle += int((we - ws).sum() - covered_ns(ws, we, ms, me).sum())
            wi = np.searchsorted(ws, gs, side="right") - 1
            wc = np.maximum(wi, 0)
            gm = (wi >= 0) & (ge <= we[wc]) & (gs >= ws[wc])
            g0, g1 = gs[gm], ge[gm]
            gap_lens.append(g1 - g0)
            gap_launch += int(covered_ns(g0, g1, launch_s, launch_e).sum())
            gap_sync += int(covered_ns(g0, g1, sync_s, sync_e).sum())
        gl = np.concatenate(gap_lens) if gap_lens else np.empty(0, np.int64)
        gap_total = int(gl.sum())
        idle_ratio = (idle / span) if span > 0 else None
        launch_cover = (gap_launch / gap_total) if gap_total > 0 and len(trace.api) else None
        sync_cover = (gap_sync / gap_total) if gap_total > 0 and len(trace.api) else None
        med_kernel = float(np.median(dur[m])) if cnt else None
        med_gap = float(np.median(gl)) if len(gl) else None

        # Work: shapes per kernel, model per step; choose one (see module docs).
        by_source: dict[str, dict] = {}
        shapes_cov = model_cov = 0.0
        if kernel_work is not None and cnt:
            known = m & kernel_work.known
            shapes_cov = float(dur[known].sum() / ktime) if ktime else 0.0
            if known.any():
                kb = 0
                for dev in np.unique(k["device"][known]).tolist():
                    md = known & (k["device"] == dev)
                    kb += busy_ns(k["start_ns"][md], k["end_ns"][md])
                codes = kernel_work.dtype_code[known]
                fl = np.nan_to_num(kernel_work.flops[known])
                dt = None
                if (codes >= 0).any():
                    w = np.bincount(codes[codes >= 0], weights=fl[codes >= 0], minlength=len(DTYPE_KEYS))
                    dt = DTYPE_KEYS[int(np.argmax(w))] if w.sum() > 0 else None
                by_source[SOURCE_SHAPES] = {
                    "flops": float(np.nansum(kernel_work.flops[known])),
                    "bytes": float(np.nansum(kernel_work.bytes[known])),
                    "busy_ns": kb, "coverage_ratio": shapes_cov, "dtype": dt,
                    "kernels": int(known.sum())}
        if step_work and kernel_step is not None and cnt:
            idxs = sorted({s.index for s in steps if s.phase == ph and s.index in step_work})
            if idxs:
                km = m & np.isin(kernel_step, idxs)
                model_cov = float(dur[km].sum() / ktime) if ktime else 0.0
                kb = 0
                for dev in np.unique(k["device"][km]).tolist():
                    md = km & (k["device"] == dev)
                    kb += busy_ns(k["start_ns"][md], k["end_ns"][md])
                notes = sorted({x for i in idxs for x in step_work[i].notes})
                by_source[SOURCE_MODEL] = {
                    "flops": float(sum(step_work[i].flops for i in idxs)),
                    "bytes": float(sum(step_work[i].bytes for i in idxs)),
                    "busy_ns": kb, "coverage_ratio": model_cov, "dtype": model_dtype,
                    "steps": len(idxs), "notes": notes}
        wc = choose_work(by_source, shapes_cov, model_cov, ceilings, model_dtype)
        implausible, src, chosen = wc["implausible"], wc["work_source"], wc["chosen"]
        flops, bytes_, cov, wbusy = wc["flops"], wc["bytes"], wc["work_coverage_ratio"], wc["work_busy_ns"]
        afl, aby, ai = wc["achieved_flops_per_s"], wc["achieved_bytes_per_s"], wc["arithmetic_intensity"]
        ridge, peak_f, used_dtype = wc["ridge_point"], wc["peak_flops_per_s"], wc["ceiling_dtype"]
        pct_f, pct_b = wc["pct_of_peak_flops"], wc["pct_of_peak_bytes"]
        verdict, evidence = decide_verdict(
            idle_ratio=idle_ratio, launch_cover_ratio=launch_cover, sync_cover_ratio=sync_cover,
            median_gap_ns=med_gap, median_kernel_ns=med_kernel, arithmetic_intensity=ai,
            ridge_point=ridge, pct_of_peak_flops=pct_f, pct_of_peak_bytes=pct_b,
            work_coverage_ratio=cov)
        for name_ in implausible:
            r = by_source[name_]["exceeds_ceilings_ratio"]
            evidence.append(
                f"{name_} figures would need {r:.1f}x the GPU's ceilings in the traced kernel time"
                + (": the trace holds only part of the step's kernels; model figures not used"
                   if name_ == SOURCE_MODEL else ": shape bytes exceed DRAM traffic (cache reuse)"))
        if chosen:
            evidence.append(f"work from {src}, covering {100 * cov:.0f}% of kernel time")
            evidence.extend(chosen.get("notes", []))
        elif cnt:
            evidence.append("no FLOP/byte source (no operator shapes; pass --model for the analytic model)")
        lat = launch_latency(trace, m, join)
        if lat["p50_ns"] is not None:
            evidence.append(f"launch latency p50 {lat['p50_ns'] / 1e3:.1f} us over {lat['kernels']} kernels")
        out[phase_names.get(ph, str(ph))] = {
            "kernel_time_ns": ktime, "busy_ns": pbusy, "kernels": cnt,
            "share_of_gpu_time_ratio": (pbusy / total_busy) if total_busy else None,
            "steps": sum(1 for s in steps if s.phase == ph),
            "window_ns": span, "idle_ns": idle, "idle_ratio": idle_ratio,
            "gaps": int(len(gl)), "median_gap_ns": med_gap, "median_kernel_ns": med_kernel,
            "idle_in_launch_calls_ratio": launch_cover, "idle_in_sync_calls_ratio": sync_cover,
            "flops": flops, "bytes": bytes_, "work_source": src, "work_coverage_ratio": cov,
            "work_busy_ns": wbusy, "work_by_source": by_source,
            "achieved_flops_per_s": afl, "achieved_bytes_per_s": aby,
            "arithmetic_intensity": ai, "ridge_point": ridge, "ceiling_dtype": used_dtype,
            "peak_flops_per_s": peak_f,
            "peak_bytes_per_s": ceilings.hbm_bytes_per_s if ceilings else None,
            "pct_of_peak_flops": pct_f, "pct_of_peak_bytes": pct_b,
            "launch_latency": lat, "verdict": verdict, "evidence": evidence,
            "top_kernels": top_kernels(trace, m, kernel_work),
        }
    return out
