"""Nsight Systems SQLite exports (``nsys export --type sqlite``) as a :class:`Trace`.

``load_trace(path)`` reads, with Python's sqlite3, read-only:

=================================  ===============================================
table                              goes to
=================================  ===============================================
``CUPTI_ACTIVITY_KIND_KERNEL``     ``trace.kernels`` (name: ``demangledName``)
``CUPTI_ACTIVITY_KIND_MEMCPY``     ``trace.copies`` (kind memcpy, ``copyKind``)
``CUPTI_ACTIVITY_KIND_MEMSET``     ``trace.copies`` (kind memset)
``CUPTI_ACTIVITY_KIND_RUNTIME``    ``trace.api`` (domain runtime; ``_v7000``-style
                                   version suffixes dropped from names)
``CUPTI_ACTIVITY_KIND_DRIVER``     ``trace.api`` (domain driver)
``NVTX_EVENTS`` (push/pop and      ``trace.ranges`` (``RANGE_NVTX``), device -1
start/end ranges)
``TARGET_INFO_GPU``                ``trace.devices`` (name, memory, SMs, compute
                                   capability), by its ``id`` (the ``deviceId`` of
                                   the activity tables)
=================================  ===============================================

Times are the export's nanoseconds (relative to the session start). ``globalTid`` is
split into pid (bits 24-47) and tid (bits 0-23) as Nsight documents it; kernels and
copies get the pid/tid of the runtime/driver call with the same ``correlationId``.

Bounded: row counts are read first and charged to the caller's
:class:`probes.budget.EventBudget` before any row is fetched; rows are fetched in
blocks; strings are cut at :data:`MAX_NAME_CHARS`. A table read that is not a plain
table (a virtual table, or one with generated columns, computed on every read: issue
18.7 found one that allocated 800 MB per row or spun for minutes) is refused; every
query runs under SQLite's progress handler with a budget of VM steps and of wall time
that grows with the rows counted, and no value may exceed :data:`MAX_VALUE_BYTES`. Values of the wrong SQLite type
(a string where a time belongs) become unusable times, dropped and counted like the
Kineto importer does (``meta["rejected_events"]``). Any problem with the file raises
:class:`InputError` naming it.
"""
from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path

import numpy as np

from .errors import InputError
from .events import (
    API_DOMAIN_DRIVER,
    API_DOMAIN_RUNTIME,
    API_DTYPE,
    COPY_DTOD,
    COPY_DTOH,
    COPY_DTYPE,
    COPY_HTOD,
    COPY_KIND_MEMCPY,
    COPY_KIND_MEMSET,
    COPY_UNKNOWN,
    KERNEL_DTYPE,
    MISSING,
    RANGE_DTYPE,
    RANGE_NVTX,
    Device,
    NameTable,
    Trace,
    empty,
)
from .kineto_records import api_category, reject_invalid_times
from .trace_joins import join_launch_threads

__all__ = ["load_trace", "is_nsys_export"]

SQLITE_MAGIC = b"SQLite format 3\x00"
MAX_NAME_CHARS = 4096
_FETCH_ROWS = 65536
_BAD_TIME = np.iinfo(np.int64).min
_NVTX_RANGE_TYPES = (59, 60)          # NvtxPushPopRange, NvtxStartEndRange
# CUPTI_ActivityMemcpyKind 0..10 are the COPY_* values; 11..13 are unified-memory copies
_UVM_COPY = {11: COPY_HTOD, 12: COPY_DTOH, 13: COPY_DTOD}
_API_VERSION_SUFFIX = re.compile(r"_v\d+$")
MAX_VALUE_BYTES = 16 << 20      # SQLITE_LIMIT_LENGTH: no string or blob (stored or computed) beyond
# The progress handler runs every _TICK_OPS virtual-machine steps (100: a computed value
# can cost a row 0.25 s, so a coarser tick overshoots the time budget by seconds; the
# CloverLeaf export reads 7% slower than at 10,000). The step budget is
# STEPS_BASE for the schema and counts, plus STEPS_PER_ROW per counted row (our queries
# took 290k steps for the 5,936 rows of the shared CloverLeaf export, about 50 a row:
# 40x headroom), and the wall-time budget TIME_BASE_S plus TIME_PER_ROW_S per row (that
# export read in 0.15 s, 25 us a row with the fixed cost, on this 2-core machine).
_TICK_OPS = 100
STEPS_BASE = 50_000_000
STEPS_PER_ROW = 2_000
TIME_BASE_S = 30.0
TIME_PER_ROW_S = 20e-6
_INT32 = (-(1 << 31), (1 << 31) - 1)


def is_nsys_export(path: str | Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError:
        return False


def _int(col: str, default: int = MISSING) -> str:
    """SQL for an integer column: anything of another type becomes ``default``."""
    return f"coalesce(iif(typeof({col}) = 'integer', {col}, NULL), {default})"


class _Db:
    def __init__(self, path: Path, steps: int = STEPS_BASE, seconds: float = TIME_BASE_S):
        self.path = path
        self.steps, self.seconds = 0, 0.0
        self.max_steps, self.t0 = steps, time.monotonic()
        self.max_seconds = seconds
        self.over = ""          # which budget stopped a query
        try:
            # read-only and immutable: never writes a journal next to someone's file
            self.c = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
            self.c.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
            self.c.set_progress_handler(self._tick, _TICK_OPS)
            self.tables = {r[0] for r in self.c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            self.virtual = {r[0] for r in self.c.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND sql LIKE 'CREATE VIRTUAL TABLE%'")}
        except sqlite3.Error as exc:
            raise InputError(f"{path}: not a readable SQLite database ({exc})") from None

    def _tick(self) -> int:
        """SQLite's progress handler: nonzero interrupts the query."""
        self.steps += _TICK_OPS
        if self.steps > self.max_steps:
            self.over = f"more than {self.max_steps} SQLite steps"
        elif time.monotonic() - self.t0 > self.max_seconds:
            self.over = f"more than {self.max_seconds:.0f} s"
        return 1 if self.over else 0

    def allow_rows(self, rows: int) -> None:
        """Grow the budgets by what ``rows`` counted rows may cost to read."""
        self.max_steps = STEPS_BASE + STEPS_PER_ROW * rows
        self.max_seconds = TIME_BASE_S + TIME_PER_ROW_S * rows

    def _error(self, exc: sqlite3.Error) -> InputError:
        if self.over:
            return InputError(f"{self.path}: Nsight Systems export takes {self.over} to read "
                              "(budget of the rows it counts); refused")
        if isinstance(exc, sqlite3.DataError) or "too big" in str(exc):
            return InputError(f"{self.path}: Nsight Systems export holds a value over "
                              f"{MAX_VALUE_BYTES >> 20} MiB ({exc})")
        return InputError(f"{self.path}: Nsight Systems export does not read ({exc})")

    def check_plain(self, table: str) -> None:
        """Refuse a table whose reads compute: a virtual table, or generated columns."""
        if table in self.virtual:
            raise InputError(f"{self.path}: {table} is a virtual table, not an Nsight Systems export's")
        computed = [r[1] for r in self.q(f"PRAGMA table_xinfo({table})") if r[6] != 0]
        if computed:
            raise InputError(f"{self.path}: {table} has generated columns ({', '.join(computed[:4])}), "
                             "which no Nsight Systems export has; refused")

    def columns(self, table: str) -> set[str]:
        return {r[1] for r in self.q(f"PRAGMA table_info({table})")}

    def q(self, sql: str, args=()):
        try:
            return self.c.execute(sql, args)
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    def fetch(self, cur, n: int) -> list:
        try:
            return cur.fetchmany(n)
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    def count(self, table: str) -> int:
        return int(self.q(f"SELECT count(*) FROM {table}").fetchone()[0]) if table in self.tables else 0

    def rows(self, sql: str, n: int, width: int) -> np.ndarray:
        """Integer rows of a query as an (n, width) int64 array, fetched in blocks."""
        out = np.empty((n, width), dtype=np.int64)
        cur = self.q(sql)
        i = 0
        while i < n:
            block = self.fetch(cur, _FETCH_ROWS)
            if not block:
                break
            try:
                b = np.array(block, dtype=np.int64).reshape(-1, width)
            except (OverflowError, TypeError, ValueError):
                # our SQL makes every value an int64 or a default; this is a guard
                raise InputError(f"{self.path}: Nsight Systems export has a value outside int64") from None
            take = min(len(b), n - i)
            out[i:i + take] = b[:take]
            i += take
        return out[:i]


class _Strings:
    """StringIds ids -> our name ids, fetching only the strings used, cut in length."""

    def __init__(self, db: _Db, names: NameTable):
        self.db, self.names = db, names
        self.has = "StringIds" in db.tables

    def ids(self, sids: np.ndarray, clean=None) -> np.ndarray:
        out = np.full(len(sids), MISSING, dtype=np.int32)
        if not len(sids) or not self.has:
            return out
        uniq, inv = np.unique(sids, return_inverse=True)
        lut = np.full(len(uniq), MISSING, dtype=np.int32)
        pos = {int(u): i for i, u in enumerate(uniq.tolist())}
        want = [u for u in pos if u >= 0]
        for k in range(0, len(want), 500):
            part = want[k:k + 500]
            sql = (f"SELECT id, substr(value, 1, {MAX_NAME_CHARS}) FROM StringIds "
                   f"WHERE id IN ({','.join('?' * len(part))})")
            for sid, text in self.db.q(sql, part):
                if isinstance(text, str):
                    lut[pos[int(sid)]] = self.names.intern(clean(text) if clean else text)
        return lut[inv]


def _kernels(db: _Db, strings: _Strings, n: int) -> np.ndarray:
    t = "CUPTI_ACTIVITY_KIND_KERNEL"
    cols = db.columns(t)
    name_col = "demangledName" if "demangledName" in cols else "shortName"
    want = [("start_ns", _int("start", _BAD_TIME)), ("end_ns", _int("end", _BAD_TIME)),
            ("device", _int("deviceId")), ("stream", _int("streamId")), ("context", _int("contextId")),
            ("correlation_id", _int("correlationId")),
            ("grid_x", _int("gridX")), ("grid_y", _int("gridY")), ("grid_z", _int("gridZ")),
            ("block_x", _int("blockX")), ("block_y", _int("blockY")), ("block_z", _int("blockZ")),
            ("registers", _int("registersPerThread")),
            # two columns, summed below: their sum in SQL leaves int64 as a REAL (issue 18.7)
            ("shared_static", _int("staticSharedMemory", 0)), ("shared_dynamic", _int("dynamicSharedMemory", 0)),
            ("graph_node_id", _int("graphNodeId") if "graphNodeId" in cols else str(MISSING)),
            ("name", _int(name_col))]
    a = db.rows(f"SELECT {', '.join(sql for _, sql in want)} FROM {t} ORDER BY start", n, len(want))
    out = empty(KERNEL_DTYPE, len(a))
    at = {col: j for j, (col, _) in enumerate(want)}
    for col, j in at.items():
        if col in KERNEL_DTYPE.names and col != "name":
            out[col] = _fit(a[:, j], KERNEL_DTYPE[col])
    static, dynamic = a[:, at["shared_static"]], a[:, at["shared_dynamic"]]
    ok = (static >= 0) & (dynamic >= 0) & (static <= _INT32[1]) & (dynamic <= _INT32[1] - static)
    out["shared_mem_bytes"] = np.where(ok, static + np.where(ok, dynamic, 0), MISSING)
    out["name_id"] = strings.ids(a[:, -1])
    return out


def _fit(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """int64 values for a column of ``dtype``: those an int32 cannot hold become MISSING
    (a cast would wrap them into plausible sizes)."""
    if dtype == np.int32:
        return np.where((values >= _INT32[0]) & (values <= _INT32[1]), values, MISSING)
    return values


def _copies(db: _Db, strings: _Strings, n_memcpy: int, n_memset: int) -> np.ndarray:
    parts = []
    for t, n, kind in (("CUPTI_ACTIVITY_KIND_MEMCPY", n_memcpy, COPY_KIND_MEMCPY),
                       ("CUPTI_ACTIVITY_KIND_MEMSET", n_memset, COPY_KIND_MEMSET)):
        if not n:
            continue
        cols = db.columns(t)
        direction = _int("copyKind", 0) if "copyKind" in cols else "0"
        want = [_int("start", _BAD_TIME), _int("end", _BAD_TIME), _int("deviceId"), _int("streamId"),
                _int("correlationId"), _int("bytes"), direction]
        a = db.rows(f"SELECT {', '.join(want)} FROM {t} ORDER BY start", n, len(want))
        out = empty(COPY_DTYPE, len(a))
        for j, col in enumerate(("start_ns", "end_ns", "device", "stream", "correlation_id", "bytes")):
            out[col] = a[:, j]
        out["kind"] = kind
        d = a[:, 6]
        d = np.where((d >= 0) & (d <= 10), d, COPY_UNKNOWN)
        for k, v in _UVM_COPY.items():
            d = np.where(a[:, 6] == k, v, d)
        out["direction"] = d if kind == COPY_KIND_MEMCPY else COPY_UNKNOWN
        out["name_id"] = strings.names.intern("Memset" if kind == COPY_KIND_MEMSET else "Memcpy")
        parts.append(out)
    return np.concatenate(parts) if parts else empty(COPY_DTYPE)


def _split_tid(gtid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ok = gtid >= 0
    pid = np.where(ok, (gtid >> 24) & 0xFFFFFF, MISSING)
    tid = np.where(ok, gtid & 0xFFFFFF, MISSING)
    return pid, tid


def _api(db: _Db, strings: _Strings, counts: dict) -> np.ndarray:
    parts = []
    for t, domain in (("CUPTI_ACTIVITY_KIND_RUNTIME", API_DOMAIN_RUNTIME),
                      ("CUPTI_ACTIVITY_KIND_DRIVER", API_DOMAIN_DRIVER)):
        n = counts.get(t, 0)
        if not n:
            continue
        want = [_int("start", _BAD_TIME), _int("end", _BAD_TIME), _int("globalTid"),
                _int("correlationId"), _int("nameId")]
        a = db.rows(f"SELECT {', '.join(want)} FROM {t} ORDER BY start", n, len(want))
        out = empty(API_DTYPE, len(a))
        out["start_ns"], out["end_ns"] = a[:, 0], a[:, 1]
        out["pid"], out["tid"] = _split_tid(a[:, 2])
        out["correlation_id"] = a[:, 3]
        out["domain"] = domain
        out["name_id"] = strings.ids(a[:, 4], clean=lambda s: _API_VERSION_SUFFIX.sub("", s))
        uniq, inv = np.unique(out["name_id"], return_inverse=True)
        cats = np.array([api_category(strings.names[int(i)]) if i >= 0 else 0 for i in uniq], dtype=np.uint8)
        out["category"] = cats[inv] if len(uniq) else 0
        parts.append(out)
    return np.concatenate(parts) if parts else empty(API_DTYPE)


def _ranges(db: _Db, strings: _Strings, n: int) -> np.ndarray:
    t = "NVTX_EVENTS"
    if not n:
        return empty(RANGE_DTYPE)
    cols = db.columns(t)
    types = ",".join(map(str, _NVTX_RANGE_TYPES))
    text_id = _int("textId") if "textId" in cols else str(MISSING)
    want = [_int("start", _BAD_TIME), _int("end", _BAD_TIME), _int("globalTid"), text_id, "rowid"]
    where = f"eventType IN ({types}) AND end IS NOT NULL"
    a = db.rows(f"SELECT {', '.join(want)} FROM {t} WHERE {where} ORDER BY start", n, len(want))
    out = empty(RANGE_DTYPE, len(a))
    out["start_ns"], out["end_ns"] = a[:, 0], a[:, 1]
    out["pid"], out["tid"] = _split_tid(a[:, 2])
    out["kind"] = RANGE_NVTX
    ids = strings.ids(a[:, 3])
    if "text" in cols:    # inline text where there is no textId
        need = np.flatnonzero(ids < 0)
        for k in range(0, len(need), 500):
            part = a[need[k:k + 500], 4].tolist()
            sql = (f"SELECT rowid, substr(text, 1, {MAX_NAME_CHARS}) FROM {t} "
                   f"WHERE rowid IN ({','.join('?' * len(part))})")
            got = {int(r): s for r, s in db.q(sql, part) if isinstance(s, str)}
            for i in need[k:k + 500].tolist():
                s = got.get(int(a[i, 4]))
                if s is not None:
                    ids[i] = strings.names.intern(s)
    out["name_id"] = ids
    return out


def _devices(db: _Db) -> list[Device]:
    if "TARGET_INFO_GPU" not in db.tables:
        return []
    cols = db.columns("TARGET_INFO_GPU")
    pick = [c for c in ("id", "name", "totalMemory", "smCount", "computeMajor", "computeMinor",
                        "memoryBandwidth", "clockRate", "busLocation", "chipName") if c in cols]
    if "id" not in pick:
        return []
    out = {}
    for row in db.q(f"SELECT {', '.join(pick)} FROM TARGET_INFO_GPU LIMIT 256"):
        r = dict(zip(pick, row))
        if type(r.get("id")) is not int or r["id"] in out:
            continue
        major, minor = r.get("computeMajor"), r.get("computeMinor")
        props = {k: v for k, v in r.items() if isinstance(v, (int, float)) or (isinstance(v, str) and len(v) < 256)}
        out[r["id"]] = Device(
            index=r["id"], name=str(r.get("name") or "")[:256],
            sm_count=r["smCount"] if type(r.get("smCount")) is int else MISSING,
            memory_total_bytes=r["totalMemory"] if type(r.get("totalMemory")) is int else MISSING,
            compute_capability=f"{major}.{minor}" if type(major) is int and type(minor) is int else "",
            properties=props)
    return [out[k] for k in sorted(out)]


def _meta(db: _Db, path: Path) -> dict:
    meta = {"source_path": str(path), "format": "nsys-sqlite"}
    for table in ("META_DATA_EXPORT", "EXPORT_META_DATA"):
        if table in db.tables and {"name", "value"} <= db.columns(table):
            for name, value in db.q(f"SELECT name, value FROM {table} WHERE name IN "
                                    "('EXPORT_SCHEMA_VERSION', 'EXPORT_PRODUCT_VERSION') LIMIT 4"):
                if isinstance(value, str) and len(value) < 64:
                    key = "nsys_export_schema" if name == "EXPORT_SCHEMA_VERSION" else "nsys_version"
                    meta[key] = value
    return meta


def load_trace(path: str | Path, budget=None) -> Trace:
    """Read an Nsight Systems SQLite export (see the module docstring)."""
    path = Path(path)
    db = _Db(path)
    try:
        activity = {"CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
                    "CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_DRIVER"}
        if not activity & db.tables:
            shown = ", ".join(sorted(db.tables)[:8]) or "none"
            raise InputError(f"{path}: an SQLite file without Nsight Systems CUDA tables "
                             f"(CUPTI_ACTIVITY_KIND_*; tables: {shown})")
        for t in sorted((activity | {"NVTX_EVENTS", "StringIds", "TARGET_INFO_GPU", "META_DATA_EXPORT",
                                     "EXPORT_META_DATA"}) & db.tables):
            db.check_plain(t)
        counts = {t: db.count(t) for t in activity}
        if "NVTX_EVENTS" in db.tables:
            types = ",".join(map(str, _NVTX_RANGE_TYPES))
            counts["NVTX_EVENTS"] = int(db.q(f"SELECT count(*) FROM NVTX_EVENTS WHERE eventType IN ({types}) "
                                             "AND end IS NOT NULL").fetchone()[0])
        if budget is not None:    # charged before a single row is fetched
            budget.charge("kernels", counts["CUPTI_ACTIVITY_KIND_KERNEL"])
            budget.charge("copies", counts["CUPTI_ACTIVITY_KIND_MEMCPY"] + counts["CUPTI_ACTIVITY_KIND_MEMSET"])
            budget.charge("api", counts["CUPTI_ACTIVITY_KIND_RUNTIME"] + counts["CUPTI_ACTIVITY_KIND_DRIVER"])
            budget.charge("ranges", counts.get("NVTX_EVENTS", 0))
        db.allow_rows(sum(counts.values()) + db.count("StringIds"))
        names = NameTable()
        strings = _Strings(db, names)
        kernels = (_kernels(db, strings, counts["CUPTI_ACTIVITY_KIND_KERNEL"])
                   if counts["CUPTI_ACTIVITY_KIND_KERNEL"] else empty(KERNEL_DTYPE))
        copies = _copies(db, strings, counts["CUPTI_ACTIVITY_KIND_MEMCPY"], counts["CUPTI_ACTIVITY_KIND_MEMSET"])
        api = _api(db, strings, counts)
        ranges = _ranges(db, strings, counts.get("NVTX_EVENTS", 0))
        trace = Trace(kernels=kernels, copies=copies, api=api, ranges=ranges, names=names,
                      devices=_devices(db), meta=_meta(db, path))
    finally:
        db.c.close()
    reject_invalid_times(trace)
    join_launch_threads(trace.api, trace.kernels, trace.copies)
    trace.meta["event_counts"] = {k: v for k, v in counts.items() if v}
    return trace.sorted()
