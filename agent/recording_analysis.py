"""Analysis of an agent recording segment by segment, in bounded memory.

:func:`analyze_recording` reads a recording once (``agent.recording.iter_segments``),
analyses each segment as it arrives and keeps only its document, so memory is one
segment's events whatever the recording's length. :func:`combine` folds the segment
documents into one document of the same shape as a trace's (``ridgeline analyze``
keys), plus a ``recording`` object:

* sums (kernels, kernel time, busy, idle, gaps, FLOPs, bytes, copies) are exact;
  ratios and achieved rates are recomputed from the sums;
* percentiles (idle gaps, launch latency, median kernel) cannot be combined exactly:
  they are those of the segment with the most kernel time for that figure, and the
  document says so (``percentiles_from_segment``);
* a phase's verdict and evidence are those of its longest segment;
* the time between two segments cut at an agent restart or at lost ``events``
  messages is the agent's own downtime: it is in no span or idle figure, and is
  reported as ``recording.downtime_ns`` with the restarts and gaps;
* steps are renumbered across segments; at most :data:`MAX_STEPS_KEPT` are listed
  (``steps_total`` counts them all).
"""
from __future__ import annotations

from pathlib import Path

import msgspec
from msgspec import UNSET

from ridgeline.aggregator.analysis import (
    Analysis,
    Copies,
    IdleGaps,
    LaunchLatency,
    PhaseAnalysis,
    RecordingFacts,
    RecordingRequests,
    RecordingSegment,
    TopKernel,
    WorkSource,
)

MAX_STEPS_KEPT = 2000
MAX_SEGMENTS_LISTED = 200

#: The phase figures that add across segments (the others are recomputed from them, or
#: are those of the phase's longest segment).
_PHASE_SUMS = ("kernel_time_ns", "busy_ns", "kernels", "steps", "window_ns", "idle_ns", "gaps",
               "flops", "bytes", "work_busy_ns")
_WORK_SUMS = ("flops", "bytes", "busy_ns", "kernels")


def analyze_recording(path: str | Path, analyze_one, max_memory_bytes: int | None = None,
                      segments=None, fmt: str = "ridgeline-recording") -> Analysis:
    """One document for a recording: ``analyze_one(trace) -> Analysis`` per segment, combined.
    ``segments(max_memory_bytes, summary)``: the segment iterator (default: the ``.rlrec``
    file's, agent.recording.iter_segments; a Parquet recording gives its own).
    InputError when the recording holds no events and is cut off or has no frame at all."""
    from ridgeline.probes.errors import InputError

    from .recording import StreamSummary, iter_segments
    summary = StreamSummary()
    docs: list[Analysis] = []
    segs: list[RecordingSegment] = []
    if segments is None:
        segments = lambda mm, sm: iter_segments(path, mm, summary=sm)  # noqa: E731
    for seg in segments(max_memory_bytes, summary):
        docs.append(analyze_one(seg.trace))
        k = seg.trace.kernels
        segs.append(RecordingSegment(index=seg.index, started_by=seg.started_by, batches=seg.batches,
                                     kernels=int(len(k)),
                                     start_ns=int(k["start_ns"].min()) if len(k) else None,
                                     end_ns=int(k["end_ns"].max()) if len(k) else None))
        del seg
    if not docs and not summary.windows and (summary.truncated or not summary.messages):
        # Nothing to report on (no events, no window the agent judged) and the file says
        # why: cut off (a recorder killed early, a partial copy) or no frame at all. Exit 2
        # with that, not a report of 0 kernels.
        n = sum(summary.messages.values())
        why = ("truncated recording: it ends inside a frame" if summary.truncated
               else "empty recording: no frame after its header")
        raise InputError(f"{path}: {why}; {n} complete message(s) before that, no events or windows "
                         "among them (nothing to analyse)")
    if not docs:     # no events at all: the report of an empty trace, with the recording's facts
        from ridgeline.probes.events import Trace
        docs.append(analyze_one(Trace(meta={"path": str(path), "format": fmt})))
    rec = RecordingFacts(segments=len(segs), restarts=summary.restarts, gaps=dict(summary.gaps),
                         messages=dict(summary.messages), truncated=summary.truncated,
                         hosts=sorted(h for h in summary.hosts if h))
    doc = combine(docs, segs, rec)
    if summary.requests_told:
        # the agent's request join (issue 22): the slowest requests with their segments and
        # culprits, as `ridgeline requests` showed them live
        doc.requests = RecordingRequests(told=summary.requests_told, slowest=summary.slowest_requests)
    last = _last_window_verdicts(summary.last_window)
    if last:
        # the agent's own judgement, with the engine and scheduler figures a trace lacks
        doc.answer = last
        doc.answer_title = "Answer (the recording's last window, as the agent judged it)"
    return doc


def _last_window_verdicts(payload) -> list:
    from ridgeline.aggregator import wire
    from ridgeline.aggregator.answer import verdict_records
    from ridgeline.probes.errors import InputError

    from .subscriber import decode_payload
    if payload is None:
        return []
    if isinstance(payload, dict):        # already decoded (a Parquet recording's verdicts)
        return verdict_records(payload.get("verdict"))
    try:
        w = decode_payload(wire, "window", payload)
    except InputError:
        return []       # a torn last window: the trace's own answer stands
    return verdict_records(w.get("verdict") if isinstance(w, dict) else None)


def _downtime_ns(segs: list[RecordingSegment]) -> int:
    """Time between segments that start at a restart or after lost events messages."""
    total = 0
    prev_end = None
    for s in segs:
        if s.start_ns is None:
            continue
        if prev_end is not None and s.started_by in ("restart", "gap") and s.start_ns > prev_end:
            total += s.start_ns - prev_end
        prev_end = s.end_ns if prev_end is None else max(prev_end, s.end_ns)
    return total


def _longest(docs: list, key):
    best, best_v = None, -1
    for d in docs:
        v = key(d)
        if v is not None and v > best_v:
            best, best_v = d, v
    return best


def _combine_phase(parts: list[tuple[int, PhaseAnalysis]]) -> PhaseAnalysis:
    """One phase over segments: sums added, rates recomputed from them, the rest (verdict,
    evidence, percentiles) of the segment with the most kernel time."""
    base_i, base = max(parts, key=lambda x: x[1].kernel_time_ns)
    sums = {}
    for k in _PHASE_SUMS:
        vals = [getattr(p, k) for _, p in parts if isinstance(getattr(p, k), (int, float))]
        if vals:
            sums[k] = sum(vals)
    out = msgspec.structs.replace(base, **sums)
    _recompute_rates(out)
    by_src = _combine_work([p for _, p in parts])
    if by_src:
        out.work_by_source = by_src
    out.top_kernels = _combine_top_kernels([p for _, p in parts])
    if len(parts) > 1:
        out.evidence = list(base.evidence) + [
            f"verdict of segment {base_i} (the longest of {len(parts)} with this phase)"]
        out.percentiles_from_segment = base_i
    return out


def _recompute_rates(out: PhaseAnalysis) -> None:
    """The phase's ratios and achieved rates, from its summed figures (in place)."""
    if out.window_ns:
        out.idle_ratio = out.idle_ns / out.window_ns
    wb = out.work_busy_ns
    if wb and out.flops is not None:
        out.achieved_flops_per_s = out.flops / (wb / 1e9)
    if wb and out.bytes is not None:
        out.achieved_bytes_per_s = out.bytes / (wb / 1e9)
    if out.flops is not None and out.bytes:
        out.arithmetic_intensity = out.flops / out.bytes
    if out.kernel_time_ns and out.work_busy_ns is not None:
        out.work_coverage_ratio = out.work_busy_ns / out.kernel_time_ns
    if out.peak_flops_per_s and out.achieved_flops_per_s is not None:
        out.pct_of_peak_flops = 100.0 * out.achieved_flops_per_s / out.peak_flops_per_s
    if out.peak_bytes_per_s and out.achieved_bytes_per_s is not None:
        out.pct_of_peak_bytes = 100.0 * out.achieved_bytes_per_s / out.peak_bytes_per_s


def _combine_work(parts: list[PhaseAnalysis]) -> dict[str, WorkSource]:
    """Work per source over segments: each segment's sums added once; a source's other
    figures (coverage, dtype, notes) are those of its first segment."""
    by_src: dict[str, WorkSource] = {}
    for p in parts:
        for src, w in p.work_by_source.items():
            acc = by_src.get(src)
            if acc is None:
                by_src[src] = msgspec.structs.replace(w)
                continue
            for k in _WORK_SUMS:
                v = getattr(w, k)
                if isinstance(v, (int, float)):
                    setattr(acc, k, (getattr(acc, k) if getattr(acc, k) is not UNSET else 0) + v)
    return by_src


def _combine_top_kernels(parts: list[PhaseAnalysis]) -> list[TopKernel]:
    """Kernels by name over segments, counts, times and work added, rates recomputed; as
    many as the longest list."""
    tops: dict[str, TopKernel] = {}
    for p in parts:
        for t in p.top_kernels:
            acc = tops.get(t.name)
            if acc is None:
                tops[t.name] = msgspec.structs.replace(t)
                continue
            acc.count += t.count
            acc.time_ns += t.time_ns
            if t.flops is not None:
                acc.flops = (acc.flops or 0) + t.flops
            if t.bytes is not None:
                acc.bytes = (acc.bytes or 0) + t.bytes
    for t in tops.values():
        if t.time_ns:
            if t.flops is not None:
                t.achieved_flops_per_s = t.flops / (t.time_ns / 1e9)
            if t.bytes is not None:
                t.achieved_bytes_per_s = t.bytes / (t.time_ns / 1e9)
    n_top = max((len(p.top_kernels) for p in parts), default=0)
    return sorted(tops.values(), key=lambda t: -(t.time_ns or 0))[:n_top]


def _combine_gaps(parts: list[IdleGaps]) -> IdleGaps:
    """One device's idle gaps over segments: sums added; percentiles of the longest."""
    best = max(parts, key=lambda g: g.span_ns)
    span = sum(x.span_ns for x in parts)
    idle = sum(x.idle_ns for x in parts)
    mx = [x.gap_max_ns for x in parts if x.gap_max_ns is not None]
    hist: dict[str, int] = {}
    for x in parts:
        for k, v in x.gap_histogram.items():
            hist[k] = hist.get(k, 0) + v
    g = msgspec.structs.replace(best, span_ns=span, busy_ns=sum(x.busy_ns for x in parts), idle_ns=idle,
                                gaps=sum(x.gaps for x in parts), idle_ratio=idle / span if span else None,
                                gap_max_ns=max(mx) if mx else None, gap_histogram=hist)
    if len(parts) > 1:
        g.percentiles_from_segment = "longest"
    return g


def _combine_latency(docs: list[Analysis]) -> LaunchLatency:
    """Launch latency over segments: kernels added, the mean weighted by them, the
    percentiles of the segment with the most kernels."""
    ll = [d.launch_latency for d in docs]
    best = _longest(ll, lambda x: x.kernels)
    k = sum(x.kernels for x in ll)
    lat = msgspec.structs.replace(best, kernels=k)
    means = [(x.mean_ns, x.kernels) for x in ll if x.mean_ns is not None]
    if means and k:
        lat.mean_ns = sum(m * w for m, w in means) / max(sum(w for _, w in means), 1)
    return lat


def _combine_copies(docs: list[Analysis]) -> list[Copies]:
    """Copy traffic by kind and direction over segments, most time first."""
    copies: dict[tuple, Copies] = {}
    for d in docs:
        for c in d.copies:
            acc = copies.get((c.kind, c.direction))
            if acc is None:
                copies[(c.kind, c.direction)] = msgspec.structs.replace(c)
                continue
            acc.count += c.count
            acc.bytes += c.bytes
            acc.time_ns += c.time_ns
    for c in copies.values():
        if c.time_ns:
            c.achieved_bytes_per_s = c.bytes / (c.time_ns / 1e9)
    return sorted(copies.values(), key=lambda c: -c.time_ns)


def combine(docs: list[Analysis], segs: list[RecordingSegment], recording: RecordingFacts) -> Analysis:
    """Fold per-segment analysis documents into one (see the module docstring)."""
    rec = msgspec.structs.replace(recording, downtime_ns=_downtime_ns(segs), segment_list=segs[:MAX_SEGMENTS_LISTED])
    if not docs:
        out = Analysis(steps_total=0, recording=rec)
        out.gpu.ceilings_from = "no events in the recording"
        return out
    first = docs[0]
    gpu_doc = _longest(docs, lambda d: d.kernel_time_ns if d.gpu.has_ceilings else None)
    out = msgspec.structs.replace(
        first, kernels=sum(d.kernels for d in docs), kernel_time_ns=sum(d.kernel_time_ns for d in docs),
        span_ns=sum(d.span_ns for d in docs), simulated=any(d.simulated for d in docs),
        gpu=(gpu_doc or first).gpu)

    phases: dict[str, list] = {}
    for i, d in enumerate(docs):
        for name, p in d.phases.items():
            phases.setdefault(name, []).append((i, p))
    out.phases = {name: _combine_phase(parts) for name, parts in phases.items()}
    total = sum(p.kernel_time_ns for p in out.phases.values())
    for p in out.phases.values():
        if total:
            p.share_of_gpu_time_ratio = p.kernel_time_ns / total

    steps, n = [], 0
    for d in docs:
        for s in d.steps:
            if len(steps) < MAX_STEPS_KEPT:
                steps.append(msgspec.structs.replace(s, index=n))
            n += 1
    out.steps = steps
    out.steps_total = n

    gaps: dict[str, list[IdleGaps]] = {}
    for d in docs:
        for dev, g in d.idle_gaps.items():
            gaps.setdefault(dev, []).append(g)
    out.idle_gaps = {dev: _combine_gaps(parts) for dev, parts in gaps.items()}
    out.launch_latency = _combine_latency(docs)
    out.copies = _combine_copies(docs)
    out.recording = rec
    return out
