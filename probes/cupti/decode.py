"""Decode raw CUPTI record sections into the columnar event model, one injected process at a time.

No CUPTI, no sockets: input is what :func:`probes.cupti.protocol.parse_batch` returns,
output is :mod:`probes.events` arrays. Kernel and API sections, and the joins of
:meth:`ProcessDecoder.take`, go through one C pass each (:mod:`probes.cupti.decode_native`:
the numpy passes cost about 250 ns per kernel with its API and external-correlation
records, more than the agent's budget at 50k kernels/s); the numpy code here is their
reference (``ProcessDecoder(reference=True)``), which tests/test_cupti_decode_native.py
compares them with byte for byte. Other kinds (copies, markers, graph launches) are numpy. Each section is decoded right when its
message arrives (a section is one CUPTI buffer, a few MiB, so the column copies stay
in cache); joins across sections happen in :meth:`ProcessDecoder.take`.

Joins (by CUPTI correlation id, within one process):
* API record -> kernel/copy: launching thread (``tid``) and launch latency
  (kernel start - API call start, both on the CUPTI clock).
* EXTERNAL_CORRELATION -> kernel/API: ``external_id`` (the framework op id Kineto or
  Ridgeline pushed).
API and external-correlation records are kept for a while (bounded) because CUPTI
delivers per-thread API buffers and device kernel buffers independently; a kernel whose
API record has not arrived by the time it is handed on keeps ``tid == -1`` and is
counted in ``unjoined_kernels``.

Values are range-checked as they are decoded (:func:`valid_records`): a record whose
timestamps are zero, beyond the int64 nanosecond range, reversed or longer than
:data:`MAX_DURATION_NS`, whose device is not a plausible ordinal, or whose byte count
is absurd, is rejected and counted (``rejected_records`` and one ``rejected_<field>``
counter per reason), never turned into a negative duration or device -1.
Kernel names are demangled once per name when interned (:mod:`probes.cupti.demangle`, in
a bounded worker process); a name that cannot be demangled safely stays mangled and is
counted (``names_not_demangled``); after :data:`MAX_DEMANGLE_DEADLINES` names of one
process ran past the demangler's deadline, that process's names are no longer demangled
(``demangling_stopped``), so a hostile peer costs the agent a bounded time.
"""
from __future__ import annotations

import numpy as np

from ridgeline.probes.cupti import decode_native as N
from ridgeline.probes.cupti import layouts as L
from ridgeline.probes.cupti.demangle import demangle_many
from ridgeline.probes.cupti.protocol import MAX_CBID, MAX_DEVICE_ID, Batch, Hello
from ridgeline.probes.events import (
    API_DOMAIN_DRIVER,
    API_DOMAIN_RUNTIME,
    API_DTYPE,
    API_GRAPH_LAUNCH,
    API_LAUNCH,
    API_OTHER,
    COPY_DTYPE,
    COPY_KIND_MEMCPY,
    COPY_KIND_MEMSET,
    COPY_UNKNOWN,
    KERNEL_DTYPE,
    MISSING,
    RANGE_DTYPE,
    RANGE_NVTX,
    NameTable,
    Trace,
    empty,
)

_I8 = np.int64
_I4 = np.int32
#: kinds add_batch decodes with the native pass (decode_native), the rest with numpy
_NATIVE_KINDS = frozenset((L.KIND_CONCURRENT_KERNEL, L.KIND_KERNEL, L.KIND_RUNTIME, L.KIND_DRIVER,
                           L.KIND_INTERNAL_LAUNCH_API))

#: Timestamps are int64 ns in the event model; larger values would turn negative.
MAX_TIMESTAMP_NS = (1 << 63) - 1
#: Longest interval accepted for one kernel, copy or API call (a day: persistent kernels
#: run for hours; more is a broken or forged record and would swamp a window's sums).
MAX_DURATION_NS = 86_400 * 10**9
#: Largest byte count of one copy (256 TiB, beyond any device memory).
MAX_COPY_BYTES = 1 << 48
#: Memory one interned name is counted for beyond its characters (str and dict overhead).
NAME_OVERHEAD_BYTES = 64
#: Names of one process that may run past the demangler's deadline before its names are
#: no longer demangled (each costs the agent's poll up to two deadlines).
MAX_DEMANGLE_DEADLINES = 2


#: CPU timestamps (API calls, NVTX markers) checked against the agent's receive time
_CPU_CLOCK_KINDS = (L.KIND_RUNTIME, L.KIND_DRIVER, L.KIND_INTERNAL_LAUNCH_API, L.KIND_MARKER)
CPU_CLOCK_AHEAD_NS = 2_000_000_000       # a record is made before it is received; 2 s of slack
#: below this no CLOCK_REALTIME ns can be (2001-09-09): ticks of another source (Kineto's TSC);
#: older real timestamps are not judged (a buffer can be held back long, recordings replayed)
CPU_CLOCK_FLOOR_NS = 1_000_000_000_000_000_000


def check_native() -> None:
    """Raise decode_native.DecodeLibraryMissing unless the native passes can be used, built
    with this module's limits."""
    N.check((MAX_TIMESTAMP_NS, MAX_DURATION_NS, MAX_DEVICE_ID, MISSING, API_GRAPH_LAUNCH))


def valid_records(v: np.ndarray) -> tuple[np.ndarray | None, dict[str, int]]:
    """Which records of view ``v`` hold values in range.

    Returns ``(mask, rejected)``: ``mask`` is None when every record is fine (the
    common case: no copy), else a bool array; ``rejected`` counts failing records per
    field (a record failing two checks counts once under each).
    """
    names = v.dtype.names
    checks: list[tuple[str, np.ndarray]] = []
    if "start" in names:
        start, end = v["start"], v["end"]
        # unsigned arithmetic: start - 1 wraps for 0, end - start wraps for an end before the start
        checks.append(("timestamps", ((start - np.uint64(1)) >= np.uint64(MAX_TIMESTAMP_NS))
                       | (end > np.uint64(MAX_TIMESTAMP_NS)) | ((end - start) > np.uint64(MAX_DURATION_NS))))
    if "timestamp" in names:
        ts = v["timestamp"]
        checks.append(("timestamps", (ts == 0) | (ts > MAX_TIMESTAMP_NS)))
    if "device_id" in names:
        checks.append(("device", v["device_id"] > MAX_DEVICE_ID))
    if "bytes" in names:
        checks.append(("bytes", v["bytes"] > MAX_COPY_BYTES))
    bad = None
    rejected: dict[str, int] = {}
    for what, b in checks:
        n = int(np.count_nonzero(b))
        if n:
            rejected[what] = rejected.get(what, 0) + n
            bad = b if bad is None else (bad | b)
    return (None if bad is None else ~bad), rejected


def _nz(a: np.ndarray) -> np.ndarray:
    """CUPTI writes 0 for "no graph": the event model says -1 (as for ids past int64)."""
    out = a.astype(_I8)
    out[out <= 0] = MISSING
    return out


def _copy_span(v: np.ndarray, out: np.ndarray) -> None:
    """The fields a kernel row and a graph-launch row share: time span, device, stream,
    context (clamped to int32) and the launch correlation; no external id yet."""
    out["start_ns"] = v["start"]
    out["end_ns"] = v["end"]
    out["device"] = v["device_id"]
    out["stream"] = v["stream_id"]
    out["context"] = np.minimum(v["context_id"], np.iinfo(_I4).max)
    out["correlation_id"] = v["correlation_id"]
    out["external_id"] = MISSING


def decode_kernels(v: np.ndarray, name_ids: np.ndarray, pid: int, out: np.ndarray | None = None) -> np.ndarray:
    """Kernel records (any ``activity_kernelN_dtype`` view) -> KERNEL_DTYPE (into ``out`` if given)."""
    n = len(v)
    out = np.empty(n, KERNEL_DTYPE) if out is None else out
    _copy_span(v, out)
    for f in ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z"):
        out[f] = v[f]
    out["registers"] = v["registers_per_thread"]
    out["shared_mem_bytes"] = v["static_shared_memory"].astype(_I4) + v["dynamic_shared_memory"]
    out["name_id"] = name_ids
    out["graph_id"] = _nz(v["graph_id"])
    out["graph_node_id"] = _nz(v["graph_node_id"])
    out["pid"] = pid
    out["tid"] = MISSING
    return out


def decode_copies(v: np.ndarray, kind: int, pid: int, out: np.ndarray | None = None) -> np.ndarray:
    """MEMCPY or MEMSET records -> COPY_DTYPE (memcpy direction keeps CUPTI's numbering)."""
    n = len(v)
    out = np.empty(n, COPY_DTYPE) if out is None else out
    out["start_ns"] = v["start"]
    out["end_ns"] = v["end"]
    out["device"] = v["device_id"]
    out["stream"] = v["stream_id"]
    out["correlation_id"] = v["correlation_id"]
    if kind == L.KIND_MEMCPY:
        out["kind"] = COPY_KIND_MEMCPY
        out["direction"] = v["copy_kind"]
    else:
        out["kind"] = COPY_KIND_MEMSET
        out["direction"] = COPY_UNKNOWN
    out["bytes"] = v["bytes"]
    out["graph_id"] = _nz(v["graph_id"])
    out["pid"] = pid
    out["tid"] = MISSING
    out["name_id"] = MISSING
    return out


class ProcessDecoder:
    """Decoding state of one injected process: its name table, layouts, and join carry.

    ``names`` is the process's :class:`NameTable` (one source = one process); ids stay
    valid for the life of the decoder, across reconnections of the library.
    """

    def __init__(self, pid: int, max_carry: int = 1 << 18, max_open_markers: int = 1 << 16,
                 max_name_bytes: int = 8 << 20, reference: bool | None = None):
        self.pid = pid
        #: kernel and API sections and the joins through decode_native's one-pass C code;
        #: False: the numpy reference (``reference=True``, or decode_native.REFERENCE set)
        self.native = not (N.REFERENCE if reference is None else reference)
        if self.native:
            check_native()
        self._scratch = N.Scratch()
        self._counts = N.Counts()
        self.names = NameTable()
        #: local name id -> the mangled name CUPTI reported, for names that were demangled
        self.mangled: dict[int, str] = {}
        self._seen_raw: dict[str, int] = {}     # raw (mangled) name -> id: demangle once per name
        self.max_name_bytes = max_name_bytes
        self._name_bytes = 0
        self.hello: Hello | None = None
        self.cupti_version = 0
        self.layout_sources: dict[int, str] = {}
        self.records_by_kind: dict[int, int] = {}   # records received per CUPTI kind (decoded or not)
        self.max_carry = max_carry
        self.max_open_markers = max_open_markers
        self._ptrs = np.empty(0, np.uint64)       # sorted CUPTI name pointers
        self._ptr_ids = np.empty(0, _I4)
        self._cbid_cat: dict[int, np.ndarray] = {}
        self._cbid_name: dict[int, np.ndarray] = {}
        self._cbid_tables: dict[int, N.Table] = {}  # the same, for the native pass
        self._name_table = N.NO_TABLE               # _ptrs/_ptr_ids, for the native pass
        # decoded straight into growing arrays: one copy per record, not decode + concatenate
        self._kernels = _Grow(KERNEL_DTYPE)
        self._copies = _Grow(COPY_DTYPE)
        self._api = _Grow(API_DTYPE)
        self._ext = _Grow(_EXT_DTYPE)             # (correlation_id, external_id) pairs
        self._marker_starts: list[np.ndarray] = []
        self._marker_ends: list[np.ndarray] = []
        self._api_carry = empty(API_DTYPE)
        self._ext_carry = np.empty(0, _EXT_DTYPE)
        self._open = np.empty(0, _MARKER_START_DTYPE)
        self.counters = {"records": 0, "kernels": 0, "copies": 0, "api": 0, "ranges": 0,
                         "undecodable_records": 0, "unresolved_names": 0, "unjoined_kernels": 0,
                         "unmatched_marker_ends": 0, "open_markers_dropped": 0,
                         "rejected_records": 0, "rejected_timestamps": 0, "rejected_device": 0,
                         "rejected_bytes": 0, "rejected_sections": 0, "names_over_limit": 0,
                         "names_not_demangled": 0, "demangle_deadlines": 0, "demangling_stopped": 0,
                         "demangle_budget_spent": 0, "clock_disagreements": 0}
        #: what demangles this process's names: ``raw -> (shown, failed)`` like
        #: :func:`demangle_many` (None: that function). The probe sets one that charges the
        #: process's and its user's time budget (probes.cupti.peer_time_budget).
        self.demangler = None
        self.library_counters: dict[str, int] = {}
        self.devices: set[int] = set()
        self.mode = 0
        self.flags = 0

    # -- set-up from the library's HELLO ------------------------------------------------
    def set_hello(self, hello: Hello) -> None:
        self.hello = hello
        self.cupti_version = hello.cupti_version
        self.mode, self.flags = hello.mode, hello.flags
        for domain in (API_DOMAIN_RUNTIME, API_DOMAIN_DRIVER):
            # protocol.parse_hello refuses ids >= MAX_CBID; checked again here because
            # the table size comes from the peer
            entries = [(cb, cat, nm) for (d, cb), (cat, nm) in hello.cbids.items()
                       if d == domain and 0 <= cb < MAX_CBID]
            size = max((cb for cb, _, _ in entries), default=-1) + 1
            cat = np.full(max(size, 1), API_OTHER, np.uint8)
            nid = np.full(max(size, 1), MISSING, _I4)
            for cb, c, nm in entries:
                cat[cb] = c
                nid[cb] = self._intern_bounded(nm)
            self._cbid_cat[domain], self._cbid_name[domain] = cat, nid
            self._cbid_tables[domain] = N.Table(cat, nid)

    def _intern_bounded(self, s: str) -> int:
        """Intern ``s`` within the process's name budget (a HELLO is sent again on every
        takeover change, and each may name 4096 callbacks: without the budget a peer
        repeating HELLOs with new names grew the agent by 1 MiB each); MISSING past it."""
        i = self.names.lookup(s)
        if i != MISSING:
            return i
        if self._name_bytes + len(s) + NAME_OVERHEAD_BYTES > self.max_name_bytes:
            self.counters["names_over_limit"] += 1
            return MISSING
        self._name_bytes += len(s) + NAME_OVERHEAD_BYTES
        return self.names.intern(s)

    # -- names --------------------------------------------------------------------------
    def add_names(self, names: dict[int, str]) -> None:
        if not names:
            return
        keep = {}
        new: dict[str, list[int]] = {}          # raw name -> pointers that carry it
        for p, s in names.items():
            i = self._seen_raw.get(s)
            if i is not None:
                keep[p] = i
                continue
            if s not in new:
                if self._name_bytes + len(s) + NAME_OVERHEAD_BYTES > self.max_name_bytes:
                    self.counters["names_over_limit"] += 1
                    continue
                self._name_bytes += len(s) + NAME_OVERHEAD_BYTES
                new[s] = []
            new[s].append(p)
        if new:
            raw = list(new)
            if self.counters["demangling_stopped"]:
                shown = raw
                self.counters["names_not_demangled"] += sum(1 for r in raw if r.startswith("_Z"))
            else:
                shown, failed = (self.demangler or demangle_many)(raw)
                self.counters["names_not_demangled"] += (failed["too_long"] + failed["deadline"]
                                                         + failed.get("budget", 0))
                self.counters["demangle_budget_spent"] += failed.get("budget", 0)
                self.counters["demangle_deadlines"] += failed["deadline"]
                if self.counters["demangle_deadlines"] >= MAX_DEMANGLE_DEADLINES:
                    self.counters["demangling_stopped"] = 1
            for s, d in zip(raw, shown):
                if d != s:
                    self._name_bytes += len(d) + NAME_OVERHEAD_BYTES     # the demangled spelling is held too
                i = self._seen_raw[s] = self.names.intern(d)
                if d != s:
                    self.mangled[i] = s
                for p in new[s]:
                    keep[p] = i
        if not keep:
            return
        ptrs = np.fromiter(keep.keys(), np.uint64, len(keep))
        ids = np.fromiter(keep.values(), _I4, len(keep))
        allp = np.concatenate([self._ptrs, ptrs])
        alli = np.concatenate([self._ptr_ids, ids])
        # a pointer sent again (after a reconnect) keeps its newest string
        order = np.argsort(allp, kind="stable")
        allp, alli = allp[order], alli[order]
        last = np.ones(len(allp), bool)
        last[:-1] = allp[1:] != allp[:-1]
        self._ptrs, self._ptr_ids = allp[last], alli[last]

    def name_ids(self, ptrs: np.ndarray) -> np.ndarray:
        """Name ids for raw CUPTI pointers; MISSING for NULL or never-sent pointers."""
        p = ptrs.astype(np.uint64, copy=False)
        if len(self._ptrs) == 0:
            out = np.full(len(p), MISSING, _I4)
        else:
            pos = np.searchsorted(self._ptrs, p)
            pos[pos == len(self._ptrs)] = 0
            hit = self._ptrs[pos] == p
            out = np.where(hit, self._ptr_ids[pos], MISSING).astype(_I4)
        bad = (out == MISSING) & (p != 0)
        if bad.any():
            self.counters["unresolved_names"] += int(bad.sum())
        return out

    # -- one message --------------------------------------------------------------------
    def add_batch(self, batch: Batch, received_ns: int | None = None) -> int:
        """Decode one BATCH message; returns the records decoded.

        ``received_ns`` (CLOCK_REALTIME when the agent took the message): API and marker
        records carry CPU timestamps taken in the served process on the same host clock,
        before the agent received them; one later than ``received_ns`` + CPU_CLOCK_AHEAD_NS
        or below CPU_CLOCK_FLOOR_NS is on another clock (a timestamp source such as
        Kineto's TSC ticks): rejected, counted in ``clock_disagreements``, never published."""
        # the header's fields as Python ints at once (field by field cost a microsecond each)
        h = dict(zip(batch.header.dtype.names, batch.header.item()))
        self.cupti_version = h["cupti_version"] or self.cupti_version
        self.mode, self.flags = h["mode"], h["flags"]
        self.library_counters = {k: h[k] for k in
                                 ("dropped_cupti", "dropped_pool_full", "dropped_no_agent", "dropped_send",
                                  "sampled_out", "names_dropped", "walk_errors")}
        self.devices.update(d for d in h["device_ids"][:h["n_devices"]].tolist() if d <= MAX_DEVICE_ID)
        self.add_names(batch.names)
        n_done = 0
        for kind, count, reason in batch.rejected:
            self.counters["rejected_sections"] += 1
            self.counters["undecodable_records"] += count
            self.layout_sources[kind] = reason
        for s in batch.sections:
            self.records_by_kind[s.kind] = self.records_by_kind.get(s.kind, 0) + s.count
            dtype, source = L.layout_for(s.kind, s.record_size, self.cupti_version)
            if dtype is None:
                self.counters["undecodable_records"] += s.count
                self.layout_sources[s.kind] = source
                continue
            self.layout_sources[s.kind] = source
            # (a section whose bytes fall short of its count is left to numpy, which refuses it)
            if self.native and s.kind in _NATIVE_KINDS and memoryview(s.data).nbytes >= s.count * s.record_size:
                done = self._add_native(s, dtype, received_ns)
                if done is not None:
                    n_done += done
                    continue
            v = np.frombuffer(s.data, dtype, s.count)
            ok, rejected = valid_records(v)
            if ok is not None:
                v = v[ok]
                self.counters["rejected_records"] += s.count - len(v)
                for what, n in rejected.items():
                    self.counters[f"rejected_{what}"] += n
            if received_ns is not None and s.kind in _CPU_CLOCK_KINDS and len(v):
                ts = v["timestamp"] if s.kind == L.KIND_MARKER else v["start"]
                bad = (ts > np.uint64(received_ns + CPU_CLOCK_AHEAD_NS)) | (ts < np.uint64(CPU_CLOCK_FLOOR_NS))
                nbad = int(np.count_nonzero(bad))
                if nbad:
                    v = v[~bad]
                    self.counters["clock_disagreements"] += nbad
                    self.counters["rejected_records"] += nbad
            n_done += len(v)
            if s.kind in (L.KIND_CONCURRENT_KERNEL, L.KIND_KERNEL):
                decode_kernels(v, self.name_ids(v["name"]), self.pid, self._kernels.reserve(len(v)))
            elif s.kind in (L.KIND_MEMCPY, L.KIND_MEMSET):
                decode_copies(v, s.kind, self.pid, self._copies.reserve(len(v)))
            elif s.kind in (L.KIND_RUNTIME, L.KIND_DRIVER, L.KIND_INTERNAL_LAUNCH_API):
                self._decode_api(v, s.kind, self._api.reserve(len(v)))
            elif s.kind == L.KIND_EXTERNAL_CORRELATION:
                e = self._ext.reserve(len(v))
                e["correlation_id"] = v["correlation_id"]
                e["external_id"] = v["external_id"]
            elif s.kind == L.KIND_MARKER:
                self._decode_markers(v)
            elif s.kind == L.KIND_GRAPH_TRACE:
                self._decode_graph_launches(v, self._kernels.reserve(len(v)))
            else:
                n_done -= len(v)    # MARKER_DATA, GRAPH_TRACE: carried, not modelled yet
                self.counters["undecodable_records"] += len(v)
        self.counters["records"] += n_done
        return n_done

    def _add_native(self, s, dtype: np.dtype, received_ns: int | None) -> int | None:
        """A kernel or API section through the native pass (decode_native): the range checks,
        the CPU clock check and the decode of add_batch's numpy path, in one pass, with the
        same counters; None when the section's layout does not fit that pass (numpy then)."""
        counts = self._counts
        if s.kind in (L.KIND_CONCURRENT_KERNEL, L.KIND_KERNEL):
            offs = N.kernel_offsets(dtype)
            if offs is None:
                return None
            out = self._kernels.reserve(s.count)
            if self._name_table.keys is not self._ptrs:
                self._name_table = N.Table(self._ptrs, self._ptr_ids)
            n = N.decode_kernels(s.data, s.count, s.record_size, offs, out, self._name_table, self.pid, counts)
            self._kernels.unreserve(s.count - n)
            bad_ts, bad_dev, unresolved = counts.read()
            self.counters["rejected_timestamps"] += bad_ts
            self.counters["rejected_device"] += bad_dev
            self.counters["unresolved_names"] += unresolved
        else:
            offs = N.api_offsets(dtype)
            if offs is None:
                return None
            domain = API_DOMAIN_DRIVER if s.kind == L.KIND_DRIVER else API_DOMAIN_RUNTIME
            out = self._api.reserve(s.count)
            n = N.decode_api(s.data, s.count, s.record_size, offs, out, self.pid, domain,
                             self._cbid_tables.get(domain, N.NO_TABLE), received_ns, CPU_CLOCK_FLOOR_NS,
                             0 if received_ns is None else received_ns + CPU_CLOCK_AHEAD_NS, counts)
            self._api.unreserve(s.count - n)
            bad_ts, bad_clock, _ = counts.read()
            self.counters["rejected_timestamps"] += bad_ts
            self.counters["clock_disagreements"] += bad_clock
        self.counters["rejected_records"] += s.count - n
        return n

    def _decode_graph_launches(self, v: np.ndarray, out: np.ndarray) -> None:
        """Graph-level mode: each graph launch becomes one row of the kernel table, named
        ``CUDA graph <id>``, spanning the whole replay on its stream (no node id, no grid),
        so GPU busy time, streams and the launch join hold as in node mode."""
        gids = v["graph_id"].astype(_I8)
        uniq, inv = np.unique(gids, return_inverse=True)
        ids = np.array([self.names.intern(f"CUDA graph {int(g)}") for g in uniq], _I4)
        _copy_span(v, out)
        for f in ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "registers", "shared_mem_bytes"):
            out[f] = 0
        out["name_id"] = ids[inv.reshape(-1)] if len(ids) else MISSING
        out["graph_id"] = _nz(v["graph_id"])
        out["graph_node_id"] = MISSING
        out["pid"] = self.pid
        out["tid"] = MISSING

    def _decode_api(self, v: np.ndarray, kind: int, out: np.ndarray) -> np.ndarray:
        domain = API_DOMAIN_DRIVER if kind == L.KIND_DRIVER else API_DOMAIN_RUNTIME
        out["start_ns"] = v["start"]
        out["end_ns"] = v["end"]
        out["pid"] = self.pid
        out["tid"] = v["thread_id"]
        out["correlation_id"] = v["correlation_id"]
        out["external_id"] = MISSING
        cb = v["cbid"].astype(np.int64)
        out["cbid"] = cb
        out["domain"] = domain
        cat = self._cbid_cat.get(domain)
        if cat is None:
            out["category"] = API_OTHER
            out["name_id"] = MISSING
        else:
            inside = cb < len(cat)
            idx = np.where(inside, cb, 0)
            out["category"] = np.where(inside, cat[idx], API_OTHER)
            out["name_id"] = np.where(inside, self._cbid_name[domain][idx], MISSING)
        return out

    def _decode_markers(self, v: np.ndarray) -> None:
        flags = v["flags_"]
        oid = v["object_id"]
        pt = oid["pt"] if "pt" in (oid.dtype.names or ()) else oid
        is_thread = v["object_kind"] == L.MARKER_OBJECT_THREAD
        starts = (flags & (L.MARKER_FLAG_START | L.MARKER_FLAG_INSTANTANEOUS)) != 0
        if starts.any():
            s = v[starts]
            st = np.empty(len(s), _MARKER_START_DTYPE)
            st["id"] = s["id"]
            st["start_ns"] = s["timestamp"]
            st["name_id"] = self.name_ids(s["name"])
            st["tid"] = np.where(is_thread[starts], pt["thread_id"][starts], MISSING)
            st["instant"] = (s["flags_"] & L.MARKER_FLAG_INSTANTANEOUS) != 0
            self._marker_starts.append(st)
        ends = (flags & L.MARKER_FLAG_END) != 0
        if ends.any():
            e = np.empty(int(ends.sum()), _MARKER_END_DTYPE)
            e["id"] = v["id"][ends]
            e["end_ns"] = v["timestamp"][ends]
            self._marker_ends.append(e)

    # -- hand-off ------------------------------------------------------------------------
    def pending(self) -> bool:
        return bool(self._kernels.n or self._copies.n or self._api.n or self._marker_starts or self._marker_ends)

    def take(self) -> tuple[Trace, np.ndarray]:
        """Everything decoded since the last call, joined: ``(trace, launch_latency_ns)``.

        ``launch_latency_ns`` is aligned with ``trace.kernels`` (-1 where no API record
        matched). The trace's ``names`` is this process's table (shared, append-only).
        """
        kernels, copies, api_new, ext_new = (self._kernels.take(), self._copies.take(), self._api.take(),
                                             self._ext.take())
        if self.native:
            ext_all = np.concatenate([self._ext_carry, ext_new]) if len(self._ext_carry) else ext_new
            api_all = np.concatenate([self._api_carry, api_new]) if len(self._api_carry) else api_new
            latency, api_used, ext_used, graph, unjoined, n_graph = N.join(kernels, copies, api_new, api_all,
                                                                           ext_all, self._scratch)
            if api_all is not api_new and len(api_new):
                # the reference joins api_new before concatenating: the carry keeps the same ids
                api_all[len(self._api_carry):]["external_id"] = api_new["external_id"]
            if n_graph > 1:
                latency[_later_graph_nodes(kernels, None, graph)] = MISSING
            self.counters["unjoined_kernels"] += unjoined
            return self._finish(kernels, copies, api_new, api_all, api_used, ext_all, ext_used, latency)

        ext_all = np.concatenate([self._ext_carry, ext_new]) if len(self._ext_carry) else ext_new
        ext_used = np.zeros(len(ext_all), bool)
        if len(ext_all):
            index = _Index(ext_all["correlation_id"])
            for arr in (kernels, api_new):
                if len(arr):
                    pos, hit = index.find(arr["correlation_id"])
                    arr["external_id"] = np.where(hit, ext_all["external_id"][pos], MISSING)
                    if arr is not api_new:
                        ext_used[pos[hit]] = True
        api_all = np.concatenate([self._api_carry, api_new]) if len(self._api_carry) else api_new
        api_used = np.zeros(len(api_all), bool)
        latency = np.full(len(kernels), MISSING, _I8)
        if len(api_all) and (len(kernels) or len(copies)):
            index = _Index(api_all["correlation_id"])
            if len(kernels):
                pos, hit = index.find(kernels["correlation_id"])
                kernels["tid"] = np.where(hit, api_all["tid"][pos], MISSING)
                latency = np.where(hit, kernels["start_ns"] - api_all["start_ns"][pos], MISSING)
                latency[_later_graph_nodes(kernels, api_all["category"][pos], hit)] = MISSING
                api_used[pos[hit]] = True
            if len(copies):
                pos, hit = index.find(copies["correlation_id"])
                copies["tid"] = np.where(hit, api_all["tid"][pos], MISSING)
                api_used[pos[hit]] = True
        if len(kernels):
            self.counters["unjoined_kernels"] += int((kernels["tid"] == MISSING).sum())
        return self._finish(kernels, copies, api_new, api_all, api_used, ext_all, ext_used, latency)

    def _finish(self, kernels, copies, api_new, api_all, api_used, ext_all, ext_used, latency):
        """The rest of take() once joined: the carries, markers, counters and the Trace."""
        # Only launch records still waiting for their kernel are worth keeping (a kernel
        # buffer may arrive after its thread's API buffer); the rest is done with.
        waiting = ~api_used & ((api_all["category"] == API_LAUNCH) | (api_all["category"] == API_GRAPH_LAUNCH))
        self._api_carry = api_all[waiting][-self.max_carry:]
        self._ext_carry = ext_all[~ext_used][-self.max_carry:]
        ranges = self._pair_markers()
        self.counters["kernels"] += len(kernels)
        self.counters["copies"] += len(copies)
        self.counters["api"] += len(api_new)
        self.counters["ranges"] += len(ranges)
        meta = {"source": "cupti", "pid": self.pid, "cupti_version": self.cupti_version,
                "mode": self.mode, "flags": self.flags, "layouts": dict(self.layout_sources),
                "records_by_kind": dict(self.records_by_kind),
                "library_counters": dict(self.library_counters), "devices": sorted(self.devices)}
        if self.hello is not None:
            meta["comm"] = self.hello.comm
        meta["mangled_names"] = self.mangled
        return Trace(kernels=kernels, copies=copies, api=api_new, ranges=ranges, names=self.names,
                     meta=meta), latency

    def _pair_markers(self) -> np.ndarray:
        starts = np.concatenate([self._open, *self._marker_starts]) if self._marker_starts else self._open
        ends = np.concatenate(self._marker_ends) if self._marker_ends else np.empty(0, _MARKER_END_DTYPE)
        self._marker_starts, self._marker_ends = [], []
        inst = starts["instant"]
        pairs = starts[~inst]
        out_parts = []
        if inst.any():
            i = starts[inst]
            out_parts.append((i["start_ns"], i["start_ns"], i["tid"], i["name_id"]))
        matched_start = np.zeros(len(pairs), bool)
        if len(ends) and len(pairs):
            order = np.argsort(pairs["id"], kind="stable")
            sid = pairs["id"][order]
            pos, hit = _match(sid, ends["id"])
            m = order[pos[hit]]
            matched_start[m] = True
            out_parts.append((pairs["start_ns"][m], ends["end_ns"][hit], pairs["tid"][m], pairs["name_id"][m]))
            self.counters["unmatched_marker_ends"] += int((~hit).sum())
        elif len(ends):
            self.counters["unmatched_marker_ends"] += len(ends)
        still_open = pairs[~matched_start]
        if len(still_open) > self.max_open_markers:
            self.counters["open_markers_dropped"] += len(still_open) - self.max_open_markers
            still_open = still_open[-self.max_open_markers:]
        self._open = still_open
        n = sum(len(p[0]) for p in out_parts)
        out = np.empty(n, RANGE_DTYPE)
        at = 0
        for s, e, tid, nid in out_parts:
            k = len(s)
            out["start_ns"][at:at + k] = s
            out["end_ns"][at:at + k] = e
            out["tid"][at:at + k] = tid
            out["name_id"][at:at + k] = nid
            at += k
        out["pid"] = self.pid
        out["device"] = MISSING
        out["kind"] = RANGE_NVTX
        out["external_id"] = MISSING
        return out[np.argsort(out["start_ns"], kind="stable")] if n else out


def _later_graph_nodes(kernels: np.ndarray, api_category: np.ndarray, hit: np.ndarray) -> np.ndarray:
    """Kernels joined to a graph launch that are not its first node (by start).

    Every node of a replay shares the cudaGraphLaunch's correlation id; only the first
    node's start minus the launch is a launch latency, the others are node offsets.
    ``api_category`` None: ``hit`` already says which kernels joined a graph launch.
    """
    graph = np.flatnonzero(hit if api_category is None else hit & (api_category == API_GRAPH_LAUNCH))
    out = np.zeros(len(kernels), bool)
    if len(graph) > 1:
        order = graph[np.lexsort((kernels["start_ns"][graph], kernels["correlation_id"][graph]))]
        corr = kernels["correlation_id"][order]
        out[order[1:][corr[1:] == corr[:-1]]] = True
    return out


_MARKER_START_DTYPE = np.dtype([("id", "<u4"), ("start_ns", _I8), ("name_id", _I4), ("tid", _I4), ("instant", "?")])
_MARKER_END_DTYPE = np.dtype([("id", "<u4"), ("end_ns", _I8)])


class _Index:
    """Positions of correlation ids, for joins; the last record of a repeated id wins.

    CUPTI correlation ids of one process come from one counter, so a batch's ids are
    nearly dense: a direct table (no sort) when the id range is at most 8x the count,
    a sorted search otherwise.
    """
    __slots__ = ("lo", "table", "keys", "order")

    def __init__(self, ids: np.ndarray):
        self.table = None
        lo, hi = int(ids.min()), int(ids.max())
        if hi - lo < 8 * len(ids) + 1024:
            self.lo = lo
            self.table = np.full(hi - lo + 1, -1, np.int64)
            self.table[ids - lo] = np.arange(len(ids))
        else:
            self.order = np.argsort(ids, kind="stable")
            self.keys = ids[self.order]

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(pos, hit)``: positions into the indexed array, and where there was a match."""
        if self.table is not None:
            rel = ids - self.lo
            ok = (rel >= 0) & (rel < len(self.table))
            pos = self.table[np.where(ok, rel, 0)]
            hit = ok & (pos >= 0)
            return np.where(hit, pos, 0), hit
        pos, hit = _match_last(self.keys, ids)
        return self.order[pos], hit


_EXT_DTYPE = np.dtype([("correlation_id", _I8), ("external_id", _I8)])


class _Grow:
    """An array that grows by doubling; :meth:`take` hands the filled part on and starts
    a new one sized for the same load (so a steady stream allocates once per poll)."""
    __slots__ = ("dtype", "arr", "n", "hint")

    def __init__(self, dtype: np.dtype):
        self.dtype, self.arr, self.n, self.hint = dtype, None, 0, 1024

    def reserve(self, k: int) -> np.ndarray:
        if self.arr is None:
            self.arr = np.empty(max(self.hint, k), self.dtype)
        elif self.n + k > len(self.arr):
            bigger = np.empty(max(2 * len(self.arr), self.n + k), self.dtype)
            bigger[:self.n] = self.arr[:self.n]
            self.arr = bigger
        out = self.arr[self.n:self.n + k]
        self.n += k
        return out

    def unreserve(self, k: int) -> None:
        """Give back the last ``k`` rows of the latest :meth:`reserve` (records a pass rejected)."""
        self.n -= k

    def take(self) -> np.ndarray:
        if self.arr is None:
            return empty(self.dtype) if "start_ns" in self.dtype.names else np.empty(0, self.dtype)
        out = self.arr[:self.n]
        self.hint = max(1024, self.n + self.n // 4)
        self.arr, self.n = None, 0
        return out


def _match(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    pos = np.searchsorted(sorted_keys, keys)
    pos[pos >= len(sorted_keys)] = 0
    hit = sorted_keys[pos] == keys if len(sorted_keys) else np.zeros(len(keys), bool)
    return pos, hit


def _match_last(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Like _match, but the last record of a repeated key wins."""
    pos = np.searchsorted(sorted_keys, keys, side="right") - 1
    ok = pos >= 0
    pos[~ok] = 0
    hit = ok & (sorted_keys[pos] == keys) if len(sorted_keys) else np.zeros(len(keys), bool)
    return pos, hit
