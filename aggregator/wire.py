"""The wire schema: every message the agent publishes or records, versioned, msgpack.

One module owns the format so that producers (agent), consumers (``tail``, ``top``,
recordings, ``analyze``) and tests agree byte for byte. Maps are keyed by small
integers (field numbers), not by names: names cost bytes on every message and break
silently when renamed; numbers are fixed forever.

Envelope (``encode_envelope`` / ``decode_envelope``), a msgpack map:

====  ===========  =====================================================================
no.   name         value
====  ===========  =====================================================================
0     version      ``SCHEMA_VERSION`` (int); a decoder rejects any other
1     topic        one of ``TOPICS`` (str)
2     host         host name (str)
3     seq          per-topic sequence number (int), consecutive: a subscriber counts gaps
4     ts_ns        wall-clock time of sending, ns (int)
5     payload      ``bin`` for ``window`` and ``events`` (the bytes of
                   :func:`encode_window` / :func:`encode_event_batch`, decoded lazily by
                   :func:`decode_window` / :func:`decode_event_batch`); for the other
                   topics a plain value whose dict keys are numbered by ``FIELDS``
====  ===========  =====================================================================

Window records and other plain records (``encode_window`` / ``decode_window``; also the
``sched``/``device``/``engine``/``health`` payloads): a msgpack map
``{0: version, 1: record}`` where ``record`` is the dict (or the typed
:class:`probes.records.Window`, its fields in declaration order, None ones left out) with
every string key found in :data:`FIELDS` replaced by its number, at any depth. Keys not in the table travel as
strings (so a new key never breaks a consumer), and a number a consumer does not know
decodes as ``"field_<n>"``. Dict keys are strings: data keys such as phase names are
fine (they either are in the table or travel as text), and a non-string key (a tid, a
device index) is sent as its text, so it decodes as a string. numpy scalars and arrays
are converted to plain Python.

**Adding a key**: declare it in its Struct in :mod:`probes.records` with its wire number
``Annotated[..., N(<next number>)]`` (the next number is ``max(FIELDS.values()) + 1``;
numbers are never reused or changed, names never renamed); :data:`FIELDS` is generated
from those Structs (:func:`probes.records.wire_fields`). Regenerate nothing: the
golden-byte tests only pin keys that already exist. Keep units in names (``_ns``,
``_bytes``, ``_pct``).

**Version notes** (schema 1 throughout; keys only ever appended):

* fields 1-73: the first release.
* fields 74-108 (issue 12): the engine window's latency segments (``queue_mean_s`` ...
  ``queue_share_of_ttft_ratio``, ``segment_kinds``), KV dynamics (``num_swapped_requests``,
  prefix-cache and eviction figures, ``preemption_episode_*``, ``preemption_recovery_s``),
  engine work estimates (``estimated_*``, ``work_estimate_source``), the engine's lifetime
  ``latency_histograms`` (``bounds``, ``cumulative``), the GPU record's ``launch_tids`` and
  the decode phase's KV-cache reads from the engine estimate (``kv_read_*``).
  A decoder built before them reads these keys as ``field_74`` ... ``field_108``; the
  golden file ``wire_envelope_engine_window_v1.bin`` pins their bytes.
* event column 29 (issue 13): ``cpu_ops.is_causal``, the SDPA operators' causal flag. A
  decoder built before it skips the column; a batch written before it decodes with -1
  (unknown). ``wire_event_batch_v1.bin`` was regenerated with it (its literal operator
  carries the flag 1).

* fields 109-143 (issue 22): the window's ``requests`` record (requests joined, dragged-time
  share, p99 of each segment, the top culprit) and the request stories of the ``requests``
  topic (appended to ``TOPICS``: ``{"end_ns", "stories": [...]}``, one message per window
  that told a request). A decoder built before them reads ``field_109`` ... ``field_143``
  and refuses the new topic's envelopes as an unknown topic (counted, skipped); the golden
  files ``wire_envelope_requests_window_v1.bin`` and ``wire_envelope_requests_v1.bin`` pin
  their bytes.

* fields 144-157 (issue 23): the window's ``stragglers`` record (per tensor-parallel group:
  its ranks, collectives, waiting share, the straggler, how late and why;
  ``aggregator.straggler_window``). A decoder built before them reads ``field_144`` ...
  ``field_157``; the golden file ``wire_envelope_stragglers_window_v1.bin`` pins their bytes.

* fields 158-162 (issue 22): the window's request histogram of end-to-end time
  (``e2e_total_ns``, ``e2e_bucket_counts``) and its ``exemplars`` (per bucket the slowest
  request's id and ``trace_id``), which ``/metrics`` serves as OpenMetrics exemplars; a
  story's ``trace_id``.
* fields 163-164 (issue 23): per straggler group, the launch threads' off-CPU share of the
  straggler and of the other ranks (``straggler_launch_off_cpu_ratio``,
  ``others_launch_off_cpu_ratio``).

Event batches (``encode_event_batch`` / ``decode_event_batch``), a msgpack map:

====  ===========  =====================================================================
0     version      ``SCHEMA_VERSION``
1     stream       int id of a stateful stream (:class:`EventBatchEncoder`), or absent
2     names_base   id of the first name shipped in this batch
3     names        list of str: names ``names_base, names_base + 1, ...``
4     names_total  size of the stream's name table after this batch
5     full         true when ``names`` is the whole table (resynchronises a decoder)
6     meta         plain dict (``source`` and the like)
7     devices      list of ``[index, name, sm_count, memory_total_bytes, cc]``
8..12 kinds        ``kernels``, ``copies``, ``api``, ``ranges``, ``cpu_ops``: each
                   ``{1: rows, 2: [[column, codec, dtype, base], ...], 3: zlib(bin),
                   4: uncompressed length}``
====  ===========  =====================================================================

Columns (numbered by :data:`COLUMNS`) are stored in order, each as little-endian bytes
of the narrowest integer type that holds it (``dtype`` code from :data:`_DTYPES`) after
its codec: ``0`` raw, ``1`` constant (no bytes; the value is ``base``), ``2`` delta
(``base`` + cumulative sum, for ``start_ns`` and ids that grow), ``3`` duration
(``end_ns`` - ``start_ns``). Multi-byte columns are byte-shuffled (all first bytes,
then all second bytes, ...) before zlib, which is what makes timestamps and ids
compress to a few bytes per event. Name ids refer to the batch's (or the stream's)
name table; a stateful stream ships only names it has not shipped before, plus the
whole table every ``full_every`` batches so a late or lossy subscriber recovers.
"""
from __future__ import annotations

import random
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import msgpack
import msgspec
import numpy as np

from ridgeline.probes import records
from ridgeline.probes.errors import InputError
from ridgeline.probes.events import (
    API_DTYPE,
    COPY_DTYPE,
    CPU_OP_DTYPE,
    KERNEL_DTYPE,
    MISSING,
    RANGE_DTYPE,
    Columns,
    Device,
    EventColumns,
    NameTable,
    Trace,
    empty,
)

SCHEMA_VERSION = 1
TOPICS = ("window", "events", "sched", "device", "engine", "health", "requests")

# Envelope field numbers.
F_VERSION, F_TOPIC, F_HOST, F_SEQ, F_TS, F_PAYLOAD = range(6)

# Field numbers of record keys (windows and plain payloads), at any nesting depth: the
# numbers declared on the typed records (probes.records), generated, never written here.
FIELDS: dict[str, int] = records.wire_fields()
_FIELD_NAMES = {v: k for k, v in FIELDS.items()}
assert len(_FIELD_NAMES) == len(FIELDS), "duplicate field number in FIELDS"

# Column numbers of the event arrays (shared across kinds). Append only.
COLUMNS: dict[str, int] = {
    "start_ns": 1, "end_ns": 2, "device": 3, "stream": 4, "context": 5, "correlation_id": 6,
    "external_id": 7, "grid_x": 8, "grid_y": 9, "grid_z": 10, "block_x": 11, "block_y": 12,
    "block_z": 13, "registers": 14, "shared_mem_bytes": 15, "name_id": 16, "graph_id": 17,
    "graph_node_id": 18, "pid": 19, "tid": 20, "kind": 21, "direction": 22, "bytes": 23,
    "cbid": 24, "domain": 25, "category": 26, "input_dims_id": 27, "input_types_id": 28, "is_causal": 29,
}
_COLUMN_NAMES = {v: k for k, v in COLUMNS.items()}

KINDS = {"kernels": (8, KERNEL_DTYPE), "copies": (9, COPY_DTYPE), "api": (10, API_DTYPE),
         "ranges": (11, RANGE_DTYPE), "cpu_ops": (12, CPU_OP_DTYPE)}
_NAME_COLUMNS = ("name_id", "input_dims_id", "input_types_id")
_DELTA_COLUMNS = ("start_ns", "correlation_id", "external_id")

CODEC_RAW, CODEC_CONST, CODEC_DELTA, CODEC_DURATION = 0, 1, 2, 3
_DTYPES = {1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<u2"), 4: np.dtype("<i2"),
           5: np.dtype("<i4"), 6: np.dtype("<i8")}
_DTYPE_CODES = {v: k for k, v in _DTYPES.items()}
_RANGES = [(1, 0, 255), (2, -128, 127), (3, 0, 65535), (4, -32768, 32767),
           (5, -2**31, 2**31 - 1)]
ZLIB_LEVEL = 6
MAX_ROWS = 2_000_000             # a decoder refuses batches claiming more (memory bound)
MAX_CONST_ROWS = 65_536          # rows of a kind whose columns are all constant (carry no bytes)
MAX_NAMES = 1 << 20              # names a batch's table may claim (total, base)
ZLIB_MAX_RATIO = 1032            # deflate never expands more than this: claims beyond it are lies


# --------------------------------------------------------------------------- helpers

def _bad(what: str) -> InputError:
    return InputError(f"wire: {what}")


def _unpack(data, what: str):
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _bad(f"{what} is {type(data).__name__}, expected bytes")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, TypeError) as exc:   # msgpack: ExtraData, FormatError, StackError, bad UTF-8 (all
        # ValueError), an unhashable map key (TypeError); 200,000 fuzzed inputs raised no other
        raise _bad(f"{what} is not valid msgpack ({type(exc).__name__})") from None


def _check_version(v, what: str) -> None:
    if v != SCHEMA_VERSION:
        raise _bad(f"{what} has schema version {v!r}; this build reads version {SCHEMA_VERSION} only")


# Types _plain passes through unchanged, tested by exact type (a subclass, e.g. numpy's
# float64, which is a float, takes the general path and is converted there).
_AS_IS = frozenset((int, float, str, bool, bytes, type(None)))
# Struct class -> its (attribute, wire key) pairs in declaration order, made on first use:
# a window holds a few hundred records of a dozen classes, every window.
_STRUCT_KEYS: dict[type, tuple[tuple[str, object], ...]] = {}


def _struct_keys(t: type) -> tuple[tuple[str, object], ...]:
    keys = _STRUCT_KEYS.get(t)
    if keys is None:
        keys = _STRUCT_KEYS[t] = tuple((k, FIELDS.get(k, k)) for k in t.__struct_fields__)
    return keys


def _plain(obj):
    """A record as the wire carries it: string keys numbered by FIELDS at any depth, a
    Struct's fields in declaration order without its None ones, numpy values as Python's.
    :func:`_plain_reference` defines it; this is the same walk with the common types
    found by exact type first (a window close walked about 1,700 isinstance checks;
    tests/test_wire_plain.py compares the two)."""
    t = type(obj)
    if t in _AS_IS:
        return obj
    if t is dict:
        out = {}
        for k, v in obj.items():
            if type(k) is not str and not isinstance(k, str):
                k = str(k)    # data keys (a tid, a device index) travel as text
            out[FIELDS.get(k, k)] = v if type(v) in _AS_IS else _plain(v)
        return out
    if t is list or t is tuple:
        return [v if type(v) in _AS_IS else _plain(v) for v in obj]
    if isinstance(obj, msgspec.Struct):
        out = {}
        for k, key in _struct_keys(t):
            v = getattr(obj, k)
            if v is not None:
                out[key] = v if type(v) in _AS_IS else _plain(v)
        return out
    return _plain_reference(obj, _plain)


def _plain_reference(obj, walk=None):
    """The wire form of a record, by isinstance (the definition :func:`_plain` follows);
    ``walk``: what converts the parts (itself when None)."""
    walk = walk or _plain_reference
    if isinstance(obj, msgspec.Struct):
        out = {}
        for k in obj.__struct_fields__:
            v = getattr(obj, k)
            if v is not None:
                out[FIELDS.get(k, k)] = walk(v)
        return out
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                k = str(k)    # data keys (a tid, a device index) travel as text
            out[FIELDS.get(k, k)] = walk(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [walk(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return walk(obj.tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _named(obj):
    if isinstance(obj, dict):
        return {(_FIELD_NAMES.get(k, f"field_{k}") if isinstance(k, int) else k): _named(v)
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_named(v) for v in obj]
    return obj


# --------------------------------------------------------------------------- envelope

@dataclass
class Envelope:
    """A decoded envelope. ``payload`` is bytes for ``window``/``events`` (decode with
    :func:`decode_window` / :func:`decode_event_batch`), else the plain record."""
    version: int
    topic: str
    host: str
    seq: int
    ts_ns: int
    payload: object

    @property
    def kind(self) -> str:
        return self.topic


def encode_envelope(topic: str, seq: int, payload, host: str, ts_ns: int) -> bytes:
    """Encode one message. ``payload``: bytes (an encoded window or event batch) or a
    plain record (dict/list/scalars) whose keys are numbered by ``FIELDS``."""
    if topic not in TOPICS:
        raise ValueError(f"unknown topic {topic!r}; topics: {', '.join(TOPICS)}")
    body = bytes(payload) if isinstance(payload, (bytes, bytearray, memoryview)) else _plain(payload)
    return msgpack.packb({F_VERSION: SCHEMA_VERSION, F_TOPIC: topic, F_HOST: host,
                          F_SEQ: int(seq), F_TS: int(ts_ns), F_PAYLOAD: body}, use_bin_type=True)


def decode_envelope(data: bytes) -> Envelope:
    """Decode an envelope; InputError for malformed input or another schema version."""
    m = _unpack(data, "envelope")
    if not isinstance(m, dict):
        raise _bad("envelope is not a map")
    _check_version(m.get(F_VERSION), "envelope")
    topic, host, seq, ts = m.get(F_TOPIC), m.get(F_HOST), m.get(F_SEQ), m.get(F_TS)
    if topic not in TOPICS:
        raise _bad(f"envelope has unknown topic {topic!r}")
    if not isinstance(host, str) or type(seq) is not int or type(ts) is not int:
        raise _bad("envelope lacks host, seq or ts_ns of the right types")
    if F_PAYLOAD not in m:
        raise _bad("envelope has no payload")
    payload = m[F_PAYLOAD]
    if topic in ("window", "events"):
        if not isinstance(payload, bytes):
            raise _bad(f"{topic} envelope payload is not bin")
    else:
        payload = _named(payload)
    return Envelope(SCHEMA_VERSION, topic, host, seq, ts, payload)


# --------------------------------------------------------------------------- windows

def encode_window(window: dict | records.Window) -> bytes:
    """Encode a window record: the :class:`probes.records.Window` the builder closes, or a
    plain dict with string keys. A typed record's fields go in declaration order, and a
    field that is None is left out (a decoder reads it back as None, with ``window_of`` or
    ``.get``), as the builder's dicts left out what they did not know."""
    if not isinstance(window, (dict, records.Window)):
        raise TypeError("a window record is a dict or a probes.records.Window")
    return msgpack.packb({0: SCHEMA_VERSION, 1: _plain(window)}, use_bin_type=True)


def decode_window(data: bytes) -> dict:
    """Decode :func:`encode_window` bytes back to the dict (InputError if malformed)."""
    m = _unpack(data, "window")
    if not isinstance(m, dict):
        raise _bad("window is not a map")
    _check_version(m.get(0), "window")
    rec = m.get(1)
    if not isinstance(rec, dict):
        raise _bad("window record is not a map")
    return _named(rec)


# --------------------------------------------------------------------------- columns

def _narrow(x: np.ndarray) -> tuple[int, np.ndarray]:
    lo, hi = int(x.min()), int(x.max())
    for code, a, b in _RANGES:
        if a <= lo and hi <= b:
            return code, x.astype(_DTYPES[code])
    return 6, x.astype("<i8")


def _shuffle(b: np.ndarray) -> bytes:
    if b.dtype.itemsize == 1:
        return b.tobytes()
    return b.view(np.uint8).reshape(-1, b.dtype.itemsize).T.tobytes()


def _encode_kind(arr: np.ndarray, name_map: np.ndarray | None) -> dict:
    n = len(arr)
    cols, blobs = [], []
    names = arr.dtype.names
    for col in names:
        x = arr[col].astype(np.int64)
        if col in _NAME_COLUMNS and name_map is not None and n:
            x = np.where(x >= 0, name_map[np.maximum(x, 0)], -1)
        codec, base = CODEC_RAW, 0
        if col == "end_ns" and "start_ns" in names:
            x = x - arr["start_ns"].astype(np.int64)
            codec = CODEC_DURATION
        elif col in _DELTA_COLUMNS and n:
            base = int(x[0])
            x = np.diff(x, prepend=x[0])
            codec = CODEC_DELTA
        if n == 0 or (x == x[0]).all():
            value = int(x[0]) if n else 0
            cols.append([COLUMNS.get(col, col), CODEC_CONST, 0,
                         base + value if codec == CODEC_DELTA and n and value == 0 else value,
                         codec])
            continue
        code, y = _narrow(x)
        cols.append([COLUMNS.get(col, col), codec, code, base])
        blobs.append(_shuffle(y))
    raw = b"".join(blobs)
    return {1: n, 2: cols, 3: zlib.compress(raw, ZLIB_LEVEL), 4: len(raw)}


def _check_kind_claims(n: int, cols: list, blob: bytes, raw_len: int, what: str) -> None:
    """Refuse row counts and lengths the batch's own bytes cannot hold, before anything
    is allocated: a few hundred crafted bytes must not claim gigabytes."""
    if raw_len > ZLIB_MAX_RATIO * len(blob) + 64:
        raise _bad(f"{what} claims {raw_len} bytes from {len(blob)} compressed bytes")
    carrying = sum(1 for c in cols if isinstance(c, list) and len(c) >= 3 and c[1] != CODEC_CONST)
    if carrying == 0 and n > MAX_CONST_ROWS:
        raise _bad(f"{what} claims {n} rows with no column data (at most {MAX_CONST_ROWS})")
    if carrying and n * carrying > raw_len:
        raise _bad(f"{what} claims {n} rows, which runs past the data "
                   f"({raw_len} bytes hold at most {raw_len // carrying} rows)")


def _unshuffled(raw: bytes, off: int, dt: np.dtype, n: int) -> np.ndarray:
    """A column's values back from its shuffled bytes: a zero-copy view for one-byte
    columns; otherwise each byte plane copied into its place in the values (a strided copy
    per plane: 3-9x faster than numpy's transposing copy of the planes, which walks the
    bytes one at a time)."""
    if dt.itemsize == 1:
        return np.frombuffer(raw, dtype=dt, count=n, offset=off)
    k = dt.itemsize
    planes = np.frombuffer(raw, dtype=np.uint8, count=n * k, offset=off).reshape(k, n)
    out = np.empty(n, dt)
    dst = out.view(np.uint8).reshape(n, k)
    for j in range(k):
        dst[:, j] = planes[j]
    return out


def _decode_columns(m, dtype: np.dtype, what: str, complete: bool = True) -> tuple[int, dict[str, np.ndarray]]:
    """``(rows, {field: column})`` of one kind: the fields of ``dtype`` the batch sent,
    each a contiguous array of the field's own type, and with ``complete`` the others too
    (``MISSING``, or 0 for the unsigned codes, as probes.events.empty() does). The column is converted
    from the wire's narrow type once, straight to the field's type (through int64 only
    where a codec adds: the cumulative sums and durations)."""
    if not isinstance(m, dict):
        raise _bad(f"{what} is not a map")
    n, cols, blob, raw_len = m.get(1), m.get(2), m.get(3), m.get(4)
    if type(n) is int and n > MAX_ROWS:
        raise _bad(f"{what} header is malformed: {n} rows claimed (at most {MAX_ROWS} per batch)")
    if type(n) is not int or not 0 <= n <= MAX_ROWS or not isinstance(cols, list) \
            or not isinstance(blob, bytes) or type(raw_len) is not int or raw_len < 0:
        raise _bad(f"{what} header is malformed")
    _check_kind_claims(n, cols, blob, raw_len, what)
    try:
        d = zlib.decompressobj()
        raw = d.decompress(blob, raw_len)
        if d.unconsumed_tail or len(raw) != raw_len:
            raise _bad(f"{what} data does not match its stated length")
    except zlib.error:
        raise _bad(f"{what} data is not valid zlib") from None
    out: dict[str, np.ndarray] = {}
    off = 0
    start = None
    for c in cols:
        if not isinstance(c, list) or len(c) not in (4, 5):
            raise _bad(f"{what} column descriptor is malformed")
        key, codec, code = c[0], c[1], c[2]
        base = c[3]
        name = _COLUMN_NAMES.get(key, key) if isinstance(key, int) else key
        if type(base) is not int:
            raise _bad(f"{what} column {name!r} has a non-integer base")
        if not -2**63 <= base < 2**63:
            # msgpack carries uint64: a base past int64 would raise OverflowError in numpy
            raise _bad(f"{what} column {name!r} has a base outside int64")
        want = dtype[name] if isinstance(name, str) and name in dtype.names else None
        if codec == CODEC_CONST:
            inner = c[4] if len(c) == 5 else CODEC_RAW
            if inner not in (CODEC_RAW, CODEC_DELTA, CODEC_DURATION):
                raise _bad(f"{what} column {name!r} has unknown codec {inner!r}")
            if inner == CODEC_DURATION:
                if start is None:
                    raise _bad(f"{what} column {name!r} is a duration before start_ns")
                x = start + base
            elif name == "start_ns" or want is None or want.itemsize == 8:
                x = np.full(n, base, dtype=np.int64)
            else:
                # the value as the int64 column would have been cast to the field's type
                x = np.full(n, np.int64(base).astype(want), dtype=want)
        else:
            dt = _DTYPES.get(code)
            if dt is None or codec not in (CODEC_RAW, CODEC_DELTA, CODEC_DURATION):
                raise _bad(f"{what} column {name!r} has unknown codec/dtype {codec!r}/{code!r}")
            size = n * dt.itemsize
            if off + size > len(raw):
                raise _bad(f"{what} column {name!r} runs past the data")
            x = _unshuffled(raw, off, dt, n)
            off += size
            if codec == CODEC_DELTA:
                x = np.cumsum(x, dtype=np.int64)
                x += base
            elif codec == CODEC_DURATION:
                if start is None:
                    raise _bad(f"{what} column {name!r} is a duration before start_ns")
                x = start + x
        if name == "start_ns":
            start = x if x.dtype == np.int64 else x.astype(np.int64)
        if want is not None:
            # C casts, as assigning the int64 values into the structured field did
            out[name] = x if x.dtype == want else x.astype(want)
    if off != len(raw):
        raise _bad(f"{what} has {len(raw) - off} bytes no column claims")
    if complete:
        for name in dtype.names:
            if name not in out:
                out[name] = np.full(n, _unsent(dtype, name), dtype=dtype[name])
    return n, out


def _unsent(dtype: np.dtype, name: str) -> int:
    return MISSING if dtype[name].kind == "i" else 0


def _decode_kind(m, dtype: np.dtype, what: str) -> np.ndarray:
    """One kind's structured rows (:func:`_decode_columns`), each field set once: only
    the fields the batch does not send are filled (filling every field with ``MISSING``
    first was a third of this decode: docs/parquet-schema.md, "Cost of writing")."""
    n, cols = _decode_columns(m, dtype, what, complete=False)
    out = np.empty(n, dtype)
    for name in dtype.names:
        col = cols.get(name)
        out[name] = _unsent(dtype, name) if col is None else col
    return out


# --------------------------------------------------------------------------- batches

def _used_names(trace: Trace) -> np.ndarray:
    ids = [getattr(trace, k)[c] for k in KINDS for c in _NAME_COLUMNS
           if c in getattr(trace, k).dtype.names]
    allids = np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)
    return np.unique(allids[allids >= 0])


def _devices_out(devs: list[Device]) -> list:
    return [[d.index, d.name, d.sm_count, d.memory_total_bytes, d.compute_capability] for d in devs]


def _meta_out(meta: dict) -> dict:
    return {str(k): v for k, v in meta.items() if isinstance(v, (str, int, float, bool))}


def _batch(trace: Trace, name_map: np.ndarray, header: dict) -> bytes:
    m = {0: SCHEMA_VERSION}
    m.update(header)
    m[6] = _meta_out(trace.meta)
    m[7] = _devices_out(trace.devices)
    for kind, (no, _) in KINDS.items():
        m[no] = _encode_kind(getattr(trace, kind), name_map)
    return msgpack.packb(m, use_bin_type=True)


def encode_event_batch(trace: Trace) -> bytes:
    """Encode a self-contained batch: the names it uses are shipped with it."""
    used = _used_names(trace)
    name_map = np.full(max(len(trace.names), 1), -1, dtype=np.int64)
    name_map[used] = np.arange(len(used))
    names = [trace.names[i] for i in used.tolist()]
    return _batch(trace, name_map, {2: 0, 3: names, 4: len(names), 5: True})


class EventBatchEncoder:
    """Stateful encoder of one stream: ships each name once (and the whole table every
    ``full_every`` batches so that late or lossy subscribers resynchronise)."""

    def __init__(self, full_every: int = 64, stream: int | None = None):
        self.stream = stream if stream is not None else random.getrandbits(62)
        self.full_every = full_every
        self._ids: dict[str, int] = {}
        self._names: list[str] = []
        self._count = 0

    def encode(self, trace: Trace) -> bytes:
        used = _used_names(trace)
        name_map = np.full(max(len(trace.names), 1), -1, dtype=np.int64)
        base = len(self._names)
        for i in used.tolist():
            s = trace.names[i]
            j = self._ids.get(s)
            if j is None:
                j = self._ids[s] = len(self._names)
                self._names.append(s)
            name_map[i] = j
        full = self._count % self.full_every == 0
        self._count += 1
        if full:
            header = {1: self.stream, 2: 0, 3: list(self._names), 4: len(self._names), 5: True}
        else:
            header = {1: self.stream, 2: base, 3: self._names[base:], 4: len(self._names), 5: False}
        return _batch(trace, name_map, header)


@dataclass
class _StreamState:
    """One stream's name table. ``names`` only grows in place (ids are positional), so the
    batches decoded from it share it rather than copy it: a copy per batch made decoding
    O(names) per batch (36 ms a batch at 100k names). A full table equal to it keeps it;
    any other change replaces the list, so what earlier batches hold never changes.
    ``table`` is the same strings as a NameTable, appended to as ``names`` grows
    (``None`` after a replacement: rebuilt on the next use)."""
    names: list = field(default_factory=list)
    synced: bool = False
    table: NameTable | None = None

    def name_table(self, total: int) -> NameTable:
        t = self.table
        if t is None:
            t = self.table = NameTable()
        if len(t) < total:
            t.append_positional(self.names[len(t):total])
        return t


class EventBatchDecoder:
    """Decodes batches of any number of streams, keeping each stream's name table."""

    def __init__(self, max_streams: int = 64):
        self.max_streams = max_streams
        self._streams: OrderedDict[int, _StreamState] = OrderedDict()

    def _header(self, data: bytes):
        """The batch's map, its name table (the stream's, updated), the names it lacks,
        meta and devices."""
        m = _unpack(data, "event batch")
        if not isinstance(m, dict):
            raise _bad("event batch is not a map")
        _check_version(m.get(0), "event batch")
        stream, base, names, total, full = m.get(1), m.get(2), m.get(3), m.get(4), m.get(5)
        if type(base) is not int or not isinstance(names, list) or type(total) is not int \
                or not all(isinstance(s, str) for s in names) or base < 0 or total < 0:
            raise _bad("event batch name table is malformed")
        if total > MAX_NAMES or base > MAX_NAMES or len(names) > MAX_NAMES:
            raise _bad(f"event batch claims a name table of {max(total, base)} names (at most {MAX_NAMES})")
        missing = 0
        if stream is None:
            st = _StreamState(names=list(names))
        else:
            st = self._streams.pop(stream, None) or _StreamState()
            self._streams[stream] = st
            while len(self._streams) > self.max_streams:
                self._streams.popitem(last=False)
            if full:
                # the full table every EventBatchEncoder.full_every batches is, on a synced
                # stream, the table already held: one list compare, not a rebuild
                if not (st.synced and st.names == names):
                    st.names, st.table = list(names), None
                st.synced = True
            elif st.synced and base == len(st.names):
                st.names.extend(names)
            else:   # joined late or lost a batch: names stay unknown until a full table
                st.synced = False
                grown = list(st.names)       # a new list: earlier batches keep theirs
                if len(grown) < base:
                    grown.extend([""] * (base - len(grown)))
                grown[base:base + len(names)] = names
                st.names, st.table = grown, None
            missing = total - sum(1 for s in st.names[:total] if s) if not st.synced else 0
        if len(st.names) < total:
            # names claimed but never shipped (lost, or a peer's claim): this batch alone
            # gets them as unknown; the stream's table stays as shipped
            st = _StreamState(names=st.names + [""] * (total - len(st.names)), synced=st.synced)
        meta = m.get(6) if isinstance(m.get(6), dict) else {}
        devs = []
        for d in m.get(7) or []:
            if isinstance(d, list) and len(d) == 5:
                devs.append(Device(index=d[0], name=d[1], sm_count=d[2], memory_total_bytes=d[3],
                                   compute_capability=d[4]))
        # the stream's own table (no copy): it only grows past ``total``, and ids of this
        # batch are checked against ``total`` (_check_names)
        return m, st, total, missing, dict(meta), devs

    @staticmethod
    def _check_names(kind: str, arr, total: int) -> None:
        for c in _NAME_COLUMNS:
            if c in arr.dtype.names and len(arr) and (arr[c] >= total).any():
                raise _bad(f"event batch {kind}.{c} refers to a name it does not ship")

    def decode(self, data: bytes) -> Trace:
        m, st, total, missing, meta, devs = self._header(data)
        arrays = {}
        for kind, (no, dtype) in KINDS.items():
            arrays[kind] = _decode_kind(m[no], dtype, f"event batch {kind}") if no in m else empty(dtype)
        for kind, arr in arrays.items():
            self._check_names(kind, arr, total)
        # the stream's table, shared by its batches and appended to as it grows (as a
        # probe's own table is); unknown ("") placeholders repeat, ids stay positional
        trace = Trace(names=st.name_table(total), devices=devs, meta=meta, **arrays)
        if missing:
            trace.meta["names_missing"] = missing
        return trace

    def decode_columns(self, data: bytes) -> EventColumns:
        """The batch as :class:`probes.events.EventColumns`: each kind's fields as the
        contiguous columns the wire carries, no structured rows (what a columnar writer
        takes as it is: agent.parquet_recording). The same checks, errors and stream
        state as :meth:`decode`; ``names`` is the table as a list (ids positional)."""
        m, st, total, missing, meta, devs = self._header(data)
        table = st.names
        kinds = {}
        for kind, (no, dtype) in KINDS.items():
            if no in m:
                n, cols = _decode_columns(m[no], dtype, f"event batch {kind}")
            else:
                n, cols = 0, {name: np.empty(0, dtype[name]) for name in dtype.names}
            kinds[kind] = Columns(dtype, n, cols)
        for kind, arr in kinds.items():
            self._check_names(kind, arr, total)
        if missing:
            meta["names_missing"] = missing
        return EventColumns(names=table, devices=devs, meta=meta, **kinds)

    def snapshot(self) -> dict[int, list[str]]:
        """The name tables of the synced streams: what a decoder needs to go on decoding
        those streams mid-way (agent.object_sink writes it at the head of each journal)."""
        return {sid: list(st.names) for sid, st in self._streams.items() if st.synced}

    def restore(self, snap: dict[int, list[str]]) -> None:
        """Take the name tables of :meth:`snapshot` (each checked as a shipped table is)."""
        for sid, names in snap.items():
            if type(sid) is not int or not isinstance(names, list) or len(names) > MAX_NAMES \
                    or not all(isinstance(x, str) for x in names):
                raise _bad("decoder snapshot is malformed")
            self._streams[sid] = _StreamState(names=list(names), synced=True)
            while len(self._streams) > self.max_streams:
                self._streams.popitem(last=False)


_default_decoder = EventBatchDecoder()


def decoder_snapshot() -> dict[int, list[str]]:
    """:meth:`EventBatchDecoder.snapshot` of the decoder :func:`decode_event_batch` uses."""
    return _default_decoder.snapshot()


def decoder_restore(snap: dict[int, list[str]]) -> None:
    """:meth:`EventBatchDecoder.restore` into the decoder :func:`decode_event_batch` uses."""
    _default_decoder.restore(snap)


def decode_event_batch(data: bytes) -> Trace:
    """Decode a batch into a Trace (names of stateful streams are remembered per
    stream). InputError for malformed input or another schema version."""
    return _default_decoder.decode(data)


def decode_event_columns(data: bytes) -> EventColumns:
    """:func:`decode_event_batch` into columns (:meth:`EventBatchDecoder.decode_columns`),
    through the same decoder and its streams' names."""
    return _default_decoder.decode_columns(data)
