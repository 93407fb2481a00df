"""Perfetto-loadable Chrome-trace JSON of a Trace, with a phase track added.

:func:`write_perfetto` writes the trace's kernels, copies, API calls, CPU operators and
ranges as complete ("X") events, plus a process "Ridgeline phases" with one thread per
device whose slices are the steps (name = phase, args = step index, tokens, evidence).
Every kernel slice carries ``args.phase`` and ``args.step``. Timestamps are microseconds
(Chrome JSON's unit) relative to the first event, with nanosecond decimals.

The events are built per column with numpy and serialised with orjson; the only Python
loop is over event records when forming the dicts orjson writes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson

from ridgeline.probes.errors import InputError
from ridgeline.probes.events import API_CATEGORY_NAMES, COPY_DIRECTION_NAMES, RANGE_KIND_NAMES, Trace

PHASE_PID = 1_000_000_000       # synthetic pid of the phase track, away from real pids
GPU_PID_BASE = 1_000_000_100    # synthetic pids of GPU devices


def _us(ns: np.ndarray, t0: int) -> np.ndarray:
    return (ns.astype(np.int64) - t0) / 1e3


def build_events(trace: Trace, kernel_phase: np.ndarray, kernel_step: np.ndarray, steps: list,
                 phase_names: dict[int, str]) -> list[dict]:
    names = trace.names.strings
    starts = [a["start_ns"] for a in (trace.kernels, trace.copies, trace.api, trace.cpu_ops, trace.ranges) if len(a)]
    t0 = int(min(int(s.min()) for s in starts)) if starts else 0
    ev: list[dict] = []
    devices = sorted(set(trace.kernels["device"].tolist()) | set(trace.copies["device"].tolist()))
    for d in devices:
        ev.append({"ph": "M", "name": "process_name", "pid": GPU_PID_BASE + d, "args": {"name": f"GPU {d}"}})
    ev.append({"ph": "M", "name": "process_name", "pid": PHASE_PID, "args": {"name": "Ridgeline phases"}})
    ev.append({"ph": "M", "name": "process_sort_index", "pid": PHASE_PID, "args": {"sort_index": -1}})

    k = trace.kernels
    if len(k):
        ts, dur = _us(k["start_ns"], t0), np.maximum(k["end_ns"] - k["start_ns"], 0) / 1e3
        pn = [phase_names.get(int(p), str(p)) for p in range(max(phase_names) + 1)]
        for i, (nid, dev, st, corr, p, s, a, b) in enumerate(zip(
                k["name_id"].tolist(), k["device"].tolist(), k["stream"].tolist(),
                k["correlation_id"].tolist(), kernel_phase.tolist(), kernel_step.tolist(),
                ts.tolist(), dur.tolist())):
            ev.append({"ph": "X", "cat": "kernel", "name": names[nid] if nid >= 0 else "kernel",
                       "pid": GPU_PID_BASE + dev, "tid": st, "ts": a, "dur": b,
                       "args": {"phase": pn[p] if p < len(pn) else str(p), "step": s, "correlation": corr}})
    c = trace.copies
    if len(c):
        ts, dur = _us(c["start_ns"], t0), np.maximum(c["end_ns"] - c["start_ns"], 0) / 1e3
        for kind, d, dev, st, nbytes, a, b in zip(c["kind"].tolist(), c["direction"].tolist(), c["device"].tolist(),
                                                  c["stream"].tolist(), c["bytes"].tolist(), ts.tolist(), dur.tolist()):
            nm = "Memset" if kind == 1 else f"Memcpy {COPY_DIRECTION_NAMES.get(d, d)}"
            ev.append({"ph": "X", "cat": "gpu_memcpy" if kind == 0 else "gpu_memset", "name": nm,
                       "pid": GPU_PID_BASE + dev, "tid": st, "ts": a, "dur": b, "args": {"bytes": nbytes}})
    for arr, cat in ((trace.api, "cuda_api"), (trace.cpu_ops, "cpu_op")):
        if not len(arr):
            continue
        ts, dur = _us(arr["start_ns"], t0), np.maximum(arr["end_ns"] - arr["start_ns"], 0) / 1e3
        extra = (arr["category"].tolist() if cat == "cuda_api" else arr["external_id"].tolist())
        for nid, pid, tid, x, a, b in zip(arr["name_id"].tolist(), arr["pid"].tolist(), arr["tid"].tolist(),
                                          extra, ts.tolist(), dur.tolist()):
            args = {"category": API_CATEGORY_NAMES.get(x, x)} if cat == "cuda_api" else {"External id": x}
            ev.append({"ph": "X", "cat": cat, "name": names[nid] if nid >= 0 else cat, "pid": pid, "tid": tid,
                       "ts": a, "dur": b, "args": args})
    r = trace.ranges
    if len(r):
        ts, dur = _us(r["start_ns"], t0), np.maximum(r["end_ns"] - r["start_ns"], 0) / 1e3
        for nid, pid, tid, dev, kind, a, b in zip(r["name_id"].tolist(), r["pid"].tolist(), r["tid"].tolist(),
                                                  r["device"].tolist(), r["kind"].tolist(), ts.tolist(), dur.tolist()):
            gpu = dev >= 0
            ev.append({"ph": "X", "cat": RANGE_KIND_NAMES.get(kind, "range"),
                       "name": names[nid] if nid >= 0 else "range",
                       "pid": GPU_PID_BASE + dev if gpu else pid, "tid": tid, "ts": a, "dur": b})
    for s in steps:
        args = {"step": int(s.index), "evidence": list(s.evidence)}
        if s.prefill_tokens is not None:
            args["prefill_tokens"] = s.prefill_tokens
        if s.decode_tokens is not None:
            args["decode_tokens"] = s.decode_tokens
        ev.append({"ph": "X", "cat": "ridgeline_phase", "name": phase_names.get(int(s.phase), str(s.phase)),
                   "pid": PHASE_PID, "tid": int(s.device), "ts": (int(s.start_ns) - t0) / 1e3,
                   "dur": max(int(s.end_ns) - int(s.start_ns), 0) / 1e3, "args": args})
    for d in sorted({int(s.device) for s in steps}):
        ev.append({"ph": "M", "name": "thread_name", "pid": PHASE_PID, "tid": d, "args": {"name": f"GPU {d} steps"}})
    return ev


def write_perfetto(trace: Trace, phase_map, phase_names: dict[int, str], path: str | Path) -> Path:
    """Write the trace with its phase track to ``path``; InputError if it cannot."""
    ev = build_events(trace, np.asarray(phase_map.kernel_phase), np.asarray(phase_map.kernel_step),
                      list(phase_map.steps), phase_names)
    doc = {"traceEvents": ev, "displayTimeUnit": "ns",
           "otherData": {"producer": "ridgeline analyze", "source": str(trace.meta.get("path") or trace.meta.get("source_path") or "")}}
    out = Path(path)
    try:
        out.write_bytes(orjson.dumps(doc))
    except OSError as exc:
        raise InputError(f"{out}: cannot write Perfetto trace: {exc.strerror or exc}") from None
    return out
