"""CUPTI activity record layouts: the fields Ridgeline reads, by record kind.

Every CUPTI release writes the newest struct version of each kind its headers define
(CUDA 12.4: ``Kernel9``/``Memcpy5``/``Memset4``, 12.8: ``Kernel9``/``Memcpy6``, 13.0:
``Kernel10``, 13.5: ``Kernel13``/``Memcpy7``/``Memset5``), so a record's size depends on
the libcupti inside the served process. New struct versions append fields: every field
Ridgeline reads sits at the same offset in all of them (checked against the real headers
of CUDA 12.4, 12.8, 13.0 and 13.5 by tests/test_cupti_layouts.py, which compiles C
against each header set). So a record is decoded by its kind with those offsets and the
section's record size as stride; it is rejected only when it is really unknown: a kind
not listed here, a record too short to hold the fields, or a CUPTI older than the
releases checked.

cupti-python is not needed to decode (the GPU hosts Ridgeline serves often lack it).
The field names are cupti-python's (``activity_kernel13_dtype`` ...), so views from either
read the same way.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

KIND_MEMCPY = 1
KIND_MEMSET = 2
KIND_KERNEL = 3
KIND_DRIVER = 4
KIND_RUNTIME = 5
KIND_CONCURRENT_KERNEL = 10
KIND_MARKER = 12
KIND_MARKER_DATA = 13
KIND_EXTERNAL_CORRELATION = 39
KIND_INTERNAL_LAUNCH_API = 48
KIND_GRAPH_TRACE = 51

MARKER_FLAG_INSTANTANEOUS = 1 << 0
MARKER_FLAG_START = 1 << 1
MARKER_FLAG_END = 1 << 2
#: CUpti_ActivityObjectKind: 2 (THREAD) in every header of 12.4..13.x, 1 is PROCESS (object_id
#: then holds only the process id). tests/test_cupti_layouts.py compares these with each header.
MARKER_OBJECT_PROCESS = 1  # CUPTI_ACTIVITY_OBJECT_PROCESS
MARKER_OBJECT_THREAD = 2   # CUPTI_ACTIVITY_OBJECT_THREAD: object_id.pt holds process and thread ids

#: Oldest CUPTI whose layouts were checked (cuptiGetVersion() of CUDA 12.4 is 22; CUDA 13
#: reports 130000 and up). 0 means "not reported" (test drivers) and is accepted.
MIN_CUPTI_VERSION = 22

_KERNEL_FIELDS = {
    "kind": ("<i4", 0), "registers_per_thread": ("<u2", 6), "start": ("<u8", 16), "end": ("<u8", 24),
    "device_id": ("<u4", 40), "context_id": ("<u4", 44), "stream_id": ("<u4", 48),
    "grid_x": ("<i4", 52), "grid_y": ("<i4", 56), "grid_z": ("<i4", 60),
    "block_x": ("<i4", 64), "block_y": ("<i4", 68), "block_z": ("<i4", 72),
    "static_shared_memory": ("<i4", 76), "dynamic_shared_memory": ("<i4", 80),
    "correlation_id": ("<u4", 92), "name": ("<i8", 104), "graph_node_id": ("<u8", 144), "graph_id": ("<u4", 156),
}
_API_FIELDS = {"kind": ("<i4", 0), "cbid": ("<u4", 4), "start": ("<u8", 8), "end": ("<u8", 16),
               "process_id": ("<u4", 24), "thread_id": ("<u4", 28), "correlation_id": ("<u4", 32),
               "return_value": ("<u4", 36)}

#: kind -> {field: (numpy type, byte offset)}; the C names are in tests/support/cupti_header_records.c.
FIELDS: dict[int, dict] = {
    KIND_CONCURRENT_KERNEL: _KERNEL_FIELDS,
    KIND_KERNEL: _KERNEL_FIELDS,
    KIND_MEMCPY: {"kind": ("<i4", 0), "copy_kind": ("u1", 4), "bytes": ("<u8", 8), "start": ("<u8", 16),
                  "end": ("<u8", 24), "device_id": ("<u4", 32), "context_id": ("<u4", 36),
                  "stream_id": ("<u4", 40), "correlation_id": ("<u4", 44), "graph_node_id": ("<u8", 64),
                  "graph_id": ("<u4", 72)},
    KIND_MEMSET: {"kind": ("<i4", 0), "value": ("<u4", 4), "bytes": ("<u8", 8), "start": ("<u8", 16),
                  "end": ("<u8", 24), "device_id": ("<u4", 32), "context_id": ("<u4", 36),
                  "stream_id": ("<u4", 40), "correlation_id": ("<u4", 44), "graph_node_id": ("<u8", 64),
                  "graph_id": ("<u4", 72)},
    KIND_RUNTIME: _API_FIELDS,
    KIND_DRIVER: _API_FIELDS,
    KIND_INTERNAL_LAUNCH_API: _API_FIELDS,
    KIND_MARKER: {"kind": ("<i4", 0), "flags_": ("<i4", 4), "timestamp": ("<u8", 8), "id": ("<u4", 16),
                  "object_kind": ("<i4", 20),
                  "object_id": (np.dtype([("process_id", "<u4"), ("thread_id", "<u4"), ("pad", "<u4")]), 24),
                  "name": ("<i8", 40), "domain": ("<i8", 48)},
    KIND_EXTERNAL_CORRELATION: {"kind": ("<i4", 0), "external_kind": ("<i4", 4),
                                "external_id": ("<u8", 8), "correlation_id": ("<u4", 16)},
    # CUpti_ActivityGraphTrace2 (graph-level mode): one record per graph launch
    KIND_GRAPH_TRACE: {"kind": ("<i4", 0), "correlation_id": ("<u4", 4), "start": ("<u8", 8), "end": ("<u8", 16),
                       "device_id": ("<u4", 24), "graph_id": ("<u4", 28), "context_id": ("<u4", 32),
                       "stream_id": ("<u4", 36)},
}


def min_record_size(kind: int) -> int:
    """Bytes a record of ``kind`` needs to hold every field read (0 for an unknown kind)."""
    f = FIELDS.get(kind)
    if f is None:
        return 0
    return max(off + np.dtype(t).itemsize for t, off in f.values())


@lru_cache(maxsize=256)
def layout_for(kind: int, record_size: int, cupti_version: int = 0) -> tuple[np.dtype | None, str]:
    """Return ``(dtype, source)`` for records of ``kind`` that are ``record_size`` bytes.

    ``dtype`` views one record (``itemsize == record_size``) with the fields read;
    ``source`` says which layout was used, or why none (the section is then skipped
    and counted by the decoder, never misread).
    """
    fields = FIELDS.get(kind)
    if fields is None:
        return None, f"no layout for kind {kind} (not a kind Ridgeline decodes)"
    need = min_record_size(kind)
    if record_size < need:
        return None, f"no layout for kind {kind} size {record_size}: records of this kind hold at least {need} bytes"
    if 0 < cupti_version < MIN_CUPTI_VERSION:
        return None, (f"no layout for kind {kind}: CUPTI version {cupti_version} is older than CUDA 12.4 "
                      f"(version {MIN_CUPTI_VERSION}), whose layouts were not checked")
    names = list(fields)
    dt = np.dtype({"names": names, "formats": [fields[n][0] for n in names],
                   "offsets": [fields[n][1] for n in names], "itemsize": record_size})
    return dt, f"kind {kind} size {record_size} (fixed offsets, CUPTI 12.4..13.x)"
