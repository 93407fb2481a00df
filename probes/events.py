"""Columnar event model shared by every probe and the aggregator.

Events are numpy structured arrays, one array per kind, never a Python object per
event. All times are integer nanoseconds on one clock per source (``*_ns``); sizes are
bytes (``*_bytes``). Missing integer values are ``-1`` (``MISSING``).

Strings (kernel names, API names, annotation names, operator shapes) are interned in a
:class:`NameTable` and referred to by ``name_id``; a table belongs to one source (one
trace file, or one injected process) and ids are only meaningful with it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

MISSING = -1

# CUPTI's CUpti_ActivityMemcpyKind values, kept numerically identical so raw CUPTI
# records decode without a lookup table.
COPY_UNKNOWN, COPY_HTOD, COPY_DTOH, COPY_HTOA, COPY_ATOH, COPY_ATOA, COPY_ATOD, \
    COPY_DTOA, COPY_DTOD, COPY_HTOH, COPY_PTOP = range(11)
COPY_DIRECTION_NAMES = {
    COPY_UNKNOWN: "unknown", COPY_HTOD: "HtoD", COPY_DTOH: "DtoH", COPY_HTOA: "HtoA",
    COPY_ATOH: "AtoH", COPY_ATOA: "AtoA", COPY_ATOD: "AtoD", COPY_DTOA: "DtoA",
    COPY_DTOD: "DtoD", COPY_HTOH: "HtoH", COPY_PTOP: "PtoP",
}

# Copy records: a memcpy or a memset.
COPY_KIND_MEMCPY = 0
COPY_KIND_MEMSET = 1

# API records: which CUDA API layer.
API_DOMAIN_RUNTIME = 1
API_DOMAIN_DRIVER = 2

# API call category, decided once when the record is made (by cbid or by name) so the
# aggregator filters with one vectorised comparison.
API_OTHER = 0
API_LAUNCH = 1          # cudaLaunchKernel, cuLaunchKernel(Ex), ...
API_GRAPH_LAUNCH = 2    # cudaGraphLaunch, cuGraphLaunch
API_SYNC = 3            # stream/device/event synchronize
API_MEMCPY = 4          # cudaMemcpy*, cuMemcpy*
API_MEMSET = 5
API_CATEGORY_NAMES = {API_OTHER: "other", API_LAUNCH: "launch", API_GRAPH_LAUNCH: "graph_launch",
                      API_SYNC: "sync", API_MEMCPY: "memcpy", API_MEMSET: "memset"}

# Range records: what kind of interval.
RANGE_USER_ANNOTATION = 1      # record_function / user annotation on the CPU timeline
RANGE_GPU_ANNOTATION = 2       # the GPU-side projection of a user annotation (Kineto)
RANGE_NVTX = 3                 # NVTX push/pop or start/end range (CUPTI MARKER)
RANGE_PROFILER_STEP = 4        # ProfilerStep#N
RANGE_CUDA_SYNC = 5            # GPU-side wait of a synchronisation (Kineto "cuda_sync")
RANGE_OTHER = 9
RANGE_KIND_NAMES = {RANGE_USER_ANNOTATION: "user_annotation", RANGE_GPU_ANNOTATION: "gpu_user_annotation",
                    RANGE_NVTX: "nvtx", RANGE_PROFILER_STEP: "profiler_step", RANGE_CUDA_SYNC: "cuda_sync", RANGE_OTHER: "other"}

KERNEL_DTYPE = np.dtype([
    ("start_ns", "<i8"),
    ("end_ns", "<i8"),
    ("device", "<i4"),
    ("stream", "<i8"),
    ("context", "<i4"),
    ("correlation_id", "<i8"),
    ("external_id", "<i8"),      # framework op id (Kineto "External id"), -1 if unknown
    ("grid_x", "<i4"), ("grid_y", "<i4"), ("grid_z", "<i4"),
    ("block_x", "<i4"), ("block_y", "<i4"), ("block_z", "<i4"),
    ("registers", "<i4"),        # registers per thread
    ("shared_mem_bytes", "<i4"), # static + dynamic shared memory per block
    ("name_id", "<i4"),
    ("graph_id", "<i8"),
    ("graph_node_id", "<i8"),
    ("pid", "<i4"),              # process that launched it, -1 if unknown
    ("tid", "<i4"),              # launching thread (from the API record), -1 if unknown
])

COPY_DTYPE = np.dtype([
    ("start_ns", "<i8"),
    ("end_ns", "<i8"),
    ("device", "<i4"),
    ("stream", "<i8"),
    ("correlation_id", "<i8"),
    ("kind", "u1"),              # COPY_KIND_MEMCPY / COPY_KIND_MEMSET
    ("direction", "u1"),         # COPY_* direction (memsets: COPY_UNKNOWN)
    ("bytes", "<i8"),
    ("graph_id", "<i8"),
    ("pid", "<i4"),
    ("tid", "<i4"),
    ("name_id", "<i4"),          # original record name where the source has one
])

API_DTYPE = np.dtype([
    ("start_ns", "<i8"),
    ("end_ns", "<i8"),
    ("pid", "<i4"),
    ("tid", "<i4"),
    ("correlation_id", "<i8"),
    ("external_id", "<i8"),
    ("cbid", "<i4"),
    ("domain", "u1"),            # API_DOMAIN_*
    ("category", "u1"),          # API_*
    ("name_id", "<i4"),
])

RANGE_DTYPE = np.dtype([
    ("start_ns", "<i8"),
    ("end_ns", "<i8"),
    ("pid", "<i4"),
    ("tid", "<i4"),
    ("device", "<i4"),           # -1 for CPU-side ranges
    ("kind", "u1"),              # RANGE_*
    ("name_id", "<i4"),
    ("external_id", "<i8"),
])

CPU_OP_DTYPE = np.dtype([
    ("start_ns", "<i8"),
    ("end_ns", "<i8"),
    ("pid", "<i4"),
    ("tid", "<i4"),
    ("name_id", "<i4"),
    ("external_id", "<i8"),
    ("input_dims_id", "<i4"),    # interned JSON text of "Input Dims", -1 if absent
    ("input_types_id", "<i4"),   # interned JSON text of "Input type", -1 if absent
    ("is_causal", "i1"),         # SDPA operators' causal flag (probes.sdpa): 1 yes, 0 no, -1 unknown/other op
])


def empty(dtype: np.dtype, n: int = 0) -> np.ndarray:
    """Return ``n`` records of ``dtype`` with every integer field set to ``MISSING``."""
    out = np.zeros(n, dtype=dtype)
    if not n:
        # No record to fill: each Trace() built its absent kinds this way, a field-by-field
        # loop of ~20 assignments per kind, a few per fold (bench/bench_scale.py's profile).
        return out
    for name in dtype.names:
        if dtype[name].kind == "i":
            out[name] = MISSING
    return out


class NameTable:
    """Interned strings of one source. ``intern`` is O(1); ids are dense from 0.

    Vectorised matching: :meth:`ids_matching` returns the ids whose string matches a
    regular expression, to be used with ``np.isin(events["name_id"], ids)``.
    """

    __slots__ = ("_strings", "_index", "__weakref__")   # weakref: per-table memos (signatures)

    def __init__(self, strings: Iterable[str] = ()):
        self._strings: list[str] = []
        self._index: dict[str, int] = {}
        for s in strings:
            self.intern(s)

    def intern(self, s: str) -> int:
        i = self._index.get(s)
        if i is None:
            i = len(self._strings)
            self._strings.append(s)
            self._index[s] = i
        return i

    def append_positional(self, strings: list[str]) -> None:
        """Append ``strings`` as the next ids whatever they hold: a repeated string (an
        unknown "" placeholder, or a peer's duplicate) still takes its own id, and
        :meth:`lookup` finds its first (a table whose ids another side numbered)."""
        base = len(self._strings)
        self._strings.extend(strings)
        for i, s in enumerate(strings, base):
            self._index.setdefault(s, i)

    def lookup(self, s: str) -> int:
        """Id of ``s``, or ``MISSING`` when it was never interned."""
        return self._index.get(s, MISSING)

    def __getitem__(self, i: int) -> str:
        return self._strings[i]

    def __len__(self) -> int:
        return len(self._strings)

    def __iter__(self):
        return iter(self._strings)

    @property
    def strings(self) -> list[str]:
        return self._strings

    @property
    def index(self) -> dict[str, int]:
        """The string -> id map itself, for readers that look up many names in one C loop
        (``map(table.index.__getitem__, names)``); read it, never write it."""
        return self._index

    def ids_matching(self, pattern: str | re.Pattern, flags: int = 0) -> np.ndarray:
        rx = re.compile(pattern, flags) if isinstance(pattern, str) else pattern
        return np.fromiter((i for i, s in enumerate(self._strings) if rx.search(s)), dtype=np.int32)

    def names_of(self, ids: np.ndarray) -> list[str]:
        return [self._strings[i] if i >= 0 else "" for i in ids.tolist()]


@dataclass
class Device:
    """One GPU as the source describes it."""
    index: int
    name: str
    sm_count: int = MISSING
    memory_total_bytes: int = MISSING
    compute_capability: str = ""
    properties: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CpuOpJoin:
    """The kernel -> CPU operator join of a Trace (:func:`probes.trace_joins.
    kernel_cpu_op_index`) and the arrays it was computed from, compared by identity so that
    a replaced array is never mistaken for its predecessor."""
    kernels: np.ndarray
    api: np.ndarray
    cpu_ops: np.ndarray
    index: np.ndarray


@dataclass
class Trace:
    """All events of one source, columnar, with their name table and devices.

    ``meta`` holds plain facts about the source (path, format, CUPTI version,
    distributed rank); it never holds raw environment or credentials. ``cpu_op_join``
    is the memo of :func:`probes.trace_joins.kernel_cpu_op_index` (not an argument of the
    constructor: a derived Trace starts without it).
    """
    kernels: np.ndarray = field(default_factory=lambda: empty(KERNEL_DTYPE))
    copies: np.ndarray = field(default_factory=lambda: empty(COPY_DTYPE))
    api: np.ndarray = field(default_factory=lambda: empty(API_DTYPE))
    ranges: np.ndarray = field(default_factory=lambda: empty(RANGE_DTYPE))
    cpu_ops: np.ndarray = field(default_factory=lambda: empty(CPU_OP_DTYPE))
    names: NameTable = field(default_factory=NameTable)
    devices: list[Device] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    cpu_op_join: CpuOpJoin | None = field(default=None, init=False, repr=False, compare=False)

    def sorted(self) -> "Trace":
        """Return a copy whose arrays are ordered by ``start_ns`` (stable)."""
        def s(a):
            return a[np.argsort(a["start_ns"], kind="stable")] if len(a) else a
        return Trace(s(self.kernels), s(self.copies), s(self.api), s(self.ranges), s(self.cpu_ops),
                     self.names, list(self.devices), dict(self.meta))


class Columns:
    """One kind's events as separate contiguous columns (a field name -> an array of the
    field's type in ``dtype``, every field present, ``rows`` long), where a structured
    array would interleave them: what the wire decodes to before any row is built, and
    what a columnar writer (Parquet) takes without copying. Read like the structured
    array: ``cols["start_ns"]``, ``len(cols)``, ``cols.dtype.names``. Columns may be
    read-only views of the decoded bytes: never written."""

    __slots__ = ("dtype", "rows", "fields")

    def __init__(self, dtype: np.dtype, rows: int, fields: dict[str, np.ndarray]):
        self.dtype, self.rows, self.fields = dtype, rows, fields

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, name: str) -> np.ndarray:
        return self.fields[name]


@dataclass
class EventColumns:
    """An event batch as :class:`Columns` per kind (aggregator.wire.decode_event_columns),
    with the batch's name table as a list (ids positional; "" for a name not known yet),
    its devices and meta: a :class:`Trace` without the rows."""
    kernels: Columns
    copies: Columns
    api: Columns
    ranges: Columns
    cpu_ops: Columns
    names: list[str]
    devices: list[Device] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
