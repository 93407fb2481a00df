"""The reference Kineto reader: events as Python dicts, built into columns by
:class:`EventBuilder`.

:func:`load_trace_via_dicts` parses the whole document (a dict per event: slow and
memory-hungry) and is the independent reference the fast readers are tested against. The
builder is also what those readers hand the events they cannot read exactly (an exponent,
an unexpected shape, a string where a number belongs), one event or one piece at a time,
so that a result never depends on the path taken; and the pre-1.10 schema reader
(:mod:`probes.kineto_legacy`) builds its events with it.
"""
from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np
import orjson

from . import json_chunks, sdpa
from . import kineto_records as rec
from .errors import InputError
from .events import (
    API_DOMAIN_DRIVER,
    API_DOMAIN_RUNTIME,
    API_DTYPE,
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
    NameTable,
    Trace,
    empty,
)

__all__ = ["EventBuilder", "event_dict", "read_bytes", "parse_document", "load_trace_via_dicts"]


def event_dict(raw: bytes) -> dict:
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


def read_bytes(path: Path) -> bytes:
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


def parse_document(path: Path, data: bytes) -> dict:
    doc = json_chunks.parse_json(path, data)
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise InputError(f"{path}: not a Kineto/Chrome trace (JSON without a traceEvents array)")
    return doc


class EventBuilder:
    """Accumulates parsed event dicts per kind, then builds the structured arrays.

    ``names`` and ``counts`` (events per category) may be shared with a reader that hands
    this builder some of its events: the ids and counts then continue the reader's."""

    def __init__(self, names: NameTable | None = None, counts: dict[str, int] | None = None):
        self.names = NameTable() if names is None else names
        self.kernels: list[dict] = []
        self.copies: list[dict] = []
        self.api: list[dict] = []
        self.ranges: list[tuple[dict, int]] = []
        self.cpu_ops: list[dict] = []
        self.counts: dict[str, int] = {} if counts is None else counts

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

    def build_all(self) -> dict[str, np.ndarray]:
        """The columns of every kind, by kind name (``kineto_records.KINDS``)."""
        return {"kernels": self.build_kernels(), "copies": self.build_copies(), "api": self.build_api(),
                "ranges": self.build_ranges(), "cpu_ops": self.build_cpu_ops()}

    # -- per kind -----------------------------------------------------------------
    def _intern_all(self, values) -> np.ndarray:
        intern = self.names.intern
        return np.fromiter((intern(v) if isinstance(v, str) else MISSING for v in values),
                           dtype=np.int32, count=len(values))

    def _columns(self, evs: list, dtype) -> tuple[np.ndarray, list[dict]]:
        """A kind's rows with what every kind shares set: the checked times and the name
        (interned first, so name ids come in the order the kinds are built), and each
        event's args for the kind's own columns."""
        out = empty(dtype, len(evs))
        if evs:
            rec.checked_times(evs, out)
            out["name_id"] = self._intern_all([e.get("name") for e in evs])
        return out, [e.get("args") or {} for e in evs]

    def build_kernels(self) -> np.ndarray:
        evs = self.kernels
        out, args = self._columns(evs, KERNEL_DTYPE)
        if not evs:
            return out
        for col, key in (("device", "device"), ("stream", "stream"), ("context", "context"),
                         ("correlation_id", "correlation"), ("external_id", "External id"),
                         ("registers", "registers per thread"), ("shared_mem_bytes", "shared memory")):
            out[col] = [rec.int_or_missing(a.get(key)) for a in args]
        for prefix, key in (("grid", "grid"), ("block", "block")):
            xyz = np.array([_xyz(a.get(key)) for a in args], dtype=np.int64).reshape(-1, 3)
            out[prefix + "_x"], out[prefix + "_y"], out[prefix + "_z"] = xyz[:, 0], xyz[:, 1], xyz[:, 2]
        return out

    def build_copies(self) -> np.ndarray:
        evs = self.copies
        out, args = self._columns(evs, COPY_DTYPE)
        if not evs:
            return out
        for col, key in (("device", "device"), ("stream", "stream"),
                         ("correlation_id", "correlation"), ("bytes", "bytes")):
            out[col] = [rec.int_or_missing(a.get(key)) for a in args]
        out["kind"] = [COPY_KIND_MEMSET if e.get("cat") == "gpu_memset" else COPY_KIND_MEMCPY for e in evs]
        out["direction"] = rec.per_name(self.names, out["name_id"], rec.copy_direction, np.uint8)
        out["direction"][out["kind"] == COPY_KIND_MEMSET] = COPY_UNKNOWN
        return out

    def build_api(self) -> np.ndarray:
        evs = self.api
        out, args = self._columns(evs, API_DTYPE)
        if not evs:
            return out
        out["pid"] = [rec.id32(e.get("pid")) for e in evs]
        out["tid"] = [rec.id32(e.get("tid")) for e in evs]
        out["correlation_id"] = [rec.int_or_missing(a.get("correlation")) for a in args]
        out["external_id"] = [rec.int_or_missing(a.get("External id")) for a in args]
        out["cbid"] = [rec.int_or_missing(a.get("cbid")) for a in args]
        out["domain"] = [API_DOMAIN_DRIVER if e.get("cat") == "cuda_driver" else API_DOMAIN_RUNTIME for e in evs]
        out["category"] = rec.per_name(self.names, out["name_id"], rec.api_category, np.uint8)
        return out

    def build_ranges(self) -> np.ndarray:
        evs = self.ranges
        out, _ = self._columns(evs, RANGE_DTYPE)
        if not evs:
            return out
        kinds, pids, tids, devices = [], [], [], []
        for e in evs:
            cat = e.get("cat")
            a = e.get("args") or {}
            name = e.get("name")
            step = isinstance(name, str) and name.startswith("ProfilerStep#")
            if cat == "user_annotation":
                kinds.append(RANGE_PROFILER_STEP if step else RANGE_USER_ANNOTATION)
                pids.append(rec.id32(e.get("pid")))
                tids.append(rec.id32(e.get("tid")))
                devices.append(MISSING)
            else:
                # GPU-side rows: Kineto puts the device index in pid and the stream in tid.
                kinds.append(RANGE_CUDA_SYNC if cat == "cuda_sync"
                             else RANGE_PROFILER_STEP if step else RANGE_GPU_ANNOTATION)
                dev = a.get("device", e.get("pid"))
                devices.append(rec.id32(dev))
                pids.append(MISSING)
                tids.append(rec.id32(a.get("stream", e.get("tid"))))
        out["kind"], out["pid"], out["tid"], out["device"] = kinds, pids, tids, devices
        out["external_id"] = [rec.int_or_missing((e.get("args") or {}).get("External id")) for e in evs]
        return out

    def build_cpu_ops(self) -> np.ndarray:
        evs = self.cpu_ops
        out, args = self._columns(evs, CPU_OP_DTYPE)
        if not evs:
            return out
        out["pid"] = [rec.id32(e.get("pid")) for e in evs]
        out["tid"] = [rec.id32(e.get("tid")) for e in evs]
        out["external_id"] = [rec.int_or_missing(a.get("External id")) for a in args]
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


def load_trace_via_dicts(path: str | Path) -> Trace:
    """Same contract as :func:`probes.kineto.load_trace`, by parsing the whole document into Python
    objects. Slow and memory-hungry (a dict per event); kept as the independent
    reference the streaming importer is tested against."""
    path = Path(path)
    doc = parse_document(path, read_bytes(path))
    b = EventBuilder()
    b.add(doc["traceEvents"])
    return _finished(path, doc, b)


def _finished(path: Path, doc: dict, b: EventBuilder) -> Trace:
    trace = Trace(
        **b.build_all(), names=b.names,
        devices=rec.document_devices(doc), meta=rec.document_meta(path, doc),
    )
    return rec.finished(trace, b.counts)
