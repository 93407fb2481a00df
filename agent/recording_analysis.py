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

MAX_STEPS_KEPT = 2000
MAX_SEGMENTS_LISTED = 200

_PHASE_SUMS = ("kernel_time_ns", "busy_ns", "kernels", "steps", "window_ns", "idle_ns", "gaps",
               "flops", "bytes", "work_busy_ns")


def analyze_recording(path: str | Path, analyze_one, max_memory_bytes: int | None = None,
                      segments=None, fmt: str = "ridgeline-recording") -> dict:
    """One document for a recording: ``analyze_one(trace) -> dict`` per segment, combined.
    ``segments(max_memory_bytes, summary)``: the segment iterator (default: the ``.rlrec``
    file's, agent.recording.iter_segments; a Parquet recording gives its own).
    InputError when the recording holds no events and is cut off or has no frame at all."""
    from ridgeline.probes.errors import InputError

    from .recording import StreamSummary, iter_segments
    summary = StreamSummary()
    docs, segs = [], []
    if segments is None:
        segments = lambda mm, sm: iter_segments(path, mm, summary=sm)  # noqa: E731
    for seg in segments(max_memory_bytes, summary):
        docs.append(analyze_one(seg.trace))
        k = seg.trace.kernels
        segs.append({"index": seg.index, "started_by": seg.started_by, "batches": seg.batches,
                     "kernels": int(len(k)),
                     "start_ns": int(k["start_ns"].min()) if len(k) else None,
                     "end_ns": int(k["end_ns"].max()) if len(k) else None})
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
    rec = {"segments": len(segs), "restarts": summary.restarts, "gaps": dict(summary.gaps),
           "messages": dict(summary.messages), "truncated": summary.truncated,
           "hosts": sorted(h for h in summary.hosts if h)}
    doc = combine(docs, segs, rec)
    if summary.requests_told:
        # the agent's request join (issue 22): the slowest requests with their segments and
        # culprits, as `ridgeline requests` showed them live
        doc["requests"] = {"told": summary.requests_told, "slowest": summary.slowest_requests}
    last = _last_window_verdicts(summary.last_window)
    if last:
        # the agent's own judgement, with the engine and scheduler figures a trace lacks
        doc["answer"] = last
        doc["answer_title"] = "Answer (the recording's last window, as the agent judged it)"
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


def _downtime_ns(segs: list[dict]) -> int:
    """Time between segments that start at a restart or after lost events messages."""
    total = 0
    prev_end = None
    for s in segs:
        if s["start_ns"] is None:
            continue
        if prev_end is not None and s["started_by"] in ("restart", "gap") and s["start_ns"] > prev_end:
            total += s["start_ns"] - prev_end
        prev_end = s["end_ns"] if prev_end is None else max(prev_end, s["end_ns"])
    return total


def _longest(docs: list[dict], key) -> dict | None:
    best, best_v = None, -1
    for d in docs:
        v = key(d)
        if v is not None and v > best_v:
            best, best_v = d, v
    return best


def _combine_phase(name: str, parts: list[tuple[int, dict]]) -> dict:
    base_i, base = max(parts, key=lambda x: x[1].get("kernel_time_ns", 0))
    out = dict(base)
    for k in _PHASE_SUMS:
        vals = [p.get(k) for _, p in parts if isinstance(p.get(k), (int, float))]
        if vals:
            out[k] = sum(vals)
    if out.get("window_ns"):
        out["idle_ratio"] = out.get("idle_ns", 0) / out["window_ns"]
    wb = out.get("work_busy_ns")
    flops, byts = out.get("flops"), out.get("bytes")
    if wb and flops is not None:
        out["achieved_flops_per_s"] = flops / (wb / 1e9)
    if wb and byts is not None:
        out["achieved_bytes_per_s"] = byts / (wb / 1e9)
    if flops is not None and byts:
        out["arithmetic_intensity"] = flops / byts
    if out.get("kernel_time_ns") and out.get("work_busy_ns") is not None:
        out["work_coverage_ratio"] = out["work_busy_ns"] / out["kernel_time_ns"]
    for peak, ach, pct in (("peak_flops_per_s", "achieved_flops_per_s", "pct_of_peak_flops"),
                           ("peak_bytes_per_s", "achieved_bytes_per_s", "pct_of_peak_bytes")):
        if out.get(peak) and out.get(ach) is not None:
            out[pct] = 100.0 * out[ach] / out[peak]
    by_src: dict[str, dict] = {}
    for _, p in parts:
        for src, w in (p.get("work_by_source") or {}).items():
            acc = by_src.setdefault(src, dict(w))
            if acc is not w:
                for k in ("flops", "bytes", "busy_ns", "kernels"):
                    if isinstance(w.get(k), (int, float)):
                        acc[k] = acc.get(k, 0) + w[k]
    if by_src:
        out["work_by_source"] = by_src
    tops: dict[str, dict] = {}
    for _, p in parts:
        for t in p.get("top_kernels") or []:
            acc = tops.get(t["name"])
            if acc is None:
                tops[t["name"]] = dict(t)
                continue
            for k in ("count", "time_ns", "flops", "bytes"):
                if isinstance(t.get(k), (int, float)):
                    acc[k] = (acc.get(k) or 0) + t[k]
    for t in tops.values():
        if t.get("time_ns"):
            for k, r in (("flops", "achieved_flops_per_s"), ("bytes", "achieved_bytes_per_s")):
                if isinstance(t.get(k), (int, float)):
                    t[r] = t[k] / (t["time_ns"] / 1e9)
    n_top = max((len(p.get("top_kernels") or []) for _, p in parts), default=0)
    out["top_kernels"] = sorted(tops.values(), key=lambda t: -(t.get("time_ns") or 0))[:n_top]
    if len(parts) > 1:
        out["evidence"] = list(base.get("evidence") or []) + [
            f"verdict of segment {base_i} (the longest of {len(parts)} with this phase)"]
        out["percentiles_from_segment"] = base_i
    return out


def combine(docs: list[dict], segs: list[dict], recording: dict) -> dict:
    """Fold per-segment analysis documents into one (see the module docstring)."""
    rec = dict(recording)
    rec["downtime_ns"] = _downtime_ns(segs)
    rec["segment_list"] = segs[:MAX_SEGMENTS_LISTED]
    if not docs:
        return {"kernels": 0, "kernel_time_ns": 0, "span_ns": 0, "phases": {}, "steps": [],
                "steps_total": 0, "idle_gaps": {}, "launch_latency": {}, "copies": [],
                "gpu": {"ceilings_from": "no events in the recording"}, "recording": rec,
                "simulated": False}
    first = docs[0]
    out = {k: v for k, v in first.items()}
    out["kernels"] = sum(d.get("kernels", 0) for d in docs)
    out["kernel_time_ns"] = sum(d.get("kernel_time_ns", 0) for d in docs)
    out["span_ns"] = sum(d.get("span_ns", 0) for d in docs)
    out["simulated"] = any(d.get("simulated") for d in docs)
    gpu_doc = _longest(docs, lambda d: d.get("kernel_time_ns", 0) if d.get("gpu", {}).get("key") else None)
    out["gpu"] = (gpu_doc or first).get("gpu")

    phases: dict[str, list] = {}
    for i, d in enumerate(docs):
        for name, p in (d.get("phases") or {}).items():
            phases.setdefault(name, []).append((i, p))
    out["phases"] = {name: _combine_phase(name, parts) for name, parts in phases.items()}
    total = sum(p.get("kernel_time_ns", 0) for p in out["phases"].values())
    for p in out["phases"].values():
        if total:
            p["share_of_gpu_time_ratio"] = p.get("kernel_time_ns", 0) / total

    steps, n = [], 0
    for d in docs:
        for s in d.get("steps") or []:
            if len(steps) < MAX_STEPS_KEPT:
                s = dict(s)
                s["index"] = n
                steps.append(s)
            n += 1
    out["steps"] = steps
    out["steps_total"] = n

    gaps: dict[str, dict] = {}
    for d in docs:
        for dev, g in (d.get("idle_gaps") or {}).items():
            parts = gaps.setdefault(dev, [])
            parts.append(g)
    out["idle_gaps"] = {}
    for dev, parts in gaps.items():
        best = max(parts, key=lambda g: g.get("span_ns", 0))
        g = dict(best)
        for k in ("span_ns", "busy_ns", "idle_ns", "gaps"):
            g[k] = sum(x.get(k, 0) for x in parts)
        g["idle_ratio"] = g["idle_ns"] / g["span_ns"] if g["span_ns"] else None
        mx = [x.get("gap_max_ns") for x in parts if x.get("gap_max_ns") is not None]
        g["gap_max_ns"] = max(mx) if mx else None
        hist: dict[str, int] = {}
        for x in parts:
            for k, v in (x.get("gap_histogram") or {}).items():
                hist[k] = hist.get(k, 0) + v
        g["gap_histogram"] = hist
        if len(parts) > 1:
            g["percentiles_from_segment"] = "longest"
        out["idle_gaps"][dev] = g

    ll = [d.get("launch_latency") or {} for d in docs]
    best = _longest(ll, lambda x: x.get("kernels", 0))
    if best:
        lat = dict(best)
        k = sum(x.get("kernels", 0) for x in ll)
        lat["kernels"] = k
        means = [(x.get("mean_ns"), x.get("kernels", 0)) for x in ll if x.get("mean_ns") is not None]
        if means and k:
            lat["mean_ns"] = sum(m * w for m, w in means) / max(sum(w for _, w in means), 1)
        out["launch_latency"] = lat

    copies: dict[tuple, dict] = {}
    for d in docs:
        for c in d.get("copies") or []:
            key = (c.get("kind"), c.get("direction"))
            acc = copies.get(key)
            if acc is None:
                copies[key] = dict(c)
                continue
            for k in ("count", "bytes", "time_ns"):
                acc[k] = acc.get(k, 0) + c.get(k, 0)
    for c in copies.values():
        if c.get("time_ns"):
            c["achieved_bytes_per_s"] = c.get("bytes", 0) / (c["time_ns"] / 1e9)
    out["copies"] = sorted(copies.values(), key=lambda c: -c.get("time_ns", 0))
    out["recording"] = rec
    return out
