"""The native per-record passes of the CUPTI decoder: ``probes/cupti/native/libridgeline_cupti_decode.so``.

Built from ``probes/cupti/native/ridgeline_cupti_decode.c`` by the package build (setup.py)
and, in a source tree, by ``make -C probes/cupti/native`` (``scripts/setup.sh`` runs it), as
the fold library is. Loaded once with ctypes. :class:`probes.cupti.decode.ProcessDecoder`
calls it for kernel and API sections and for the joins of ``take``; the numpy code in
decode.py (``reference=True``, or :data:`REFERENCE`) is the reference the tests compare it
with, never a fallback: without the library :func:`library` raises
:class:`DecodeLibraryMissing`, one line that says what to build (CuptiProbe.check says it).

Why native: the numpy decode copied each record field by field into the event columns,
checked ranges in one pass per check and joined with a table per index: about 250 ns per
kernel with its API and external-correlation records, more than the agent's whole budget
at 50k kernels/s (issue 21); one pass per section and one for the joins cost a fraction.

Record layouts stay those of probes/cupti/layouts.py, per CUPTI release: the C code is
handed each field's offset from the section's layout dtype, and reads each at the width
listed in :data:`KERNEL_IN` / :data:`API_IN`; :func:`kernel_offsets` / :func:`api_offsets`
give None for a layout whose widths differ (that section then goes through the numpy
reference).
"""
from __future__ import annotations

import ctypes as ct
from functools import lru_cache
from pathlib import Path

import numpy as np

from ridgeline.probes import native_library
from ridgeline.probes.errors import RuntimeFailure
from ridgeline.probes.events import API_DTYPE, KERNEL_DTYPE

LIB_NAME = "libridgeline_cupti_decode.so"

#: The tests set this (monkeypatch) to run every section and join through the numpy
#: reference instead, and compare the two.
REFERENCE = False

#: Input fields read from a kernel record, in the C enum's order, with the width read
#: (numpy type of layouts.FIELDS; a layout naming another type is not used natively).
KERNEL_IN = (("start", "<u8"), ("end", "<u8"), ("device_id", "<u4"), ("stream_id", "<u4"),
             ("context_id", "<u4"), ("correlation_id", "<u4"), ("grid_x", "<i4"), ("grid_y", "<i4"),
             ("grid_z", "<i4"), ("block_x", "<i4"), ("block_y", "<i4"), ("block_z", "<i4"),
             ("registers_per_thread", "<u2"), ("static_shared_memory", "<i4"), ("dynamic_shared_memory", "<i4"),
             ("name", "<i8"), ("graph_id", "<u4"), ("graph_node_id", "<u8"))
#: KERNEL_DTYPE columns written, in the C enum's order, with their width.
KERNEL_OUT = (("start_ns", "<i8"), ("end_ns", "<i8"), ("device", "<i4"), ("stream", "<i8"), ("context", "<i4"),
              ("correlation_id", "<i8"), ("external_id", "<i8"), ("grid_x", "<i4"), ("grid_y", "<i4"),
              ("grid_z", "<i4"), ("block_x", "<i4"), ("block_y", "<i4"), ("block_z", "<i4"), ("registers", "<i4"),
              ("shared_mem_bytes", "<i4"), ("name_id", "<i4"), ("graph_id", "<i8"), ("graph_node_id", "<i8"),
              ("pid", "<i4"), ("tid", "<i4"))
API_IN = (("cbid", "<u4"), ("start", "<u8"), ("end", "<u8"), ("thread_id", "<u4"), ("correlation_id", "<u4"))
API_OUT = (("start_ns", "<i8"), ("end_ns", "<i8"), ("pid", "<i4"), ("tid", "<i4"), ("correlation_id", "<i8"),
           ("external_id", "<i8"), ("cbid", "<i4"), ("domain", "u1"), ("category", "u1"), ("name_id", "<i4"))

_V = ct.c_void_p
_I = ct.c_int64
_P = np.ctypeslib.ndpointer(dtype=np.int64, flags="C_CONTIGUOUS")


class DecodeLibraryMissing(RuntimeFailure):
    """The native CUPTI decode library is not built or cannot be loaded (the message says what to do)."""


_NATIVE_DIR = Path(__file__).resolve().parent / "native"


def library_path() -> Path:
    """The built library (``RIDGELINE_CUPTI_DECODE_LIB`` overrides)."""
    return native_library.path_of("RIDGELINE_CUPTI_DECODE_LIB", _NATIVE_DIR, LIB_NAME)


def _hint() -> str:
    return native_library.build_hint(_NATIVE_DIR)


def _offsets(dtype: np.dtype, spec) -> np.ndarray | None:
    """Byte offsets of ``spec``'s fields in ``dtype``, or None when one is missing or of another width."""
    out = []
    for name, t in spec:
        f = dtype.fields.get(name) if dtype.names else None
        if f is None or f[0] != np.dtype(t):
            return None
        out.append(f[1])
    return np.array(out, np.int64)


_K_OUT = _offsets(KERNEL_DTYPE, KERNEL_OUT)
_A_OUT = _offsets(API_DTYPE, API_OUT)
assert _K_OUT is not None and _A_OUT is not None, "events.py's columns changed: update decode_native"
_K_OUT_ADDR, _A_OUT_ADDR = _K_OUT.ctypes.data, _A_OUT.ctypes.data

#: rl_decode_abi()'s version: the argument lists this module passes
ABI_VERSION = 1


@lru_cache(maxsize=1)
def library() -> ct.CDLL:
    """The loaded library, its constants checked against decode.py's."""
    path = library_path()
    lib = native_library.open_library(path, "CUPTI decode", _hint(), DecodeLibraryMissing)
    try:
        lib.rl_decode_abi.restype = _I
        lib.rl_decode_abi.argtypes = (_P,)
        lib.rl_decode_kernels.restype = _I
        lib.rl_decode_kernels.argtypes = (_V, _I, _I, _V, _V, _I, _V, _V, _V, _I, ct.c_int32, _V)
        lib.rl_decode_api.restype = _I
        lib.rl_decode_api.argtypes = (_V, _I, _I, _V, _V, _I, _V, ct.c_int32, ct.c_int32, _V, _V, _I,
                                      ct.c_int32, ct.c_uint64, ct.c_uint64, _V)
        lib.rl_join.restype = _I
        lib.rl_join.argtypes = (_V, _I, _I, _P, _V, _I, _I, _P, _V, _I, _I, _P, _V, _I, _I, _P, _V, _I, _I, _P,
                                _V, _V, _V, _V, _P, _V, _I)
        lib.rl_remap_i32.restype = None
        lib.rl_remap_i32.argtypes = (_V, _I, _I, _I, _V, _I)
    except AttributeError as exc:     # a symbol this version calls is not in the library
        raise DecodeLibraryMissing(f"ridgeline: the native CUPTI decode library {path} was built from another "
                                   f"version ({exc}): {_hint()}") from None
    if lib.rl_decode_abi(np.zeros(5, np.int64)) != ABI_VERSION:
        raise DecodeLibraryMissing(f"ridgeline: the native CUPTI decode library {path} was built from another "
                                   f"version: {_hint()}")
    return lib


def constants() -> tuple[int, ...]:
    """The constants the C passes were built with: (MAX_TIMESTAMP_NS, MAX_DURATION_NS,
    MAX_DEVICE_ID, MISSING, API_GRAPH_LAUNCH)."""
    got = np.zeros(5, np.int64)
    library().rl_decode_abi(got)
    return tuple(int(x) for x in got)


def check(expected: tuple[int, ...] | None = None) -> None:
    """Raise :class:`DecodeLibraryMissing` now if the library cannot be used, or (``expected``:
    decode.py's values, passed by it: this module does not import decode) was built with
    other constants."""
    library()
    if expected is not None and constants() != expected:
        raise DecodeLibraryMissing(f"ridgeline: the native CUPTI decode library {library_path()} was built with "
                                   f"other limits ({constants()}, expected {expected}): {_hint()}")


class Offsets:
    """A layout's input offsets for a C pass, with their address (taken once per layout:
    each numpy-to-ctypes conversion costs one to three microseconds, per section)."""
    __slots__ = ("arr", "addr")

    def __init__(self, arr: np.ndarray):
        self.arr, self.addr = arr, arr.ctypes.data


@lru_cache(maxsize=256)
def kernel_offsets(dtype: np.dtype) -> Offsets | None:
    """The C pass's input offsets for a kernel section's layout, None if it does not fit."""
    o = _offsets(dtype, KERNEL_IN)
    return None if o is None else Offsets(o)


@lru_cache(maxsize=256)
def api_offsets(dtype: np.dtype) -> Offsets | None:
    """The same for an API section's layout."""
    o = _offsets(dtype, API_IN)
    return None if o is None else Offsets(o)


class Table:
    """A lookup table the passes read (name pointers and their ids; callback categories and
    names) and the addresses of its arrays, taken once when it changes."""
    __slots__ = ("keys", "values", "n", "keys_addr", "values_addr")

    def __init__(self, keys: np.ndarray | None, values: np.ndarray | None):
        self.keys, self.values = keys, values
        self.n = 0 if keys is None else len(keys)
        self.keys_addr = keys.ctypes.data if self.n else None
        self.values_addr = values.ctypes.data if self.n else None


NO_TABLE = Table(None, None)


class Counts:
    """Per-call counts the C passes write (int64[3]), one buffer per decoder: its address is
    taken once (each numpy-to-ctypes conversion costs about a microsecond, per section)."""
    __slots__ = ("arr", "addr")

    def __init__(self):
        self.arr = np.zeros(3, np.int64)
        self.addr = self.arr.ctypes.data

    def read(self) -> list[int]:
        return self.arr.tolist()


def _base(buf) -> int:
    """Address of a read-only buffer (a memoryview of the received body) without copying it."""
    return np.frombuffer(buf, np.uint8).ctypes.data


def _rows(out: np.ndarray) -> int:
    """Address of ``out``, rows the C pass writes at its dtype's itemsize."""
    if not out.flags.c_contiguous:
        raise ValueError("the decode passes write contiguous rows")
    return out.ctypes.data


def decode_kernels(data, count: int, stride: int, offs: Offsets, out: np.ndarray, names: Table, pid: int,
                   counts: Counts) -> int:
    """``count`` raw kernel records in ``data`` -> rows of ``out`` (KERNEL_DTYPE, room for
    ``count``); ``names``: sorted unique name pointers -> name ids. Returns the rows written;
    ``counts`` then holds the records failing the timestamp and device checks and the
    unresolved names."""
    if not count:
        counts.arr[:] = 0
        return 0
    return library().rl_decode_kernels(_base(data), count, stride, offs.addr, _rows(out), KERNEL_DTYPE.itemsize,
                                       _K_OUT_ADDR, names.keys_addr, names.values_addr, names.n, pid, counts.addr)


def decode_api(data, count: int, stride: int, offs: Offsets, out: np.ndarray, pid: int, domain: int, cbids: Table,
               received_ns: int | None, floor_ns: int, ahead_ns: int, counts: Counts) -> int:
    """``count`` raw API records -> rows of ``out`` (API_DTYPE); ``cbids``: callback id ->
    category (uint8) and name id (int32). ``counts`` then holds the timestamp failures and
    the clock disagreements."""
    if not count:
        counts.arr[:] = 0
        return 0
    return library().rl_decode_api(
        _base(data), count, stride, offs.addr, _rows(out), API_DTYPE.itemsize, _A_OUT_ADDR, pid, domain,
        cbids.keys_addr, cbids.values_addr, cbids.n, received_ns is not None, floor_ns,
        min(ahead_ns, (1 << 64) - 1), counts.addr)


def _field_offs(a: np.ndarray, names) -> np.ndarray:
    return np.array([a.dtype.fields[f][1] for f in names], np.int64)


def _stride(a: np.ndarray) -> int:
    return a.strides[0] if len(a) > 1 else a.dtype.itemsize


#: int64s of join index memory a decoder keeps however little the last join used (4 MiB)
SCRATCH_KEPT = 1 << 19


class Scratch:
    """Index memory the joins reuse from one take() to the next (one per decoder)."""
    __slots__ = ("arr",)

    def __init__(self):
        self.arr = np.empty(0, np.int64)


def join(kernels: np.ndarray, copies: np.ndarray, api_new: np.ndarray, api_all: np.ndarray, ext_all: np.ndarray,
         scratch: Scratch):
    """ProcessDecoder.take's joins in one pass (see ridgeline_cupti_decode.c ``rl_join``):
    writes kernels' external_id and tid, copies' tid, api_new's external_id in place;
    returns ``(latency_ns, api_used, ext_used, graph_joined, unjoined_kernels, graph_joined_count)``."""
    nk = len(kernels)
    latency = np.empty(nk, np.int64)
    api_used = np.zeros(len(api_all), bool)
    ext_used = np.zeros(len(ext_all), bool)
    graph = np.zeros(nk, bool)
    counts = np.zeros(2, np.int64)
    ptr = lambda a: a.ctypes.data if len(a) else None  # noqa: E731
    args = (ptr(kernels), nk, _stride(kernels),
            _field_offs(kernels, ("correlation_id", "external_id", "tid", "start_ns")),
            ptr(copies), len(copies), _stride(copies), _field_offs(copies, ("correlation_id", "tid")),
            ptr(api_new), len(api_new), _stride(api_new), _field_offs(api_new, ("correlation_id", "external_id")),
            ptr(api_all), len(api_all), _stride(api_all),
            _field_offs(api_all, ("correlation_id", "tid", "start_ns", "category")),
            ptr(ext_all), len(ext_all), _stride(ext_all), _field_offs(ext_all, ("correlation_id", "external_id")),
            latency.ctypes.data, api_used.ctypes.data, ext_used.ctypes.data, graph.ctypes.data, counts)
    lib = library()
    used = lib.rl_join(*args, scratch.arr.ctypes.data, len(scratch.arr))
    if used < 0:
        # at most 8 entries per record of the two indexed arrays, plus 2048 (their id ranges)
        scratch.arr = np.empty(-used + (-used >> 2), np.int64)
        used = lib.rl_join(*args, scratch.arr.ctypes.data, len(scratch.arr))
        assert used >= 0, used
    elif len(scratch.arr) > max(4 * used, SCRATCH_KEPT):
        # a burst (or a peer's sparse ids) does not keep its index memory for the decoder's life
        scratch.arr = np.empty(0, np.int64)
    return latency, api_used, ext_used, graph, int(counts[0]), int(counts[1])


def remap(arr: np.ndarray, field: str, table: np.ndarray) -> None:
    """``arr[field] = table[arr[field]]`` where the id is >= 0, in place (an int32 field)."""
    if len(arr):
        t = np.ascontiguousarray(table, np.int32)
        library().rl_remap_i32(arr.ctypes.data, len(arr), _stride(arr), arr.dtype.fields[field][1], t.ctypes.data,
                               len(t))
