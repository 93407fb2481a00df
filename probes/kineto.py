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
everything else        not kept (python_function, flows, instants, metadata rows)
=====================  =====================================================

Only complete events (``"ph": "X"``) are kept. ``trace.meta["event_counts"]`` counts
every event of the file by ``cat`` (``"<none>"`` for events without one), kept or not.
``kernel_cpu_op_index(trace)`` maps each kernel to the ``cpu_op`` that launched it.

How it reads: first by typed decoding (:mod:`probes.kineto_typed`: ISA-L inflate, the
array cut into pieces of whole events, each decoded by msgspec into structs of the kept
fields, pieces shared by two processes for big files). A file that path cannot cut is
read by the structural scanner: the decompressed bytes are streamed in chunks and
scanned with numpy (:mod:`probes.json_chunks`); categories are found first, so skipped
events cost only the scan; numbers are parsed by numpy's C parser and names sliced out in
bulk. Events (scanner) or pieces (typed path) that the fast code cannot read exactly go
to orjson and the same dict-based builder as :func:`load_trace_via_dicts` (the
reference the tests compare against), so results never depend on the path taken.

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

import bisect
import gzip
import os
import re
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import orjson

from . import json_chunks, sdpa
from .errors import InputError
from .events import (
    API_DOMAIN_DRIVER,
    API_DOMAIN_RUNTIME,
    API_DTYPE,
    API_GRAPH_LAUNCH,
    API_LAUNCH,
    API_MEMCPY,
    API_MEMSET,
    API_OTHER,
    API_SYNC,
    COPY_DIRECTION_NAMES,
    COPY_DTYPE,
    COPY_KIND_MEMCPY,
    COPY_KIND_MEMSET,
    COPY_UNKNOWN,
    CPU_OP_DTYPE,
    KERNEL_DTYPE,
    MISSING,
    RANGE_CUDA_SYNC,
    RANGE_DTYPE,
    RANGE_GPU_ANNOTATION,
    RANGE_PROFILER_STEP,
    RANGE_USER_ANNOTATION,
    Device,
    NameTable,
    Trace,
    empty,
)

__all__ = ["load_trace", "load_trace_via_dicts", "kernel_cpu_op_index", "api_category", "copy_direction"]

_DIRECTION_BY_NAME = {v.lower(): k for k, v in COPY_DIRECTION_NAMES.items()}
_COPY_NAME_RX = re.compile(r"\b([A-Za-z])to([A-Za-z])\b")

# API categories by name; checked in order, first match wins.
_API_CATEGORY_RX = [
    (API_GRAPH_LAUNCH, re.compile(r"^(cudaGraphLaunch|cuGraphLaunch|hipGraphLaunch)")),
    # HIP (ROCm traces): hipLaunchKernel, hipModuleLaunchKernel (Triton), hipExtLaunchKernel,
    # hipExtModuleLaunchKernel (hipBLASLt); they were "other", so ROCm kernels had no launch.
    (API_LAUNCH, re.compile(r"^(cudaLaunch|cuLaunch|hipLaunch|hipModuleLaunch|hipExtLaunch|hipExtModuleLaunch)")),
    (API_SYNC, re.compile(r"^(cuda|cu|hip)(Device|Stream|Event|Ctx)Synchronize")),
    (API_MEMCPY, re.compile(r"^(cudaMemcpy|cuMemcpy|hipMemcpy)")),
    (API_MEMSET, re.compile(r"^(cudaMemset|cuMemset|hipMemset)")),
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


# --------------------------------------------------------------------------- validation
#
# Kept apart from the parse core on purpose: what a value may be, not how it is read.
# Times are int64 ns; anything that is not a finite number, lies beyond +-2^62 ns
# (146 years from the epoch, so sums of two never wrap) or ends before it starts is
# dropped and counted by reason in ``trace.meta["rejected_events"]``, never turned into
# a silently wrong number.

TIME_LIMIT_NS = 1 << 62
_BAD_TIME = np.iinfo(np.int64).min   # marks a time the dict path could not read
_TIME_LIMIT_US = TIME_LIMIT_NS // 1000


def _us_value_to_ns(v) -> int:
    """One ``ts``/``dur`` value (microseconds) -> ns, or ``_BAD_TIME``."""
    if type(v) is int:
        return v * 1000 if -_TIME_LIMIT_US <= v <= _TIME_LIMIT_US else _BAD_TIME
    if type(v) is float:
        if not (-_TIME_LIMIT_US <= v <= _TIME_LIMIT_US):    # also False for NaN
            return _BAD_TIME
        ip = int(v // 1)
        return ip * 1000 + round((v - ip) * 1000.0)
    return _BAD_TIME   # a string, null, bool, list ...


def _checked_times(evs: list, out: np.ndarray) -> None:
    """start_ns/end_ns of dict events; ``_BAD_TIME`` where ts or dur is unusable
    (a missing dur is 0, a missing ts is unusable)."""
    conv = _us_value_to_ns
    start = np.fromiter((conv(e.get("ts")) for e in evs), dtype=np.int64, count=len(evs))
    dur = np.fromiter((conv(e.get("dur", 0)) for e in evs), dtype=np.int64, count=len(evs))
    bad = (start == _BAD_TIME) | (dur == _BAD_TIME)
    out["start_ns"] = np.where(bad, _BAD_TIME, start)
    out["end_ns"] = np.where(bad, _BAD_TIME, start + np.where(bad, 0, dur))


def _would_wrap(got: np.ndarray, up: np.ndarray, m: int):
    """None when ``got * 10**up`` stays within the time range for every value; else an
    ok mask over the ``m`` windows (False: re-read by the dict path, which rejects it)."""
    lim = TIME_LIMIT_NS // _POW10[np.clip(up, 0, 18)]
    over = (up > 0) & (np.abs(got) > lim)
    if not over.any():
        return None
    return ~over.reshape(m, -1).any(axis=1)


def _event_dict(raw: bytes) -> dict:
    """One event's JSON text as a dict. NaN and Infinity (Python's json writes them,
    orjson refuses them) are read so that validation can reject the event by reason."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    import json
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InputError(f"not valid JSON inside an event ({str(exc).splitlines()[0][:80]})") from None


def _has_key(cf, key: str, depth: int, rowmap: np.ndarray, n: int) -> np.ndarray:
    """Per selected event: does it have ``key`` at ``depth`` (whatever its value)?"""
    m = np.zeros(n, dtype=bool)
    m[cf.rows(key, depth, rowmap)[1]] = True
    return m


def reject_invalid_times(trace: Trace) -> None:
    """Drop rows whose times are unusable, counting each by kind and reason."""
    rejected: dict[str, dict[str, int]] = {}
    for kind in ("kernels", "copies", "api", "ranges", "cpu_ops"):
        a = getattr(trace, kind)
        if not len(a):
            continue
        s, e = a["start_ns"], a["end_ns"]
        unreadable = (s == _BAD_TIME) | (e == _BAD_TIME)
        unreadable |= (np.abs(s) > TIME_LIMIT_NS) | (np.abs(e) > TIME_LIMIT_NS)
        negative = ~unreadable & (e < s)
        drop = unreadable | negative
        if not drop.any():
            continue
        reasons = {"ts or dur not a number within +-2^62 ns": int(unreadable.sum()),
                   "negative duration": int(negative.sum())}
        rejected[kind] = {k: v for k, v in reasons.items() if v}
        setattr(trace, kind, a[~drop])
    if rejected:
        trace.meta["rejected_events"] = rejected


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
    doc = json_chunks.parse_json(path, data)
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise InputError(f"{path}: not a Kineto/Chrome trace (JSON without a traceEvents array)")
    return doc


# --------------------------------------------------------------------------- columns

def _us_to_ns(values: list) -> np.ndarray:
    """Microseconds (ints, or floats with <= 3 decimals) -> int64 ns, exact.

    Floats are split into integer and fractional parts so that large absolute
    timestamps (1.7e15 us) keep nanosecond resolution. A value that is not a finite
    number within +-2^62 ns becomes ``_BAD_TIME`` (dropped and counted by
    :func:`reject_invalid_times`), never a wrapped integer.
    """
    a = np.asarray(values)
    if a.dtype.kind in "iu":
        ok = (a >= -_TIME_LIMIT_US) & (a <= _TIME_LIMIT_US)
        return np.where(ok, np.where(ok, a, 0).astype(np.int64) * 1000, _BAD_TIME)
    if a.dtype.kind != "f":      # strings, None, mixed: one by one
        return np.fromiter((_us_value_to_ns(v) for v in values), dtype=np.int64, count=len(values))
    a = a.astype(np.float64)
    ok = (a >= -_TIME_LIMIT_US) & (a <= _TIME_LIMIT_US)      # False for NaN and infinities
    a = np.where(ok, a, 0.0)
    ip = np.floor(a)
    ns = ip.astype(np.int64) * 1000 + np.rint((a - ip) * 1000.0).astype(np.int64)
    return np.where(ok, ns, _BAD_TIME)


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
            if type(e) is not dict:   # not an event; ignored (the streaming path never sees it)
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
        _checked_times(evs, out)

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
        out["is_causal"] = [sdpa.causal_flag(e.get("name"), a.get("Concrete Inputs"), a.get("Input type"))
                            if e.get("name") in sdpa.SDPA_OPS else sdpa.CAUSAL_FLAG_UNKNOWN
                            for e, a in zip(evs, args)]
        return out


def _xyz(v) -> tuple[int, int, int]:
    if isinstance(v, list) and len(v) == 3 and all(type(x) is int for x in v):
        return v[0], v[1], v[2]
    return MISSING, MISSING, MISSING


def _per_name(names: NameTable, ids: np.ndarray, fn, dtype) -> np.ndarray:
    """Apply ``fn(name)`` once per distinct name id, then broadcast (vectorised).
    Name ids are dense (0..len(names)-1, MISSING for none): a table indexed by id + 1
    replaces a sort of all the ids (np.unique), linear in the rows."""
    if not len(ids):
        return np.zeros(0, dtype=dtype)
    if ids.min() < MISSING:     # not a name id: the sorting way, as before
        uniq, inv = np.unique(ids, return_inverse=True)
        vals = np.array([fn(names[i]) if i >= 0 else 0 for i in uniq.tolist()], dtype=dtype)
        return vals[inv]
    present = np.flatnonzero(np.bincount(ids.astype(np.int64) + 1, minlength=1))
    table = np.zeros(int(present[-1]) + 1, dtype=dtype)
    table[present] = [fn(names[i - 1]) if i > 0 else 0 for i in present.tolist()]
    return table[ids.astype(np.int64) + 1]


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

    Memory: the API records and operators (5.6 M and 4.2 M at a million kernels) are read
    :data:`JOIN_ROWS` at a time against the kernels' sorted keys; nothing the size of
    either is sorted or copied, so the transient memory follows the kernels and the block.
    """
    k = trace.kernels
    ops = trace.cpu_ops
    out = np.full(len(k), MISSING, dtype=np.int64)
    if not len(ops) or not len(k):
        return out
    api_pos, api_hit = _api_for(k["correlation_id"], trace.api)
    if _external_id_is_correlation(trace.api):
        rest = np.flatnonzero(api_hit)
        out[rest] = _enclosing_launch(ops, trace.api, api_pos[rest])
        return out
    ext = k["external_id"].copy()
    if len(trace.api):
        api_ext = trace.api["external_id"][api_pos]
        ext = np.where((ext < 0) & api_hit, api_ext, ext)
        del api_ext
    # the op with each External id that starts last (ties: the later record) is the innermost
    keys, inv = np.unique(ext, return_inverse=True)
    op = _last_starting(keys, ops["external_id"], ops["start_ns"])[inv]
    hit = (op >= 0) & (ext >= 0)
    out[hit] = op[hit]
    del keys, inv, op, ext
    hit ^= True
    hit &= api_hit
    rest = np.flatnonzero(hit)
    del hit
    if len(rest):
        out[rest] = _enclosing_launch(ops, trace.api, api_pos[rest])
    return out


# Rows of the API records or operators read at a time by the joins: bounds their transient
# memory (a few tens of bytes a row) whatever the trace's size.
JOIN_ROWS = 1 << 18


def _key_positions(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``values`` equal to one of the sorted unique ``keys``, and that key's index."""
    p = np.searchsorted(keys, values)
    np.minimum(p, len(keys) - 1, out=p)
    j = np.flatnonzero(keys[p] == values)
    return j, p[j]


def _first_row(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """For each of the sorted unique ``keys``, the first row of ``values`` equal to it; -1 if none."""
    first = np.full(len(keys), -1, dtype=np.int64)
    if not len(keys):
        return first
    for lo in range(0, len(values), JOIN_ROWS):
        j, p = _key_positions(keys, values[lo:lo + JOIN_ROWS])
        if not len(j):
            continue
        u, at = np.unique(p, return_index=True)    # the first row of the block per key
        new = first[u] < 0
        first[u[new]] = j[at[new]] + lo
    return first


def _last_starting(keys: np.ndarray, values: np.ndarray, start: np.ndarray) -> np.ndarray:
    """For each of the sorted unique ``keys``, the row of ``values`` equal to it with the
    latest ``start`` (ties: the last such row); -1 if none."""
    best = np.full(len(keys), -1, dtype=np.int64)
    best_start = np.zeros(len(keys), dtype=np.int64)
    if not len(keys):
        return best
    for lo in range(0, len(values), JOIN_ROWS):
        j, p = _key_positions(keys, values[lo:lo + JOIN_ROWS])
        if not len(j):
            continue
        s = start[lo:lo + JOIN_ROWS][j]
        o = np.lexsort((s, p))                       # stable: equal starts keep row order
        j, p, s = j[o], p[o], s[o]
        last = np.append(p[1:] != p[:-1], True)      # the last row of each key in the block
        j, p, s = j[last] + lo, p[last], s[last]
        # later blocks hold later rows, so an equal start replaces the earlier row
        take = (best[p] < 0) | (s >= best_start[p])
        best[p[take]], best_start[p[take]] = j[take], s[take]
    return best


def _external_id_is_correlation(api: np.ndarray) -> bool:
    """True for older Kineto, whose API records carry External id == correlation id
    (an id of the launch itself, not of the operator), so matching ops by it would pair
    unrelated records whose numbers happen to coincide."""
    ext = api["external_id"]
    launches = (api["category"] == API_LAUNCH) & (ext >= 0)   # masks, not a copy of the rows
    n = int(np.count_nonzero(launches))
    if not n:
        return False
    launches &= ext == api["correlation_id"]
    return int(np.count_nonzero(launches)) / n > 0.9


def _api_for(correlation: np.ndarray, api: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index into ``api`` of the (first) record with each correlation id, and whether it
    exists (the index is 0 where it does not)."""
    if not len(api) or not len(correlation):
        return np.zeros(len(correlation), dtype=np.int64), np.zeros(len(correlation), dtype=bool)
    keys, inv = np.unique(correlation, return_inverse=True)
    pos = _first_row(keys, api["correlation_id"])[inv]
    hit = (pos >= 0) & (correlation >= 0)
    pos[~hit] = 0
    return pos, hit


def _stack_parents(thread: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Parent of each interval (sorted by thread, start, longer first) as a stack pass per
    thread gives it: the latest earlier interval of the thread with end >= this start,
    -1 if none.

    Vectorised by pointer jumping: every candidate starts at the previous interval; one
    whose candidate ends before its start jumps to the candidate's own current candidate,
    which skips only intervals ending before the candidate's start (so before its own).
    Rounds grow with the nesting depth, not the number of intervals."""
    n = len(start)
    idx = np.int32 if n < 2**31 - 1 else np.int64    # half the temporaries' memory
    cand = np.arange(-1, n - 1, dtype=idx)
    if n:
        cand[0] = -1
        cand[1:][thread[1:] != thread[:-1]] = -1
    todo = np.flatnonzero(cand >= 0).astype(idx)
    while len(todo):
        c = cand[todo]
        bad = end[c] < start[todo]
        todo = todo[bad]
        cand[todo] = cand[c[bad]]
        todo = todo[cand[todo] >= 0]
    return cand


def _enclosing_launch(ops: np.ndarray, api: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """:func:`_enclosing` of the API records ``rows`` (their thread and start)."""
    return _enclosing(ops, api["pid"][rows], api["tid"][rows], api["start_ns"][rows])


def _rows_where(mask: np.ndarray) -> np.ndarray:
    """``np.flatnonzero(mask)`` as int32 where that fits, built a block at a time (the
    int64 result for a whole thread's operators is the largest temporary otherwise)."""
    idx = np.int32 if len(mask) < 2**31 - 1 else np.int64
    out = np.empty(int(np.count_nonzero(mask)), dtype=idx)
    at = 0
    for lo in range(0, len(mask), JOIN_ROWS):
        j = np.flatnonzero(mask[lo:lo + JOIN_ROWS])
        out[at:at + len(j)] = j + lo
        at += len(j)
    return out


def _in_stack_order(ops: np.ndarray, members: np.ndarray) -> np.ndarray:
    """``members`` (rows of one thread's operators, owned by the caller) ordered by start,
    longer first on equal starts: the stack pass's order, as ``np.lexsort((-end, start))``
    gives it. Operators come in start order in the files seen (Kineto writes them so) but
    not always longer first among equal starts: then only runs of equal starts are
    reordered, in place, a block at a time whose bounds fall between runs."""
    st, en = ops["start_ns"], ops["end_ns"]
    n = len(members)
    ties_out_of_order = False
    for lo in range(0, n, JOIN_ROWS):
        m = members[lo:lo + JOIN_ROWS + 1]          # one row of overlap with the next block
        s, e = st[m], en[m]
        ds = s[1:] - s[:-1]
        if (ds < 0).any():                          # not in start order: sort all
            s, e = st[members], en[members]
            o = np.lexsort((-e, s))
            del s, e
            return members[o]
        ties_out_of_order |= bool(((ds == 0) & (e[1:] > e[:-1])).any())
    if not ties_out_of_order:
        return members
    lo = 0
    while lo < n:
        hi = min(lo + JOIN_ROWS, n)
        if hi < n:                                  # move the bound past the run it splits
            last = int(st[members[hi - 1]])
            hi = bisect.bisect_right(members, last, lo=hi, key=lambda i: int(st[i]))
        block = members[lo:hi]
        block[:] = block[np.lexsort((-en[block], st[block]))]
        lo = hi
    return members


def _enclosing(ops: np.ndarray, pid: np.ndarray, tid: np.ndarray, t_ns: np.ndarray) -> np.ndarray:
    """Innermost op on thread (pid, tid) whose [start, end] contains t_ns; -1 if none.

    Ops on one thread nest properly, so the answer is the latest-starting op with
    start <= t, or the nearest ancestor of it that still contains t. One thread at a
    time and, within it, :data:`JOIN_ROWS` operators at a time in start order: a block's
    parents are computed with the chain of operators still open where it begins (the
    stack of a stack pass, at most the nesting depth) put in front of it, which is all a
    stack pass over the whole thread would have there, so the parents are the same.
    """
    res = np.full(len(t_ns), -1, dtype=np.int64)
    if not len(t_ns) or not len(ops):
        return res
    qkey = (pid.astype(np.int64) << 32) | (tid.astype(np.int64) & 0xFFFFFFFF)
    op_pid, op_tid, op_st, op_en = ops["pid"], ops["tid"], ops["start_ns"], ops["end_ns"]
    for kv in np.unique(qkey).tolist():
        low = kv & 0xFFFFFFFF
        members = _rows_where((op_pid == kv >> 32) & (op_tid == (low - (1 << 32) if low >> 31 else low)))
        if not len(members):
            continue
        members = _in_stack_order(ops, members)
        q = _rows_where(qkey == kv)
        tq = t_ns[q]
        # block b holds the queries whose latest-starting op is in it (none before the first op)
        bounds = op_st[members[::JOIN_ROWS]].tolist() + [None]
        open_chain = np.zeros(0, dtype=members.dtype)
        for b, lo in enumerate(range(0, len(members), JOIN_ROWS)):
            rows = np.concatenate((open_chain, members[lo:lo + JOIN_ROWS]))
            st, en = op_st[rows], op_en[rows]
            parent = _stack_parents(np.zeros(len(rows), dtype=np.int8), st, en)
            inside = tq >= bounds[b]
            if bounds[b + 1] is not None:
                inside &= tq < bounds[b + 1]
            here = _rows_where(inside)
            del inside
            if len(here):
                t = tq[here]
                n0 = len(open_chain)
                cand = n0 + np.searchsorted(st[n0:], t, side="right") - 1
                for _ in range(64):  # nesting depth bound; each round climbs one level
                    bad = (cand >= 0) & (en[np.maximum(cand, 0)] < t)
                    if not bad.any():
                        break
                    cand = np.where(bad, parent[np.maximum(cand, 0)], cand)
                res[q[here]] = np.where(cand >= 0, rows[np.maximum(cand, 0)], -1)
            chain = []                               # the last row and its ancestors
            i = len(rows) - 1
            while i >= 0:
                chain.append(i)
                i = int(parent[i])
            open_chain = rows[chain[::-1]]
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
    # A trace written by ``ridgeline simulate --trace`` names its model and says it is
    # simulated in ``metadata`` (agent.simulator.kineto_writer); other writers' metadata
    # is not read (it is free-form).
    md = doc.get("metadata")
    if isinstance(md, dict) and str(md.get("generator", "")).startswith("ridgeline"):
        if isinstance(md.get("model"), str):
            meta["model"] = md["model"][:200]
        if md.get("simulated") is True:
            meta["simulated"] = True
    dist = doc.get("distributedInfo")
    if isinstance(dist, dict):
        for key in ("rank", "world_size", "backend"):
            if isinstance(dist.get(key), (int, str)):
                meta[key] = dist[key]
    return meta


def load_trace_via_dicts(path: str | Path) -> Trace:
    """Same contract as :func:`load_trace`, by parsing the whole document into Python
    objects. Slow and memory-hungry (a dict per event); kept as the independent
    reference the streaming importer is tested against."""
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
    return _joined(trace, b.counts)


def _joined(trace: Trace, counts: dict) -> Trace:
    reject_invalid_times(trace)
    _join_launch_thread(trace.kernels, trace.api)
    _join_launch_thread(trace.copies, trace.api)
    trace.meta["event_counts"] = dict(sorted(counts.items()))
    return trace


# --------------------------------------------------------------------------- streaming
#
# The streaming importer never builds a Python object per event. json_chunks finds the
# events and every key/value colon of a chunk; keys and category values are identified
# by a 64-bit signature of their bytes; numbers are parsed from fixed-width byte windows
# with numpy; only strings that become names (kernel, API and op names, shapes) are
# sliced out as bytes and interned. An event the vectorised path cannot read exactly
# (an exponent, more than 18 digits, an unexpected shape) is parsed alone with orjson
# by the dict path above, so the result never depends on which path read it.

_C1 = np.uint64(0x9E3779B97F4A7C15)
_C2 = np.uint64(0xC2B2AE3D27D4EB4F)
_POW10 = np.array([10 ** i for i in range(19)], dtype=np.int64)


def _u64(buf: bytes) -> np.ndarray:
    """Unaligned view: element i is the 8 bytes starting at buf[i] (little-endian)."""
    return np.ndarray(shape=(len(buf) - 8,), dtype="<u8", buffer=buf, strides=(1,))


def _sig(u64: np.ndarray, start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """64-bit signature of the byte strings buf[start:start+length] (first 16 bytes + length)."""
    length = length.astype(np.uint64)
    x = u64[start]
    short = length < 8
    x = np.where(short, x & ((np.uint64(1) << (length * np.uint64(8) * short)) - np.uint64(1)), x)
    with np.errstate(over="ignore"):
        h = x * _C1 + length
        long_ = np.flatnonzero(length > 8)
        if len(long_):
            l1 = length[long_] - np.uint64(8)
            y = u64[start[long_] + 8]
            y = np.where(l1 < 8, y & ((np.uint64(1) << (l1 * np.uint64(8) * (l1 < 8))) - np.uint64(1)), y)
            h[long_] += y * _C2
    return h


def _sig_of(text: str) -> int:
    b = text.encode() + b" " * 32
    return int(_sig(_u64(b), np.array([0]), np.array([len(text.encode())]))[0])


_KEYS = ["cat", "ph", "name", "pid", "tid", "ts", "dur", "args",
         "device", "stream", "context", "correlation", "External id", "registers per thread",
         "shared memory", "grid", "block", "bytes", "cbid", "Input Dims", "Input type", "Concrete Inputs"]
_K = {k: i for i, k in enumerate(_KEYS)}
_KEY_SIGS = np.array([_sig_of(k) for k in _KEYS], dtype=np.uint64)
_KEY_ORDER = np.argsort(_KEY_SIGS)
_KEY_SORTED = _KEY_SIGS[_KEY_ORDER]

# categories the importer keeps, by kind
_CATS = ["kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "cpu_op",
         "user_annotation", "gpu_user_annotation", "cuda_sync"]
_CAT_CODE = {_sig_of(c): i for i, c in enumerate(_CATS)}
_CAT_NONE = -1      # no "cat" key
_CAT_OTHER = -2     # a category we do not keep
(_C_KERNEL, _C_MEMCPY, _C_MEMSET, _C_RUNTIME, _C_DRIVER, _C_CPU_OP,
 _C_USER, _C_GPU_USER, _C_SYNC) = range(len(_CATS))


class _ChunkFields:
    """Keys and value positions of one chunk, and per-event category."""

    def __init__(self, chunk: json_chunks.Chunk, counts: dict, cat_names: dict):
        s = chunk.scan
        self.s = s
        self.buf = s.buf
        a = self.a = s.a
        self.u64 = u64 = _u64(s.buf)
        q = s.quotes
        self.q_ext = q_ext = np.concatenate([q, [s.n, s.n]])   # so j + 1, j + 2 always index
        self.starts, self.ends = starts, ends = chunk.starts, chunk.ends
        self.nev = nev = len(starts)
        self.cat = cat = np.full(nev, _CAT_NONE, dtype=np.int8)
        self._slen = None
        self._closes2 = None

        # 1. category of each event, from its depth-1 "cat" key, before anything else, so
        #    that events we do not keep (python_function, flows, instants) cost nothing more
        ck, ck_v = self._event_keys(b'"cat"')
        ck_j, ck_ev = ck
        is_str = q_ext[ck_j + 1] == ck_v
        ck_j, ck_ev, ck_v = ck_j[is_str], ck_ev[is_str], ck_v[is_str]
        vs = ck_v + 1
        ve = q_ext[ck_j + 2]
        csig = _sig(u64, vs, ve - vs)
        uniq, first, inv, cnt = np.unique(csig, return_index=True, return_inverse=True, return_counts=True)
        code = np.empty(len(uniq), dtype=np.int8)
        for i, (u, f) in enumerate(zip(uniq.tolist(), first.tolist())):
            name = cat_names.get(u)
            if name is None:
                name = cat_names[u] = _decode(self.buf[vs[f]:ve[f]])
            counts[name] = counts.get(name, 0) + int(cnt[i])
            code[i] = _CAT_CODE.get(u, _CAT_OTHER)
        cat[ck_ev] = code[inv]
        none = int((cat == _CAT_NONE).sum())
        if none:
            counts["<none>"] = counts.get("<none>", 0) + none
        (pk_j, pk_ev), pv = self._event_keys(b'"ph"')
        not_x = (a[pv] != 34) | (a[pv + 1] != ord("X")) | (a[pv + 2] != 34)
        cat[pk_ev[not_x]] = _CAT_OTHER

        # 2. every key of the kept events: closing quotes followed by ':'
        kept = np.flatnonzero(cat >= 0)
        lo = np.searchsorted(q, starts[kept])
        hi = np.searchsorted(q, ends[kept])
        lo += lo & 1 == 0                     # first closing quote (odd index) in the event
        cnt_q = np.maximum((hi - lo + 1) // 2, 0)
        total = int(cnt_q.sum())
        offs = np.cumsum(cnt_q) - cnt_q
        jc = np.repeat(lo - 2 * offs, cnt_q) + 2 * np.arange(total)
        evq = np.repeat(kept, cnt_q)
        after = q[jc] + 1
        nx = a[after]
        is_key = nx == 58
        ws = np.flatnonzero(json_chunks.WS[nx])
        if len(ws):
            p = json_chunks.skip(a, after[ws], json_chunks.WS)
            is_key[ws] = a[p] == 58
            after[ws] = p
        j, colon, ev = jc[is_key], after[is_key], evq[is_key]
        b = s.before[j]
        depth = s.depth[np.maximum(b - 1, 0)]
        keep = (depth >= 1) & (depth <= 2)
        if not keep.all():
            j, colon, ev, depth = j[keep], colon[keep], ev[keep], depth[keep]
        kopen = q[j - 1] + 1
        ksig = _sig(u64, kopen, q[j] - kopen)
        pos = np.minimum(np.searchsorted(_KEY_SORTED, ksig), len(_KEY_SORTED) - 1)
        known = np.flatnonzero(_KEY_SORTED[pos] == ksig)
        kid = _KEY_ORDER[pos[known]].astype(np.int8)
        order = np.argsort(kid, kind="stable")
        self.kid = kid[order]
        sel = known[order]
        self.cdep = depth[sel]
        self.cev = ev[sel]
        self.kj = j[sel]
        v = colon[sel] + 1
        v = v + (a[v] == 32)                  # "key": value  (one space, the common case)
        more = np.flatnonzero(json_chunks.WS[a[v]])
        if len(more):
            v[more] = json_chunks.skip(a, v[more], json_chunks.WS)
        self.v = v
        self._bounds = np.searchsorted(self.kid, np.arange(len(_KEYS) + 1))

    def _event_keys(self, pattern: bytes):
        """((quote index of the closing quote, event), value position) of the depth-1
        keys spelled ``pattern`` (with its quotes) in every event of the chunk."""
        a, s = self.a, self.s
        if self._slen is None:
            q = s.quotes
            m = len(q) // 2
            self._slen = q[1:2 * m:2] - q[0:2 * m:2] - 1   # length of every string
        L = len(pattern) - 2
        cand = np.flatnonzero(self._slen == L)
        jo = 2 * cand
        qo = s.quotes[jo]
        for i in range(L):
            ok = a[qo + 1 + i] == pattern[1 + i]
            jo, qo = jo[ok], qo[ok]
        cand = jo + 1
        after = json_chunks.skip(a, qo + L + 2, json_chunks.WS)
        ok = a[after] == 58
        cand, after = cand[ok], after[ok]
        b = s.before[cand]
        depth = np.where(b > 0, s.depth[np.maximum(b - 1, 0)], 0)
        ev = np.searchsorted(self.starts, after, side="right") - 1
        ok = (depth == 1) & (ev >= 0) & (ev < self.nev)
        cand, after, ev = cand[ok], after[ok], ev[ok]
        ok = after < self.ends[ev]
        cand, after, ev = cand[ok], after[ok], ev[ok]
        v = json_chunks.skip(self.a, after + 1, json_chunks.WS)
        return (cand, ev), v

    # -- field access for a set of events ------------------------------------------
    def rows(self, key: str, depth: int, rowmap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(key rows, output rows) of ``key`` at ``depth`` in the selected events."""
        k = _K[key]
        lo, hi = self._bounds[k], self._bounds[k + 1]
        r = lo + np.flatnonzero(self.cdep[lo:hi] == depth)
        out = rowmap[self.cev[r]]
        sel = out >= 0
        return r[sel], out[sel]

    def numbers(self, key: str, depth: int, rowmap: np.ndarray, n: int, scale: int,
                bad: np.ndarray) -> np.ndarray:
        """int64 column (MISSING where absent or not a number), value * 10**scale."""
        col = np.full(n, MISSING, dtype=np.int64)
        r, o = self.rows(key, depth, rowmap)
        if len(r):
            v = self.v[r]
            vals, status = _parse_windows(self.a, v, self.q_ext[self.kj[r] + 1], scale, 1)
            ok = status == 0
            col[o[ok]] = vals[ok, 0]
            bad[o[status == 2]] = True
        return col

    def triples(self, key: str, rowmap: np.ndarray, n: int, bad: np.ndarray) -> np.ndarray:
        """n x 3 int64 from ``[x, y, z]`` values of an args key."""
        out = np.full((n, 3), MISSING, dtype=np.int64)
        r, o = self.rows(key, 2, rowmap)
        if not len(r):
            return out
        v = self.v[r]
        is_arr = self.a[v] == ord("[")
        vals, status = _parse_windows(self.a, v + 1, self.q_ext[self.kj[r] + 1], 0, 3)
        ok = is_arr & (status == 0)
        out[o[ok]] = vals[ok]
        bad[o[~ok]] = True
        return out

    def strings(self, key: str, depth: int, rowmap: np.ndarray, n: int,
                interner: "_Interner", bad: np.ndarray) -> np.ndarray:
        """Name ids of string values (MISSING where absent)."""
        col = np.full(n, MISSING, dtype=np.int32)
        r, o = self.rows(key, depth, rowmap)
        if not len(r):
            return col
        v = self.v[r]
        qs = self.q_ext[self.kj[r] + 1]
        is_str = qs == v
        bad[o[~is_str & (self.a[v] != ord("n"))]] = True   # null is simply absent
        r, o, qs = r[is_str], o[is_str], qs[is_str]
        col[o] = interner.ids(self.a, qs + 1, self.q_ext[self.kj[r] + 2])
        return col

    def raw_json(self, key: str, rowmap: np.ndarray, n: int, interner: "_Interner",
                 bad: np.ndarray) -> np.ndarray:
        """Name ids of the compact JSON text of array values of an args key."""
        col = np.full(n, MISSING, dtype=np.int32)
        r, o = self.rows(key, 2, rowmap)
        if not len(r):
            return col
        s = self.s
        v = self.v[r]
        is_arr = self.a[v] == ord("[")
        bad[o[~is_arr & (self.a[v] != ord("n"))]] = True
        v, o = v[is_arr], o[is_arr]
        if self._closes2 is None:
            self._closes2 = s.pos[(s.depth == 2) & (s.cls >= 3)]
        closes = self._closes2
        end = closes[np.minimum(np.searchsorted(closes, v), len(closes) - 1)] + 1
        col[o] = interner.json_ids(self.a, v, end)
        return col

    def json_values(self, key: str, rowmap: np.ndarray, want: np.ndarray) -> dict[int, object]:
        """Output row -> decoded array value of an args key, for the output rows where
        ``want`` is True (a few rows: each value is decoded on its own)."""
        r, o = self.rows(key, 2, rowmap)
        sel = want[o]
        r, o = r[sel], o[sel]
        if not len(r):
            return {}
        v = self.v[r]
        is_arr = self.a[v] == ord("[")
        v, o = v[is_arr], o[is_arr]
        if self._closes2 is None:
            self._closes2 = self.s.pos[(self.s.depth == 2) & (self.s.cls >= 3)]
        closes = self._closes2
        end = closes[np.minimum(np.searchsorted(closes, v), len(closes) - 1)] + 1
        out = {}
        for row, lo, hi in zip(o.tolist(), v.tolist(), end.tolist()):
            try:
                out[row] = orjson.loads(self.a[lo:hi].tobytes())
            except orjson.JSONDecodeError:
                pass
        return out

    def event_dicts(self, events: np.ndarray) -> list[dict]:
        buf = self.buf
        return [_event_dict(buf[s:e + 1]) for s, e in zip(self.starts[events].tolist(),
                                                          self.ends[events].tolist())]


# bytes kept when numbers are handed to numpy's C parser: digits, '-', '.';
# exponent characters become 'x' so that such a number fails to parse (-> slow path);
# everything else (',', '}', ']', whitespace) becomes a separator.
_NUMMAP = np.full(256, 32, dtype=np.uint8)
for _c in b"0123456789-.":
    _NUMMAP[_c] = _c
for _c in b"eE+":
    _NUMMAP[_c] = ord("x")
_MAX_WINDOW = 64


def _parse_windows(a: np.ndarray, v: np.ndarray, end: np.ndarray, scale: int,
                   per: int) -> tuple[np.ndarray, np.ndarray]:
    """Parse ``per`` JSON numbers from each window a[v:end] (a value up to the next
    quote); values times 10**scale, exactly (integer arithmetic, no float rounding).

    Returns (values n x per, status): 0 parsed, 1 not a number (string, null, bool:
    the caller treats it as absent), 2 not read exactly here (exponent, > 18 digits,
    extra decimals, wrong count): the caller re-reads that event with orjson.
    """
    n = len(v)
    vals = np.full((n, per), MISSING, dtype=np.int64)
    status = np.ones(n, dtype=np.int8)
    first = a[v]
    num = ((first >= 48) & (first <= 57)) | (first == 45)
    length = end - v
    status[num & (length > _MAX_WINDOW)] = 2
    idx = np.flatnonzero(num & (length <= _MAX_WINDOW))
    for _ in range(2):
        if not len(idx):
            return vals, status
        got, ok = _parse_selected(a, v[idx], length[idx], scale, per)
        if ok is None:
            vals[idx] = got
            status[idx] = 0
            return vals, status
        status[idx[~ok]] = 2          # drop the windows that broke the count, retry once
        idx = idx[ok]
    status[idx] = 2
    return vals, status


def _parse_selected(a, v, length, scale, per):
    """(values, None) on success, or (None, per-window ok mask) when some window does
    not hold exactly ``per`` plain numbers."""
    m = len(v)
    offsets = np.cumsum(length) - length
    total = int(length.sum())
    idx = np.repeat(v - offsets, length) + np.arange(total)
    blob = _NUMMAP[a[idx]]
    dots = np.flatnonzero(blob == 46)
    frac = np.zeros(m * per, dtype=np.int64)
    if len(dots):
        seps = np.flatnonzero(blob == 32)
        nxt = seps[np.minimum(np.searchsorted(seps, dots), len(seps) - 1)]
        nxt = np.where(nxt > dots, nxt, total)
        w = np.searchsorted(offsets, dots, side="right") - 1
        if per != 1 or (np.bincount(w, minlength=m) > 1).any():
            ok = np.ones(m, dtype=bool)
            ok[w] = False             # decimals in a triple, or two dots in a window
            return None, ok
        frac[w] = nxt - dots - 1
        blob = blob[blob != 46]
    blob_b = blob.tobytes()
    try:
        with _quiet():
            got = np.fromstring(blob_b, dtype=np.int64, sep=" ")
    except ValueError:          # trailing junk (e.g. an exponent): find the windows below
        got = np.empty(0, dtype=np.int64)
    # 19+ digit integers saturate silently in the C parser: send them to the slow path
    if len(got) != m * per or (frac > 18).any() or (np.abs(got) >= 10**18).any():
        return None, _token_counts_ok(blob, offsets if not len(dots) else None, m, per, v, a, length)
    up = scale - frac
    wraps = _would_wrap(got, up, m)
    if wraps is not None:
        return None, wraps
    scaled = np.where(up >= 0, got * _POW10[np.clip(up, 0, 18)], 0)
    down = up < 0
    if down.any():
        div = _POW10[np.clip(-up, 0, 18)]
        if (got[down] % div[down] != 0).any():
            ok = np.ones(m, dtype=bool)
            ok[np.flatnonzero(down)[got[down] % div[down] != 0] // per] = False
            return None, ok
        scaled = np.where(down, got // div, scaled)
    return scaled.reshape(m, per), None


def _token_counts_ok(blob, offsets, m, per, v, a, length):
    """Per window: does it hold exactly ``per`` tokens that are plain numbers?"""
    if offsets is None:   # dots were removed: recompute on the original bytes
        offsets = np.cumsum(length) - length
        total = int(length.sum())
        idx = np.repeat(v - offsets, length) + np.arange(total)
        blob = _NUMMAP[a[idx]]
    is_tok = blob != 32
    start = is_tok.copy()
    start[1:] &= ~is_tok[:-1]
    start[offsets] = is_tok[offsets]
    w = np.searchsorted(offsets, np.flatnonzero(start), side="right") - 1
    cnt = np.bincount(w, minlength=m)
    bad_chars = np.bincount(np.searchsorted(offsets, np.flatnonzero(blob == ord("x")), side="right") - 1,
                            minlength=m)
    ok = (cnt == per) & (bad_chars == 0)
    if ok.all():   # the count was right: a value too large for int64; all go the slow path
        ok[:] = False
    return ok


class _quiet:
    """np.fromstring(sep=...) warns on trailing junk; the count check handles it."""

    def __enter__(self):
        import warnings
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


def _decode(raw: bytes) -> str:
    if b"\\" in raw:
        return orjson.loads(b'"' + raw + b'"')
    return raw.decode("utf-8", errors="replace")


def _slices(a: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> list[bytes]:
    """buf[s:e] for many ranges at once: one gather and one C-level split instead of a
    Python slice per range. NUL separates them: JSON text never holds a raw NUL."""
    n = len(starts)
    if not n:
        return []
    L = ends - starts + 1
    offs = np.cumsum(L) - L
    idx = np.repeat(starts - offs, L) + np.arange(int(L.sum()))
    out = a[idx]
    out[offs + L - 1] = 0
    return out.tobytes().split(b"\x00")[:n]


class _Interner:
    """bytes -> name id, decoding each distinct string once."""

    def __init__(self, names: NameTable):
        self.names = names
        self.by_bytes: dict[bytes, int] = {}
        self.by_json: dict[bytes, int] = {}

    def _ids(self, d: dict, raws: list, make) -> np.ndarray:
        out = list(map(d.get, raws))
        if None in out:
            for i, r in enumerate(raws):
                if out[i] is None:
                    j = d.get(r)
                    if j is None:
                        j = d[r] = self.names.intern(make(r))
                    out[i] = j
        return np.array(out, dtype=np.int32)

    def ids(self, a: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        return self._ids(self.by_bytes, _slices(a, starts, ends), _decode)

    def json_ids(self, a: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        return self._ids(self.by_json, _slices(a, starts, ends),
                         lambda r: orjson.dumps(orjson.loads(r)).decode())


def _select(cf: _ChunkFields, codes: tuple) -> tuple[np.ndarray, np.ndarray]:
    events = np.flatnonzero(np.isin(cf.cat, codes))
    rowmap = np.full(cf.nev, -1, dtype=np.int64)
    rowmap[events] = np.arange(len(events))
    return events, rowmap


def _times(cf: _ChunkFields, rowmap, n, out, bad) -> None:
    ts = cf.numbers("ts", 1, rowmap, n, 3, bad)
    dur = cf.numbers("dur", 1, rowmap, n, 3, bad)
    bad |= ts == MISSING
    bad |= (dur == MISSING) & _has_key(cf, "dur", 1, rowmap, n)
    out["start_ns"] = ts
    out["end_ns"] = ts + np.where(dur == MISSING, 0, dur)


def _ids32(col: np.ndarray) -> np.ndarray:
    """pid/tid to int32 as _id32 does: out-of-range ids folded, missing stays -1."""
    return np.where((col >= -1) & (col <= _INT32_MAX), col, col & _INT32_MAX).astype(np.int32)


def _fallback(cf: _ChunkFields, events: np.ndarray, bad: np.ndarray, out: np.ndarray,
              b: _Builder, build) -> None:
    """Re-read the flagged events with orjson through the dict path, in place."""
    if not bad.any():
        return
    rows = np.flatnonzero(bad)
    dicts = cf.event_dicts(events[rows])
    tmp = _Builder()
    tmp.names = b.names
    tmp.add(dicts)
    out[rows] = build(tmp)


def _chunk_rows(cf, interner, b, dtype, codes, fill, build) -> np.ndarray:
    """Rows of one event kind (categories ``codes``) of a chunk.

    The columns every kind has (times, name) are read here, the kind's own by ``fill``;
    rows the vectorised read flags ``bad`` are re-read by the dict path (``build``).
    """
    events, rowmap = _select(cf, codes)
    n = len(events)
    out = empty(dtype, n)
    if not n:
        return out
    bad = np.zeros(n, dtype=bool)
    _times(cf, rowmap, n, out, bad)
    out["name_id"] = cf.strings("name", 1, rowmap, n, interner, bad)
    fill(cf, interner, b, events, rowmap, n, out, bad)
    _fallback(cf, events, bad, out, b, build)
    return out


def _fill_kernels(cf, interner, b, events, rowmap, n, out, bad):
    for col, key in (("device", "device"), ("stream", "stream"), ("context", "context"),
                     ("correlation_id", "correlation"), ("external_id", "External id"),
                     ("registers", "registers per thread"), ("shared_mem_bytes", "shared memory")):
        out[col] = cf.numbers(key, 2, rowmap, n, 0, bad)
    for prefix in ("grid", "block"):
        xyz = cf.triples(prefix, rowmap, n, bad)
        out[prefix + "_x"], out[prefix + "_y"], out[prefix + "_z"] = xyz[:, 0], xyz[:, 1], xyz[:, 2]


def _fill_copies(cf, interner, b, events, rowmap, n, out, bad):
    for col, key in (("device", "device"), ("stream", "stream"),
                     ("correlation_id", "correlation"), ("bytes", "bytes")):
        out[col] = cf.numbers(key, 2, rowmap, n, 0, bad)
    out["kind"] = np.where(cf.cat[events] == _C_MEMSET, COPY_KIND_MEMSET, COPY_KIND_MEMCPY)


def _fill_api(cf, interner, b, events, rowmap, n, out, bad):
    out["pid"] = _ids32(cf.numbers("pid", 1, rowmap, n, 0, bad))
    out["tid"] = _ids32(cf.numbers("tid", 1, rowmap, n, 0, bad))
    out["correlation_id"] = cf.numbers("correlation", 2, rowmap, n, 0, bad)
    out["external_id"] = cf.numbers("External id", 2, rowmap, n, 0, bad)
    out["cbid"] = cf.numbers("cbid", 2, rowmap, n, 0, bad)
    out["domain"] = np.where(cf.cat[events] == _C_DRIVER, API_DOMAIN_DRIVER, API_DOMAIN_RUNTIME)


def _fill_ranges(cf, interner, b, events, rowmap, n, out, bad):
    cat = cf.cat[events]
    cpu = cat == _C_USER
    pid = _ids32(cf.numbers("pid", 1, rowmap, n, 0, bad))
    tid = _ids32(cf.numbers("tid", 1, rowmap, n, 0, bad))
    dev = _ids32(cf.numbers("device", 2, rowmap, n, 0, bad))
    stream = _ids32(cf.numbers("stream", 2, rowmap, n, 0, bad))
    # mirror the dict path: GPU rows take device from args or else pid, stream from args or tid
    has_dev = _present(cf, "device", rowmap, n)
    has_stream = _present(cf, "stream", rowmap, n)
    out["device"] = np.where(cpu, MISSING, np.where(has_dev, dev, pid))
    out["pid"] = np.where(cpu, pid, MISSING)
    out["tid"] = np.where(cpu, tid, np.where(has_stream, stream, tid))
    out["external_id"] = cf.numbers("External id", 2, rowmap, n, 0, bad)
    step_ids = np.zeros(max(len(b.names), 1), dtype=bool)
    for i, s in enumerate(b.names.strings):
        step_ids[i] = s.startswith("ProfilerStep#")
    nid = out["name_id"]
    step = np.zeros(n, dtype=bool)
    step[nid >= 0] = step_ids[nid[nid >= 0]]
    out["kind"] = np.where(cat == _C_SYNC, RANGE_CUDA_SYNC,
                           np.where(step, RANGE_PROFILER_STEP,
                                    np.where(cpu, RANGE_USER_ANNOTATION, RANGE_GPU_ANNOTATION)))


def _present(cf, key, rowmap, n) -> np.ndarray:
    m = np.zeros(n, dtype=bool)
    _, o = cf.rows(key, 2, rowmap)
    m[o] = True
    return m


def _fill_cpu_ops(cf, interner, b, events, rowmap, n, out, bad):
    out["pid"] = _ids32(cf.numbers("pid", 1, rowmap, n, 0, bad))
    out["tid"] = _ids32(cf.numbers("tid", 1, rowmap, n, 0, bad))
    out["external_id"] = cf.numbers("External id", 2, rowmap, n, 0, bad)
    # after the name: the interner numbers strings in the order met
    out["input_dims_id"] = cf.raw_json("Input Dims", rowmap, n, interner, bad)
    out["input_types_id"] = cf.raw_json("Input type", rowmap, n, interner, bad)
    out["is_causal"] = _causal_flags(cf, b, rowmap, n, out["name_id"])


def _causal_flags(cf, b, rowmap, n, name_id) -> np.ndarray:
    """The SDPA operators' causal flag (probes.sdpa); only their few rows are decoded."""
    col = np.full(n, sdpa.CAUSAL_FLAG_UNKNOWN, dtype=np.int8)
    strings = b.names.strings
    ids = [i for i in map(b.names.lookup, sdpa.SDPA_OPS) if i >= 0]
    if not ids or not n:
        return col
    want = np.isin(name_id, ids)
    if not want.any():
        return col
    concrete = cf.json_values("Concrete Inputs", rowmap, want)
    types = cf.json_values("Input type", rowmap, want)
    for row, ci in concrete.items():
        col[row] = sdpa.causal_flag(strings[int(name_id[row])], ci, types.get(row))
    return col


# kind, dtype, event categories, kind-specific columns, dict-path builder
_KINDS = (("kernels", KERNEL_DTYPE, (_C_KERNEL,), _fill_kernels, _Builder.build_kernels),
          ("copies", COPY_DTYPE, (_C_MEMCPY, _C_MEMSET), _fill_copies, _Builder.build_copies),
          ("api", API_DTYPE, (_C_RUNTIME, _C_DRIVER), _fill_api, _Builder.build_api),
          ("ranges", RANGE_DTYPE, (_C_USER, _C_GPU_USER, _C_SYNC), _fill_ranges, _Builder.build_ranges),
          ("cpu_ops", CPU_OP_DTYPE, (_C_CPU_OP,), _fill_cpu_ops, _Builder.build_cpu_ops))


PARALLEL_MIN_BYTES = 256 << 20   # plain files at least this big are read by two processes
PARALLEL_MIN_GZ_BYTES = 16 << 20  # gzip files likewise (Kineto JSON gzips 10-20x)


def _read_parts(chunks, b: _Builder, interner: _Interner, budget=None) -> dict[str, np.ndarray]:
    """Run the per-chunk extraction over ``chunks``; one array per kind, in file order.
    Rows kept are charged to ``budget`` (an :class:`EventBudget`) chunk by chunk."""
    parts: dict[str, list] = {k[0]: [] for k in _KINDS}
    cat_names: dict[int, str] = {}
    for chunk in chunks:
        cf = _ChunkFields(chunk, b.counts, cat_names)
        for kind, dtype, codes, fill, build in _KINDS:
            arr = _chunk_rows(cf, interner, b, dtype, codes, fill, build)
            if len(arr):
                parts[kind].append(arr)
                if budget is not None:
                    budget.charge(kind, len(arr))
        if budget is not None:
            budget.charge_names(b.names)
        del cf, chunk
    cols = {}
    for kind, dtype, *_ in _KINDS:
        lst = parts.pop(kind)
        cols[kind] = np.concatenate(lst) if len(lst) > 1 else (lst[0] if lst else empty(dtype))
        del lst
    return cols


def _part_worker(path: str, chunk_bytes: int, head: bytes, start: int, conn, budget=None) -> None:
    """Child process: read the second half of a plain file, send back plain arrays."""
    try:
        stream = json_chunks.ArrayStream(path, "traceEvents", chunk_bytes)
        b = _Builder()
        cols = _read_parts(stream.iter_part(head, start, None), b, _Interner(b.names), budget)
        conn.send(("ok", cols, list(b.names), b.counts, stream.top))
    except BaseException as exc:  # noqa: BLE001  (a child process: any failure is sent to the parent, which reads alone)
        conn.send(("error", f"{type(exc).__name__}: {exc}", None, None, None))
    finally:
        conn.close()


def _split_point(path: Path, lo: int, size: int) -> int | None:
    """A byte offset just after the ',' between two events near the middle, or None.

    ``}`` ``,`` ``{`` ``"`` with an unescaped quote cannot occur inside a JSON string,
    so the match is between two objects; whether they are top-level events is checked
    by the readers (SplitError), and the caller falls back to one reader."""
    mid = lo + (size - lo) // 2
    with open(path, "rb") as f:
        f.seek(mid)
        window = f.read(4 << 20)
    m = re.search(rb'\}\s*,(?=\s*\{\s*"(?:ph|cat|name|pid|tid|ts)")', window)
    return mid + m.end() if m else None


def _load_parallel(path: Path, chunk_bytes: int, budget=None) -> Trace | None:
    import multiprocessing as mp
    stream = json_chunks.ArrayStream(path, "traceEvents", chunk_bytes)
    head, start, size, gz = stream.head()
    if gz:
        return None
    split = _split_point(path, start, size)
    if split is None:
        return None
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    half = budget.half() if budget is not None else None
    child = ctx.Process(target=_part_worker, args=(str(path), chunk_bytes, head, split, send, half), daemon=True)
    child.start()
    send.close()
    try:
        b = _Builder()
        interner = _Interner(b.names)
        first = _read_parts(stream.iter_part(head, start, split), b, interner, half)
        # never wait forever on the child: it must answer within a generous time
        # (5 MB/s of its half) or have died, else the file is read here alone
        deadline = time.monotonic() + max(60.0, (size - split) / 5e6)
        while not recv.poll(1.0):
            if not child.is_alive() or time.monotonic() > deadline:
                return None
        status, second, names2, counts2, top = recv.recv()
    except (json_chunks.SplitError, InputError, EOFError, OSError):
        return None
    finally:
        if child.is_alive():
            child.kill()
        child.join()
    if status != "ok":
        return None
    remap = np.array([b.names.intern(s) for s in names2] or [0], dtype=np.int32)
    cols = {}
    for kind, dtype, *_ in _KINDS:
        x = second[kind]
        for c in ("name_id", "input_dims_id", "input_types_id"):
            if c in dtype.names and len(x):
                x[c] = np.where(x[c] >= 0, remap[np.maximum(x[c], 0)], x[c])
        cols[kind] = np.concatenate([first.pop(kind), x])
        second[kind] = None
    for k, v in counts2.items():
        b.counts[k] = b.counts.get(k, 0) + v
    return _assemble(path, top, b, cols)


def _assemble(path: Path, doc: dict, b: _Builder, cols: dict) -> Trace:
    c, a = cols["copies"], cols["api"]
    c["direction"] = _per_name(b.names, c["name_id"], copy_direction, np.uint8)
    c["direction"][c["kind"] == COPY_KIND_MEMSET] = COPY_UNKNOWN
    a["category"] = _per_name(b.names, a["name_id"], api_category, np.uint8)
    trace = Trace(names=b.names, devices=_devices(doc), meta=_meta(path, doc), **cols)
    return _joined(trace, b.counts)


def load_trace(path: str | Path, chunk_bytes: int = json_chunks.CHUNK_BYTES,
               parallel: bool | None = None, budget=None) -> Trace:
    """Load a Kineto trace (``.json`` or ``.json.gz``, detected by content) into a Trace.

    Streams the file in pieces of whole events (``chunk_bytes`` of decompressed bytes,
    8 MiB at the default): peak memory is a few pieces plus the output columns, whatever
    the file size. A file of at least ``PARALLEL_MIN_BYTES`` (plain) or
    ``PARALLEL_MIN_GZ_BYTES`` (gzip) is read by two processes when this process may use
    two CPUs, the load average leaves one of them idle, and the caller runs a single
    thread (``parallel`` forces it on or off); the result is identical, and any trouble
    with the second reader falls back to reading the file in this process.
    Raises :class:`InputError` naming the file for a missing, unreadable, truncated,
    non-JSON or non-trace file, for a file with GPU-like events of which none could be
    read (naming its schema), and when the rows kept would pass ``budget`` (a
    :class:`probes.budget.EventBudget`, charged chunk by chunk; None: unbounded, for
    callers that bound their input otherwise). Pre-1.10 traces and Chrome's JSON Array
    Format are read too; events with unusable times are dropped and counted.
    """
    path = Path(path)
    if parallel is None:
        # fork only from a single-threaded caller (the CLI): a fork while other threads
        # hold locks is how children deadlock
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                gz = f.read(2) == b"\x1f\x8b"
            # a second reader costs CPU (the typed reader's about 6% more in all, each
            # process inflating and cutting the whole stream; the scanner's about 20%) and
            # gains wall time only where a CPU is idle: on a busy host (with the kernel's
            # per-session fair share, autogroup) the two share what one would get
            # (docs/benchmarks-analyze.md)
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            parallel = (size >= (PARALLEL_MIN_GZ_BYTES if gz else PARALLEL_MIN_BYTES)
                        and cpus >= 2 and os.getloadavg()[0] <= cpus - 1
                        and threading.active_count() == 1)
        except OSError:
            parallel = False
    # the fast path: typed decoding of whole-event pieces (probes.kineto_typed); files it
    # cannot cut or decode cleanly are read by the structural scanner below
    try:
        from . import kineto_typed
    except ImportError:   # msgspec, a third-party dependency, absent (the GPU check's bundle
        # installs ridgeline without dependencies; tests/test_kineto_typed.py reads it so)
        return _load_scanned(path, chunk_bytes, bool(parallel), budget)
    try:
        trace = kineto_typed.load(path, max(chunk_bytes, kineto_typed.CHUNK_BYTES)
                                  if chunk_bytes == json_chunks.CHUNK_BYTES else chunk_bytes, bool(parallel),
                                  budget=budget)
        return _checked_schema(path, trace, budget)
    except json_chunks.Unsplit:
        pass
    if budget is not None:       # the typed reader's charges are void: the scanner starts over
        budget = budget.fresh()
    return _load_scanned(path, chunk_bytes, bool(parallel), budget)


def _load_scanned(path: Path, chunk_bytes: int, parallel: bool, budget=None) -> Trace:
    """load_trace by the structural scanner (json_chunks.ArrayStream) alone."""
    if parallel:
        trace = _load_parallel(path, chunk_bytes, budget)
        if trace is not None:
            return _checked_schema(path, trace, budget)
    stream = json_chunks.ArrayStream(path, "traceEvents", chunk_bytes)
    b = _Builder()
    cols = _read_parts(stream, b, _Interner(b.names), budget)
    trace = _assemble(path, stream.top, b, cols)
    if stream.top_array:
        trace.meta["json_array_format"] = True
    return _checked_schema(path, trace, budget)


# --------------------------------------------------------------------------- schemas
#
# Kept apart from the fast reader above: which schema a file is written in, and the
# event-by-event reader of the older one.
#
# Kineto before PyTorch 1.10 (``schemaVersion`` 1, 2020-2021) names categories in
# title case (``Kernel``, ``Memcpy``, ``Memset``, ``Runtime``, ``Driver``,
# ``Operator``), links GPU records to operators with ``external id`` in lower case,
# writes operator ``Input dims``, string thread ids (``"25738"``, and ``"stream 7"``
# for GPU rows) and profiler steps as ``Operator`` events named ``ProfilerStep#N``.
# Such files are small (one profiler window), so they are read event by event,
# chunk by chunk (memory bounded by the chunk and the kept rows), through the same
# dict builder as the reference path.

_LEGACY_CATS = {"Kernel": "kernel", "Memcpy": "gpu_memcpy", "Memset": "gpu_memset",
                "Runtime": "cuda_runtime", "Driver": "cuda_driver", "Operator": "cpu_op",
                "User Annotation": "user_annotation", "gpu_user_annotation": "gpu_user_annotation"}
_GPU_LIKE_RX = re.compile(r"kernel|memcpy|memset|gpu|hip|stream|xpu|mtia", re.IGNORECASE)
_STREAM_TID_RX = re.compile(r"^\s*stream\s+(\d+)\s*$", re.IGNORECASE)


def _legacy_id(v):
    """String ids of the old schema as ints: ``"25738"`` -> 25738, ``"stream 7"`` -> 7."""
    if isinstance(v, str):
        t = v.strip()
        if t.isdigit():
            return int(t)
        m = _STREAM_TID_RX.match(t)
        if m:
            return int(m.group(1))
    return v


def _legacy_event(e: dict) -> dict | None:
    """An old-schema event in the current schema's spelling, or None (not kept)."""
    cat = _LEGACY_CATS.get(e.get("cat"))
    if cat is None or e.get("ph") != "X":
        return None
    out = dict(e)
    name = e.get("name")
    if cat == "cpu_op" and isinstance(name, str) and name.startswith("ProfilerStep#"):
        cat = "user_annotation"
    out["cat"] = cat
    out["pid"] = _legacy_id(e.get("pid"))
    out["tid"] = _legacy_id(e.get("tid"))
    args = e.get("args")
    if isinstance(args, dict):
        a = dict(args)
        if "external id" in a and "External id" not in a:
            a["External id"] = a.pop("external id")
        if "Input dims" in a and "Input Dims" not in a:
            a["Input Dims"] = a.pop("Input dims")
        out["args"] = a
    return out


def _legacy_top(top: dict) -> dict:
    """``computeProperties`` (the oldest Kineto: ``major``, ``minor``,
    ``multiProcessorCount``) as ``deviceProperties``."""
    if top.get("deviceProperties") or not isinstance(top.get("computeProperties"), list):
        return top
    props = []
    for p in top["computeProperties"]:
        if isinstance(p, dict):
            q = dict(p)
            for old, new in (("major", "computeMajor"), ("minor", "computeMinor"), ("multiProcessorCount", "numSms")):
                if old in q and new not in q:
                    q[new] = q.pop(old)
            props.append(q)
    return dict(top, deviceProperties=props)


def _is_legacy(counts: dict) -> bool:
    return any(counts.get(c) for c in ("Kernel", "Memcpy", "Memset", "Runtime", "Operator"))


def _load_legacy(path: Path, chunk_bytes: int, budget=None) -> Trace:
    """Read a pre-1.10 Kineto trace (see the section comment), chunk by chunk."""
    stream = json_chunks.ArrayStream(path, "traceEvents", chunk_bytes)
    names = NameTable()
    counts: dict[str, int] = {}
    parts: dict[str, list] = {k[0]: [] for k in _KINDS}
    for chunk in stream:
        buf = chunk.scan.buf
        b = _Builder()
        b.names = names
        kept = []
        for s_, e_ in zip(chunk.starts.tolist(), chunk.ends.tolist()):
            e = _event_dict(buf[s_:e_ + 1])
            if type(e) is not dict:
                continue
            cat = e.get("cat")
            key = cat if isinstance(cat, str) else "<none>"
            counts[key] = counts.get(key, 0) + 1
            ev = _legacy_event(e)
            if ev is not None:
                kept.append(ev)
        b.add(kept)
        for kind, build in (("kernels", _Builder.build_kernels), ("copies", _Builder.build_copies),
                            ("api", _Builder.build_api), ("ranges", _Builder.build_ranges),
                            ("cpu_ops", _Builder.build_cpu_ops)):
            arr = build(b)
            if len(arr):
                parts[kind].append(arr)
                if budget is not None:
                    budget.charge(kind, len(arr))
        if budget is not None:
            budget.charge_names(names)
    cols = {kind: (np.concatenate(parts[kind]) if parts[kind] else empty(dtype))
            for kind, dtype, *_ in _KINDS}
    top = stream.top
    trace = Trace(names=names, devices=_devices(_legacy_top(top)), meta=_meta(path, top), **cols)
    trace.meta["kineto_schema"] = "pre-1.10 (title-case categories)"
    return _joined(trace, counts)


def _checked_schema(path: Path, trace: Trace, budget=None) -> Trace:
    """The trace, re-read by the old-schema reader when it is one; InputError naming
    the schema when the file has GPU-like events but no kernel or copy was read."""
    counts = trace.meta.get("event_counts", {})
    if not counts and trace.meta.get("json_array_format"):
        raise InputError(f"{path}: not a Chrome trace (a JSON array without trace event objects)")
    if not len(trace.kernels) and not len(trace.copies) and _is_legacy(counts):
        trace = _load_legacy(path, json_chunks.CHUNK_BYTES, budget)
        counts = trace.meta.get("event_counts", {})
    if len(trace.kernels) or len(trace.copies):
        return trace
    gpu_like = {c: n for c, n in counts.items() if _GPU_LIKE_RX.search(c)}
    if gpu_like:
        seen = ", ".join(f"{c} x{n}" for c, n in sorted(gpu_like.items(), key=lambda x: -x[1])[:6])
        schema = trace.meta.get("kineto_schema_version", "none")
        rejected = trace.meta.get("rejected_events")
        why = f"; rejected: {rejected}" if rejected else ""
        raise InputError(f"{path}: has GPU-like events ({seen}) but no kernel or copy could be read "
                         f"(schemaVersion {schema}; reads Kineto categories kernel/gpu_memcpy/gpu_memset "
                         f"and the pre-1.10 Kernel/Memcpy/Memset{why})")
    return trace
