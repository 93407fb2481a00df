"""Forward-step structure of a kernel timeline.

A *step* is one launch set of the engine (one forward pass over all layers for a batch);
it is the unit that gets a phase label. Steps come from two places:

* annotation ranges: :func:`kernels_in_gpu_ranges` (the GPU-side copy of a range, e.g.
  Kineto ``gpu_user_annotation``) and :func:`kernels_in_cpu_ranges` (a CPU-side range,
  mapped to the kernels whose launching API call it contains, by correlation id: CPU
  windows are not GPU windows);
* the kernels alone: :func:`segment_kernels` cuts the timeline of each device where an
  engine step visibly ends (idle gap on the GPU, the token count of the per-token kernels
  changes, a sampling kernel closes the step, the per-layer pattern restarts, a CUDA graph
  is launched again, or a weak hint such as a ProfilerStep range changes).

Everything is columnar: per-kernel ``int32`` step ids, computed with numpy over all
kernels; Python loops only run over boundary candidates (at most a few per step).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ridgeline.aggregator import fold_native
from ridgeline.aggregator.columns import distinct
from ridgeline.aggregator.signatures import (
    GRID_TOKENS,
    ROLE_ATTENTION,
    ROLE_PER_TOKEN,
    STRONG,
    KernelClasses,
    short_name,
)
from ridgeline.probes.events import API_GRAPH_LAUNCH, API_LAUNCH, Trace

# Idle time on a device that ends a step whatever else is seen: a forward step never
# leaves the GPU idle this long between two of its own kernels unless the host stalls,
# and a stall that long is itself worth a new step. Also relative to the trace's own
# median inter-kernel gap (eager-mode traces have long gaps everywhere: the B200 vLLM
# step has gaps up to 2.6 ms inside one step, median 76 us).
GAP_MIN_NS = 5_000_000
GAP_MEDIAN_FACTOR = 50
# ... except inside a running layer pattern: a gap between two layer-marker launches that
# are one usual layer apart is a host stall inside one forward (an eager model whose host
# thread stalls), not a step boundary; only a stall this long is cut there anyway.
GAP_INSIDE_LAYERS_NS = 200_000_000
# ... nor where the host launched the kernels on both sides of the gap back to back (same
# thread, launches at most this far apart): the host did no step boundary's work (sampling
# sync, scheduling, input preparation) between them, so the GPU waited inside one engine
# step (a stream waiting on another stream's copy). The MI300X SGLang steps: the overlap
# scheduler's arange (sglang overlap_utils.py alloc_future_indices) runs 463 ms before the
# forward's first kernel, launched 52 us before it.
HOST_TOGETHER_NS = 1_000_000
# Layer-pattern restart: an interval between two consecutive attention launches longer
# than the usual per-layer interval by this many kernels (and by a quarter) holds the end
# of one step and the start of the next (LM head, sampling, embedding).
PATTERN_MIN_EXTRA = 2
PATTERN_MIN_REPEATS = 3
# Without attention kernels (an eager model whose attention is GEMM + softmax), the layer
# marker is the kernel name that recurs most regularly: at least this share of the spacings
# between its launches equal the most common spacing, which spans at least MARKER_MIN_SPAN
# kernels.
MARKER_MIN_REGULARITY = 0.75
MARKER_MIN_SPAN = 3
# ... and at most this many (a kernel that recurs once per forward of a benchmark loop is not
# a layer marker: its spacing is the whole step; layers of real models span 10-60 kernels).
MARKER_MAX_SPAN = 128
# A training step ends with its optimizer: torch.optim's fused/foreach Adam launches one run
# of multi_tensor_apply kernels per optimizer.step() (PyTorch aten/src/ATen/native/cuda/
# fused_adam_impl.cu, MultiTensorApply.cuh), the last GPU work of an iteration. Kernels of one
# run lie at most this many kernels apart (other streams interleave); a device with at least
# OPTIMIZER_MIN_RUNS runs is a training loop whose steps end after each run.
OPTIMIZER_RUN_GAP = 8
OPTIMIZER_MIN_RUNS = 2
# Nesting levels of CPU ranges a launch is looked up through (engine step annotation inside
# a profiler's or a patch's own range).
NEST_DEPTH = 4


def _spacing_mode(pos: np.ndarray) -> tuple[int, int, int]:
    """(most common spacing, its count, number of spacings) of sorted positions."""
    if len(pos) < 2:
        return 0, 0, 0
    d = np.diff(pos)
    if int(d.min()) >= 0:
        # Counts by value (sorted positions: spacings >= 0, at most the last position):
        # argmax takes the smallest of the most common spacings, as np.unique's order does.
        counts = np.bincount(d)
        j = int(np.argmax(counts))
        return j, int(counts[j]), len(pos) - 1
    vals, counts = np.unique(d, return_counts=True)
    j = int(np.argmax(counts))
    return int(vals[j]), int(counts[j]), len(pos) - 1


def attention_marker(name_ids: np.ndarray, attention: np.ndarray) -> tuple[np.ndarray, int]:
    """Positions of the attention launches that mark layers, and the usual kernels per layer
    (empty, 0: attention does not repeat regularly).

    Candidates: every attention launch, and the launches of each attention kernel name
    alone; the most regular candidate wins (share of spacings equal to their mode; ties:
    more launches). A layer that launches its attention as two kernels (ROCm paged decode
    attention: ``paged_attention_ll4mi_QKV_mfma16_kernel`` then
    ``paged_attention_ll4mi_reduce_kernel``, one kernel apart, 14 kernels to the next
    layer in the MI300X SGLang decode step) alternates spacings 1 and 14: all launches
    together give a "layer" of one kernel and every layer reads as a restart; one name alone
    gives the real 15. Layers that alternate attention kernel names (sliding-window and
    full layers) stay most regular with all launches together.
    """
    att = np.flatnonzero(attention)
    return _attention_marker_at(att, name_ids[att])


def _attention_marker_at(att: np.ndarray, att_names: np.ndarray) -> tuple[np.ndarray, int]:
    """:func:`attention_marker` from the attention launches' positions and name ids."""
    if len(att) <= PATTERN_MIN_REPEATS:
        return np.empty(0, dtype=np.int64), 0
    best = None
    cands = [att]
    if att_names.min() != att_names.max():      # one attention kernel name: no sort
        cands += [att[att_names == nm] for nm in np.unique(att_names).tolist()]
    for pos in cands:
        period, hits, n = _spacing_mode(pos)
        if hits < PATTERN_MIN_REPEATS:
            continue
        key = (hits / n, len(pos))
        if best is None or key > best[0]:
            best = (key, pos, period)
    if best is None:
        return np.empty(0, dtype=np.int64), 0
    return best[1], best[2]


def layer_marker(name_ids: np.ndarray, attention: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Positions of the per-layer marker kernel in one device's kernel sequence, the usual
    number of kernels per layer and the marker's name id (-1: attention kernels).

    Attention launches when they repeat regularly; otherwise the name whose launches are the
    most regular (share of spacings equal to their mode >= MARKER_MIN_REGULARITY, mode in
    [MARKER_MIN_SPAN, MARKER_MAX_SPAN]; ties: more launches). Empty positions when nothing repeats. Linear:
    one stable sort of the positions by name and one np.unique over (name, spacing).
    """
    att = np.flatnonzero(attention)
    return _layer_marker_at(att, name_ids[att], len(name_ids), lambda: name_ids)


def _layer_marker_at(att: np.ndarray, att_names: np.ndarray, m: int, name_ids_of) -> tuple[np.ndarray, int, int]:
    """:func:`layer_marker` from the attention launches' positions and name ids among ``m``
    kernels; ``name_ids_of()`` gives every kernel's name id, read only when attention does
    not mark the layers (the common case reads no name column)."""
    att, period = _attention_marker_at(att, att_names)
    if len(att):
        return att, period, -1
    if m < 2 * (PATTERN_MIN_REPEATS + 1):
        return np.empty(0, dtype=np.int64), 0, -1
    name_ids = name_ids_of()
    order = np.argsort(name_ids, kind="stable")
    nid = name_ids[order].astype(np.int64)
    same = nid[1:] == nid[:-1]
    d = np.diff(order)[same]
    g = nid[1:][same]
    if not len(d):
        return np.empty(0, dtype=np.int64), 0, -1
    keys, counts = np.unique(g * (m + 1) + d, return_counts=True)
    kname, kspan = keys // (m + 1), keys % (m + 1)
    names, first = np.unique(kname, return_index=True)
    best_count = np.maximum.reduceat(counts, first)
    n_spacings = np.add.reduceat(counts, first)
    # The mode's span per name: the first key of the name holding the best count.
    at_best = counts == np.repeat(best_count, np.diff(np.r_[first, len(keys)]))
    span = np.full(len(names), -1, dtype=np.int64)
    pos = np.searchsorted(names, kname[at_best])
    np.maximum.at(span, pos, kspan[at_best])
    ok = (best_count >= PATTERN_MIN_REPEATS) & (best_count >= MARKER_MIN_REGULARITY * n_spacings) \
        & (span >= MARKER_MIN_SPAN) & (span <= MARKER_MAX_SPAN) & (names >= 0)
    if not ok.any():
        return np.empty(0, dtype=np.int64), 0, -1
    cand = np.flatnonzero(ok)
    reg = best_count[cand] / n_spacings[cand]
    pick = cand[np.lexsort((-n_spacings[cand], -reg))[0]]
    return np.flatnonzero(name_ids == names[pick]), int(span[pick]), int(names[pick])


@dataclass
class Segment:
    """One step found from the kernels: device, time span and why it starts where it does."""
    device: int
    start_ns: int
    end_ns: int
    reasons: list[str] = field(default_factory=list)


@dataclass
class Segmentation:
    """``kernel_step``: per-kernel index into ``segments`` (-1: not segmented)."""
    kernel_step: np.ndarray
    segments: list[Segment]


def kernels_in_gpu_ranges(trace: Trace, starts_ns: np.ndarray, ends_ns: np.ndarray,
                          devices: np.ndarray, candidates: np.ndarray | None = None) -> np.ndarray:
    """Index of the GPU-side range holding each kernel (by start time, same device), or -1.

    Ranges of one device are expected not to overlap (engine steps do not); where they do,
    the latest-starting range that contains the kernel wins.
    """
    k = trace.kernels
    out = np.full(len(k), -1, dtype=np.int32)
    if not len(k) or not len(starts_ns):
        return out
    sel = np.ones(len(k), dtype=bool) if candidates is None else candidates.copy()
    for dev in np.unique(devices):
        r = np.flatnonzero(devices == dev)
        r = r[np.argsort(starts_ns[r], kind="stable")]
        on = np.flatnonzero(sel & (k["device"] == dev))
        if not len(on):
            continue
        pos = np.searchsorted(starts_ns[r], k["start_ns"][on], side="right") - 1
        ok = pos >= 0
        hit = np.full(len(on), -1, dtype=np.int64)
        hit[ok] = r[pos[ok]]
        ok &= k["start_ns"][on] < np.where(hit >= 0, ends_ns[np.maximum(hit, 0)], 0)
        out[on[ok]] = hit[ok]
    return out


def launch_index(trace: Trace) -> np.ndarray:
    """For each kernel, the index of the API record that launched it (same correlation id), or -1."""
    k, a = trace.kernels, trace.api
    out = np.full(len(k), -1, dtype=np.int64)
    if not len(k) or not len(a):
        return out
    cat, corr_all = a["category"], a["correlation_id"]
    launches = np.flatnonzero(((cat == API_LAUNCH) | (cat == API_GRAPH_LAUNCH)) & (corr_all >= 0))
    if not len(launches):
        launches = np.flatnonzero(corr_all >= 0)
        if not len(launches):       # only calls without a correlation (syncs): no launch known
            return out
    corr = corr_all[launches]
    # Launch records come in time order and correlation ids grow with time on a thread, so
    # the ids are usually sorted already: skip the sort then.
    if len(corr) > 1 and not bool((corr[1:] >= corr[:-1]).all()):
        o = np.argsort(corr, kind="stable")
        launches, corr = launches[o], corr[o]
    order = launches
    pos = np.searchsorted(corr, k["correlation_id"])
    pos_c = np.minimum(pos, len(corr) - 1)
    ok = (k["correlation_id"] >= 0) & (pos < len(corr)) & (corr[pos_c] == k["correlation_id"])
    out[ok] = order[pos_c[ok]]
    return out


def kernels_in_cpu_ranges(trace: Trace, starts_ns: np.ndarray, ends_ns: np.ndarray, pids: np.ndarray,
                          tids: np.ndarray, launch: np.ndarray | None = None,
                          candidates: np.ndarray | None = None) -> np.ndarray:
    """Index of the CPU-side range whose thread launched each kernel inside it, or -1.

    The launch is the runtime/driver API record with the kernel's correlation id; it must
    start inside the range on the range's (pid, tid). Kernels whose launch record is
    missing (e.g. launched before the profiler started) stay -1.
    """
    k, a = trace.kernels, trace.api
    out = np.full(len(k), -1, dtype=np.int32)
    if not len(k) or not len(starts_ns):
        return out
    li = launch_index(trace) if launch is None else launch
    sel = li >= 0
    if candidates is not None:
        sel &= candidates
    ks = np.flatnonzero(sel)
    if not len(ks):
        return out
    api_start = a["start_ns"][li[ks]]
    api_pid = a["pid"][li[ks]]
    api_tid = a["tid"][li[ks]]
    for pid, tid in {(int(p), int(t)) for p, t in zip(pids.tolist(), tids.tolist())}:
        r = np.flatnonzero((pids == pid) & (tids == tid))
        r = r[np.argsort(starts_ns[r], kind="stable")]
        on = np.flatnonzero((api_pid == pid) & (api_tid == tid))
        if not len(on):
            continue
        pos = np.searchsorted(starts_ns[r], api_start[on], side="right") - 1
        ok = pos >= 0
        hit = np.where(ok, r[np.maximum(pos, 0)], -1)
        ok &= api_start[on] < ends_ns[np.maximum(hit, 0)]
        out[ks[on[ok]]] = hit[ok]
        # A launch after a nested range ended but inside its enclosing one (SGLang's
        # step[DECODE] inside an execute_... range: the sampler runs after the inner range
        # closes) belongs to the enclosing range: step back over earlier-starting ranges,
        # a few nesting levels deep.
        miss = np.flatnonzero(~ok & (pos > 0))
        for _ in range(NEST_DEPTH):
            if not len(miss):
                break
            pos[miss] -= 1
            cand = r[pos[miss]]
            inside = api_start[on[miss]] < ends_ns[cand]
            out[ks[on[miss[inside]]]] = cand[inside]
            miss = miss[~inside & (pos[miss] > 0)]
    return out


def enclosing_roots(starts_ns: np.ndarray, ends_ns: np.ndarray, pids: np.ndarray, tids: np.ndarray) -> np.ndarray:
    """For each CPU range, the index of the outermost range of the same thread that contains
    it (itself when none does). Nested step annotations on one thread describe one engine
    step (TraceLens's vLLM-style ``execute_...`` range around SGLang's own ``step[...]``
    range): they are one step, not two. Columnar: ranges sorted by (thread, start, -end); a
    range is contained when an earlier range of its thread ends at or after its end (a
    running maximum of the ends, offset per thread so that one accumulate serves all
    threads); a contained range belongs to the latest root before it."""
    n = len(starts_ns)
    out = np.arange(n, dtype=np.int64)
    if n < 2:
        return out
    thread = (pids.astype(np.int64) << 32) | (tids.astype(np.int64) & 0xFFFFFFFF)
    o = np.lexsort((-ends_ns, starts_ns, thread))
    t_rank = np.cumsum(np.r_[0, thread[o][1:] != thread[o][:-1]])
    lo = int(min(starts_ns.min(), ends_ns.min()))
    span = int(max(starts_ns.max(), ends_ns.max())) - lo + 1
    key = (ends_ns[o] - lo) + t_rank * span
    prev_max = np.r_[np.iinfo(np.int64).min, np.maximum.accumulate(key)[:-1]]
    root = ~(prev_max >= key)
    root_at = np.maximum.accumulate(np.where(root, np.arange(n), 0))
    out[o] = o[root_at]
    return out


def _idle_gaps(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """GPU idle time between kernel i and i+1 (kernels ordered by start; overlap counts as 0)."""
    if len(start) < 2:
        return np.empty(0, dtype=np.int64)
    busy_until = np.maximum.accumulate(end)[:-1]
    return np.maximum(start[1:] - busy_until, 0)


def _argmax_in_ranges(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """First position of the maximum of ``values[lo_i:hi_i]`` for every range (hi > lo),
    vectorised: the ranges are laid end to end (np.repeat) and reduced with reduceat. Ranges
    from one rule barely overlap (they lie between consecutive launches), so the laid-out
    length stays near len(values); past a few times that, one slice per range."""
    lo = np.asarray(lo, dtype=np.int64)
    hi = np.asarray(hi, dtype=np.int64)
    if not len(lo):
        return lo
    if not fold_native.REFERENCE:
        # One native loop over the ranges (fold_native.argmax_ranges): the same positions,
        # without the numpy calls of the layout below (each rule's few ranges paid ten).
        out = fold_native.argmax_ranges(values, lo, hi)
        if out is not None:
            return out
    size = hi - lo
    total = int(size.sum())
    if total > 4 * len(values) + 1024:
        return np.array([a + int(np.argmax(values[a:b])) for a, b in zip(lo.tolist(), hi.tolist())],
                        dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(size)[:-1]))
    pos = np.arange(total, dtype=np.int64) - np.repeat(starts - lo, size)
    v = values[pos]
    vmax = np.maximum.reduceat(v, starts)
    at = np.where(v == np.repeat(vmax, size), np.arange(total), total)
    return pos[np.minimum.reduceat(at, starts)]


def _mark(cut: np.ndarray, reason: dict[int, str], at: np.ndarray, whys: list[str]) -> None:
    """Mark boundaries after kernels ``at`` (in order), each with its reason; a boundary
    already marked gains the reason unless it already says it. ``reason`` holds exactly the
    marked boundaries (segment_kernels sets both together), so it alone says which are:
    no numpy scalar read per boundary."""
    if not len(at):
        return
    for j, why in zip(at.tolist(), whys):
        r = reason.get(j)
        if r is None:
            reason[j] = why
        elif why not in r:
            reason[j] = r + "; " + why
    cut[at] = True


def _launched_together(trace: Trace, before: np.ndarray, after: np.ndarray, launch: np.ndarray | None) -> np.ndarray:
    """Per pair of kernels: launched by one host thread at most HOST_TOGETHER_NS apart
    (False where a launch record is missing). ``launch``: :func:`launch_index` when known."""
    li = launch_index(trace) if launch is None else launch
    a, b = li[before], li[after]
    ok = (a >= 0) & (b >= 0)
    api = trace.api
    a_, b_ = api[np.maximum(a, 0)], api[np.maximum(b, 0)]
    return ok & (a_["pid"] == b_["pid"]) & (a_["tid"] == b_["tid"]) & \
        (np.abs(b_["start_ns"] - a_["start_ns"]) <= HOST_TOGETHER_NS)


def optimizer_kernels(classes: KernelClasses) -> np.ndarray:
    """Per kernel: an optimizer kernel (signature ``optimizer`` of the data file)."""
    opt_of = np.array([sg.id == "optimizer" for sg in classes.signatures] + [False], dtype=bool)
    return opt_of[np.where(classes.sig >= 0, classes.sig, len(classes.signatures))]


def optimizer_run_ends(optimizer: np.ndarray) -> np.ndarray:
    """Positions of the last kernel of each optimizer run (kernels flagged ``optimizer``, in
    device order, at most OPTIMIZER_RUN_GAP apart), or empty when fewer than
    OPTIMIZER_MIN_RUNS runs: one optimizer.step() is no loop."""
    return _run_ends(np.flatnonzero(optimizer))


def _run_ends(pos: np.ndarray) -> np.ndarray:
    """:func:`optimizer_run_ends` from the optimizer kernels' positions (sorted)."""
    if not len(pos):
        return pos
    ends = np.r_[pos[:-1][np.diff(pos) > OPTIMIZER_RUN_GAP], pos[-1]]
    return ends if len(ends) >= OPTIMIZER_MIN_RUNS else np.empty(0, dtype=np.int64)


def _same_profiler_step(h: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per optimizer-run end (positions into ``h``, the ProfilerStep hint of one device's
    kernels in order): True when that optimizer kernel's ProfilerStep window also launched
    every hinted kernel up to the next run end (or the device's last kernel). The profiler's
    step is the engine's own count: kernels the loop launches after optimizer.step() inside
    the same window (TorchRec's pipeline starting the next batch's input work: the A100 trace's
    last 448 kernels, in ProfilerStep#554 after its Adam run) stay in that step."""
    stops = np.r_[ends[1:], len(h) - 1]
    out = np.zeros(len(ends), dtype=bool)
    for i, (j, stop) in enumerate(zip(ends.tolist(), stops.tolist())):
        nxt = h[j + 1:stop + 1]
        nxt = nxt[nxt >= 0]
        out[i] = h[j] >= 0 and len(nxt) > 0 and bool((nxt == h[j]).all())
    return out


# Bits of the per-kernel flags of the step cut's scan (aggregator/native/ridgeline_fold.c,
# rl_segment_scan: the same values).
SEG_ATT, SEG_TOK, SEG_TOK_STRONG, SEG_END, SEG_OPT = 1, 2, 4, 8, 16


def _flag_bits(c, opt_of: np.ndarray) -> np.ndarray:
    """SEG_* bits from classes (per-name or per-kernel arrays alike)."""
    role = c.role
    f = np.where(role == ROLE_ATTENTION, SEG_ATT, 0).astype(np.uint8)
    tok = role == ROLE_PER_TOKEN
    f |= np.where(tok, SEG_TOK, 0).astype(np.uint8)
    f |= np.where(tok & (c.grid_rule == GRID_TOKENS) & (c.strength == STRONG), SEG_TOK_STRONG, 0).astype(np.uint8)
    f |= np.where(np.asarray(c.step_end, dtype=bool), SEG_END, 0).astype(np.uint8)
    f |= np.where(opt_of[np.where(c.sig >= 0, c.sig, len(opt_of) - 1)], SEG_OPT, 0).astype(np.uint8)
    return f


def _scan_flags(classes) -> tuple[np.ndarray, bool]:
    """(flags, by_name) for :func:`fold_native.segment_scan`: per name slot when the classes
    are gathered from per-name arrays (the stream phaser's: no per-kernel array at all;
    computed once per state of its name table, in the classes' ``memo``), else per kernel."""
    per_name = getattr(classes, "per_name", None)
    memo = getattr(classes, "memo", None) if per_name is not None else None
    if memo is not None and "scan_flags" in memo:
        # The stream phaser's per-name flags, kept while its name table stays the same.
        return memo["scan_flags"], True
    opt_of = np.array([sg.id == "optimizer" for sg in classes.signatures] + [False], dtype=bool)
    if per_name is not None:
        flags = _flag_bits(per_name(), opt_of)
        if memo is not None:
            memo["scan_flags"] = flags
        return flags, True
    return _flag_bits(classes, opt_of), False


def _scan_reference(k: np.ndarray, idx: np.ndarray, whole: bool, classes: KernelClasses, optimizer: np.ndarray):
    """The numpy reference of ``rl_segment_scan`` (aggregator/native/ridgeline_fold.c) over
    the kernels ``k[idx]`` in time order: the same tuple as :func:`fold_native.segment_scan`."""
    def col(a):
        return a if whole else a[idx]
    gaps = _idle_gaps(col(k["start_ns"]), col(k["end_ns"]))
    role = col(classes.role)
    att = np.flatnonzero(role == ROLE_ATTENTION)
    nid = col(k["name_id"])
    grid_x = col(k["grid_x"])
    tok = np.flatnonzero((role == ROLE_PER_TOKEN) & (col(classes.grid_rule) == GRID_TOKENS)
                         & (col(classes.strength) == STRONG) & (grid_x > 0))
    layer = np.flatnonzero((role == ROLE_ATTENTION) | (role == ROLE_PER_TOKEN))
    ends = np.flatnonzero(col(classes.step_end))
    gid = col(k["graph_id"])
    first = np.empty(0, dtype=np.int64)
    if bool((gid >= 0).any()):
        corr = col(k["correlation_id"])
        first = np.flatnonzero((gid >= 0) & np.concatenate(([True], (corr[1:] != corr[:-1])
                                                            | (gid[1:] != gid[:-1]))))
    return (gaps, att, nid[att].astype(np.int64), tok, grid_x[tok].astype(np.int64), layer, ends,
            np.flatnonzero(col(optimizer)), first, gid[first])


def segment_kernels(trace: Trace, classes: KernelClasses, mask: np.ndarray | None = None,
                    hint: np.ndarray | None = None, hint_name: str = "profiler step",
                    launch: np.ndarray | None = None) -> Segmentation:
    """Cut the kernels selected by ``mask`` into steps, per device, from the kernels alone.

    ``hint`` (optional, per kernel, -1 = no information) is a weak grouping such as the ProfilerStep
    range each kernel fell in; a change of hint between consecutive kernels is a boundary.
    Boundaries, each recorded as the reason its step starts:

    * idle gap >= max(GAP_MIN_NS, GAP_MEDIAN_FACTOR x median gap of the device), except
      inside a running layer pattern (the layer markers around the gap are one usual
      layer apart) unless the gap reaches GAP_INSIDE_LAYERS_NS, and except where one host
      thread launched the kernels on both sides at most HOST_TOGETHER_NS apart (``launch``:
      the launch record of each kernel, :func:`launch_index`, computed when needed);
    * the grid.x of the KV-cache-write kernels (= tokens in the step) changes: cut at the
      largest idle gap between the two launches;
    * a sampling kernel (runs once at the end of a step) followed by more layer kernels:
      cut at the largest idle gap after it;
    * the per-layer pattern restarts: an interval between consecutive layer markers
      (attention launches, else the most regularly recurring kernel name: an eager model's
      softmax) that holds clearly more kernels than the usual per-layer interval: cut at
      its largest idle gap;
    * a CUDA graph launched again (same graph id seen earlier in the current step);
    * the hint changes;
    * on a training device (at least OPTIMIZER_MIN_RUNS optimizer runs: :func:`optimizer_kernels`)
      only the end of each optimizer run: a training iteration's forward, backward and
      optimizer hold idle gaps and repeated layer patterns of their own (the A100 TorchRec
      trace: 5 iterations were cut into 19), and its optimizer.step() ends it.
    """
    k = trace.kernels
    n = len(k)
    kernel_step = np.full(n, -1, dtype=np.int32)
    segments: list[Segment] = []
    sel = mask                          # None: every kernel
    if not n or (sel is not None and not sel.any()):
        return Segmentation(kernel_step, segments)
    device = k["device"]
    ref = fold_native.REFERENCE
    end = None
    groups = None                       # per device, its records' indices (several devices)
    if mask is None and not ref:
        # One pass over the packed records: the devices, and the ends the segments' spans read.
        end, d0, d1 = fold_native.end_and_devices(k)
        if d0 == d1:
            devices = [d0]
        else:
            # Several devices: their records grouped in two native passes (np.unique's sort
            # and a pass over every record per device took a seventh of the fold at 8 GPUs).
            grouped = fold_native.device_groups(k, d0, d1)
            if grouped is not None:
                devices, groups = grouped
            else:
                devices = distinct(device)
    else:
        devices = distinct(device if mask is None else device[sel])
    # The per-kernel pass (gaps and the positions of the kernel kinds the rules read): one
    # native pass over the records (fold_native.segment_scan), or its numpy reference.
    optimizer = flags = None
    by_name = False
    if ref:
        optimizer = optimizer_kernels(classes)
    else:
        flags, by_name = _scan_flags(classes)
    for di, dev in enumerate(devices):
        if groups is not None:
            idx = groups[di]
        elif sel is None:
            idx = np.arange(n) if len(devices) == 1 else np.flatnonzero(device == dev)
        else:
            idx = np.flatnonzero(sel if len(devices) == 1 else sel & (device == dev))
        whole = len(idx) == n           # every kernel, in batch order (so far)
        scan = None if ref else fold_native.segment_scan(k, None if whole else idx, flags, by_name)
        if scan is None:
            s = k["start_ns"][idx]
            if len(idx) > 1 and not bool((s[1:] >= s[:-1]).all()):
                o = np.lexsort((idx, s))
                idx = idx[o]
                whole = False
            scan = _scan_reference(k, idx, whole, classes, optimizer) if ref else \
                fold_native.segment_scan(k, idx, flags, by_name)
        gaps, att, att_nid, tok, gx, layer, ends, opt_at, graph_at, graph_ids = scan
        m = len(idx)

        def col(a, idx=idx, whole=whole):
            return a if whole else a[idx]
        cut = np.zeros(max(m - 1, 0), dtype=bool)
        reason: dict[int, str] = {}     # boundary after kernel j -> why (only where cut)
        if m > 1:
            layer_at, per_layer, marker_name = _layer_marker_at(att, att_nid, m, lambda: col(k["name_id"]))
            limit = per_layer + max(PATTERN_MIN_EXTRA, per_layer // 4)
            # Only gaps of at least GAP_MIN_NS can reach the threshold: the median and the
            # layer-interval test are computed when there are any (a serving stream's steps
            # rarely leave the GPU idle that long, and they were passes over every kernel).
            at = np.flatnonzero(gaps >= GAP_MIN_NS)
            thr = float(GAP_MIN_NS)
            if len(at):
                med = float(np.median(gaps))
                thr = max(GAP_MIN_NS, GAP_MEDIAN_FACTOR * med)
                at = at[gaps[at] >= thr]
            if len(at) and len(layer_at) > PATTERN_MIN_REPEATS:
                # Gap j (after kernel j) lies inside a layer interval when the markers around
                # it are at most one usual layer apart.
                nxt = np.searchsorted(layer_at, at + 1, side="left")
                ok = (nxt > 0) & (nxt < len(layer_at))
                a = layer_at[np.maximum(nxt - 1, 0)]
                b_ = layer_at[np.minimum(nxt, len(layer_at) - 1)]
                inside = ok & (b_ - a <= limit)
                at = at[~inside | (gaps[at] >= GAP_INSIDE_LAYERS_NS)]
            if len(at) and len(trace.api):
                at = at[~_launched_together(trace, idx[at], idx[at + 1], launch)]
            _mark(cut, reason, at, [f"GPU idle {g / 1e6:.1f} ms (>= {thr / 1e6:.1f} ms)" for g in gaps[at].tolist()])
            # Token count change of the KV-cache writes (strong per-token kernels only:
            # they run once per layer on exactly the step's tokens).
            if len(tok) > 1:
                c = np.flatnonzero(gx[1:] != gx[:-1])
                c = c[tok[c + 1] > tok[c]]
                _mark(cut, reason, _argmax_in_ranges(gaps, tok[c], tok[c + 1]),
                      [f"tokens per step change ({a} -> {b}, KV-cache write grid.x)"
                       for a, b in zip(gx[c].tolist(), gx[c + 1].tolist())])
            if not len(layer) and marker_name >= 0:
                layer = layer_at
            # Sampling closes a step when layer kernels follow it.
            if len(ends) and len(layer):
                nxt = np.searchsorted(layer, ends, side="right")
                ok = nxt < len(layer)
                lo, hi = ends[ok], layer[nxt[ok]]
                _mark(cut, reason, _argmax_in_ranges(gaps, lo, hi),
                      ["previous step ended with a sampling kernel"] * len(lo))
            # Layer pattern restart.
            if len(layer_at) > PATTERN_MIN_REPEATS:
                d = np.diff(layer_at)
                c = np.flatnonzero(d > limit)
                what = "attention" if marker_name < 0 else short_name(trace.names[marker_name], 40)
                _mark(cut, reason, _argmax_in_ranges(gaps, layer_at[c], layer_at[c + 1]),
                      [f"layer pattern restarts ({n} kernels between {what} launches, {per_layer} per layer)"
                       for n in d[c].tolist()])
            # CUDA graph relaunch: a graph id already seen in the current step. Sequential
            # (each cut resets what was seen), so one pass over graph launches, not kernels.
            seen: set[int] = set()
            for j, g in zip(graph_at.tolist(), graph_ids.tolist()):
                if j > 0 and cut[j - 1]:
                    seen = set()
                if g in seen and j > 0:
                    cut[j - 1] = True
                    prev = reason.get(j - 1, "")
                    reason[j - 1] = (prev + "; " if prev else "") + f"CUDA graph {g} launched again"
                    seen = set()
                seen.add(g)
            if hint is not None:
                # Only hinted kernels count: a kernel outside every hint range (another
                # thread's launch, an orphan) says nothing about where the step ends.
                hk = np.flatnonzero(hint[idx] != -1)
                if len(hk) > 1:
                    hv = hint[idx][hk]
                    c = np.flatnonzero(hv[1:] != hv[:-1])
                    _mark(cut, reason, _argmax_in_ranges(gaps, hk[c], hk[c + 1]),
                          [f"{hint_name} boundary"] * len(c))
            all_ends = _run_ends(opt_at)
            opt_ends = all_ends[all_ends < m - 1]
            if len(all_ends):
                cut[:] = False
                reason = {}
                if hint is not None and len(opt_ends):
                    opt_ends = opt_ends[~_same_profiler_step(hint[idx], opt_ends)]
                _mark(cut, reason, opt_ends, ["previous training step ended with its optimizer run "
                                              f"({short_name(trace.names[int(k['name_id'][idx[j]])], 40)})"
                                              for j in opt_ends.tolist()])
        starts = np.concatenate(([0], np.flatnonzero(cut) + 1))
        stops = np.concatenate((starts[1:], [m]))
        base = len(segments)
        step_of = np.repeat(np.arange(len(starts), dtype=np.int32) + base, stops - starts)
        if whole:                       # idx is every kernel in batch order
            kernel_step[:] = step_of
        else:
            kernel_step[idx] = step_of
        if ref:
            e = col(k["end_ns"])
        elif end is not None:
            e = end if whole else end[idx]
        else:
            e = fold_native.gather(k, "end_ns", None if whole else idx)
        seg_end = np.maximum.reduceat(e, starts)
        dv = int(dev)
        for a0, s0, e0 in zip(starts.tolist(), k["start_ns"][idx[starts]].tolist(), seg_end.tolist()):
            segments.append(Segment(dv, s0, e0, [reason[a0 - 1] if a0 else "first kernel on the device"]))
    return Segmentation(kernel_step, segments)
