"""What a Kineto event becomes in a :class:`probes.events.Trace`, whichever reader read it.

The rules every Kineto reader (:mod:`probes.kineto_dicts`, :mod:`probes.kineto_scan`,
:mod:`probes.kineto_typed`, :mod:`probes.kineto_legacy`) shares, so that their results
cannot differ: the API category and copy direction of a name, times in integer
nanoseconds and the times that are rejected, pid/tid as int32, the plain facts copied
from the document's top level (``meta``, devices), and the finishing of a trace (rejected
times dropped, launching threads joined, event counts).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .events import (
    API_DTYPE,
    API_GRAPH_LAUNCH,
    API_LAUNCH,
    API_MEMCPY,
    API_MEMSET,
    API_OTHER,
    API_SYNC,
    COPY_DIRECTION_NAMES,
    COPY_DTYPE,
    COPY_KIND_MEMSET,
    COPY_UNKNOWN,
    CPU_OP_DTYPE,
    KERNEL_DTYPE,
    MISSING,
    RANGE_DTYPE,
    Device,
    NameTable,
    Trace,
)
from .trace_joins import join_launch_threads

__all__ = ["api_category", "copy_direction", "reject_invalid_times", "us_to_ns", "us_value_to_ns",
           "checked_times", "TIME_LIMIT_NS", "TIME_LIMIT_US", "BAD_TIME", "KINDS", "id32", "ids32",
           "int_or_missing", "per_name", "document_devices", "document_meta", "finished", "assembled"]

# the kinds of rows a trace holds, in the order the readers fill them, and their dtypes
KINDS = (("kernels", KERNEL_DTYPE), ("copies", COPY_DTYPE), ("api", API_DTYPE),
         ("ranges", RANGE_DTYPE), ("cpu_ops", CPU_OP_DTYPE))

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


# --------------------------------------------------------------------------- times
#
# Kept apart from the parse core on purpose: what a value may be, not how it is read.
# Times are int64 ns; anything that is not a finite number, lies beyond +-2^62 ns
# (146 years from the epoch, so sums of two never wrap) or ends before it starts is
# dropped and counted by reason in ``trace.meta["rejected_events"]``, never turned into
# a silently wrong number.

TIME_LIMIT_NS = 1 << 62
BAD_TIME = np.iinfo(np.int64).min   # marks a time the dict path could not read
TIME_LIMIT_US = TIME_LIMIT_NS // 1000


def us_value_to_ns(v) -> int:
    """One ``ts``/``dur`` value (microseconds) -> ns, or ``BAD_TIME``."""
    if type(v) is int:
        return v * 1000 if -TIME_LIMIT_US <= v <= TIME_LIMIT_US else BAD_TIME
    if type(v) is float:
        if not (-TIME_LIMIT_US <= v <= TIME_LIMIT_US):    # also False for NaN
            return BAD_TIME
        ip = int(v // 1)
        return ip * 1000 + round((v - ip) * 1000.0)
    return BAD_TIME   # a string, null, bool, list ...


def checked_times(evs: list, out: np.ndarray) -> None:
    """start_ns/end_ns of dict events; ``BAD_TIME`` where ts or dur is unusable
    (a missing dur is 0, a missing ts is unusable)."""
    conv = us_value_to_ns
    start = np.fromiter((conv(e.get("ts")) for e in evs), dtype=np.int64, count=len(evs))
    dur = np.fromiter((conv(e.get("dur", 0)) for e in evs), dtype=np.int64, count=len(evs))
    bad = (start == BAD_TIME) | (dur == BAD_TIME)
    out["start_ns"] = np.where(bad, BAD_TIME, start)
    out["end_ns"] = np.where(bad, BAD_TIME, start + np.where(bad, 0, dur))


def reject_invalid_times(trace: Trace) -> None:
    """Drop rows whose times are unusable, counting each by kind and reason."""
    rejected: dict[str, dict[str, int]] = {}
    for kind in ("kernels", "copies", "api", "ranges", "cpu_ops"):
        a = getattr(trace, kind)
        if not len(a):
            continue
        s, e = np.ascontiguousarray(a["start_ns"]), np.ascontiguousarray(a["end_ns"])
        # the usual case, nothing to drop, told by reductions without a mask per test
        # (BAD_TIME is int64's minimum, below -TIME_LIMIT_NS)
        if s.min() >= -TIME_LIMIT_NS and e.min() >= -TIME_LIMIT_NS and s.max() <= TIME_LIMIT_NS \
                and e.max() <= TIME_LIMIT_NS and not (e < s).any():
            continue
        unreadable = (s < -TIME_LIMIT_NS) | (s > TIME_LIMIT_NS) | (e < -TIME_LIMIT_NS) | (e > TIME_LIMIT_NS)
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


def us_to_ns(values: list) -> np.ndarray:
    """Microseconds (ints, or floats with <= 3 decimals) -> int64 ns, exact.

    Floats are split into integer and fractional parts so that large absolute
    timestamps (1.7e15 us) keep nanosecond resolution. A value that is not a finite
    number within +-2^62 ns becomes ``BAD_TIME`` (dropped and counted by
    :func:`reject_invalid_times`), never a wrapped integer.
    """
    a = np.asarray(values)
    if a.dtype.kind in "iu":
        ok = (a >= -TIME_LIMIT_US) & (a <= TIME_LIMIT_US)
        return np.where(ok, np.where(ok, a, 0).astype(np.int64) * 1000, BAD_TIME)
    if a.dtype.kind != "f":      # strings, None, mixed: one by one
        return np.fromiter((us_value_to_ns(v) for v in values), dtype=np.int64, count=len(values))
    a = a.astype(np.float64)
    ok = (a >= -TIME_LIMIT_US) & (a <= TIME_LIMIT_US)      # False for NaN and infinities
    a = np.where(ok, a, 0.0)
    ip = np.floor(a)
    ns = ip.astype(np.int64) * 1000 + np.rint((a - ip) * 1000.0).astype(np.int64)
    return np.where(ok, ns, BAD_TIME)


def int_or_missing(v) -> int:
    """An int as it is; anything else -> MISSING."""
    return v if type(v) is int else MISSING


def id32(v) -> int:
    """pid/tid as int32: strings (Kineto's "Spans" rows) -> -1; pthread-sized ids folded."""
    if type(v) is not int:
        return MISSING
    return v if -1 <= v <= _INT32_MAX else v & _INT32_MAX


def ids32(col: np.ndarray) -> np.ndarray:
    """pid/tid to int32 as :func:`id32` does: out-of-range ids folded, missing stays -1."""
    return np.where((col >= -1) & (col <= _INT32_MAX), col, col & _INT32_MAX).astype(np.int32)


def per_name(names: NameTable, ids: np.ndarray, fn, dtype) -> np.ndarray:
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


def document_devices(doc: dict) -> list[Device]:
    """The GPUs of the document's ``deviceProperties``."""
    out = []
    for p in doc.get("deviceProperties") or []:
        if not isinstance(p, dict):
            continue
        major, minor = p.get("computeMajor"), p.get("computeMinor")
        out.append(Device(
            index=int_or_missing(p.get("id")),
            name=str(p.get("name", "")),
            sm_count=int_or_missing(p.get("numSms")),
            memory_total_bytes=int_or_missing(p.get("totalGlobalMem")),
            compute_capability=f"{major}.{minor}" if major is not None and minor is not None else "",
            properties={k: v for k, v in p.items() if isinstance(v, (int, float, str))},
        ))
    return out


def document_meta(path: Path, doc: dict) -> dict:
    """The plain facts of the document's top level (see :mod:`probes.kineto`)."""
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


def finished(trace: Trace, counts: dict, times_checked: bool = False) -> Trace:
    """The trace with unusable times dropped, launching threads joined and ``counts``
    (events per category) in its meta. ``times_checked``: the reader saw every row's times
    and none that :func:`reject_invalid_times` drops (the native reader counts them as it
    writes the rows), so that pass over the columns is skipped."""
    if not times_checked:
        reject_invalid_times(trace)
    join_launch_threads(trace.api, trace.kernels, trace.copies)
    trace.meta["event_counts"] = dict(sorted(counts.items()))
    return trace


def assembled(path: Path, doc: dict, names: NameTable, counts: dict, cols: dict,
              times_checked: bool = False) -> Trace:
    """A finished trace from columns read without names classified (the scanner's and
    the typed reader's): copy direction and API category set per name. ``times_checked``:
    as :func:`finished`."""
    c, a = cols["copies"], cols["api"]
    c["direction"] = per_name(names, c["name_id"], copy_direction, np.uint8)
    c["direction"][c["kind"] == COPY_KIND_MEMSET] = COPY_UNKNOWN
    a["category"] = per_name(names, a["name_id"], api_category, np.uint8)
    trace = Trace(names=names, devices=document_devices(doc), meta=document_meta(path, doc), **cols)
    return finished(trace, counts, times_checked)
