"""Perfetto-loadable Chrome-trace JSON of a Trace, with a phase track and launch flows.

:func:`write_perfetto` writes the trace's kernels, copies, API calls, CPU operators and
ranges as complete ("X") events, plus a process "Ridgeline phases" with one track per
device whose slices are the steps (name = phase, args = step index, tokens, evidence).
Every kernel slice carries ``args.phase`` and ``args.step``. Timestamps are microseconds
(Chrome JSON's unit) relative to the first event, with nanosecond decimals.

The layout follows the rules of Perfetto's JSON importer (``src/trace_processor/
importers/json/`` and ``importers/common/slice_tracker.cc`` of google/perfetto), so that
every slice written is imported, on the track it was written to, with no import error:

* Every track is named: one process per GPU ("GPU 0: <device name>"), one per host
  process, one for the phases; one thread track per GPU stream and kind — kernels,
  copies (memcpy/memset) and GPU-side annotations each get their own, because Kineto
  copies and annotations partially overlap the kernels of their stream.
* Perfetto finds a thread by (tid, pid) (``ProcessTracker::GetThreadOrNull``). GPU and
  phase tracks get synthetic tids from ``TRACK_TID_BASE`` up, unique in the file, and
  host events keep their real OS tids (one tid per track, so a track is never two
  threads by mistake).
* On one track, slices must nest or be disjoint (a start equal to an end is disjoint);
  a slice that partially overlaps another is moved by Perfetto to an overflow track and
  reported as an import error. The exporter assigns such slices itself to a numbered
  overlap track of the same stream or thread ("stream 7 kernels (overlap 1)").
* Within a track, slices are written by start time, the longer first at equal starts:
  the order the importer's sorter uses, so parents open before their children.
* Launch flows use the version-2 form, on the slices themselves: the API call that
  launched a kernel or copy (same correlation id) carries ``bind_id`` and
  ``flow_out: true``, every kernel and copy it launched ``bind_id`` and ``flow_in: true``
  (a CUDA-graph launch has one flow to each of its kernels).
* No ``displayTimeUnit``: current importers ignore it and older ones used it to rescale
  timestamps.
* Simulated data says so where a reader of the trace looks: every process name starts
  with ``SIMULATED`` (the track headers), and ``otherData`` has ``"simulated": true``.

The events are built per column with numpy and serialised with orjson; the Python loops
are over event records when forming the dicts orjson writes, and over the slices of a
track that is not already disjoint when assigning overlap tracks.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from ridgeline.probes.errors import InputError
from ridgeline.probes.events import API_CATEGORY_NAMES, COPY_DIRECTION_NAMES, RANGE_KIND_NAMES, Trace

PHASE_PID = 1_000_000_000       # synthetic pid of the phase track, away from real pids
GPU_PID_BASE = 1_000_000_100    # synthetic pids of GPU devices
UNKNOWN_HOST_PID = 999_999_999  # API calls / ops whose process the source does not give
TRACK_TID_BASE = 1_100_000_000  # synthetic tids (GPU, phase and overlap tracks); OS tids are < 2**22
REQUEST_PID = 1_000_000_001     # synthetic pid of the served requests' tracks (issue 22)
MAX_REQUEST_TRACKS = 200        # request tracks written at most (the slowest)


def _us(ns: np.ndarray, t0: int) -> np.ndarray:
    return (ns.astype(np.int64) - t0) / 1e3


def nesting_lanes(start_ns: np.ndarray, end_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, lane): the slices of one track in the importer's order (start, then longer
    first), and for each slice (by original index) the lowest lane on which it nests
    with the slices already placed there, following SliceTracker::MaybeCloseStack: an
    open slice ending before the new start, or at it (unless both last 0 ns), is closed;
    a new slice that starts inside the innermost open one and ends after it cannot nest.
    """
    n = len(start_ns)
    start = np.asarray(start_ns, dtype=np.int64)
    dur = np.maximum(np.asarray(end_ns, dtype=np.int64) - start, 0)
    order = np.lexsort((-dur, start))
    lanes = np.zeros(n, dtype=np.int32)
    if n < 2:
        return order, lanes
    s, e = start[order], start[order] + dur[order]
    if (s[1:] >= np.maximum.accumulate(e)[:-1]).all():
        return order, lanes          # disjoint (the usual kernel stream): one lane
    stacks: list[list[tuple[int, int]]] = []
    for i, st, d in zip(order.tolist(), s.tolist(), dur[order].tolist()):
        en = st + d
        for lane, stack in enumerate(stacks):
            while stack and (stack[-1][0] < st or (stack[-1][0] == st and not (stack[-1][1] == 0 and d == 0))):
                stack.pop()
            if stack and st < stack[-1][0] < en:
                continue
            stack.append((en, d))
            lanes[i] = lane
            break
        else:
            stacks.append([(en, d)])
            lanes[i] = len(stacks) - 1
    return order, lanes


@dataclass
class _Tracks:
    """Synthetic tids and the metadata rows naming processes and threads."""
    rows: list
    next_tid: int = TRACK_TID_BASE
    prefix: str = ""            # "SIMULATED ": on every process name (the track headers one sees)

    def process(self, pid: int, name: str, sort_index: int | None = None) -> None:
        self.rows.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": self.prefix + name}})
        if sort_index is not None:
            self.rows.append({"ph": "M", "name": "process_sort_index", "pid": pid,
                              "args": {"sort_index": sort_index}})

    def thread(self, pid: int, name: str, tid: int | None = None, sort_index: int | None = None) -> int:
        if tid is None:
            tid, self.next_tid = self.next_tid, self.next_tid + 1
        self.rows.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        if sort_index is not None:
            self.rows.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                              "args": {"sort_index": sort_index}})
        return tid


def _place(tracks: _Tracks, groups: dict, pid_of, name_of, start, end, base_tid=None, sort_of=None):
    """Tids for rows grouped by ``groups`` (key -> row indices): one named track per key,
    plus numbered overlap tracks where slices do not nest. Returns (tid per row, row order)."""
    tid = np.zeros(len(start), dtype=np.int64)
    order_all = []
    for rank, (key, rows) in enumerate(sorted(groups.items())):
        order, lanes = nesting_lanes(start[rows], end[rows])
        pid, name = pid_of(key), name_of(key)
        sort = (sort_of(key) if sort_of else rank) * 100
        lane_tids = [tracks.thread(pid, name, base_tid(key) if base_tid else None, sort)]
        for lane in range(1, int(lanes.max()) + 1 if len(lanes) else 1):
            lane_tids.append(tracks.thread(pid, f"{name} (overlap {lane})", None, sort + lane))
        tid[rows] = np.asarray(lane_tids, dtype=np.int64)[lanes]
        order_all.append(rows[order])
    return tid, (np.concatenate(order_all) if order_all else np.zeros(0, dtype=np.int64))


def _groups(*cols: np.ndarray) -> dict:
    """Row indices per distinct tuple of ``cols``."""
    out: dict = {}
    for i, key in enumerate(zip(*(c.tolist() for c in cols))):
        out.setdefault(key, []).append(i)
    return {k: np.asarray(v, dtype=np.int64) for k, v in out.items()}


def _launch_flows(trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flow id (0 = none) per API row, kernel and copy: API row index + 1 for the API
    record with the kernel's or copy's correlation id (the first such record)."""
    api = trace.api
    api_flow = np.zeros(len(api), dtype=np.int64)
    out = []
    if len(api):
        order = np.argsort(api["correlation_id"], kind="stable")
        corr = api["correlation_id"][order]
    for arr in (trace.kernels, trace.copies):
        flow = np.zeros(len(arr), dtype=np.int64)
        if len(api) and len(arr):
            want = arr["correlation_id"]
            pos = np.minimum(np.searchsorted(corr, want), len(corr) - 1)
            hit = (corr[pos] == want) & (want >= 0)
            src = order[pos[hit]]
            flow[hit] = src + 1
            api_flow[src] = src + 1
        out.append(flow)
    return api_flow, out[0], out[1]


def is_simulated(trace: Trace) -> bool:
    """The trace came from the simulator (its metadata or a device says so)."""
    return bool(trace.meta.get("simulated") or any(d.properties.get("simulated") for d in trace.devices))


def build_events(trace: Trace, kernel_phase: np.ndarray, kernel_step: np.ndarray, steps: list,
                 phase_names: dict[int, str], requests: list | None = None) -> list[dict]:
    """The Chrome-trace events (metadata rows first, then slices) of the export; a
    simulated trace's process names start with ``SIMULATED``."""
    names = trace.names.strings
    starts = [a["start_ns"] for a in (trace.kernels, trace.copies, trace.api, trace.cpu_ops, trace.ranges) if len(a)]
    requests = sorted(requests or [], key=lambda s: -s.e2e_ns)[:MAX_REQUEST_TRACKS]
    if requests:
        starts.append(np.array([s.start_ns for s in requests], dtype=np.int64))
    t0 = int(min(int(s.min()) for s in starts)) if starts else 0
    tracks = _Tracks([], prefix="SIMULATED " if is_simulated(trace) else "")
    slices: list[dict] = []
    k, c, r = trace.kernels, trace.copies, trace.ranges
    gpu_r = r[r["device"] >= 0] if len(r) else r
    host_r = r[r["device"] < 0] if len(r) else r
    dev_names = {d.index: d.name for d in trace.devices}
    devices = sorted(set(k["device"].tolist()) | set(c["device"].tolist()) | set(gpu_r["device"].tolist()))
    for d in devices:
        tracks.process(GPU_PID_BASE + d, f"GPU {d}: {dev_names[d]}" if dev_names.get(d) else f"GPU {d}", d)
    tracks.process(PHASE_PID, "Ridgeline phases", -1)
    api_flow, kernel_flow, copy_flow = _launch_flows(trace)

    # GPU tracks: per device, per stream: kernels, copies, annotations (in that order)
    # (GPU-side ranges: Kineto puts the stream in tid). Sorted by stream, then kind.
    kinds = (("kernels", k, k["stream"]), ("copies", c, c["stream"]), ("annotations", gpu_r, gpu_r["tid"]))
    stream_rank = {s: i for i, s in enumerate(sorted(set().union(*(x[2].tolist() for x in kinds))))}
    gpu_tids = {}
    for slot, (label, arr, stream) in enumerate(kinds):
        if not len(arr):
            gpu_tids[label] = (np.zeros(0, np.int64), np.zeros(0, np.int64))
            continue
        gpu_tids[label] = _place(
            tracks, _groups(arr["device"], stream), lambda key: GPU_PID_BASE + key[0],
            lambda key, lb=label: f"stream {key[1]} {lb}", arr["start_ns"], arr["end_ns"],
            sort_of=lambda key, sl=slot: stream_rank[key[1]] * 3 + sl)
    k_tid, k_order = gpu_tids["kernels"]
    if len(k):
        ts, dur = _us(k["start_ns"], t0), np.maximum(k["end_ns"] - k["start_ns"], 0) / 1e3
        pn = [phase_names.get(int(p), str(p)) for p in range(max(phase_names) + 1)]
        cols = (k["name_id"], k["device"], k_tid, k["correlation_id"], kernel_phase, kernel_step, ts, dur, kernel_flow)
        for nid, dev, tid, corr, p, s, a, b, fl in zip(*(np.asarray(x)[k_order].tolist() for x in cols)):
            e = {"ph": "X", "cat": "kernel", "name": names[nid] if nid >= 0 else "kernel",
                 "pid": GPU_PID_BASE + dev, "tid": tid, "ts": a, "dur": b,
                 "args": {"phase": pn[p] if p < len(pn) else str(p), "step": s, "correlation": corr}}
            if fl:
                e["bind_id"], e["flow_in"] = fl, True
            slices.append(e)
    c_tid, c_order = gpu_tids["copies"]
    if len(c):
        ts, dur = _us(c["start_ns"], t0), np.maximum(c["end_ns"] - c["start_ns"], 0) / 1e3
        cols = (c["kind"], c["direction"], c["device"], c_tid, c["bytes"], c["correlation_id"], ts, dur, copy_flow)
        for kind, d, dev, tid, nbytes, corr, a, b, fl in zip(*(np.asarray(x)[c_order].tolist() for x in cols)):
            nm = "Memset" if kind == 1 else f"Memcpy {COPY_DIRECTION_NAMES.get(d, d)}"
            e = {"ph": "X", "cat": "gpu_memcpy" if kind == 0 else "gpu_memset", "name": nm,
                 "pid": GPU_PID_BASE + dev, "tid": tid, "ts": a, "dur": b,
                 "args": {"bytes": nbytes, "correlation": corr}}
            if fl:
                e["bind_id"], e["flow_in"] = fl, True
            slices.append(e)
    g_tid, g_order = gpu_tids["annotations"]
    if len(gpu_r):
        ts, dur = _us(gpu_r["start_ns"], t0), np.maximum(gpu_r["end_ns"] - gpu_r["start_ns"], 0) / 1e3
        cols = (gpu_r["name_id"], gpu_r["device"], g_tid, gpu_r["kind"], ts, dur)
        for nid, dev, tid, kind, a, b in zip(*(np.asarray(x)[g_order].tolist() for x in cols)):
            slices.append({"ph": "X", "cat": RANGE_KIND_NAMES.get(kind, "range"),
                           "name": names[nid] if nid >= 0 else "range",
                           "pid": GPU_PID_BASE + dev, "tid": tid, "ts": a, "dur": b})

    # host: API calls, CPU operators and CPU-side ranges share their thread's track
    api, ops = trace.api, trace.cpu_ops
    h_start = np.concatenate([api["start_ns"], ops["start_ns"], host_r["start_ns"]]).astype(np.int64)
    h_end = np.concatenate([api["end_ns"], ops["end_ns"], host_r["end_ns"]]).astype(np.int64)
    h_pid = np.concatenate([api["pid"], ops["pid"], host_r["pid"]]).astype(np.int64)
    h_pid = np.where(h_pid >= 0, h_pid, UNKNOWN_HOST_PID)
    h_tid = np.concatenate([api["tid"], ops["tid"], host_r["tid"]]).astype(np.int64)
    if len(h_start):
        host_pids = sorted(set(h_pid.tolist()))
        for p in host_pids:
            tracks.process(p, "host process (unknown)" if p == UNKNOWN_HOST_PID else f"host process {p}",
                           len(devices) + 1)
        # an OS tid names the track unless it is missing or already a thread of another
        # process: then a synthetic one, so that every tid in the file is one track
        # (Perfetto itself would keep the two apart by pid)
        groups = _groups(h_pid, h_tid)
        owner: dict[int, int] = {}
        for p, t in sorted(groups):
            owner.setdefault(t, p)
        tid_of = {key: (key[1] if key[1] > 0 and owner[key[1]] == key[0] else None) for key in groups}
        h_track, h_order = _place(
            tracks, groups, lambda key: key[0],
            lambda key: f"thread {key[1]}" if key[1] > 0 else "thread (unknown)",
            h_start, h_end, base_tid=lambda key: tid_of[key])
        h_ts, h_dur = _us(h_start, t0), np.maximum(h_end - h_start, 0) / 1e3
        n_api, n_ops = len(api), len(ops)
        h_name = np.concatenate([api["name_id"], ops["name_id"], host_r["name_id"]])
        api_cat = api["category"].tolist()
        op_ext = ops["external_id"].tolist()
        r_kind = host_r["kind"].tolist()
        for i, nid, pid, tid, a, b in zip(h_order.tolist(), *(x[h_order].tolist() for x in (
                h_name, h_pid, h_track, h_ts, h_dur))):
            if i < n_api:
                e = {"ph": "X", "cat": "cuda_api", "name": names[nid] if nid >= 0 else "cuda_api",
                     "pid": pid, "tid": tid, "ts": a, "dur": b,
                     "args": {"category": API_CATEGORY_NAMES.get(api_cat[i], api_cat[i]),
                              "correlation": int(api["correlation_id"][i])}}
                if api_flow[i]:
                    e["bind_id"], e["flow_out"] = int(api_flow[i]), True
            elif i < n_api + n_ops:
                e = {"ph": "X", "cat": "cpu_op", "name": names[nid] if nid >= 0 else "cpu_op", "pid": pid,
                     "tid": tid, "ts": a, "dur": b, "args": {"External id": op_ext[i - n_api]}}
            else:
                e = {"ph": "X", "cat": RANGE_KIND_NAMES.get(r_kind[i - n_api - n_ops], "range"),
                     "name": names[nid] if nid >= 0 else "range", "pid": pid, "tid": tid, "ts": a, "dur": b}
            slices.append(e)

    # phases: one track per device
    if steps:
        s_start = np.array([int(s.start_ns) for s in steps], dtype=np.int64)
        s_end = np.array([max(int(s.end_ns), int(s.start_ns)) for s in steps], dtype=np.int64)
        s_dev = np.array([int(s.device) for s in steps], dtype=np.int64)
        s_tid, s_order = _place(tracks, _groups(s_dev), lambda key: PHASE_PID,
                                lambda key: f"GPU {key[0]} steps", s_start, s_end)
        for i in s_order.tolist():
            s = steps[i]
            args = {"step": int(s.index), "evidence": list(s.evidence)}
            if s.prefill_tokens is not None:
                args["prefill_tokens"] = s.prefill_tokens
            if s.decode_tokens is not None:
                args["decode_tokens"] = s.decode_tokens
            slices.append({"ph": "X", "cat": "ridgeline_phase", "name": phase_names.get(int(s.phase), str(s.phase)),
                           "pid": PHASE_PID, "tid": int(s_tid[i]), "ts": (int(s_start[i]) - t0) / 1e3,
                           "dur": (int(s_end[i]) - int(s_start[i])) / 1e3, "args": args})
    if requests:
        slices.extend(_request_slices(tracks, requests, t0))
    return tracks.rows + slices


def _after_active(t: int, active_ns: int, pauses: list[tuple[int, int]]) -> int:
    """The time ``active_ns`` of work after ``t``, the (sorted, disjoint) pauses skipped."""
    for a, b in pauses:
        if b <= t:
            continue
        if t + active_ns <= a:
            break
        active_ns -= max(0, a - t)
        t = b
    return t + max(0, active_ns)


def _request_slices(tracks: _Tracks, requests: list, t0: int) -> list[dict]:
    """One track per served request (``aggregator.request_join.RequestStory``), beside the
    GPU steps: its queued, prefill and decode segments, one after the other (disjoint), the
    decode slice carrying the time others added and who they were."""
    tracks.process(REQUEST_PID, "Ridgeline requests", -2)
    out = []
    for rank, s in enumerate(requests):
        tid = tracks.thread(REQUEST_PID, f"request {s.request_id[:64]} ({s.e2e_ns / 1e9:.2f} s)", sort_index=rank)
        sched = s.start_ns + max(s.queue_ns, 0)      # -1: the engine did not report it
        # Prefill and decode times leave the pauses out; on the track they hold them (a
        # "preempted" slice inside each), so each segment spans its wall time.
        pauses = [(p.start_ns, p.end_ns) for p in s.pauses]
        first = _after_active(sched, s.prefill_ns, pauses)
        # Its decode slice holds its re-prefills too (a "recompute" slice after each pause
        # they followed): the request was in the engine's steps then, not decoding.
        end = _after_active(first, s.decode_ns + s.recompute_ns, pauses)
        for name, a, b, args in (
                ("queued", s.start_ns, sched, {"kv_full": s.kv_full_while_queued}),
                ("prefill", sched, first, {"chunks": s.prefill_chunks, "prompt_tokens": s.prompt_tokens}),
                *(("preempted", max(pa, sched), min(pb, s.end_ns), {"preemptions": s.preemptions}) for pa, pb in pauses),
                *(("recompute", p.end_ns, min(p.recompute_end_ns, s.end_ns),
                   {"gpu_ms": (p.recompute_ns or 0) / 1e6})
                  for p in s.pauses if p.recompute_end_ns is not None),
                ("decode", first, end,
                 {"steps": s.decode_steps, "completion_tokens": s.completion_tokens,
                  "dragged_ms": s.dragged_ns / 1e6, "dragged_source": s.dragged_source,
                  "alone_decode_ms": s.alone_decode_ns / 1e6,
                  "recompute_ms": s.recompute_ns / 1e6, "recompute_steps": s.recompute_steps,
                  "culprits": [f"{c.request_id[:64]} +{c.added_ns / 1e6:.1f} ms ({c.kind})" for c in s.culprits]})):
            if b > a:
                out.append({"ph": "X", "cat": "ridgeline_request", "name": name, "pid": REQUEST_PID, "tid": tid,
                            "ts": (a - t0) / 1e3, "dur": (b - a) / 1e3, "args": args})
    return out


def write_perfetto(trace: Trace, phase_map, phase_names: dict[int, str], path: str | Path,
                   requests: list | None = None) -> Path:
    """Write the trace with its phase track to ``path`` (and a track per served request,
    ``requests``: RequestStory records, the slowest :data:`MAX_REQUEST_TRACKS`); InputError
    if it cannot."""
    ev = build_events(trace, np.asarray(phase_map.kernel_phase), np.asarray(phase_map.kernel_step),
                      list(phase_map.steps), phase_names, requests)
    doc = {"traceEvents": ev,
           "otherData": {"producer": "ridgeline analyze",
                         "source": str(trace.meta.get("path") or trace.meta.get("source_path") or "")}}
    if is_simulated(trace):
        # In the file's metadata too (the README's promise), not only in the track names.
        doc["otherData"]["simulated"] = True
        doc["otherData"]["note"] = "SIMULATED data: generated by ridgeline's simulator, not measured on a GPU"
    out = Path(path)
    from ridgeline.probes.output_file import open_output
    try:
        with open_output(out, "Perfetto trace") as f:
            f.write(orjson.dumps(doc))
    except OSError as exc:
        raise InputError(f"{out}: cannot write Perfetto trace: {exc.strerror or exc}") from None
    return out
