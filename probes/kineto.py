"""Kineto / PyTorch-profiler Chrome-trace importer (``.json`` and ``.json.gz``).

``load_trace(path)`` reads a trace written by ``torch.profiler`` (Kineto's Chrome-trace
JSON) into a columnar :class:`probes.events.Trace`:

=====================  =====================================================
Kineto ``cat``         goes to
=====================  =====================================================
``kernel``             ``trace.kernels``
``gpu_memcpy``         ``trace.copies`` (kind memcpy, direction from the name)
``gpu_memset``         ``trace.copies`` (kind memset)
``cuda_runtime``       ``trace.api`` (domain runtime, category from the name)
``cuda_driver``        ``trace.api`` (domain driver)
``user_annotation``    ``trace.ranges`` (``RANGE_USER_ANNOTATION``; ``ProfilerStep#N``
                       as ``RANGE_PROFILER_STEP``), device -1
``gpu_user_annotation`` ``trace.ranges`` (``RANGE_GPU_ANNOTATION``; ``ProfilerStep#N``
                       as ``RANGE_PROFILER_STEP``), device >= 0, ``tid`` = stream
``cuda_sync``          ``trace.ranges`` (``RANGE_CUDA_SYNC``), device >= 0, ``tid`` = stream
``cpu_op``             ``trace.cpu_ops`` (``Input Dims`` / ``Input type`` interned as
                       compact JSON text)
everything else        counted in ``trace.meta["skipped_events"]``, not kept
=====================  =====================================================

Times: Kineto writes ``ts``/``dur`` in microseconds (ints or floats with up to three
decimals); they become integer nanoseconds, exact for up to three decimals.

Kernels and copies carry, in ``pid``/``tid``, the process and thread that launched
them: joined through the runtime/driver API record with the same correlation id
(Kineto itself puts the device index and the stream there). ``-1`` when the trace has
no such API record (e.g. the tail of a previous profiler step).

``trace.meta`` holds plain facts only (path, format, Kineto schema version, CUPTI and
CUDA versions, distributed rank and world size, base time, per-category event counts);
the top-level ``metadata`` object and anything resembling an environment are never
copied, because recorders put environment variables (tokens) there.

Any problem with the file raises :class:`probes.errors.InputError` with one line
naming the file and the problem.
"""
from __future__ import annotations

import gzip
import re
import zlib
from pathlib import Path

import numpy as np
import orjson

from .errors import InputError
from .events import (
    API_DOMAIN_DRIVER, API_DOMAIN_RUNTIME, API_DTYPE, API_GRAPH_LAUNCH, API_LAUNCH, API_MEMCPY,
    API_MEMSET, API_OTHER, API_SYNC, COPY_DIRECTION_NAMES, COPY_DTYPE, COPY_KIND_MEMCPY,
    COPY_KIND_MEMSET, COPY_UNKNOWN, CPU_OP_DTYPE, KERNEL_DTYPE, MISSING, RANGE_CUDA_SYNC,
    RANGE_DTYPE, RANGE_GPU_ANNOTATION, RANGE_PROFILER_STEP, RANGE_USER_ANNOTATION, Device,
    NameTable, Trace, empty,
)

__all__ = ["load_trace", "kernel_cpu_op_index", "api_category", "copy_direction"]

_DIRECTION_BY_NAME = {v.lower(): k for k, v in COPY_DIRECTION_NAMES.items()}
_COPY_NAME_RX = re.compile(r"\b([A-Za-z])to([A-Za-z])\b")

# API categories by name; checked in order, first match wins.
_API_CATEGORY_RX = [
    (API_GRAPH_LAUNCH, re.compile(r"^(cudaGraphLaunch|cuGraphLaunch)")),
    (API_LAUNCH, re.compile(r"^(cudaLaunch|cuLaunch)")),
    (API_SYNC, re.compile(r"^(cuda|cu)(Device|Stream|Event|Ctx)Synchronize")),
    (API_MEMCPY, re.compile(r"^(cudaMemcpy|cuMemcpy)")),
    (API_MEMSET, re.compile(r"^(cudaMemset|cuMemset)")),
]

# Top-level keys copied into meta (plain facts). Never "metadata" or anything env-like.
_META_KEYS = {
    "schemaVersion": "kineto_schema_version",
    "cupti_version": "cupti_version",
    "cuda_runtime_version": "cuda_runtime_version",
    "cuda_driver_version": "cuda_driver_version",
    "baseTimeNanoseconds": "base_time_ns",
    "displayTimeUnit": "display_time_unit",
    "trace_id": "trace_id",
}

_INT32_MAX = 2**31 - 1


def api_category(name: str) -> int:
    """Category (``API_*``) of a CUDA runtime/driver API call from its name."""
    for cat, rx in _API_CATEGORY_RX:
        if rx.match(name):
            return cat
    return API_OTHER


def copy_direction(name: str) -> int:
    """Direction (``COPY_*``) of a Kineto memcpy record from its name, e.g.
    ``"Memcpy HtoD (Pinned -> Device)"`` -> ``COPY_HTOD``; unknown -> ``COPY_UNKNOWN``."""
    m = _COPY_NAME_RX.search(name)
    if not m:
        return COPY_UNKNOWN
    return _DIRECTION_BY_NAME.get(f"{m.group(1)}to{m.group(2)}".lower(), COPY_UNKNOWN)


# --------------------------------------------------------------------------- reading

def _read_bytes(path: Path) -> bytes:
    """Whole decompressed content, with every failure turned into an InputError."""
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(0)
            if head == b"\x1f\x8b":
                try:
                    with gzip.GzipFile(fileobj=f) as g:
                        return g.read()
                except EOFError:
                    raise InputError(f"{path}: truncated gzip file (compressed stream ends early)") from None
                except (gzip.BadGzipFile, zlib.error, OSError) as exc:
                    raise InputError(f"{path}: corrupt gzip file ({exc})") from None
            return f.read()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, expected a Kineto trace file") from None
    except PermissionError:
        raise InputError(f"{path}: permission denied") from None


def _parse_document(path: Path, data: bytes) -> dict:
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        stripped = data.lstrip()
        if not stripped:
            raise InputError(f"{path}: empty file, expected a Kineto trace (JSON)") from None
        if stripped[:1] in (b"{", b"[") and exc.pos >= len(data.rstrip()) - 1:
            raise InputError(f"{path}: truncated JSON (document ends at byte {len(data)} "
                             "before it is complete)") from None
        raise InputError(f"{path}: not valid JSON ({exc.msg} at byte {exc.pos})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise InputError(f"{path}: not a Kineto/Chrome trace (JSON without a traceEvents array)")
    return doc


# --------------------------------------------------------------------------- columns

def _us_to_ns(values: list) -> np.ndarray:
    """Microseconds (ints, or floats with <= 3 decimals) -> int64 ns, exact.

    Floats are split into integer and fractional parts so that large absolute
    timestamps (1.7e15 us) keep nanosecond resolution.
    """
    a = np.asarray(values)
    if a.dtype.kind in "iu":
        return a.astype(np.int64) * 1000
    a = a.astype(np.float64)
    ip = np.floor(a)
    return ip.astype(np.int64) * 1000 + np.rint((a - ip) * 1000.0).astype(np.int64)


def _int_or_missing(v) -> int:
    return v if type(v) is int else MISSING


def _id32(v) -> int:
    """pid/tid as int32: strings (Kineto's "Spans" rows) -> -1; pthread-sized ids folded."""
    if type(v) is not int:
        return MISSING
    return v if -1 <= v <= _INT32_MAX else v & _INT32_MAX


class _Builder:
    """Accumulates parsed event dicts per kind, then builds the structured arrays."""

    def __init__(self):
        self.names = NameTable()
        self.kernels: list[dict] = []
        self.copies: list[dict] = []
        self.api: list[dict] = []
        self.ranges: list[tuple[dict, int]] = []
        self.cpu_ops: list[dict] = []
        self.counts: dict[str, int] = {}

    def add(self, events: list) -> None:
        counts = self.counts
        for e in events:
            if type(e) is not dict:
                counts["<non-object>"] = counts.get("<non-object>", 0) + 1
                continue
            cat = e.get("cat")
            key = cat if isinstance(cat, str) else "<none>"
            counts[key] = counts.get(key, 0) + 1
            if e.get("ph") != "X":
                continue
            if cat == "kernel":
                self.kernels.append(e)
            elif cat == "gpu_memcpy" or cat == "gpu_memset":
                self.copies.append(e)
            elif cat == "cuda_runtime" or cat == "cuda_driver":
                self.api.append(e)
            elif cat == "cpu_op":
                self.cpu_ops.append(e)
            elif cat == "user_annotation" or cat == "gpu_user_annotation" or cat == "cuda_sync":
                self.ranges.append(e)

    # -- per kind -----------------------------------------------------------------
    def _intern_all(self, values) -> np.ndarray:
        intern = self.names.intern
        return np.fromiter((intern(v) if isinstance(v, str) else MISSING for v in values),
                           dtype=np.int32, count=len(values))

    def _times(self, evs, out):
        out["start_ns"] = _us_to_ns([e.get("ts", 0) for e in evs])
        out["end_ns"] = out["start_ns"] + _us_to_ns([e.get("dur", 0) for e in evs])

    def build_kernels(self) -> np.ndarray:
        evs = self.kernels
        out = empty(KERNEL_DTYPE, len(evs))
        if not evs:
            return out
        self._times(evs, out)
        args = [e.get("args") or {} for e in evs]
        for col, key in (("device", "device"), ("stream", "stream"), ("context", "context"),
                         ("correlation_id", "correlation"), ("external_id", "External id"),
                         ("registers", "registers per thread"), ("shared_mem_bytes", "shared memory")):
            out[col] = [_int_or_missing(a.get(key)) for a in args]
        for prefix, key in (("grid", "grid"), ("block", "block")):
            xyz = np.array([_xyz(a.get(key)) for a in args], dtype=np.int64).reshape(-1, 3)
            out[prefix + "_x"], out[prefix + "_y"], out[prefix + "_z"] = xyz[:, 0], xyz[:, 1], xyz[:, 2]
        out["name_id"] = self._intern_all([e.get("name") for e in evs])
        return out

    def build_copies(self) -> np.ndarray:
        evs = self.copies
        out = empty(COPY_DTYPE, len(evs))
        if not evs:
            return out
        self._times(evs, out)
        args = [e.get("args") or {} for e in evs]
        for col, key in (("device", "device"), ("stream", "stream"),
                         ("correlation_id", "correlation"), ("bytes", "bytes")):
            out[col] = [_int_or_missing(a.get(key)) for a in args]
        out["kind"] = [COPY_KIND_MEMSET if e.get("cat") == "gpu_memset" else COPY_KIND_MEMCPY for e in evs]
        out["name_id"] = self._intern_all([e.get("name") for e in evs])
        out["direction"] = _per_name(self.names, out["name_id"], copy_direction, np.uint8)
        out["direction"][out["kind"] == COPY_KIND_MEMSET] = COPY_UNKNOWN
        return out

    def build_api(self) -> np.ndarray:
        evs = self.api
        out = empty(API_DTYPE, len(evs))
        if not evs:
            return out
        self._times(evs, out)
        args = [e.get("args") or {} for e in evs]
        out["pid"] = [_id32(e.get("pid")) for e in evs]
        out["tid"] = [_id32(e.get("tid")) for e in evs]
        out["correlation_id"] = [_int_or_missing(a.get("correlation")) for a in args]
        out["external_id"] = [_int_or_missing(a.get("External id")) for a in args]
        out["cbid"] = [_int_or_missing(a.get("cbid")) for a in args]
        out["domain"] = [API_DOMAIN_DRIVER if e.get("cat") == "cuda_driver" else API_DOMAIN_RUNTIME for e in evs]
        out["name_id"] = self._intern_all([e.get("name") for e in evs])
        out["category"] = _per_name(self.names, out["name_id"], api_category, np.uint8)
        return out

    def build_ranges(self) -> np.ndarray:
        evs = self.ranges
        out = empty(RANGE_DTYPE, len(evs))
        if not evs:
            return out
        self._times(evs, out)
        kinds, pids, tids, devices = [], [], [], []
        for e in evs:
            cat = e.get("cat")
            a = e.get("args") or {}
            name = e.get("name")
            step = isinstance(name, str) and name.startswith("ProfilerStep#")
            if cat == "user_annotation":
                kinds.append(RANGE_PROFILER_STEP if step else RANGE_USER_ANNOTATION)
                pids.append(_id32(e.get("pid")))
                tids.append(_id32(e.get("tid")))
                devices.append(MISSING)
            else:
                # GPU-side rows: Kineto puts the device index in pid and the stream in tid.
                kinds.append(RANGE_CUDA_SYNC if cat == "cuda_sync"
                             else RANGE_PROFILER_STEP if step else RANGE_GPU_ANNOTATION)
                dev = a.get("device", e.get("pid"))
                devices.append(_id32(dev))
                pids.append(MISSING)
                tids.append(_id32(a.get("stream", e.get("tid"))))
        out["kind"], out["pid"], out["tid"], out["device"] = kinds, pids, tids, devices
        out["external_id"] = [_int_or_missing((e.get("args") or {}).get("External id")) for e in evs]
        out["name_id"] = self._intern_all([e.get("name") for e in evs])
        return out

    def build_cpu_ops(self) -> np.ndarray:
        evs = self.cpu_ops
        out = empty(CPU_OP_DTYPE, len(evs))
        if not evs:
            return out
        self._times(evs, out)
        args = [e.get("args") or {} for e in evs]
        out["pid"] = [_id32(e.get("pid")) for e in evs]
        out["tid"] = [_id32(e.get("tid")) for e in evs]
        out["external_id"] = [_int_or_missing(a.get("External id")) for a in args]
        out["name_id"] = self._intern_all([e.get("name") for e in evs])
        dumps = orjson.dumps
        out["input_dims_id"] = self._intern_all(
            [dumps(a["Input Dims"]).decode() if "Input Dims" in a else None for a in args])
        out["input_types_id"] = self._intern_all(
            [dumps(a["Input type"]).decode() if "Input type" in a else None for a in args])
        return out


def _xyz(v) -> tuple[int, int, int]:
    if isinstance(v, list) and len(v) == 3 and all(type(x) is int for x in v):
        return v[0], v[1], v[2]
    return MISSING, MISSING, MISSING


def _per_name(names: NameTable, ids: np.ndarray, fn, dtype) -> np.ndarray:
    """Apply ``fn(name)`` once per distinct name id, then broadcast (vectorised)."""
    uniq, inv = np.unique(ids, return_inverse=True)
    vals = np.array([fn(names[i]) if i >= 0 else 0 for i in uniq.tolist()], dtype=dtype)
    return vals[inv] if len(uniq) else np.zeros(len(ids), dtype=dtype)


# --------------------------------------------------------------------------- joins

def _join_launch_thread(kernels_or_copies: np.ndarray, api: np.ndarray) -> None:
    """Fill pid/tid of GPU records from the API record with the same correlation id."""
    if not len(kernels_or_copies) or not len(api):
        kernels_or_copies["pid"] = MISSING
        kernels_or_copies["tid"] = MISSING
        return
    order = np.argsort(api["correlation_id"], kind="stable")
    corr = api["correlation_id"][order]
    want = kernels_or_copies["correlation_id"]
    pos = np.searchsorted(corr, want)
    pos_c = np.minimum(pos, len(corr) - 1)
    hit = (corr[pos_c] == want) & (want >= 0)
    src = order[pos_c]
    kernels_or_copies["pid"] = np.where(hit, api["pid"][src], MISSING)
    kernels_or_copies["tid"] = np.where(hit, api["tid"][src], MISSING)


def kernel_cpu_op_index(trace: Trace) -> np.ndarray:
    """For each kernel, the index into ``trace.cpu_ops`` of the operator that launched it.

    First by Kineto's ``External id`` (the kernel's own, or else that of the runtime API
    record with the kernel's correlation id), which is how current Kineto links them.
    Older Kineto (2023, e.g. HTA's A100 traces) gives the runtime record an External id
    of its own; there the operator is the innermost ``cpu_op`` on the launching thread
    whose interval contains the launch call. ``-1`` where neither finds one.
    """
    k = trace.kernels
    ops = trace.cpu_ops
    out = np.full(len(k), MISSING, dtype=np.int64)
    if not len(ops) or not len(k):
        return out
    api_pos, api_hit = _api_for(k["correlation_id"], trace.api)
    if _external_id_is_correlation(trace.api):
        rest = np.flatnonzero(api_hit)
        a = trace.api[api_pos[rest]]
        out[rest] = _enclosing(ops, a["pid"], a["tid"], a["start_ns"])
        return out
    ext = k["external_id"].copy()
    if len(trace.api):
        api_ext = trace.api["external_id"][api_pos]
        ext = np.where((ext < 0) & api_hit, api_ext, ext)
    # sort ops by (external_id, start_ns): the last of a run of equal ids is the innermost
    order = np.lexsort((ops["start_ns"], ops["external_id"]))
    op_ext = ops["external_id"][order]
    pos = np.searchsorted(op_ext, ext, side="right") - 1
    pos_c = np.maximum(pos, 0)
    hit = (pos >= 0) & (op_ext[pos_c] == ext) & (ext >= 0)
    out[hit] = order[pos_c[hit]]
    rest = np.flatnonzero(~hit & api_hit)
    if len(rest):
        a = trace.api[api_pos[rest]]
        out[rest] = _enclosing(ops, a["pid"], a["tid"], a["start_ns"])
    return out


def _external_id_is_correlation(api: np.ndarray) -> bool:
    """True for older Kineto, whose API records carry External id == correlation id
    (an id of the launch itself, not of the operator), so matching ops by it would pair
    unrelated records whose numbers happen to coincide."""
    launches = api[(api["category"] == API_LAUNCH) & (api["external_id"] >= 0)]
    if not len(launches):
        return False
    return float(np.mean(launches["external_id"] == launches["correlation_id"])) > 0.9


def _api_for(correlation: np.ndarray, api: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index into ``api`` of the record with each correlation id, and whether it exists."""
    if not len(api):
        return np.zeros(len(correlation), dtype=np.int64), np.zeros(len(correlation), dtype=bool)
    order = np.argsort(api["correlation_id"], kind="stable")
    corr = api["correlation_id"][order]
    pos = np.minimum(np.searchsorted(corr, correlation), len(corr) - 1)
    hit = (corr[pos] == correlation) & (correlation >= 0)
    return order[pos], hit


def _enclosing(ops: np.ndarray, pid: np.ndarray, tid: np.ndarray, t_ns: np.ndarray) -> np.ndarray:
    """Innermost op on thread (pid, tid) whose [start, end] contains t_ns; -1 if none.

    Ops on one thread nest properly, so the answer is the latest-starting op with
    start <= t, or the nearest ancestor of it that still contains t.
    """
    order = np.lexsort((-ops["end_ns"], ops["start_ns"], ops["tid"], ops["pid"]))
    s = ops[order]
    # parent of each op in sorted order (one linear pass with a stack per thread)
    parent = np.full(len(s), -1, dtype=np.int64)
    stack: list[int] = []
    last_thread = None
    sp, st, ss, se = s["pid"].tolist(), s["tid"].tolist(), s["start_ns"].tolist(), s["end_ns"].tolist()
    for i in range(len(s)):
        thread = (sp[i], st[i])
        if thread != last_thread:
            stack.clear()
            last_thread = thread
        while stack and se[stack[-1]] < ss[i]:
            stack.pop()
        if stack:
            parent[i] = stack[-1]
        stack.append(i)
    key = (s["pid"].astype(np.int64) << 32) | (s["tid"].astype(np.int64) & 0xFFFFFFFF)
    qkey = (pid.astype(np.int64) << 32) | (tid.astype(np.int64) & 0xFFFFFFFF)
    # lexicographic search on (thread key, start) via a combined structured sort
    res = np.full(len(t_ns), -1, dtype=np.int64)
    for kv in np.unique(qkey):
        lo, hi = np.searchsorted(key, kv, "left"), np.searchsorted(key, kv, "right")
        if lo == hi:
            continue
        q = np.flatnonzero(qkey == kv)
        cand = lo + np.searchsorted(s["start_ns"][lo:hi], t_ns[q], side="right") - 1
        cand = np.where(cand >= lo, cand, -1)
        for _ in range(64):  # nesting depth bound; each round climbs one level
            bad = (cand >= 0) & (s["end_ns"][np.maximum(cand, 0)] < t_ns[q])
            if not bad.any():
                break
            cand = np.where(bad, parent[np.maximum(cand, 0)], cand)
        res[q] = np.where(cand >= 0, order[np.maximum(cand, 0)], -1)
    return res


# --------------------------------------------------------------------------- entry

def _devices(doc: dict) -> list[Device]:
    out = []
    for p in doc.get("deviceProperties") or []:
        if not isinstance(p, dict):
            continue
        major, minor = p.get("computeMajor"), p.get("computeMinor")
        out.append(Device(
            index=_int_or_missing(p.get("id")),
            name=str(p.get("name", "")),
            sm_count=_int_or_missing(p.get("numSms")),
            memory_total_bytes=_int_or_missing(p.get("totalGlobalMem")),
            compute_capability=f"{major}.{minor}" if major is not None and minor is not None else "",
            properties={k: v for k, v in p.items() if isinstance(v, (int, float, str))},
        ))
    return out


def _meta(path: Path, doc: dict) -> dict:
    meta = {"source_path": str(path), "format": "kineto"}
    for key, name in _META_KEYS.items():
        v = doc.get(key)
        if isinstance(v, (int, float, str)):
            meta[name] = v
    dist = doc.get("distributedInfo")
    if isinstance(dist, dict):
        for key in ("rank", "world_size", "backend"):
            if isinstance(dist.get(key), (int, str)):
                meta[key] = dist[key]
    return meta


def load_trace(path: str | Path) -> Trace:
    """Load a Kineto trace (``.json`` or ``.json.gz``, detected by content) into a Trace.

    Raises :class:`InputError` naming the file for a missing, unreadable, truncated,
    non-JSON or non-trace file.
    """
    path = Path(path)
    doc = _parse_document(path, _read_bytes(path))
    b = _Builder()
    b.add(doc["traceEvents"])
    return _finish(path, doc, b)


def _finish(path: Path, doc: dict, b: _Builder) -> Trace:
    trace = Trace(
        kernels=b.build_kernels(), copies=b.build_copies(), api=b.build_api(),
        ranges=b.build_ranges(), cpu_ops=b.build_cpu_ops(), names=b.names,
        devices=_devices(doc), meta=_meta(path, doc),
    )
    _join_launch_thread(trace.kernels, trace.api)
    _join_launch_thread(trace.copies, trace.api)
    trace.meta["event_counts"] = dict(sorted(b.counts.items()))
    return trace
