"""Parquet recordings: the agent's stream as Arrow tables in Hive-style folders.

The schema is documented, column by column, in docs/parquet-schema.md (a test checks
that the document and :data:`TABLES` agree). Version :data:`SCHEMA_VERSION`; every file
carries it in its key-value metadata (``ridgeline.schema_version``) and the folder in
``_ridgeline_parquet.json``.

Layout under ``DIR`` (one folder per table, then Hive partitions)::

    DIR/_ridgeline_parquet.json
    DIR/<table>/host=<host>/gpu=<device>/hour=<YYYY-MM-DD-HH>/part-<recording>-<n>.parquet
    DIR/<table>/host=<host>/hour=<YYYY-MM-DD-HH>/part-<recording>-<n>.parquet   (no GPU)

``hour`` is the UTC hour of the time the recorder received the message (``recv_ns``:
the wall clock of the host, the same for every table, unlike the sources' own event
clocks). ``host`` is the envelope's host, percent-encoded outside ``[A-Za-z0-9._-]``.
A file is written under a dot-name and renamed, so a reader never sees half a file.

Tables: ``kernels``, ``copies``, ``api``, ``ranges``, ``cpu_ops`` (one row per event,
the columns of probes.events with names dictionary-encoded and codes as their names),
``windows`` (one row per window × GPU × served process), ``window_phases`` (× phase),
``verdicts`` (one row per verdict of a window), ``messages`` (one row per recorded
message: the stream's sequence numbers, so a reader redoes the ``.rlrec`` segmentation
exactly) and ``devices``. Every row carries ``recording`` (the writer's id) and
``frame`` (the index of its message in the recording), which join events, windows and
messages. Integers that a source does not know are -1, as in probes.events.

Contract:

* :class:`ParquetRecordingWriter` ``(root)``: ``write(envelope, recv_ns)`` (the
  :class:`agent.recording.RecordingWriter` call), or ``add_events``/``add_window``;
  buffers at most ``flush_rows`` rows, then writes one file per table and partition;
  ``close()`` flushes. Event batches are held as the caller's arrays until the flush:
  they must not be changed after they are given (the stream's batches never are). A
  batch is a :class:`Trace` (structured rows: each column copied out into reused buffers
  at the flush) or :class:`probes.events.EventColumns` (the wire's columns, what
  ``write`` and :data:`COLUMNS_CODEC`'s subscribers decode to: given to Arrow as they are).
* :func:`is_parquet_recording(path)`: a folder with the manifest.
* :func:`recordings_in(root) -> [(host, recording)]`.
* :func:`iter_messages(root, host, recording)`: the messages in recorded order, in the
  shape :func:`agent.recording.segments_of` reads, events rebuilt as :class:`Trace`
  one hour partition at a time.

pyarrow is the optional extra ``ridgeline[parquet]``: without it these calls raise
RuntimeFailure naming the extra; the daemon never imports this module.
"""
from __future__ import annotations

import functools
import os
import time
import uuid
from pathlib import Path

import numpy as np
import orjson

from ridgeline.aggregator import wire
from ridgeline.probes.errors import InputError, RuntimeFailure
from ridgeline.probes.events import (
    API_CATEGORY_NAMES,
    API_DOMAIN_DRIVER,
    API_DOMAIN_RUNTIME,
    API_DTYPE,
    COPY_DIRECTION_NAMES,
    COPY_DTYPE,
    COPY_KIND_MEMCPY,
    COPY_KIND_MEMSET,
    CPU_OP_DTYPE,
    KERNEL_DTYPE,
    RANGE_DTYPE,
    RANGE_KIND_NAMES,
    Device,
    EventColumns,
    NameTable,
    Trace,
)

SCHEMA_VERSION = 1
FORMAT = "ridgeline-parquet"
MANIFEST = "_ridgeline_parquet.json"
FLUSH_ROWS = 1_000_000           # rows buffered before files are written (bounded memory)
COMPRESSIONS = ("zstd", "lz4", "snappy", "none")

# Codes stored as their names (dictionary-encoded strings); the inverse maps read them back.
COPY_KIND_NAMES = {COPY_KIND_MEMCPY: "memcpy", COPY_KIND_MEMSET: "memset"}
API_DOMAIN_NAMES = {0: "unknown", API_DOMAIN_RUNTIME: "runtime", API_DOMAIN_DRIVER: "driver"}
_CODE_COLUMNS = {
    "copies": {"kind": COPY_KIND_NAMES, "direction": COPY_DIRECTION_NAMES},
    "api": {"domain": API_DOMAIN_NAMES, "category": API_CATEGORY_NAMES},
    "ranges": {"kind": RANGE_KIND_NAMES},
}
EVENT_DTYPES = {"kernels": KERNEL_DTYPE, "copies": COPY_DTYPE, "api": API_DTYPE, "ranges": RANGE_DTYPE,
                "cpu_ops": CPU_OP_DTYPE}
# name-id columns: stored as the dictionary-encoded string (column name without ``_id``)
_NAME_COLUMNS = {"name_id": "name", "input_dims_id": "input_dims", "input_types_id": "input_types"}
# tables partitioned by GPU (their rows have one); the others by host and hour only
GPU_TABLES = ("kernels", "copies", "windows", "window_phases")

# Window tables: (column, kind, key path in the window's GPU record). Kinds: i int64,
# f float64, s dictionary string. Unknown or absent values are null.
WINDOW_COLUMNS = (
    ("device", "i", ("device",)), ("pid", "i", ("pid",)), ("gpu_name", "s", ("gpu",)),
    ("source", "s", ("source",)), ("kernels", "i", ("kernels",)), ("kernel_time_ns", "i", ("kernel_time_ns",)),
    ("busy_ns", "i", ("busy_ns",)), ("span_ns", "i", ("span_ns",)), ("idle_ns", "i", ("idle_ns",)),
    ("idle_gaps", "i", ("idle_gaps", "count")), ("idle_gap_p50_ns", "i", ("idle_gaps", "p50_ns")),
    ("idle_gap_p99_ns", "i", ("idle_gaps", "p99_ns")),
    ("copy_htod_bytes", "i", ("copy_bytes", "HtoD")), ("copy_dtoh_bytes", "i", ("copy_bytes", "DtoH")),
    ("copy_dtod_bytes", "i", ("copy_bytes", "DtoD")), ("copy_other_bytes", "i", None),
    ("launches", "i", ("launch", "count")), ("launch_p50_ns", "i", ("launch", "p50_ns")),
    ("launch_p99_ns", "i", ("launch", "p99_ns")), ("syncs", "i", ("sync", "count")),
    ("sync_p50_ns", "i", ("sync", "p50_ns")), ("sync_p99_ns", "i", ("sync", "p99_ns")),
    ("peak_bytes_per_s", "f", ("ceilings", "hbm_bytes_per_s")),
)
PHASE_COLUMNS = (
    ("kernels", "i"), ("kernel_time_ns", "i"), ("busy_ns", "i"), ("idle_ns", "i"), ("steps", "i"),
    ("time_share_pct", "f"), ("flops", "f"), ("bytes", "f"), ("work_busy_ns", "i"),
    ("achieved_flops_per_s", "f"), ("achieved_bytes_per_s", "f"), ("arithmetic_intensity", "f"),
    ("peak_flops_per_s", "f"), ("peak_bytes_per_s", "f"), ("pct_of_peak_flops", "f"),
    ("pct_of_peak_bytes", "f"), ("verdict", "s"), ("work_source", "s"),
)
# every table's leading columns (after the Hive partitions host, gpu, hour)
_KEY = (("recording", "s"), ("frame", "i"), ("recv_ns", "i"))
_WINDOW_KEY = _KEY + (("window_start_ns", "i"), ("window_end_ns", "i"), ("window_duration_ns", "i"),
                      ("model", "s"))


def _pa():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise RuntimeFailure("Parquet recordings need pyarrow: pip install 'ridgeline[parquet]'") from None
    return pa, pq


class _ColumnsCodec:
    """The wire codec for a subscriber that writes Parquet (``record --format parquet``,
    the sink): event batches decoded into columns (probes.events.EventColumns), which the
    writer gives Arrow as they are. Decoding them into structured rows first, then copying
    each column back out of the rows, was half of the sink's decode and a third of its
    write (docs/parquet-schema.md, "Cost of writing")."""

    decode_envelope = staticmethod(wire.decode_envelope)
    decode_window = staticmethod(wire.decode_window)
    decode_event_batch = staticmethod(wire.decode_event_columns)


COLUMNS_CODEC = _ColumnsCodec()


def _event_columns(kind: str) -> list[tuple[str, str]]:
    """(column, arrow type name) of an event table, in order."""
    out = [(c, t) for c, t in ((k, "dict" if k == "recording" else "int64") for k, _ in _KEY)]
    codes = _CODE_COLUMNS.get(kind, {})
    for name in EVENT_DTYPES[kind].names:
        if name in _NAME_COLUMNS:
            out.append((_NAME_COLUMNS[name], "dict"))
        elif name in codes:
            out.append((name, "dict"))
        else:
            out.append((name, EVENT_DTYPES[kind][name].name))
    return out


def _typed(cols) -> list[tuple[str, str]]:
    return [(c, {"i": "int64", "f": "float64", "s": "dict", "t": "string", "c": "culprits"}[k]) for c, k in cols]


TABLES: dict[str, list[tuple[str, str]]] = {k: _event_columns(k) for k in EVENT_DTYPES}
TABLES["windows"] = _typed(_WINDOW_KEY + tuple((c, k) for c, k, _ in WINDOW_COLUMNS))
TABLES["window_phases"] = _typed(_WINDOW_KEY + (("device", "i"), ("pid", "i"), ("phase", "s")) + PHASE_COLUMNS)
TABLES["verdicts"] = _typed(_WINDOW_KEY + (("device", "i"), ("pid", "i"), ("phase", "s"), ("verdict", "s"),
                                           ("face", "s"), ("record_json", "t")))
TABLES["messages"] = _typed(_KEY + (("ts_ns", "i"), ("topic", "s"), ("seq", "i"), ("meta_json", "t"), ("events", "i")))
TABLES["devices"] = _typed(_KEY + (("device", "i"), ("name", "s"), ("sm_count", "i"),
                                   ("memory_total_bytes", "i"), ("compute_capability", "s")))
# Reserved: one row per request of a window's slowest list, the fields of
# aggregator.request_join.RequestStory. No window record carries them yet, so no
# recording has this table; its schema is fixed here so that fleet queries can be
# written (docs/fleet.md) and checked against it.
RESERVED_TABLES: dict[str, list[tuple[str, str]]] = {"requests": _typed(_WINDOW_KEY + (
    ("request_id", "t"), ("engine", "s"), ("start_ns", "i"), ("end_ns", "i"), ("e2e_ns", "i"), ("queue_ns", "i"),
    ("kv_usage_max_queued_ratio", "f"), ("kv_full_while_queued", "i"), ("prefill_ns", "i"),
    ("prefill_chunks", "i"), ("decode_ns", "i"), ("decode_steps", "i"), ("ns_per_token", "f"),
    ("dragged_ns", "i"), ("dragged_by_prefill_ns", "i"), ("dragged_by_long_ns", "i"), ("dragged_source", "s"),
    ("alone_decode_ns", "i"), ("preemptions", "i"), ("recovery_ns", "i"), ("prompt_tokens", "i"),
    ("completion_tokens", "i"), ("culprits", "c"), ("paused_ns", "i"), ("recompute_ns", "i"),
    ("recompute_steps", "i")))}


@functools.cache
def arrow_schema(table: str):
    """The Arrow schema of a table's files (without the Hive partition columns). The
    event tables' numbers are never null (a source's unknown is -1): required columns,
    which spare the Parquet encoder a definition level per value (a seventh of its time
    on kernel rows)."""
    pa, _ = _pa()
    types = {"dict": pa.dictionary(pa.int32(), pa.string()), "int64": pa.int64(), "float64": pa.float64(),
             "int32": pa.int32(), "uint8": pa.uint8(), "int8": pa.int8(), "string": pa.string(),
             "culprits": pa.list_(pa.struct([("request_id", pa.string()), ("kind", pa.string()),
                                             ("added_ns", pa.int64()), ("tokens", pa.int64())]))}
    cols = TABLES[table] if table in TABLES else RESERVED_TABLES[table]
    required = table in EVENT_DTYPES
    return pa.schema([pa.field(c, types[t], nullable=not (required and t != "dict")) for c, t in cols],
                     metadata={"ridgeline.schema_version": str(SCHEMA_VERSION), "ridgeline.table": table})


def _hour(ns: int) -> str:
    return time.strftime("%Y-%m-%d-%H", time.gmtime(ns // 1_000_000_000))


_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def host_dir(host: str) -> str:
    """The host's partition value: percent-encoded outside [A-Za-z0-9._-], never empty."""
    s = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in host)
    return s or "unknown"


def _dict_array(pa, ids: np.ndarray, strings: list[str]):
    """Dictionary array of the strings ``ids`` name (-1 or out of range: null), with a
    dictionary of the names used only (a lookup table, no sort: O(rows + names))."""
    n = len(strings)
    every = len(ids) == 0 or (int(ids.min()) >= 0 and int(ids.max()) < n)
    ok = None if every else (ids >= 0) & (ids < n)
    present = np.bincount(ids if every else ids[ok], minlength=n) > 0 if n else np.zeros(0, bool)
    used = np.flatnonzero(present)
    lut = np.full(n + 1, -1, dtype=np.int32)    # slot n: the nulls
    lut[used] = np.arange(len(used), dtype=np.int32)
    dictionary = pa.array([strings[int(i)] for i in used], type=pa.string())
    if every:
        return pa.DictionaryArray.from_arrays(pa.array(lut[ids]), dictionary)
    return pa.DictionaryArray.from_arrays(pa.array(lut[np.where(ok, ids, n)], mask=~ok), dictionary)


@functools.cache
def _code_dictionary(kind: str, column: str):
    """(index of each u8 code in the names of its table, -1 unknown; the names as an Arrow array)."""
    pa, _ = _pa()
    table = _CODE_COLUMNS[kind][column]
    keys = sorted(table)
    lut = np.full(256, -1, dtype=np.int32)
    lut[keys] = np.arange(len(keys), dtype=np.int32)
    return lut, pa.array([table[k] for k in keys], type=pa.string())


def _code_array(pa, kind: str, column: str, codes: np.ndarray):
    """Dictionary array of a code column's names (a code no table names: null)."""
    lut, dictionary = _code_dictionary(kind, column)
    idx = lut[codes]
    if not len(idx) or int(idx.min()) >= 0:
        return pa.DictionaryArray.from_arrays(pa.array(idx), dictionary)
    return pa.DictionaryArray.from_arrays(pa.array(idx, mask=idx < 0), dictionary)


def _const_dict(pa, value, n: int, zeros: np.ndarray | None = None):
    if value is None:
        return pa.nulls(n, type=pa.dictionary(pa.int32(), pa.string()))
    idx = np.zeros(n, dtype=np.int32) if zeros is None else zeros[:n]
    return pa.DictionaryArray.from_arrays(pa.array(idx), pa.array([str(value)]))


ROW_GROUP_ROWS = 262_144  # rows per row group of the event files: 64k cost 8% more CPU and 7% more bytes (bench_parquet)


class _EventChunks:
    """The event batches of one table, host and hour, held as the callers' numpy arrays
    until the flush (batches are not changed once published): a message costs a list
    append, not an Arrow table per batch and column."""

    __slots__ = ("arrs", "frames", "recv", "names", "rows")

    def __init__(self):
        self.arrs: list = []            # structured arrays or probes.events.Columns
        self.frames: list[int] = []
        self.recv: list[int] = []
        self.names: list = []           # NameTable or EventColumns' list of names
        self.rows = 0

    def add(self, arr, frame: int, recv_ns: int, names) -> None:
        self.arrs.append(arr)
        self.frames.append(frame)
        self.recv.append(recv_ns)
        self.names.append(names)
        self.rows += len(arr)

    def by_gpu(self, kind: str) -> dict:
        """``{device or None: [(chunk index, rows)]}``, rows a slice or indices in recorded
        order: a file per GPU for the tables partitioned by GPU, one for the others."""
        if kind not in GPU_TABLES:
            return {None: [(i, slice(None)) for i in range(len(self.arrs))]}
        out: dict = {}
        for i, a in enumerate(self.arrs):
            devs = a["device"]
            lo, hi = int(devs.min()), int(devs.max())
            if lo == hi:
                out.setdefault(lo, []).append((i, slice(None)))
                continue
            order = np.argsort(devs, kind="stable")     # each GPU's rows in recorded order
            sdevs = devs[order]
            cuts = np.flatnonzero(np.diff(sdevs)) + 1
            for s, e in zip(np.r_[0, cuts], np.r_[cuts, len(sdevs)]):
                out.setdefault(int(sdevs[s]), []).append((i, order[s:e]))
        return out


def _row_groups(chunks: _EventChunks, pieces: list, rows: int):
    """The pieces (``(chunk index, slice(None) or indices)``) cut into groups of at most
    ``rows`` rows: ``[(chunk index, a slice with bounds or indices, length)]`` each."""
    group, held = [], 0
    for i, sel in pieces:
        n = len(chunks.arrs[i]) if isinstance(sel, slice) else len(sel)
        start = 0
        while start < n:
            take = min(rows - held, n - start)
            group.append((i, slice(start, start + take) if isinstance(sel, slice) else sel[start:start + take], take))
            held += take
            start += take
            if held == rows:
                yield group
                group, held = [], 0
    if group:
        yield group


class _ColumnPool:
    """Contiguous column buffers of one row group, reused from group to group and flush
    to flush: the copy out of the structured rows then writes memory that is already
    mapped (fresh buffers cost a page fault per 4 KiB, two thirds of that copy)."""

    def __init__(self, rows: int):
        self.rows = rows
        self._bufs: dict[tuple, np.ndarray] = {}
        self.zeros = np.zeros(rows, dtype=np.int32)    # the constant columns' indices (never written)

    def get(self, name: str, dtype) -> np.ndarray:
        key = (name, np.dtype(dtype).str)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = np.empty(self.rows, dtype=dtype)
        return buf


def _strings(names) -> list[str]:
    """The strings of a batch's name table (a NameTable, or EventColumns' list)."""
    return names.strings if isinstance(names, NameTable) else names


def _group_table(pa, kind: str, chunks: _EventChunks, group: list, recording: str, pool: _ColumnPool):
    """The Arrow table of one row group. A column the batches hold contiguous (the
    wire's decoded columns, probes.events.Columns) goes to Arrow as it is, a chunk per
    batch (no copy); one inside structured rows is copied into the pool's buffers first
    (the table refers to them: written before the next group fills them again)."""
    m = sum(k for *_, k in group)
    frame, recv = pool.get("frame", np.int64)[:m], pool.get("recv_ns", np.int64)[:m]
    o = 0
    spans = []
    for i, sel, k in group:
        frame[o:o + k] = chunks.frames[i]
        recv[o:o + k] = chunks.recv[i]
        spans.append((i, sel, o, o + k))
        o += k
    arrays = [_const_dict(pa, recording, m, pool.zeros), pa.array(frame), pa.array(recv)]
    codes = _CODE_COLUMNS.get(kind, {})
    dtype = EVENT_DTYPES[kind]
    for name in dtype.names:
        if name in _NAME_COLUMNS:
            ids, strings = _group_name_ids(chunks, spans, name, pool.get(name, np.int32)[:m])
            arrays.append(_dict_array(pa, ids, strings))
            continue
        parts = [chunks.arrs[i][name][sel] for i, sel, _, _ in spans]
        if all(p.flags.c_contiguous for p in parts):
            if name in codes:
                parts = [_code_array(pa, kind, name, p) for p in parts]
            else:
                parts = [pa.array(p) for p in parts]
            arrays.append(parts[0] if len(parts) == 1 else pa.chunked_array(parts))
            continue
        col = pool.get(name, dtype[name])[:m]
        for p, (_, _, lo, hi) in zip(parts, spans):
            col[lo:hi] = p
        arrays.append(_code_array(pa, kind, name, col) if name in codes else pa.array(col))
    return pa.Table.from_arrays(arrays, schema=arrow_schema(kind))


def _group_name_ids(chunks: _EventChunks, spans: list, name: str, out: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """The ids of a name column of one row group and the strings they index. Batches of
    one stream name their events from one append-only table (its ids as they are, against
    the longest table of the group, of which every other is a prefix); those of several
    sources are mapped onto one table of this group."""
    tables = [_strings(chunks.names[i]) for i, *_ in spans]
    longest = max(tables, key=len)
    if all(t is longest or longest[:len(t)] == t for t in tables):
        for i, sel, lo, hi in spans:
            out[lo:hi] = chunks.arrs[i][name][sel]
        return out, longest
    merged = NameTable()
    for (i, sel, lo, hi), strings in zip(spans, tables):
        # only the names a batch uses are interned, O(rows + names) with no Python loop
        # over the table
        n = len(strings)
        ids = chunks.arrs[i][name][sel].astype(np.int64)
        ok = (ids >= 0) & (ids < n)
        used = np.flatnonzero(np.bincount(ids[ok], minlength=n))
        lut = np.full(n + 1, -1, dtype=np.int64)
        lut[used] = [merged.intern(strings[j]) for j in used.tolist()]
        out[lo:hi] = lut[np.where(ok, ids, n)]
    return out, merged.strings


def events_table(kind: str, arr: np.ndarray, names: NameTable, recording: str, frame: int, recv_ns: int):
    """The Arrow table of one batch's events of ``kind`` (all its GPUs in one table)."""
    pa, _ = _pa()
    chunks = _EventChunks()
    chunks.add(arr, frame, recv_ns, names)
    return _group_table(pa, kind, chunks, [(0, slice(0, len(arr)), len(arr))], recording, _ColumnPool(len(arr)))


def _get(rec, path):
    for k in path:
        if not isinstance(rec, dict):
            return None
        rec = rec.get(k)
    return rec


def _num(v, kind):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if kind == "i":
        return int(v) if v == v and abs(v) < 2 ** 63 else None
    return float(v)


def _rows_table(pa, table: str, rows: list[dict]):
    cols = []
    for c, t in TABLES[table]:
        vals = [r.get(c) for r in rows]
        if t == "dict":
            cols.append(pa.array([None if v is None else str(v) for v in vals], type=pa.string()).dictionary_encode())
        elif t == "string":
            cols.append(pa.array([None if v is None else str(v) for v in vals], type=pa.string()))
        else:
            cols.append(pa.array(vals, type=pa.int64() if t == "int64" else pa.float64()))
    return pa.Table.from_arrays(cols, schema=arrow_schema(table))


def window_rows(window: dict, key: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """(windows, window_phases, verdicts) rows of one window record; ``key``: the columns
    every row carries (recording, frame, recv_ns, model)."""
    base = dict(key, window_start_ns=_num(window.get("start_ns"), "i"),
                window_end_ns=_num(window.get("end_ns"), "i"),
                window_duration_ns=_num(window.get("duration_ns"), "i"))
    wins, phases, verdicts = [], [], []
    for g in window.get("gpus") or []:
        if not isinstance(g, dict):
            continue
        row = dict(base)
        for col, kind, path in WINDOW_COLUMNS:
            if path is None:
                continue
            v = _get(g, path)
            row[col] = (None if v is None else str(v)[:500]) if kind == "s" else _num(v, kind)
        cb = g.get("copy_bytes") if isinstance(g.get("copy_bytes"), dict) else {}
        row["copy_other_bytes"] = int(sum(v for k, v in cb.items() if k not in ("HtoD", "DtoH", "DtoD")
                                          and isinstance(v, (int, float))))
        wins.append(row)
        for name, ph in (g.get("phases") or {}).items():
            if not isinstance(ph, dict):
                continue
            pr = dict(base, device=row["device"], pid=row["pid"], phase=str(name)[:200])
            for col, kind in PHASE_COLUMNS:
                v = ph.get(col)
                pr[col] = (None if v is None else str(v)[:200]) if kind == "s" else _num(v, kind)
            phases.append(pr)
    from ridgeline.aggregator.answer import verdict_records
    for v in verdict_records(window.get("verdict")):
        verdicts.append(dict(base, device=_num(v.get("device"), "i"), pid=_num(v.get("pid"), "i"),
                             phase=v.get("phase"), verdict=v.get("verdict"), face=v.get("face"),
                             record_json=orjson.dumps(v, option=orjson.OPT_SERIALIZE_NUMPY).decode()))
    return wins, phases, verdicts


# Columns with min/max statistics: the keys and times readers prune row groups by
# (iter_messages takes chunks of frames; fleet queries filter on time). Statistics on
# every column cost a fifth of the encoder's time and prune nothing anyone asks for; on
# a dictionary column they cost as much as its values (``recording`` has none: a file
# holds one recording, named in the file's name).
STATISTICS_COLUMNS = ("frame", "recv_ns", "start_ns", "end_ns", "window_start_ns", "window_end_ns", "ts_ns")


def _write_options(pa, schema, compression: str = "zstd") -> dict:
    """Dictionary pages for the names only; zstd; statistics for :data:`STATISTICS_COLUMNS`.
    64-bit integers (times, correlation ids, sizes: they grow row to row or sit at -1)
    delta-encoded: ~0.5 bytes per kernel row instead of ~7. The narrower ones (devices,
    pids, tids, launch shapes: few values, in runs) plain, which zstd packs smaller than
    the deltas and the encoder writes in half the time (bench/bench_parquet.py)."""
    names = [f.name for f in schema if pa.types.is_dictionary(f.type)]
    ints = {f.name: "DELTA_BINARY_PACKED" if f.type == pa.int64() else "PLAIN"
            for f in schema if pa.types.is_integer(f.type)}
    stats = [c for c in STATISTICS_COLUMNS if c in schema.names]
    return {"compression": compression, "use_dictionary": names, "column_encoding": ints, "write_statistics": stats}


class ParquetRecordingWriter:
    """Writes a Parquet recording under ``root`` (see the module docstring)."""

    def __init__(self, root: str | Path, recording: str | None = None, flush_rows: int = FLUSH_ROWS,
                 first_part: int = 0, first_frame: int = 0, compression: str = "zstd"):
        self._pa, self._pq = _pa()
        if compression not in COMPRESSIONS:
            raise InputError(f"Parquet compression {compression!r}: one of {', '.join(COMPRESSIONS)}")
        # zstd: the smallest files; lz4: a fifth less of the encoder's CPU for a third more
        # bytes (bench/bench_parquet.py)
        self.compression = compression
        self.root = Path(root)
        self.recording = recording or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:8]
        if not all(c in _SAFE for c in self.recording):
            raise InputError(f"recording id {self.recording!r}: only [A-Za-z0-9._-]")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            man = self.root / MANIFEST
            if not man.exists():
                self._atomic(man, orjson.dumps({"format": FORMAT, "schema_version": SCHEMA_VERSION,
                                                "tables": sorted(TABLES)}, option=orjson.OPT_INDENT_2))
        except OSError as exc:
            raise InputError(f"{root}: cannot write a Parquet recording here ({exc.strerror})") from None
        self.flush_rows = flush_rows
        # first_part/first_frame: where a writer resuming a recording goes on (agent.object_sink
        # replays a journal into one numbered as the writer that died, so its files and rows
        # are the same ones again)
        self.frames = first_frame
        self.bytes = 0            # bytes of Parquet files written
        self.files = 0
        self.rows = 0
        self._buf: dict[tuple, list] = {}              # (table, host, gpu, hour) -> rows
        self._events: dict[tuple, _EventChunks] = {}   # (table, host, hour) -> event batches
        self._held = 0
        self._pool = _ColumnPool(ROW_GROUP_ROWS)
        self.next_part = first_part
        self._devices: set = set()
        self._model: dict[str, str] = {}       # host -> the model its events named last
        # pyarrow initialises its compute kernels on first use (seconds on a busy host):
        # paid here, not on the first message of a live recording
        import pyarrow.compute  # noqa: F401
        events_table("kernels", np.zeros(1, KERNEL_DTYPE), NameTable(["warm-up"]), self.recording, 0, 0)

    # -- input
    def write(self, envelope: bytes, recv_ns: int) -> None:
        """One message as published (the RecordingWriter call); its payload is decoded."""
        from .subscriber import decode_payload
        env = wire.decode_envelope(envelope)
        topic, host = env.topic, env.host or ""
        payload = decode_payload(COLUMNS_CODEC, topic, env.payload)
        self.add_message(topic, int(env.seq), host, int(env.ts_ns), recv_ns, payload)

    def add_message(self, topic: str, seq: int, host: str, ts_ns: int, recv_ns: int, payload) -> None:
        frame = self.frames
        self.frames += 1
        meta = None
        events = None
        if topic == "events":
            events = sum(len(getattr(payload, k)) for k in EVENT_DTYPES)
            meta = orjson.dumps(payload.meta, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS).decode()
            self.add_events(payload, frame, recv_ns, host)
        elif topic == "window" and isinstance(payload, dict):
            self.add_window(payload, frame, recv_ns, host)
        self._add_rows("messages", host, None, recv_ns, [
            {"recording": self.recording, "frame": frame, "recv_ns": recv_ns, "ts_ns": ts_ns, "topic": topic,
             "seq": seq, "meta_json": meta, "events": events}])
        if self._held >= self.flush_rows:
            self.flush()

    def add_events(self, trace: Trace | EventColumns, frame: int, recv_ns: int, host: str) -> None:
        if isinstance(trace.meta.get("model"), str):
            self._model[host] = trace.meta["model"][:200]
        hour = _hour(recv_ns)
        for kind in EVENT_DTYPES:
            arr = getattr(trace, kind)
            if not len(arr):
                continue
            # held as they are until the flush (batches are not changed once published)
            key = (kind, host_dir(host), hour)
            chunks = self._events.get(key)
            if chunks is None:
                chunks = self._events[key] = _EventChunks()
            chunks.add(arr, frame, recv_ns, trace.names)
            self._held += len(arr)
            self.rows += len(arr)
        new = [d for d in trace.devices if (host, d.index) not in self._devices]
        if new:
            self._devices.update((host, d.index) for d in new)
            self._add_rows("devices", host, None, recv_ns, [
                {"recording": self.recording, "frame": frame, "recv_ns": recv_ns, "device": d.index,
                 "name": d.name, "sm_count": d.sm_count, "memory_total_bytes": d.memory_total_bytes,
                 "compute_capability": d.compute_capability} for d in new])

    def add_window(self, window: dict, frame: int, recv_ns: int, host: str) -> None:
        key = {"recording": self.recording, "frame": frame, "recv_ns": recv_ns, "model": self._model.get(host)}
        wins, phases, verdicts = window_rows(window, key)
        for table, rows in (("windows", wins), ("window_phases", phases)):
            by_dev: dict = {}
            for r in rows:
                by_dev.setdefault(r["device"] if r["device"] is not None else -1, []).append(r)
            for d, rs in by_dev.items():
                self._add_rows(table, host, d, recv_ns, rs)
        if verdicts:
            self._add_rows("verdicts", host, None, recv_ns, verdicts)

    def _add_rows(self, table: str, host: str, gpu, recv_ns: int, rows: list[dict]) -> None:
        """Plain rows (messages, windows, verdicts): made a table when flushed."""
        self._buf.setdefault((table, host_dir(host), gpu, _hour(recv_ns)), []).extend(rows)
        self._held += len(rows)
        self.rows += len(rows)

    # -- output
    def _atomic(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def flush(self) -> None:
        """Write what is buffered: one file per table and partition."""
        pa, pq = self._pa, self._pq
        buf, self._buf, self._held = self._buf, {}, 0
        events, self._events = self._events, {}
        if not buf and not events:
            return
        n = self.next_part
        self.next_part += 1
        files = [((table, host, gpu, hour), _rows_table(pa, table, rows)) for (table, host, gpu, hour), rows in buf.items()]
        for (kind, host, hour), chunks in events.items():
            files.extend(((kind, host, gpu, hour), (chunks, pieces)) for gpu, pieces in chunks.by_gpu(kind).items())
        for (table, host, gpu, hour), what in files:
            d = self.root / table / f"host={host}"
            if gpu is not None:
                d = d / f"gpu={gpu}"
            d = d / f"hour={hour}"
            try:
                d.mkdir(parents=True, exist_ok=True)
                path = d / f"part-{self.recording}-{n:06d}.parquet"
                tmp = d / f".{path.name}.tmp"
                if isinstance(what, tuple):
                    self._write_events(tmp, table, *what)
                else:
                    pq.write_table(what, tmp, row_group_size=ROW_GROUP_ROWS,
                                   **_write_options(pa, what.schema, self.compression))
                os.replace(tmp, path)
                self.bytes += path.stat().st_size
            except OSError as exc:
                raise RuntimeFailure(f"{d}: cannot write Parquet ({exc.strerror})") from None
            self.files += 1

    def _write_events(self, path: Path, kind: str, chunks: _EventChunks, pieces: list) -> None:
        """One event file, a row group at a time (each group's columns in the pool's buffers)."""
        pa, pq = self._pa, self._pq
        schema = arrow_schema(kind)
        with pq.ParquetWriter(path, schema, **_write_options(pa, schema, self.compression)) as w:
            for group in _row_groups(chunks, pieces, ROW_GROUP_ROWS):
                t = _group_table(pa, kind, chunks, group, self.recording, self._pool)
                w.write_table(t, row_group_size=ROW_GROUP_ROWS)
                del t     # the pool's buffers are filled again by the next group

    @property
    def pending_rows(self) -> int:
        """Rows buffered, not yet in a file."""
        return self._held

    def close(self) -> None:
        if self._buf or self._events:
            self.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --------------------------------------------------------------------------- reading

def is_parquet_recording(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def _check_manifest(root: Path) -> None:
    try:
        man = orjson.loads((root / MANIFEST).read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise InputError(f"{root}: unreadable {MANIFEST} ({exc})") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise InputError(f"{root}: {MANIFEST} is not a ridgeline Parquet manifest")
    if man.get("schema_version") != SCHEMA_VERSION:
        raise InputError(f"{root}: Parquet schema version {man.get('schema_version')!r}; "
                         f"this ridgeline reads version {SCHEMA_VERSION}")


def _dataset(root: Path, table: str):
    import pyarrow.dataset as ds
    pa, _ = _pa()
    d = root / table
    if not d.is_dir():
        return None
    part = ds.partitioning(pa.schema([("host", pa.string()), ("gpu", pa.int64()), ("hour", pa.string())])
                           if table in GPU_TABLES else
                           pa.schema([("host", pa.string()), ("hour", pa.string())]), flavor="hive")
    try:
        return ds.dataset(d, format="parquet", partitioning=part, ignore_prefixes=[".", "_"])
    except (OSError, ValueError) as exc:       # pyarrow's ArrowInvalid is a ValueError
        raise InputError(f"{d}: not a readable Parquet table ({exc})") from None


def _read(root: Path, table: str, host: str, recording: str, hour: str | None = None, frames=None):
    import pyarrow.dataset as ds
    dset = _dataset(root, table)
    if dset is None:
        return None
    f = (ds.field("host") == host_dir(host)) & (ds.field("recording") == recording)
    if hour is not None:
        f = f & (ds.field("hour") == hour)
    if frames is not None:
        f = f & (ds.field("frame") >= frames[0]) & (ds.field("frame") <= frames[1])
    try:
        return dset.to_table(filter=f)
    except (OSError, ValueError) as exc:
        raise InputError(f"{root / table}: unreadable Parquet ({exc})") from None


def recordings_in(root: str | Path) -> list[tuple[str, str]]:
    """(host partition value, recording id) of every recording in the folder, sorted."""
    root = Path(root)
    _check_manifest(root)
    dset = _dataset(root, "messages")
    if dset is None:
        return []
    t = dset.to_table(columns=["host", "recording"])
    pairs = {(h, str(r)) for h, r in zip(t.column("host").to_pylist(), t.column("recording").to_pylist())}
    from urllib.parse import unquote
    return sorted((unquote(h), r) for h, r in pairs)


def _to_events(kind: str, t) -> np.ndarray:
    """The structured array of ``kind`` from its Arrow table (names as a ``_names`` column
    of Python strings handled by the caller)."""
    dtype = EVENT_DTYPES[kind]
    out = np.zeros(t.num_rows, dtype=dtype)      # every column is set below
    codes = _CODE_COLUMNS.get(kind, {})
    for name in dtype.names:
        if name in _NAME_COLUMNS:
            continue
        col = t.column(name)
        if name in codes:
            # the code of each dictionary entry (a name this version does not know: 0)
            inv = {v: k for k, v in codes[name].items()}
            col = _dict_column(col)
            lut = np.fromiter((inv.get(v, 0) for v in col.dictionary.to_pylist()), dtype=np.int64,
                              count=len(col.dictionary))
            idx = col.indices.fill_null(0).to_numpy(zero_copy_only=False)
            valid = np.asarray(col.is_valid())
            out[name] = np.where(valid, lut[np.where(valid, idx, 0)] if len(lut) else 0, 0)
        else:
            out[name] = col.to_numpy(zero_copy_only=False)
    return out


def _dict_column(col):
    """One DictionaryArray of a (chunked) string or dictionary column."""
    import pyarrow.compute as pc
    pa, _ = _pa()
    if isinstance(col, pa.ChunkedArray):
        col = col.unify_dictionaries() if pa.types.is_dictionary(col.type) else col
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if not pa.types.is_dictionary(col.type):
        col = pc.dictionary_encode(col)
    return col


def _names_ids(col, names: NameTable) -> np.ndarray:
    """Ids in ``names`` of a dictionary string column (null: -1), interned vectorised."""
    col = _dict_column(col)
    lut = np.fromiter((names.intern(s) for s in col.dictionary.to_pylist()), dtype=np.int64,
                      count=len(col.dictionary))
    idx = col.indices.fill_null(0).to_numpy(zero_copy_only=False)   # nulls: not NaN in floats
    valid = np.asarray(col.is_valid())
    return np.where(valid, lut[np.where(valid, idx, 0)] if len(lut) else -1, -1)


def iter_messages(root: str | Path, host: str, recording: str, max_memory_bytes: int | None = None):
    """The recording's messages ``(frame, recv_ns, topic, seq, host, payload())`` in
    recorded order (see :func:`agent.recording.segments_of`), reading one hour partition
    of events at a time, in chunks of frames within a quarter of ``max_memory_bytes``
    (probes.budget's row costs)."""
    from ridgeline.probes.budget import DEFAULT_MAX_MEMORY_BYTES, ROW_COST_BYTES
    root = Path(root)
    budget = (max_memory_bytes or DEFAULT_MAX_MEMORY_BYTES) // 4
    _check_manifest(root)
    msgs = _read(root, "messages", host, recording)
    if msgs is None or not msgs.num_rows:
        return
    msgs = msgs.sort_by("frame")
    devs = _read(root, "devices", host, recording)
    devices = []
    if devs is not None:
        seen = set()
        for r in devs.sort_by("frame").to_pylist():
            if r["device"] not in seen:
                seen.add(r["device"])
                devices.append(Device(int(r["device"]), r["name"] or "", r["sm_count"], r["memory_total_bytes"],
                                      r["compute_capability"] or ""))
    verd = _read(root, "verdicts", host, recording)
    verdicts: dict[int, list] = {}
    if verd is not None:
        for f, j in zip(verd.column("frame").to_pylist(), verd.column("record_json").to_pylist()):
            verdicts.setdefault(f, []).append(orjson.loads(j))
    names = NameTable()
    cols = {c: msgs.column(c).to_pylist() for c in ("frame", "recv_ns", "topic", "seq", "hour", "meta_json", "events")}
    loaded = None
    by_frame: dict[int, dict] = {}

    # Events are read in chunks of consecutive frames of one hour, each within a quarter
    # of the budget (messages.events: rows per events message; the row groups' frame
    # statistics let the reader skip the rest), so memory is bounded whatever the hour holds.
    per_row = max(ROW_COST_BYTES.values())
    chunk_of: dict[int, int] = {}
    chunks: list[tuple[str, int, int]] = []
    acc = 0
    for f, h, t, n in zip(cols["frame"], cols["hour"], cols["topic"], cols["events"]):
        if t != "events":
            continue
        c = (n or 0) * per_row
        if not chunks or chunks[-1][0] != h or acc + c > budget:
            chunks.append((h, f, f))
            acc = 0
        chunks[-1] = (h, chunks[-1][1], f)
        acc += c
        chunk_of[f] = len(chunks) - 1

    def load_chunk(ci):
        nonlocal by_frame
        by_frame = {}
        h, lo, hi = chunks[ci]
        for kind in EVENT_DTYPES:
            t = _read(root, kind, host, recording, hour=h, frames=(lo, hi))
            if t is None or not t.num_rows:
                continue
            # files of several GPUs: back to one batch's recorded order (frame, then start)
            t = t.sort_by([("frame", "ascending"), ("start_ns", "ascending")])
            arr = _to_events(kind, t)
            for col, sname in _NAME_COLUMNS.items():
                if col in arr.dtype.names:
                    arr[col] = _names_ids(t.column(sname), names)
            frames = t.column("frame").to_numpy()
            cut = np.flatnonzero(np.diff(frames)) + 1
            for seg in np.split(np.arange(len(frames)), cut):
                if len(seg):
                    by_frame.setdefault(int(frames[seg[0]]), {})[kind] = arr[seg]

    for i in range(msgs.num_rows):
        frame, topic = cols["frame"][i], cols["topic"][i]
        if topic == "events":
            ci = chunk_of[frame]
            if ci != loaded:
                load_chunk(ci)
                loaded = ci

            def payload(frame=frame, meta=cols["meta_json"][i]):
                parts = by_frame.pop(frame, {})
                return Trace(names=names, devices=list(devices), meta=orjson.loads(meta) if meta else {}, **parts)
        elif topic == "window":
            payload = (lambda frame=frame: {"verdict": verdicts.get(frame, [])})
        else:
            payload = (lambda: None)
        yield frame, cols["recv_ns"][i], topic, cols["seq"][i], host, payload


def iter_segments(root: str | Path, host: str, recording: str, max_memory_bytes: int | None = None,
                  summary=None):
    """The segments of one recording of the folder, cut as its ``.rlrec`` would be."""
    from .recording import segments_of
    where = f"{root} (host={host}, recording={recording})"
    yield from segments_of(iter_messages(root, host, recording, max_memory_bytes), where, max_memory_bytes, summary,
                           fmt=FORMAT)
