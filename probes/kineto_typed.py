"""Typed decoding of Kineto trace events with msgspec: :mod:`probes.kineto`'s reader before
the native one (:mod:`probes.kineto_native`), kept as the reference that reader is tested
against, and the parts both share (categories, rows appended in file order, the hand-off
of a piece to the dict reference builder, :func:`reference`).

:func:`load` reads the ``traceEvents`` array in pieces of whole events
(:meth:`probes.json_chunks.ArrayStream.pieces`) and decodes each piece with one msgspec
call into small structs that hold only the fields the importer keeps (unknown keys are
skipped inside msgspec's C decoder). The decoder is tagged by ``ph``: only complete
events ("X") are decoded whole; flows, instants, metadata rows and the other phases keep
their category alone (it is counted), their other fields skipped unread; a piece with an
event of an unknown phase or none takes the untagged decoder. Categories decode into
enum members that carry their code, so one pass tells every event's kind. Columns are
then taken per event kind with ``operator.attrgetter`` maps into ``np.fromiter``, so no
Python code runs per event and field.

Same contract and result as the dict-based reference (:func:`probes.kineto_dicts.
load_trace_via_dicts`): a piece whose values do not fit the structs' types (a string
where a number belongs, ``null``, an integer wider than 64 bits, a malformed grid, an
element that is not an object) or that holds a category this module does not know is
read by that reference builder instead, so the result never depends on the path taken.
A piece that is not valid JSON (a cut that fell inside a string or a nested array, a
truncated or corrupt file) raises :class:`json_chunks.Unsplit`: the caller then reads
the whole file with the structural scanner, which names the problem exactly.

Two readers: with ``parallel`` the file is read by this process and one forked child;
both decompress the whole stream (ISA-L inflates several GB/s, cheaper than shipping
bytes between processes) and each decodes its share of the pieces (CHILD_SHARE). The
child writes each piece's rows to an unlinked spool file and sends only their counts
and its new names through the pipe; the parent reads them back in file order, punches
out what it has read and tells the child how far it got. The child runs at most
SPOOL_LEAD_BYTES ahead of the parent's reading, so the spool (page cache, or memory
where the temporary directory is a tmpfs) stays bounded however the two are scheduled.
"""
from __future__ import annotations

import enum
import gc
import mmap
import os
from itertools import chain, repeat
from operator import attrgetter, eq, itemgetter
from pathlib import Path

import msgspec
import numpy as np
import orjson

from . import json_chunks, sdpa
from . import kineto_records as rec
from .events import (
    API_DOMAIN_DRIVER,
    API_DOMAIN_RUNTIME,
    API_DTYPE,
    COPY_DTYPE,
    COPY_KIND_MEMCPY,
    COPY_KIND_MEMSET,
    CPU_OP_DTYPE,
    KERNEL_DTYPE,
    MISSING,
    RANGE_CUDA_SYNC,
    RANGE_DTYPE,
    RANGE_GPU_ANNOTATION,
    RANGE_PROFILER_STEP,
    RANGE_USER_ANNOTATION,
    Trace,
    empty,
)
from .heap_trim import trim_heap
from .kineto_dicts import EventBuilder

CHUNK_BYTES = 8 << 20
ROWS_INITIAL_BYTES = 8 << 20
_ABSENT = -(1 << 62)   # "key not present", where the reference tells absent from -1


class _Args(msgspec.Struct, frozen=True, gc=False):
    device: int = _ABSENT
    stream: int = _ABSENT
    context: int = MISSING
    correlation: int = MISSING
    external_id: int = msgspec.field(default=MISSING, name="External id")
    registers: int = msgspec.field(default=MISSING, name="registers per thread")
    shared_mem: int = msgspec.field(default=MISSING, name="shared memory")
    grid: tuple[int, int, int] = (MISSING, MISSING, MISSING)
    block: tuple[int, int, int] = (MISSING, MISSING, MISSING)
    bytes: int = MISSING
    cbid: int = MISSING
    input_dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Input type")
    # kept raw (not decoded) on every operator; decoded only on the SDPA operators
    concrete_inputs: msgspec.Raw = msgspec.field(default=msgspec.Raw(b""), name="Concrete Inputs")


_NO_ARGS = _Args()


class _Body(msgspec.Struct, gc=False):
    """The fields kept of an event, its phase and category aside."""
    name: str | None = None
    pid: int | str = MISSING
    tid: int | str = MISSING
    ts: int | float = 0
    dur: int | float = 0
    args: _Args = _NO_ARGS


class _Event(_Body, gc=False):
    ph: str | None = None
    cat: str | None = None


_DECODER = msgspec.json.Decoder(list[_Event])

_KEPT = {"kernel": "kernels", "gpu_memcpy": "copies", "gpu_memset": "copies",
         "cuda_runtime": "api", "cuda_driver": "api", "cpu_op": "cpu_ops",
         "user_annotation": "ranges", "gpu_user_annotation": "ranges", "cuda_sync": "ranges"}
# categories the reference builder does not keep, met in real traces; any other category
# sends its piece to the reference builder, which then decides
_IGNORED = {None, "ac2g", "python_function", "Trace", "overhead", "cpu_instant_event", "fwdbwd",
            "cuda_profiler_range", "Iteration", "gpu_instant_event"}
KINDS = ("kernels", "copies", "api", "ranges", "cpu_ops")
_KIND_CODE = {k: i for i, k in enumerate(KINDS)}
CATS = list(_KEPT) + sorted(_IGNORED, key=str)
CAT_INDEX = {c: i for i, c in enumerate(CATS)}
KIND_OF_CAT = np.array([_KIND_CODE[_KEPT[c]] if c in _KEPT else -1 for c in CATS], dtype=np.int8)
# the Chrome trace format's phases other than "X" (complete)
_OTHER_PHASES = ("B", "E", "i", "I", "C", "b", "n", "e", "s", "t", "f", "P", "O", "N", "D", "M",
                 "R", "c", "(", ")")


_NCATS = len(CATS)


def _coded_categories(name: str, offset: int) -> type[enum.Enum]:
    """The known categories as an enum msgspec decodes "cat" into: a member is a
    singleton (no string made and freed per event) that carries its code in ``_code``
    (its index in CATS, plus ``offset``), so one attrgetter pass gives every event's
    code. A category not in it fails the tagged decoder (the untagged one then reads the
    piece, and the piece goes to the reference builder as any unknown category does)."""
    cats = enum.Enum(name, [(f"c{i}", c) for i, c in enumerate(CATS) if c is not None])
    for member in cats:
        member._code = CAT_INDEX[member.value] + offset
    return cats


_CAT_X = _coded_categories("_CatX", 0)
_CAT_OTHER = _coded_categories("_CatOther", _NCATS)   # not "X": no rows, counted only
# code (0.._NCATS-1: "X", _NCATS..: other phases) -> kind code or -1
_KIND_OF_CODE = np.concatenate([KIND_OF_CAT, np.full(_NCATS, -1, dtype=np.int8)])
_NONE_CODE = CAT_INDEX[None]    # an absent "cat" (None: no _code); kind -1 in any phase


def _tagged_decoder():
    """A decoder of events tagged by their phase "ph": complete events ("X") into the full
    struct, every other phase (flows, instants, metadata, counters...) into a struct of
    their category alone (msgspec skips the rest unread), categories as coded enum
    members (None where absent). A piece with an event of another phase or none, or
    of an unknown category, fails it and takes the untagged decoder."""
    from typing import Union
    complete = msgspec.defstruct("_Complete", [("cat", _CAT_X | None, None)], bases=(_Body,),
                                 tag_field="ph", tag="X", namespace={"ph": "X"})
    others = [msgspec.defstruct(f"_Phase{ord(ph)}", [("cat", _CAT_OTHER | None, None)],
                                tag_field="ph", tag=ph, gc=False, namespace={"ph": ph})
              for ph in _OTHER_PHASES]
    return msgspec.json.Decoder(list[Union[(complete, *others)]])


DTYPES = {"kernels": KERNEL_DTYPE, "copies": COPY_DTYPE, "api": API_DTYPE, "ranges": RANGE_DTYPE,
           "cpu_ops": CPU_OP_DTYPE}

_get = {f: attrgetter(f) for f in ("ph", "cat", "name", "pid", "tid", "ts", "dur", "args")}
_aget = {f: attrgetter(f) for f in _Args.__struct_fields__}


class _Names:
    """str -> id through the trace's NameTable, one dict lookup per event."""

    def __init__(self, names):
        self.table = names
        self._by_json: dict[bytes, int] = {}

    def ids(self, evs) -> np.ndarray:
        """The name id of each event (struct with a ``name``)."""
        index = self.table.index
        try:
            # names seen before: one C loop; a new name (or None) stops it
            return np.fromiter(map(index.__getitem__, map(_get["name"], evs)), dtype=np.int32, count=len(evs))
        except (KeyError, TypeError):
            intern = self.table.intern
            return np.array([MISSING if v is None else intern(v) for v in map(_get["name"], evs)], dtype=np.int32)

    def json_ids(self, raws: list) -> np.ndarray:
        """Id of the compact JSON text of each raw value ("" = absent -> -1)."""
        cache = self._by_json
        # one copy of all the texts, cut at NUL (which valid JSON text never holds
        # outside an escape), is cheaper than one bytes() per Raw
        keys = b"\0".join(raws).split(b"\0")
        if len(keys) != len(raws):
            keys = list(map(bytes, raws))
        try:
            return np.fromiter(map(cache.__getitem__, keys), dtype=np.int32, count=len(keys))
        except KeyError:
            pass
        out = list(map(cache.get, keys))
        for i, key in enumerate(keys):
            if out[i] is None:
                j = cache.get(key)
                if j is None:
                    j = cache[key] = (MISSING if not key else
                                      self.table.intern(orjson.dumps(orjson.loads(key)).decode()))
                out[i] = j
        return np.array(out, dtype=np.int32)


def _ints(values, count: int = -1) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64, count=count)


def _as_is(v):
    return v


def _ids32(get, evs: list) -> np.ndarray:
    """pid/tid (get of each event) as the reference's _id32: non-int -> -1, out-of-range
    ints folded."""
    try:
        col = _ints(map(get, evs), len(evs))
    except (TypeError, ValueError):
        col = _ints([v if type(v) is int else MISSING for v in map(get, evs)])
    return rec.ids32(col)


# within it float64 holds every integer exactly, and rec.us_to_ns reads every value
_FAST_US = float(min(1 << 53, rec.TIME_LIMIT_US))


def _us_col(get, evs: list) -> np.ndarray:
    """rec.us_to_ns of one field, without a list or numpy's type inference: ints and
    floats within +-_FAST_US are exact as float64, and there the float rule (integer part
    * 1000 + rounded fraction) gives what the int rule gives. A column with a value past
    it (or not finite) takes rec.us_to_ns itself."""
    a = np.fromiter(map(get, evs), dtype=np.float64, count=len(evs))
    if not (np.abs(a) <= _FAST_US).all():      # False for NaN too
        return rec.us_to_ns(list(map(get, evs)))
    ip = np.floor(a)
    return ip.astype(np.int64) * 1000 + np.rint((a - ip) * 1000.0).astype(np.int64)


def _times(evs: list, out: np.ndarray) -> None:
    out["start_ns"] = _us_col(_get["ts"], evs)
    out["end_ns"] = out["start_ns"] + _us_col(_get["dur"], evs)


def _raw_json(raw: msgspec.Raw):
    try:
        return orjson.loads(bytes(raw)) if len(raw) else None
    except orjson.JSONDecodeError:
        return None


def _causal_flags(name_id: np.ndarray, args: list, names: _Names) -> np.ndarray:
    """The SDPA operators' causal flag (probes.sdpa), as the scanner's (probes.kineto_scan)."""
    col = np.full(len(name_id), sdpa.CAUSAL_FLAG_UNKNOWN, dtype=np.int8)
    ids = [i for i in map(names.table.lookup, sdpa.SDPA_OPS) if i >= 0]
    if not ids:
        return col
    for row in np.flatnonzero(np.isin(name_id, ids)).tolist():
        a = args[row]
        col[row] = sdpa.causal_flag(names.table[int(name_id[row])], _raw_json(a.concrete_inputs),
                                    _raw_json(a.input_type))
    return col


def _rows(kind: str, evs: list, names: _Names, cat: np.ndarray) -> np.ndarray:
    """Rows of one kind from its events ``evs`` (category index ``cat`` of each)."""
    n = len(evs)
    out = empty(DTYPES[kind], n)
    if not n:
        return out
    _times(evs, out)
    out["name_id"] = names.ids(evs)
    args = list(map(_get["args"], evs))
    if kind == "kernels":
        for col, f in (("device", "device"), ("stream", "stream"), ("context", "context"),
                       ("correlation_id", "correlation"), ("external_id", "external_id"),
                       ("registers", "registers"), ("shared_mem_bytes", "shared_mem")):
            v = _ints(map(_aget[f], args), n)
            out[col] = np.where(v == _ABSENT, MISSING, v) if f in ("device", "stream") else v
        for prefix in ("grid", "block"):
            xyz = np.fromiter(chain.from_iterable(map(_aget[prefix], args)), dtype=np.int64,
                              count=3 * n).reshape(-1, 3)
            out[prefix + "_x"], out[prefix + "_y"], out[prefix + "_z"] = xyz[:, 0], xyz[:, 1], xyz[:, 2]
    elif kind == "copies":
        for col, f in (("device", "device"), ("stream", "stream"), ("correlation_id", "correlation"),
                       ("bytes", "bytes")):
            v = _ints(map(_aget[f], args), n)
            out[col] = np.where(v == _ABSENT, MISSING, v)
        out["kind"] = np.where(cat == CAT_INDEX["gpu_memset"], COPY_KIND_MEMSET, COPY_KIND_MEMCPY)
    elif kind == "api":
        out["pid"] = _ids32(_get["pid"], evs)
        out["tid"] = _ids32(_get["tid"], evs)
        out["correlation_id"] = _ints(map(_aget["correlation"], args), n)
        out["external_id"] = _ints(map(_aget["external_id"], args), n)
        out["cbid"] = _ints(map(_aget["cbid"], args), n)
        out["domain"] = np.where(cat == CAT_INDEX["cuda_driver"], API_DOMAIN_DRIVER, API_DOMAIN_RUNTIME)
    elif kind == "cpu_ops":
        out["pid"] = _ids32(_get["pid"], evs)
        out["tid"] = _ids32(_get["tid"], evs)
        out["external_id"] = _ints(map(_aget["external_id"], args), n)
        out["input_dims_id"] = names.json_ids(list(map(_aget["input_dims"], args)))
        out["input_types_id"] = names.json_ids(list(map(_aget["input_type"], args)))
        out["is_causal"] = _causal_flags(out["name_id"], args, names)
    else:   # ranges: few; the reference's rules, one event at a time
        kinds, pids, tids, devices = [], [], [], []
        for e, a, nid, c in zip(evs, args, out["name_id"].tolist(), cat.tolist()):
            step = nid >= 0 and names.table[nid].startswith("ProfilerStep#")
            if c == CAT_INDEX["user_annotation"]:
                kinds.append(RANGE_PROFILER_STEP if step else RANGE_USER_ANNOTATION)
                pids.append(e.pid)
                tids.append(e.tid)
                devices.append(MISSING)
            else:
                kinds.append(RANGE_CUDA_SYNC if c == CAT_INDEX["cuda_sync"]
                             else RANGE_PROFILER_STEP if step else RANGE_GPU_ANNOTATION)
                devices.append(e.pid if a.device == _ABSENT else a.device)
                pids.append(MISSING)
                tids.append(e.tid if a.stream == _ABSENT else a.stream)
        out["kind"] = kinds
        out["pid"], out["tid"], out["device"] = (_ids32(_as_is, c) for c in (pids, tids, devices))
        out["external_id"] = _ints(map(_aget["external_id"], args))
    return out


def _bracketed(piece) -> bytes:
    """The piece as one JSON array text (one copy)."""
    return b"".join((b"[", piece, b"]"))


def reference(piece, b: EventBuilder) -> dict[str, np.ndarray]:
    """The piece read by the reference dict builder (names and counts shared)."""
    try:
        events = orjson.loads(_bracketed(piece))
    except orjson.JSONDecodeError:
        raise json_chunks.Unsplit("a piece is not valid JSON") from None
    tmp = EventBuilder(names=b.names, counts=b.counts)
    tmp.add(events)
    try:
        return tmp.build_all()
    except (OverflowError, ValueError, TypeError, AttributeError):
        # values the dict builder cannot hold either (AttributeError: an "args" that is
        # not an object): the scanner's path decides
        raise json_chunks.Unsplit("values the reference builder cannot read") from None


def _decode_piece(piece, b: EventBuilder, names: _Names) -> dict[str, np.ndarray]:
    """Columns of one piece, per kind; b.counts updated."""
    text = _bracketed(piece)
    try:
        try:
            evs = _TAGGED.decode(text)
            # one pass: category and phase in one code
            code = np.fromiter(map(getattr, map(_get["cat"], evs), repeat("_code"), repeat(_NONE_CODE)),
                               dtype=np.int16, count=len(evs))
            kind_of = _KIND_OF_CODE[code]
            code %= _NCATS
        except msgspec.ValidationError:
            evs = _DECODER.decode(text)
            codes = list(map(CAT_INDEX.get, map(_get["cat"], evs)))
            if None in codes:          # a category this module does not know
                return reference(piece, b)
            code = np.array(codes, dtype=np.int16)
            kind_of = KIND_OF_CAT[code]
            kind_of[~np.fromiter(map(eq, map(_get["ph"], evs), repeat("X")), dtype=bool,
                                 count=len(evs))] = -1
    except msgspec.ValidationError:
        return reference(piece, b)
    except msgspec.DecodeError:
        raise json_chunks.Unsplit("a piece is not valid JSON") from None
    except RecursionError:
        # nested past msgspec's limit: the scanner refuses it by depth (issue 18.7)
        raise json_chunks.Unsplit("a piece nests too deep") from None
    del text
    per_cat = np.bincount(code, minlength=_NCATS)
    try:
        cols = {}
        for k in KINDS:
            rows = np.flatnonzero(kind_of == _KIND_CODE[k])
            idx = rows.tolist()
            # a tuple from itemgetter as it is (map and zip read it as a list)
            sel = () if not idx else (evs[idx[0]],) if len(idx) == 1 else itemgetter(*idx)(evs)
            cols[k] = _rows(k, sel, names, code[rows])
    except (OverflowError, ValueError, TypeError, orjson.JSONDecodeError):
        return reference(piece, b)   # an integer wider than int64, a non-JSON shape text ...
    counts = b.counts
    for c in np.flatnonzero(per_cat).tolist():
        key = CATS[c] if CATS[c] is not None else "<none>"
        counts[key] = counts.get(key, 0) + int(per_cat[c])
    return cols


_TAGGED = _tagged_decoder()


def _read(stream: json_chunks.ArrayStream, b: EventBuilder, mine, emit) -> None:
    """Decode the pieces whose index ``mine(i)`` is true; emit(index, cols) for each."""
    names = _Names(b.names)
    for i, piece in enumerate(stream.pieces()):
        if mine(i):
            emit(i, _decode_piece(piece, b, names))


# The child's share of the pieces. The parent also appends every row in file order
# and maps the child's name ids, so an even split leaves the child idle at the end; on
# the 1M-kernel A100-derived trace 9/16 balanced the two (10.2 CPU s each).
CHILD_SHARE = (9, 16)

# How far the child's spool may run ahead of what the parent has read back: beyond it
# the child waits for the parent. Some 8 pieces of rows: enough that it never waits on
# a parent that keeps up, small beside the input budget.
SPOOL_LEAD_BYTES = 64 << 20


def _child_takes(i: int) -> bool:
    """Piece ``i`` goes to the child: CHILD_SHARE of the pieces, spread evenly."""
    num, den = CHILD_SHARE
    return (i + 1) * num // den != i * num // den


def _parent_takes(i: int) -> bool:
    return not _child_takes(i)


def _child(path: str, chunk_bytes: int, conn, spool, acks, parent_ends) -> None:
    """Forked reader of its share of the pieces: writes each piece's rows (per kind, in
    KINDS order, raw) to the unlinked file ``spool`` and sends ("piece", i, row counts,
    new names, None) per piece, then ("done", ...) or ("error", text). The messages are
    small: the columns go through the spool file, not through the pipe (a pipe full of
    columns stalled the child whenever the parent held the GIL in a long decode). Before
    writing past SPOOL_LEAD_BYTES beyond the spool offset the parent last reported on
    ``acks`` it waits for the parent; a parent gone ends the wait (EOF) and the child."""
    try:
        for f in parent_ends:        # fork copied the parent's ends: an EOF must mean it is gone
            f.close()
        gc.disable()
        stream = json_chunks.ArrayStream(path, "traceEvents", chunk_bytes)
        b = EventBuilder()
        sent = [0]
        written, read_back = [0], [0]

        def emit(i, cols):
            while acks.poll():           # keep the parent's reports from filling the pipe
                read_back[0] = acks.recv()
            while written[0] - read_back[0] > SPOOL_LEAD_BYTES:
                read_back[0] = acks.recv()
            counts = []
            for k in KINDS:
                a = np.ascontiguousarray(cols[k])
                counts.append(len(a))
                if len(a):
                    spool.write(a.view(np.uint8))
                    written[0] += a.nbytes
            spool.flush()
            strings = b.names.strings
            conn.send(("piece", i, counts, strings[sent[0]:], None))
            sent[0] = len(strings)
        _read(stream, b, _child_takes, emit)
        conn.send(("done", -1, None, None, b.counts))
    except BaseException as exc:  # noqa: BLE001  (a child process: any failure is sent to the parent, which reads alone)
        try:
            conn.send(("error", -1, None, f"{type(exc).__name__}: {exc}", None))
        except (OSError, ValueError):   # the parent hung up (or the pipe is closed): it reads alone
            pass
    finally:
        conn.close()
        os._exit(0)


def _every(i: int) -> bool:
    return True


def _read_rows(fd: int, dtype: np.dtype, n: int, offset: int) -> np.ndarray:
    """``n`` rows of ``dtype`` at ``offset`` of the spool file, into a fresh array."""
    out = empty(dtype, n)
    view = memoryview(out.view(np.uint8))
    got = 0
    while got < len(view):
        k = os.preadv(fd, [view[got:]], offset + got)
        if k <= 0:
            raise OSError("the child's spool file ends early")
        got += k
    return out


_FALLOC_PUNCH_HOLE = 0x01 | 0x02     # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE (linux/falloc.h)


def _release(fd: int, offset: int, length: int) -> None:
    """Free the spool's bytes already read (a hole punched in the file): where the
    temporary directory is a tmpfs they would otherwise hold memory until the end.
    Best effort: a system or file system without hole punching keeps them."""
    global _fallocate
    if _fallocate is None:
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            f = libc.fallocate
            f.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
            _fallocate = f
        except (OSError, AttributeError):
            _fallocate = False
    if _fallocate and length > 0:
        _fallocate(fd, _FALLOC_PUNCH_HOLE, offset, length)


_fallocate = None


class _Rows:
    """The rows of one kind, appended piece by piece into one anonymous mapping that
    grows in place (mremap): no per-piece arrays left to merge, and only the pages
    written are resident, so the columns cost their own size and nothing more."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self.n = 0
        self.mm: mmap.mmap | None = None

    def append(self, a: np.ndarray) -> None:
        if not len(a):
            return
        need = (self.n + len(a)) * self.dtype.itemsize
        if self.mm is None or need > len(self.mm):
            size = max(need, 2 * len(self.mm) if self.mm is not None else ROWS_INITIAL_BYTES)
            size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
            if self.mm is None:
                # private: a shared anonymous mapping cannot grow (its pages past the
                # first size would raise SIGBUS)
                self.mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            else:
                self.mm.resize(size)
        # as bytes: one copy, where a structured assignment copies field by field
        size = self.dtype.itemsize
        view = np.frombuffer(self.mm, dtype=np.uint8, count=need)
        view[self.n * size:] = np.ascontiguousarray(a, dtype=self.dtype).view(np.uint8).reshape(-1)
        del view            # a buffer still exported would block the next resize
        self.n += len(a)

    def array(self) -> np.ndarray:
        if self.mm is None:
            return empty(self.dtype)
        return np.frombuffer(self.mm, dtype=self.dtype, count=self.n)


class InOrder:
    """Appends pieces' columns in piece order, holding the ones that arrive early.
    Rows, and the names interned so far, are charged to ``budget`` (a
    :class:`probes.budget.EventBudget`, or None) as pieces arrive."""

    def __init__(self, budget=None, names=None):
        self.rows = {k: _Rows(DTYPES[k]) for k in KINDS}
        self.next = 0
        self.pending: dict[int, dict] = {}
        self.budget, self.names = budget, names

    def add(self, i: int, cols: dict) -> None:
        if self.budget is not None:
            for k in KINDS:
                if len(cols[k]):
                    self.budget.charge(k, len(cols[k]))
            if self.names is not None:
                self.budget.charge_names(self.names)
        self.pending[i] = cols
        while self.next in self.pending:
            done = self.pending.pop(self.next)
            for k in KINDS:
                self.rows[k].append(done[k])
            self.next += 1

    def columns(self) -> dict[str, np.ndarray]:
        if self.pending:
            raise json_chunks.Unsplit(f"pieces {sorted(self.pending)} arrived without their predecessors")
        return {k: r.array() for k, r in self.rows.items()}


def _load_two(path: Path, chunk_bytes: int, budget=None) -> Trace | None:
    import multiprocessing as mp
    import tempfile
    ctx = mp.get_context("fork")
    opened: list = []
    try:
        recv, send = ctx.Pipe(duplex=False)
        opened += [recv, send]
        ack_recv, ack_send = ctx.Pipe(duplex=False)    # parent -> child: spool read up to here
        opened += [ack_recv, ack_send]
        # unlinked at once: the page cache holds what the child wrote until it is read,
        # and nothing is left behind whatever happens to either process
        spool = tempfile.TemporaryFile()
        opened.append(spool)
        child = ctx.Process(target=_child, args=(str(path), chunk_bytes, send, spool, ack_recv,
                                                 (recv, ack_send)), daemon=True)
        child.start()
    except OSError:
        # no usable temporary directory, no descriptors or fork refused: one reader
        for f in opened:
            f.close()
        return None
    send.close()
    ack_recv.close()
    out = InOrder(budget)
    remap: list[int] = []    # the child's name ids -> this table's, in the order it met them
    table: list = [None]      # remap as an array, rebuilt when it grows
    done: list = []
    failed: list = []
    offset = [0]
    fd = spool.fileno()

    def take(msg) -> None:
        tag, i, counts, new_names, extra = msg
        if tag != "piece":
            done.append((tag, extra))
            return
        if new_names or table[0] is None:        # the id map grows only when names were added
            remap.extend(b.names.intern(s) for s in new_names)
            table[0] = np.array(remap or [0], dtype=np.int32)
        cols = {}
        start = offset[0]
        for kind, n in zip(KINDS, counts):
            x = _read_rows(fd, DTYPES[kind], n, offset[0])
            offset[0] += n * DTYPES[kind].itemsize
            for c in ("name_id", "input_dims_id", "input_types_id"):
                if c in x.dtype.names and n:
                    x[c] = np.where(x[c] >= 0, table[0][np.maximum(x[c], 0)], x[c])
            cols[kind] = x
        _release(fd, start, offset[0] - start)
        try:
            ack_send.send(offset[0])
        except OSError:              # the child is gone; its messages tell how it ended
            pass
        out.add(i, cols)

    def drain(block: bool) -> None:
        """Take the child's messages: those waiting, or (block) all until it ends."""
        try:
            while not done and (block or recv.poll()):
                take(recv.recv())
        except (EOFError, OSError) as exc:
            failed.append(str(exc))
            done.append(("error", None))

    def emit(i, cols):
        out.add(i, cols)
        drain(False)
    try:
        stream = json_chunks.ArrayStream(path, "traceEvents", chunk_bytes)
        b = EventBuilder()
        out.names = b.names
        _read(stream, b, _parent_takes, emit)
        drain(True)
    finally:
        if child.is_alive() and (not done or done[-1][0] != "done"):
            child.kill()
        child.join()
        recv.close()
        ack_send.close()
        spool.close()
    if failed or not done or done[-1][0] != "done":
        return None
    for k, v in done[-1][1].items():
        b.counts[k] = b.counts.get(k, 0) + v
    trace = rec.assembled(path, stream.top, b.names, b.counts, out.columns())
    if stream.top_array:
        trace.meta["json_array_format"] = True
    return trace


def load(path: str | Path, chunk_bytes: int = CHUNK_BYTES, parallel: bool = False, budget=None) -> Trace:
    """The trace at ``path`` (same contract as :func:`probes.kineto.load_trace`).

    Raises :class:`json_chunks.Unsplit` when the file must be read by the structural
    scanner instead, InputError when it cannot be read at all or the rows kept would
    pass ``budget``."""
    path = Path(path)
    enabled = gc.isenabled()
    gc.disable()   # millions of short-lived objects, none cyclic: collections are pure cost
    try:
        if parallel:
            trace = _load_two(path, chunk_bytes, budget.fresh() if budget is not None else None)
            if trace is not None:
                return trace
        stream = json_chunks.ArrayStream(path, "traceEvents", chunk_bytes)
        b = EventBuilder()
        out = InOrder(budget.fresh() if budget is not None else None, b.names)
        _read(stream, b, _every, out.add)
        trace = rec.assembled(path, stream.top, b.names, b.counts, out.columns())
        if stream.top_array:
            trace.meta["json_array_format"] = True
        return trace
    finally:
        if enabled:
            gc.enable()
        trim_heap()
