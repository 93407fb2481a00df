"""The native columnar reader of Kineto traces: the first reader of :mod:`probes.kineto`.

The JSON bytes of each piece of whole events (:meth:`probes.json_chunks.ArrayStream.
pieces`: ISA-L inflate, streamed, bounded) go to ``libridgeline_json.so``
(probes/native_json/ridgeline_json.cpp, built against the distribution's simdjson), which
writes the kernel, copy, runtime/driver-API, range and operator rows straight into row
buffers laid out as this package's numpy dtypes, names interned in its own table: no
Python object per event. This module hands it the dtypes' layout and the categories, maps
its name ids into the trace's :class:`probes.events.NameTable` (in the order the typed
reader interns them, so the tables are identical too) and sets the few columns that need a
rule on names (range kinds, the SDPA causal flag).

Same contract and result as the typed reader (:mod:`probes.kineto_typed`) and the dict
reference (:mod:`probes.kineto_dicts`): a piece holding anything the native side does not
read exactly as the reference would (a value of another type than Kineto writes, an integer
that does not fit its column, a time beyond +-2^62 ns, an unknown category, JSON simdjson
refuses) is read by the reference builder instead (``kineto_typed.reference``), which
raises :class:`json_chunks.Unsplit` for invalid JSON: the caller then reads the whole file
with the structural scanner, which names the problem exactly.

One process: the native reader parses a piece in less CPU than the typed reader's two
processes spent shipping it (docs/benchmarks-analyze.md).

A missing or unloadable library is an error naming it and how to build it
(:class:`MissingReader`), not a quiet fall back to a reader 3x slower.
"""
from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import numpy as np
import orjson

from . import json_chunks, sdpa
from . import kineto_records as rec
from . import kineto_typed as typed
from .errors import InputError
from .events import (
    API_DOMAIN_DRIVER,
    API_DOMAIN_RUNTIME,
    COPY_KIND_MEMCPY,
    COPY_KIND_MEMSET,
    MISSING,
    RANGE_CUDA_SYNC,
    RANGE_GPU_ANNOTATION,
    RANGE_PROFILER_STEP,
    RANGE_USER_ANNOTATION,
    Trace,
    empty,
)
from .kineto_dicts import EventBuilder

LIB_NAME = "libridgeline_json.so"
# Pieces of 4 MiB: simdjson's parser holds several bytes of index and tape per byte of the
# piece; 8 MiB pieces cost 39 MiB more peak RSS on the 200k-kernel A100 trace for the same
# CPU (docs/benchmarks-analyze.md)
CHUNK_BYTES = 4 << 20

# ridgeline_json.cpp's enum Field, in its order: the dtype field each one is written to
# ("<cat>": the kind's field that carries the category code until this module maps it)
_FIELDS = ("start_ns", "end_ns", "name_id", "pid", "tid", "device", "stream", "context", "correlation_id",
           "external_id", "registers", "shared_mem_bytes", "grid_x", "grid_y", "grid_z", "block_x",
           "block_y", "block_z", "bytes", "cbid", "<cat>", "input_dims_id", "input_types_id")
_CAT_FIELD = {"copies": "kind", "api": "domain", "ranges": "kind"}
_RJ_OK, _RJ_REFERENCE = 0, 1
_UNMAPPED = -2

_C = typed.CAT_INDEX


class MissingReader(InputError):
    """libridgeline_json.so is not there or does not load: one line naming it and the fix."""


def library_path() -> Path:
    """Where the library is: beside this package's probes (probes/native_json/), in a source
    tree (``make -C probes/native_json``) and in an installed wheel alike (setup.py)."""
    return Path(__file__).resolve().parent / "native_json" / LIB_NAME


_lib = None


def library() -> ctypes.CDLL:
    """The loaded library (once per process); MissingReader when it cannot be."""
    global _lib
    if _lib is not None:
        return _lib
    path = library_path()
    if not path.is_file():
        raise MissingReader(f"the native trace reader {path} is missing: build it with "
                            f"`make -C {path.parent}` (needs g++ and libsimdjson-dev; scripts/setup.sh "
                            "installs both) or reinstall ridgeline")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise MissingReader(f"the native trace reader {path} does not load ({exc}); "
                            "install libsimdjson (Debian: libsimdjson14) or rebuild it") from None
    vp, sz, i32p = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int32)
    lib.rj_new.argtypes, lib.rj_new.restype = (sz,), vp
    lib.rj_free.argtypes, lib.rj_free.restype = (vp,), None
    lib.rj_kind.argtypes, lib.rj_kind.restype = (vp, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, i32p), ctypes.c_int
    lib.rj_category.argtypes = (vp, ctypes.c_char_p, ctypes.c_int, ctypes.c_int)
    lib.rj_special.argtypes = (vp, ctypes.c_char_p)
    lib.rj_piece.argtypes, lib.rj_piece.restype = (vp, vp, sz, ctypes.c_int), ctypes.c_int
    lib.rj_why.argtypes, lib.rj_why.restype = (vp,), ctypes.c_char_p
    lib.rj_rows.argtypes, lib.rj_rows.restype = (vp, ctypes.c_int, ctypes.POINTER(vp)), ctypes.c_long
    lib.rj_counts.argtypes = (vp, ctypes.POINTER(ctypes.c_long))
    lib.rj_counts.restype = ctypes.POINTER(ctypes.c_int64)
    lib.rj_specials.argtypes, lib.rj_specials.restype = (vp, ctypes.POINTER(ctypes.c_long)), i32p
    lib.rj_count.argtypes, lib.rj_count.restype = (vp, ctypes.c_int), ctypes.c_long
    lib.rj_text.argtypes = (vp, ctypes.c_int, ctypes.c_long, ctypes.POINTER(sz))
    lib.rj_text.restype = ctypes.POINTER(ctypes.c_char)
    lib.rj_padding.argtypes, lib.rj_padding.restype = (), sz
    try:
        lib.rj_bad_times.argtypes, lib.rj_bad_times.restype = (vp,), ctypes.c_long
    except AttributeError:
        raise MissingReader(f"the native trace reader {path} was built from another version of "
                            f"probes/native_json: rebuild it with `make -C {path.parent}`") from None
    if lib.rj_padding() > json_chunks.PIECE_PAD:
        # pieces are parsed in place with PIECE_PAD readable bytes after them: a simdjson
        # that reads further would read past the buffer
        raise MissingReader(f"the native trace reader {path} was built with a simdjson that reads "
                            f"{lib.rj_padding()} bytes past a piece, more than json_chunks.PIECE_PAD "
                            f"({json_chunks.PIECE_PAD}): raise PIECE_PAD or rebuild against that simdjson")
    _lib = lib
    return lib


def _template(kind: str) -> np.ndarray:
    t = empty(typed.DTYPES[kind], 1)
    if kind == "cpu_ops":
        t["is_causal"] = sdpa.CAUSAL_FLAG_UNKNOWN
    return t


class _Ids:
    """One native string table mapped into the trace's NameTable, lazily: a native id gets
    its NameTable id when a row first uses it, so the NameTable is filled in the order the
    typed reader fills it (per piece, kind by kind, row by row)."""

    def __init__(self, reader: "_Reader", table: int, convert):
        self.reader, self.table, self.convert = reader, table, convert
        self.map = np.full(1, MISSING, dtype=np.int32)     # native id + 1 -> NameTable id

    def text(self, i: int) -> bytes:
        n = ctypes.c_size_t()
        p = self.reader.lib.rj_text(self.reader.h, self.table, i, ctypes.byref(n))
        return ctypes.string_at(p, n.value)

    def mapped(self, ids: np.ndarray, names) -> np.ndarray:
        """NameTable ids of native ``ids`` (MISSING stays), new ones interned in row order."""
        if not len(ids):
            return ids
        top = int(ids.max()) + 2
        if top > len(self.map):
            self.map = np.concatenate([self.map, np.full(top - len(self.map), _UNMAPPED, dtype=np.int32)])
        out = self.map[ids + 1]
        new = out == _UNMAPPED
        if new.any():
            fresh, first = np.unique(ids[new], return_index=True)
            intern, convert = names.intern, self.convert
            for i in fresh[np.argsort(first, kind="stable")].tolist():
                self.map[i + 1] = intern(convert(self.text(i)))
            out = self.map[ids + 1]
        return out


def _compact_json(raw: bytes) -> str:
    # the typed reader's rule (kineto_typed._Names.json_ids): orjson's compact text
    return orjson.dumps(orjson.loads(raw)).decode()


class _Reader:
    """The library's reader of one file, configured with this package's layouts."""

    def __init__(self, lib: ctypes.CDLL, max_bytes: int):
        self.lib = lib
        self.h = lib.rj_new(max_bytes)
        if not self.h:
            raise MemoryError("the native trace reader could not allocate its parser")
        self.templates = {k: _template(k) for k in typed.KINDS}
        for k, kind in enumerate(typed.KINDS):
            dt = typed.DTYPES[kind]
            slots = np.zeros(2 * len(_FIELDS), dtype=np.int32)
            for f, field in enumerate(_FIELDS):
                field = _CAT_FIELD.get(kind) if field == "<cat>" else field
                if field in (dt.names or ()):
                    off = dt.fields[field][1]
                    slots[2 * f], slots[2 * f + 1] = off, dt[field].itemsize
            rc = lib.rj_kind(self.h, k, dt.itemsize, self.templates[kind].tobytes(),
                             slots.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)))
            if rc != _RJ_OK:
                raise AssertionError(f"rj_kind refused the {kind} layout")
        for code, cat in enumerate(typed.CATS):
            lib.rj_category(self.h, None if cat is None else cat.encode(), code, int(typed.KIND_OF_CAT[code]))
        for op in sorted(sdpa.SDPA_OPS):
            lib.rj_special(self.h, op.encode())
        self.names = _Ids(self, 0, bytes.decode)
        self.jsons = _Ids(self, 1, _compact_json)
        # False while every row read has times reject_invalid_times keeps (the library
        # counts the others per piece; a piece the reference reads is not looked at)
        self.dirty_times = False

    def close(self) -> None:
        if self.h:
            self.lib.rj_free(self.h)
            self.h = None

    def _view(self, k: int, kind: str) -> np.ndarray:
        ptr = ctypes.c_void_p()
        n = self.lib.rj_rows(self.h, k, ctypes.byref(ptr))
        dt = typed.DTYPES[kind]
        if n <= 0:
            return empty(dt)
        return np.frombuffer((ctypes.c_char * (n * dt.itemsize)).from_address(ptr.value), dtype=dt)

    def piece(self, piece: memoryview, b: EventBuilder, path: Path, padded: bool = False) -> dict[str, np.ndarray]:
        """The columns of one piece, per kind (views into the library's buffers, valid until
        the next piece); b.counts updated. A piece the library leaves to the reference is
        read by it. ``padded``: the piece is one of :meth:`json_chunks.ArrayStream.pieces`
        with writable bytes around it (``padded`` there), parsed in place."""
        addr = np.frombuffer(piece, dtype=np.uint8).ctypes.data if len(piece) else 0
        rc = self.lib.rj_piece(self.h, addr, len(piece), int(padded and len(piece) > 0))
        if rc == _RJ_REFERENCE:
            self.dirty_times = True
            return typed.reference(piece, b)
        if rc != _RJ_OK:
            raise InputError(f"{path}: the native trace reader failed ({self.lib.rj_why(self.h).decode()})")
        if self.lib.rj_bad_times(self.h):
            self.dirty_times = True
        names = b.names
        cols = {kind: self._view(k, kind) for k, kind in enumerate(typed.KINDS)}
        for kind in typed.KINDS:
            rows = cols[kind]
            if len(rows):
                rows["name_id"] = self.names.mapped(rows["name_id"], names)
        c = cols["copies"]
        if len(c):
            c["kind"] = np.where(c["kind"] == _C["gpu_memset"], COPY_KIND_MEMSET, COPY_KIND_MEMCPY)
        a = cols["api"]
        if len(a):
            a["domain"] = np.where(a["domain"] == _C["cuda_driver"], API_DOMAIN_DRIVER, API_DOMAIN_RUNTIME)
        r = cols["ranges"]
        if len(r):
            step = rec.per_name(names, r["name_id"], lambda s: s.startswith("ProfilerStep#"), bool)
            code = r["kind"].copy()
            r["kind"] = np.where(code == _C["user_annotation"],
                                 np.where(step, RANGE_PROFILER_STEP, RANGE_USER_ANNOTATION),
                                 np.where(code == _C["cuda_sync"], RANGE_CUDA_SYNC,
                                          np.where(step, RANGE_PROFILER_STEP, RANGE_GPU_ANNOTATION)))
        ops = cols["cpu_ops"]
        if len(ops):
            ops["input_dims_id"] = self.jsons.mapped(ops["input_dims_id"], names)
            ops["input_types_id"] = self.jsons.mapped(ops["input_types_id"], names)
            self._causal(ops, names)
        n = ctypes.c_long()
        counts = np.ctypeslib.as_array(self.lib.rj_counts(self.h, ctypes.byref(n)), shape=(n.value,))
        bc = b.counts
        for code in np.flatnonzero(counts).tolist():
            cat = typed.CATS[code]
            key = cat if cat is not None else "<none>"
            bc[key] = bc.get(key, 0) + int(counts[code])
        return cols

    def _causal(self, ops: np.ndarray, names) -> None:
        """The SDPA operators' causal flag (probes.sdpa), as the typed reader sets it."""
        n = ctypes.c_long()
        p = self.lib.rj_specials(self.h, ctypes.byref(n))
        if not n.value:
            return
        special = np.ctypeslib.as_array(p, shape=(n.value, 3)).tolist()
        for row, concrete, types in special:
            ops["is_causal"][row] = sdpa.causal_flag(names[int(ops["name_id"][row])], self._value(concrete),
                                                     self._value(types))

    def _value(self, jid: int):
        return None if jid < 0 else orjson.loads(self.jsons.text(jid))


def load(path: str | Path, chunk_bytes: int = CHUNK_BYTES, budget=None) -> Trace:
    """The trace at ``path`` (same contract as :func:`probes.kineto.load_trace`).

    Raises :class:`json_chunks.Unsplit` when the file must be read by the structural
    scanner instead, InputError when it cannot be read at all or the rows kept would
    pass ``budget``, MissingReader when the library is not there."""
    path = Path(path)
    lib = library()
    enabled = gc.isenabled()
    gc.disable()   # the reference builder's pieces make dicts, none cyclic
    # the parser holds about 14 bytes per byte of its largest piece: pieces past twice the
    # piece size (an event bigger than a block, up to json_chunks.PIECE_LIMIT) are few
    # events, read by the reference builder instead
    reader = _Reader(lib, 2 * chunk_bytes + (1 << 20))
    try:
        stream = json_chunks.ArrayStream(path, "traceEvents", chunk_bytes)
        b = EventBuilder()
        out = typed.InOrder(budget.fresh() if budget is not None else None, b.names)
        for i, piece in enumerate(stream.pieces()):
            out.add(i, reader.piece(piece, b, path, stream.padded))
        trace = rec.assembled(path, stream.top, b.names, b.counts, out.columns(),
                              times_checked=not reader.dirty_times)
        if stream.top_array:
            trace.meta["json_array_format"] = True
        return trace
    finally:
        reader.close()
        if enabled:
            gc.enable()
