"""CUPTI activity record layouts, chosen per injected process by the CUPTI version it reports.

The layouts are cupti-python's numpy dtypes (``cupti.cupti.activity_kernel13_dtype``
...), which mirror the C structs byte for byte. Which struct version a kind uses
depends on the libcupti in the served process (CUPTI 13.5 writes ``Kernel13``, CUPTI
12.x ``Kernel9``); the library also reports the record size of every section, and every
struct version of a kind has a distinct size, so (kind, size) picks the layout and the
CUPTI version breaks ties and is reported.

When cupti-python cannot be imported, built-in layouts cover the fields Ridgeline reads
(offsets from the CUPTI 13.5 headers; they are the same in every struct version of a
kind, see docs/reference) so the agent still decodes.
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
MARKER_OBJECT_THREAD = 1   # CUPTI_ACTIVITY_OBJECT_THREAD: object_id holds process/thread ids

# cupti-python dtype names per kind, newest first
_CANDIDATES = {
    KIND_CONCURRENT_KERNEL: ("activity_kernel13_dtype", "activity_kernel12_dtype", "activity_kernel11_dtype",
                             "activity_kernel10_dtype", "activity_kernel9_dtype"),
    KIND_MEMCPY: ("activity_memcpy7_dtype", "activity_memcpy6_dtype", "activity_memcpy5_dtype"),
    KIND_MEMSET: ("activity_memset5_dtype", "activity_memset4_dtype"),
    KIND_RUNTIME: ("activity_api_dtype",),
    KIND_MARKER: ("activity_marker2_dtype",),
    KIND_MARKER_DATA: ("activity_marker_data2_dtype", "activity_marker_data_dtype"),
    KIND_EXTERNAL_CORRELATION: ("activity_external_correlation_dtype",),
    KIND_GRAPH_TRACE: ("activity_graph_trace2_dtype",),
}
_CANDIDATES[KIND_KERNEL] = _CANDIDATES[KIND_CONCURRENT_KERNEL]
_CANDIDATES[KIND_DRIVER] = _CANDIDATES[KIND_RUNTIME]
_CANDIDATES[KIND_INTERNAL_LAUNCH_API] = _CANDIDATES[KIND_RUNTIME]


def _builtin(fields: dict[str, tuple[str, int]], itemsize: int) -> np.dtype:
    names = list(fields)
    return np.dtype({"names": names, "formats": [fields[n][0] for n in names],
                     "offsets": [fields[n][1] for n in names], "itemsize": itemsize})


_KERNEL_FIELDS = {
    "kind": ("<i4", 0), "registers_per_thread": ("<u2", 6), "start": ("<u8", 16), "end": ("<u8", 24),
    "device_id": ("<u4", 40), "context_id": ("<u4", 44), "stream_id": ("<u4", 48),
    "grid_x": ("<i4", 52), "grid_y": ("<i4", 56), "grid_z": ("<i4", 60),
    "block_x": ("<i4", 64), "block_y": ("<i4", 68), "block_z": ("<i4", 72),
    "static_shared_memory": ("<i4", 76), "dynamic_shared_memory": ("<i4", 80),
    "correlation_id": ("<u4", 92), "name": ("<i8", 104), "graph_node_id": ("<u8", 144), "graph_id": ("<u4", 156),
}
_BUILTIN = {
    (KIND_CONCURRENT_KERNEL, 248): _KERNEL_FIELDS,
    (KIND_MEMCPY, 112): {"kind": ("<i4", 0), "copy_kind": ("u1", 4), "bytes": ("<u8", 8), "start": ("<u8", 16),
                         "end": ("<u8", 24), "device_id": ("<u4", 32), "context_id": ("<u4", 36),
                         "stream_id": ("<u4", 40), "correlation_id": ("<u4", 44), "graph_node_id": ("<u8", 64),
                         "graph_id": ("<u4", 72)},
    (KIND_MEMSET, 104): {"kind": ("<i4", 0), "value": ("<u4", 4), "bytes": ("<u8", 8), "start": ("<u8", 16),
                         "end": ("<u8", 24), "device_id": ("<u4", 32), "context_id": ("<u4", 36),
                         "stream_id": ("<u4", 40), "correlation_id": ("<u4", 44), "graph_node_id": ("<u8", 64),
                         "graph_id": ("<u4", 72)},
    (KIND_RUNTIME, 40): {"kind": ("<i4", 0), "cbid": ("<u4", 4), "start": ("<u8", 8), "end": ("<u8", 16),
                         "process_id": ("<u4", 24), "thread_id": ("<u4", 28), "correlation_id": ("<u4", 32),
                         "return_value": ("<u4", 36)},
    (KIND_MARKER, 56): {"kind": ("<i4", 0), "flags_": ("<i4", 4), "timestamp": ("<u8", 8), "id": ("<u4", 16),
                        "object_kind": ("<i4", 20), "object_id": (np.dtype([("process_id", "<u4"),
                                                                            ("thread_id", "<u4"),
                                                                            ("pad", "<u4")]), 24),
                        "name": ("<i8", 40), "domain": ("<i8", 48)},
    (KIND_EXTERNAL_CORRELATION, 24): {"kind": ("<i4", 0), "external_kind": ("<i4", 4),
                                      "external_id": ("<u8", 8), "correlation_id": ("<u4", 16)},
}
_BUILTIN[(KIND_KERNEL, 248)] = _KERNEL_FIELDS
_BUILTIN[(KIND_DRIVER, 40)] = _BUILTIN[(KIND_RUNTIME, 40)]
_BUILTIN[(KIND_INTERNAL_LAUNCH_API, 40)] = _BUILTIN[(KIND_RUNTIME, 40)]


@lru_cache(maxsize=1)
def _cupti_module():
    try:
        from cupti import cupti as mod   # absolute: the top-level cupti-python package
        return mod
    except Exception:                    # not installed, or a broken install: use built-ins
        return None


@lru_cache(maxsize=256)
def layout_for(kind: int, record_size: int, cupti_version: int = 0) -> tuple[np.dtype | None, str]:
    """Return ``(dtype, source)`` for records of ``kind`` that are ``record_size`` bytes.

    ``source`` names the layout (e.g. ``"cupti-python activity_kernel13_dtype"``).
    ``dtype`` is None when no known layout has that size (the section is then skipped
    and counted by the decoder, never misread).
    """
    mod = _cupti_module()
    if mod is not None:
        matches = [n for n in _CANDIDATES.get(kind, ()) if getattr(mod, n, None) is not None
                   and getattr(mod, n).itemsize == record_size]
        if matches:
            # sizes are distinct per version today; if two ever collide, an older CUPTI
            # (< 13.0) is taken to write the older struct
            name = matches[0] if cupti_version >= 130000 or len(matches) == 1 else matches[-1]
            return getattr(mod, name), f"cupti-python {name}"
    fields = _BUILTIN.get((kind, record_size))
    if fields is not None:
        return _builtin(fields, record_size), f"built-in kind {kind} size {record_size}"
    return None, f"no layout for kind {kind} size {record_size}"
