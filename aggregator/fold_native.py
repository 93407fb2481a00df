"""The native per-kernel pass of the per-phase fold: ``aggregator/native/libridgeline_fold.so``.

Built from ``aggregator/native/ridgeline_fold.c`` by the package build (setup.py) and, in a
source tree, by ``make -C aggregator/native`` (``scripts/setup.sh`` runs it), as the CUPTI
injection library is. Loaded once with ctypes. :func:`aggregator.phase_figures.fold_kernels`
calls it; its numpy twin in phase_figures.py (``reference=True``) is the reference the tests
compare it with, never a fallback. A live window's fold of a kernel stream takes the one-pass
entry points (:func:`fold_batch` through ``phase_figures.fold_records``, :func:`host_unions`,
:func:`ingest_pass`, :func:`carry_api_mask`, :func:`device_groups`: one pass over the packed
records each, arguments as raw addresses), whose references are the general native path and
the numpy twins. Without the library the fold raises
:class:`FoldLibraryMissing`, one line that says what to build (the agent says it once at
start and exits).
"""
from __future__ import annotations

import ctypes as ct
from functools import lru_cache
from pathlib import Path

import numpy as np

from ridgeline.probes import native_library
from ridgeline.probes.errors import RuntimeFailure

LIB_NAME = "libridgeline_fold.so"
_P = np.ctypeslib.ndpointer(dtype=np.int64, flags="C_CONTIGUOUS")
_U = np.ctypeslib.ndpointer(dtype=np.uint64, flags="C_CONTIGUOUS")
_B = np.ctypeslib.ndpointer(dtype=np.uint8, flags="C_CONTIGUOUS")
_V = ct.c_void_p
_I = ct.c_int64

#: What ridgeline_fold.c is built for: phase_figures.py's SUB_BITS, FINE_BINS and the
#: leading INT_FIELDS it writes, in this order (tests/test_fold_native.py checks they agree;
#: rl_fold_abi() returns the two constants and the count). A row's width is passed per call.
WRITTEN_FIELDS = ("kernels", "kernel_time_ns", "busy_ns", "steps", "window_ns", "window_busy_ns", "gaps",
                  "gap_ns", "gap_launch_ns", "gap_sync_ns", "launch_kernels", "launch_latency_ns")
LAYOUT = (3, 48 << 3, len(WRITTEN_FIELDS))

#: The tests set this (monkeypatch) to run every per-kernel pass through its numpy
#: reference instead (phase_figures.py, stream_phases.py), and compare the two.
REFERENCE = False


class FoldLibraryMissing(RuntimeFailure):
    """The native fold library is not built or cannot be loaded (the message says what to do)."""


_NATIVE_DIR = Path(__file__).resolve().parent / "native"


def library_path() -> Path:
    """The built library (``RIDGELINE_FOLD_LIB`` overrides)."""
    return native_library.path_of("RIDGELINE_FOLD_LIB", _NATIVE_DIR, LIB_NAME)


def _hint() -> str:
    return native_library.build_hint(_NATIVE_DIR)


@lru_cache(maxsize=1)
def library() -> ct.CDLL:
    """The loaded library, its layout checked against :data:`LAYOUT`."""
    path = library_path()
    lib = native_library.open_library(path, "fold", _hint(), FoldLibraryMissing)
    lib.rl_fold_abi.restype = _I
    lib.rl_fold_abi.argtypes = ()
    sub_bits, fine_bins, n_int = LAYOUT
    want = (sub_bits << 32) | (fine_bins << 8) | n_int
    if lib.rl_fold_abi() != want:
        raise FoldLibraryMissing(f"ridgeline: the native fold library {path} was built from another version "
                                 f"(layout {lib.rl_fold_abi():#x}, expected {want:#x}): {_hint()}")
    try:
        _declare(lib)
    except AttributeError as exc:     # a symbol this version calls is not in the library
        raise FoldLibraryMissing(f"ridgeline: the native fold library {path} was built from another version "
                                 f"({exc}): {_hint()}") from None
    return lib


def _declare(lib: ct.CDLL) -> None:
    """The argument and result types of each function the library exports."""
    lib.rl_fold_units.restype = _I
    lib.rl_fold_units.argtypes = (_I, _P, _P, _P, _P, ct.c_void_p, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P,
                                  ct.POINTER(_I))
    lib.rl_fold_rows.restype = None
    lib.rl_fold_rows.argtypes = (_I, _P, _P, _P, _I, _P, _P, _P, _P, _I, _P, _P, _P, _I, _P, _P, _I, _P, _P,
                                 _I, _P, _P)
    lib.rl_launch_latency_aligned.restype = _I
    lib.rl_launch_latency_aligned.argtypes = (_V, _I, _I, _I, _V, _I, _I, _I, _I, _B, _I, _P)
    lib.rl_gather_i64.restype = None
    lib.rl_gather_i64.argtypes = (_V, _I, _I, _I, _V, _P)
    lib.rl_range_i32.restype = None
    lib.rl_range_i32.argtypes = (_V, _I, _I, _I, _P)
    lib.rl_fold_batch.restype = _I
    lib.rl_fold_batch.argtypes = (_V, _I, _V, _I, _V, _V, _V, _V, _I, _V, _V, _I, _V, _V, _I, _I, _V, _V, _V, _V, _V,
                                  _V)
    lib.rl_host_unions.restype = _I
    lib.rl_host_unions.argtypes = (_V, _I, _I, _I, _I, _V, _I, _V, _V)
    lib.rl_union_sorted.restype = _I
    lib.rl_union_sorted.argtypes = (_P, _P, _I)
    lib.rl_ingest_pass.restype = _I
    lib.rl_ingest_pass.argtypes = (_V, _I, _V, _I, _V, _I, _V, _I, _V, _V, _V, _V, _V)
    lib.rl_segment_scan.restype = _I
    lib.rl_segment_scan.argtypes = (_V, _I, _P, _I, _V, _B, _I, _I, _P, _P, _P, _P)
    lib.rl_carry_api_mask.restype = _I
    lib.rl_carry_api_mask.argtypes = (_V, _I, _I, _I, _I, _I, _V, _I, _V)


def _off(a: np.ndarray, field: str) -> int:
    return a.dtype.fields[field][1]


def check() -> None:
    """Raise :class:`FoldLibraryMissing` now if the library cannot be used (for a caller that
    wants to say so once, at start, rather than at the first fold)."""
    library()


def fold_units(s, e, ph, stp, gk, gk0: int):
    """Units, merged runs and gaps of kernels in (group, step, start) order (see
    ridgeline_fold.c, ``rl_fold_units``): (first, start, end, busy, kernel_time, ukey,
    gap_start, gap_len, gap_unit)."""
    lib = library()
    n = len(s)
    u = np.empty((6, n), np.int64)
    g = np.empty((3, n), np.int64)
    ngaps = _I(0)
    nu = lib.rl_fold_units(n, s, e, ph, stp, gk.ctypes.data if gk is not None else None, int(gk0),
                           u[0], u[1], u[2], u[3], u[4], u[5], g[0], g[1], g[2], ct.byref(ngaps))
    m = ngaps.value
    return (u[0, :nu], u[1, :nu], u[2, :nu], u[3, :nu], u[4, :nu], u[5, :nu], g[0, :m], g[1, :m], g[2, :m])


def fold_rows(add, hist, s, e, lat, first, u_busy, u_kt, u_row, gap_start, gap_len, gap_unit, host) -> None:
    """Add each row's integer sums and histograms into ``add`` (rows x INT_FIELDS, the first
    :data:`WRITTEN_FIELDS` written) and
    ``hist`` (rows x 3 x FINE_BINS), both int64 C-contiguous (``rl_fold_rows``)."""
    lib = library()
    e0 = np.empty(0, np.int64)
    (hl_s, hl_e), (hs_s, hs_e) = host if host is not None else ((e0, e0), (e0, e0))
    c = np.ascontiguousarray
    lib.rl_fold_rows(len(s), s, e, lat, len(first), c(first), c(u_busy), c(u_kt), c(u_row, np.int64),
                     len(gap_len), c(gap_start), c(gap_len), c(gap_unit),
                     len(hl_s), c(hl_s, np.int64), c(hl_e, np.int64), len(hs_s), c(hs_s, np.int64), c(hs_e, np.int64),
                     add.shape[1], add, hist)


def launch_latency_aligned(k: np.ndarray, a: np.ndarray, launch: np.ndarray, lat: np.ndarray) -> bool:
    """Launch latency when every record is a launch (``launch``: bool per category) and
    record i is kernel i's (same correlation ids, in order), written into ``lat``; False
    (``lat`` untouched) otherwise (``rl_launch_latency_aligned``)."""
    if len(k) != len(a) or not len(k):
        return False
    return bool(library().rl_launch_latency_aligned(
        k.ctypes.data, k.strides[0], _off(k, "start_ns"), _off(k, "correlation_id"),
        a.ctypes.data, a.strides[0], _off(a, "start_ns"), _off(a, "correlation_id"), _off(a, "category"),
        launch.view(np.uint8), len(k), lat))


def gather(records: np.ndarray, field: str, idx: np.ndarray | None = None) -> np.ndarray:
    """``records[field][idx]`` (an int64 field; ``idx`` None: every record) as a new
    contiguous array, in one pass (``rl_gather_i64``)."""
    n = len(records) if idx is None else len(idx)
    out = np.empty(n, np.int64)
    if n:
        i = np.ascontiguousarray(idx, np.int64) if idx is not None else None
        library().rl_gather_i64(records.ctypes.data, records.strides[0], _off(records, field), n,
                                i.ctypes.data if i is not None else None, out)
    return out


def field_range(records: np.ndarray, field: str) -> tuple[int, int]:
    """(min, max) of an int32 field over the records (at least one), in one pass (``rl_range_i32``)."""
    out = np.empty(2, np.int64)
    library().rl_range_i32(records.ctypes.data, records.strides[0], _off(records, field), len(records), out)
    return int(out[0]), int(out[1])


def host_unions(a: np.ndarray, kind: np.ndarray):
    """(launch (starts, ends), sync (starts, ends)): the sorted disjoint intervals of the
    records whose category ``kind`` (uint8 per category: 1 launch, 2 sync) selects, in one
    pass (``rl_host_unions``). A kind whose records are not in start order (calls of several
    threads, or runs of them one after another) comes back as its pairs, partly merged; they
    are sorted once (a stable sort, which finds the runs already in order) and merged
    (``rl_union_sorted``). The intervals of a kind in order are views of one array (a
    kernel stream's launches rarely merge, so a copy of the part used would save little)."""
    lib = library()
    n = len(a)
    ws = np.empty((4, n), np.int64)
    out = np.zeros(2, np.int64)
    ordered = lib.rl_host_unions(a.ctypes.data, a.strides[0], _off(a, "start_ns"), _off(a, "end_ns"),
                                 _off(a, "category"), kind.ctypes.data, n, ws.ctypes.data, out.ctypes.data)
    both = []
    for k, m in enumerate(out.tolist()):
        s, e = ws[2 * k, :m], ws[2 * k + 1, :m]
        if not ordered >> k & 1:
            o = np.argsort(s, kind="stable")
            s, e = s[o], e[o]
            m = lib.rl_union_sorted(s, e, m)
            s, e = s[:m], e[:m]
        both.append((s, e))
    return both[0], both[1]


def carry_api_mask(a: np.ndarray, t0: int, held_corr: np.ndarray) -> np.ndarray:
    """Per API record: it ends at or after ``t0`` or its correlation id is one of
    ``held_corr`` (any order, repeats allowed), in one pass over the records
    (``rl_carry_api_mask``); the reference, ``(a["end_ns"] >= t0) | np.isin(a["correlation_id"],
    held_corr)``, is what SourceFold._carry_records computes under :data:`REFERENCE`."""
    n = len(a)
    mask = np.empty(n, np.bool_)
    if n:
        held = np.sort(np.asarray(held_corr, np.int64))      # the few held kernels' ids
        library().rl_carry_api_mask(a.ctypes.data, a.strides[0], _off(a, "end_ns"), _off(a, "correlation_id"), n,
                                    int(t0), held.ctypes.data, len(held), mask.ctypes.data)
    return mask


_SEG_FIELDS = ("start_ns", "end_ns", "name_id", "grid_x", "graph_id", "correlation_id")


def segment_scan(k: np.ndarray, idx: np.ndarray | None, flags: np.ndarray, by_name: bool):
    """The per-kernel pass of one device's step cut (``rl_segment_scan``; reference:
    aggregator/steps.py ``_scan_reference``) over ``k[idx]`` (``idx`` None: every record),
    or None when their starts are not in order. ``flags``: uint8 SEG_* bits per name slot
    (``by_name``) or per record. Returns (gaps, attention positions, their name ids,
    strong per-token positions, their grid.x, layer positions, sampling positions,
    optimizer positions, graph-launch positions, their graph ids)."""
    m = len(k) if idx is None else len(idx)
    gaps = np.empty(max(m, 1), np.int64)
    pos = np.empty((6, max(m, 1)), np.int64)
    val = np.empty((3, max(m, 1)), np.int64)
    cnt = np.zeros(6, np.int64)
    offs = np.array([_off(k, f) for f in _SEG_FIELDS], np.int64)
    i = np.ascontiguousarray(idx, np.int64) if idx is not None else None
    if not library().rl_segment_scan(k.ctypes.data, k.strides[0], offs, m, i.ctypes.data if i is not None else None,
                                     np.ascontiguousarray(flags, np.uint8), len(flags), int(by_name),
                                     gaps, pos, val, cnt):
        return None
    na, nt, nl, ne, no, ng = cnt.tolist()
    return (gaps[:max(m - 1, 0)], pos[0, :na], val[0, :na], pos[1, :nt], val[1, :nt], pos[2, :nl], pos[3, :ne],
            pos[4, :no], pos[5, :ng], val[2, :ng])


_BATCH_FIELDS = ("start_ns", "end_ns", "device", "pid")
#: Rows (distinct group key and phase) the one-pass fold takes first: one GPU and process
#: has at most 8; a fold with more is passed again with room for BATCH_ROWS_MAX.
BATCH_ROWS = 8
BATCH_ROWS_MAX = 512
_E0 = np.zeros(1, np.int64)


@lru_cache(maxsize=16)
def _batch_offsets(dtype: np.dtype) -> np.ndarray:
    return np.array([dtype.fields[f][1] for f in _BATCH_FIELDS], np.int64)


def _addr(a: np.ndarray) -> int:
    return a.ctypes.data


def fold_batch(k: np.ndarray, order: np.ndarray | None, phase: np.ndarray, kstep: np.ndarray, lat: np.ndarray,
               host, nf: int, fine_bins: int):
    """``rl_fold_batch``: the units, gaps and per-row sums of the kernels ``k[order]`` (in
    (step, start) order; ``phase`` uint8, ``kstep`` and ``lat`` int64 per record) in one pass
    over the records, arguments passed as raw addresses (no per-argument conversion). Returns
    (units: first, start, end, busy, kernel time, key, step, group key, kernels, row as 10
    rows of one array; gap lengths; gap units; row keys; add (rows x nf); hist (rows x 3 x
    fine_bins); the gaps' log2 histogram per row (rows x 64)), or None when the kernels hold
    more than BATCH_ROWS_MAX rows."""
    lib = library()
    n = len(order) if order is not None else len(k)
    o = np.ascontiguousarray(order, np.int64) if order is not None else None
    ph = np.ascontiguousarray(phase, np.uint8)
    st = np.ascontiguousarray(kstep, np.int64)
    la = np.ascontiguousarray(lat, np.int64)
    (hl_s, hl_e), (hs_s, hs_e) = host if host is not None else ((_E0[:0], _E0[:0]), (_E0[:0], _E0[:0]))
    hl_s, hl_e, hs_s, hs_e = (np.ascontiguousarray(x, np.int64) for x in (hl_s, hl_e, hs_s, hs_e))
    ws = np.empty((12, max(n, 1)), np.int64)
    out = np.zeros(3, np.int64)
    offs = _batch_offsets(k.dtype)
    for rows in (BATCH_ROWS, BATCH_ROWS_MAX):
        row_key = np.empty(rows, np.int64)
        add = np.zeros((rows, nf), np.int64)
        hist = np.zeros((rows, 3, fine_bins), np.int64)
        gap_log2 = np.zeros((rows, 64), np.int64)
        if lib.rl_fold_batch(k.ctypes.data, k.strides[0] if k.ndim else 0, offs.ctypes.data, n,
                             o.ctypes.data if o is not None else None, ph.ctypes.data, st.ctypes.data, la.ctypes.data,
                             len(hl_s), _addr(hl_s), _addr(hl_e), len(hs_s), _addr(hs_s), _addr(hs_e),
                             nf, rows, row_key.ctypes.data, add.ctypes.data, hist.ctypes.data, gap_log2.ctypes.data,
                             ws.ctypes.data, out.ctypes.data):
            nu, ng, nr = out.tolist()
            return ws[:10, :nu], ws[10, :ng], ws[11, :ng], row_key[:nr], add[:nr], hist[:nr], gap_log2[:nr]
    return None


_INGEST_K = ("start_ns", "correlation_id", "device")
_INGEST_A = ("start_ns", "end_ns", "correlation_id", "category", "pid", "tid")


@lru_cache(maxsize=16)
def _offsets(dtype: np.dtype, fields: tuple) -> np.ndarray:
    return np.array([dtype.fields[f][1] for f in fields], np.int64)


def ingest_pass(k: np.ndarray, a: np.ndarray, what: np.ndarray, launch: np.ndarray):
    """A batch's per-record passes in one (``rl_ingest_pass``): (the kernels' (min, max)
    device or None when there are none; (log2 histogram of the launch-call durations, pid,
    tid) when every record is a launch (``what`` 0) of one process and thread, else None; the launch latency per kernel as
    :func:`launch_latency_aligned` writes it, or None when the records are not aligned).
    ``what``, ``launch``: uint8 per category (0 a launch for the histogram; non-zero a
    kernel's launch record)."""
    hist = np.zeros(64, np.int64)
    lat = np.empty(len(k), np.int64)
    out = np.zeros(4, np.int64)
    bits = library().rl_ingest_pass(k.ctypes.data, k.strides[0], _offsets(k.dtype, _INGEST_K).ctypes.data, len(k),
                                    a.ctypes.data, a.strides[0], _offsets(a.dtype, _INGEST_A).ctypes.data, len(a),
                                    what.ctypes.data, launch.ctypes.data, hist.ctypes.data, lat.ctypes.data,
                                    out.ctypes.data)
    d0, d1, pid, tid = out.tolist()
    return ((d0, d1) if bits & 1 else None, (hist, pid, tid) if bits & 2 else None, lat if bits & 4 else None)


# -- the phase mapping's passes (aggregator/native/ridgeline_map.c) ----------------------
# Declared apart from _declare (one block per source file). Every argument is a plain
# address or integer (c_void_p / c_int64): map_batch calls these once per batch each, and
# ndpointer's from_param checks cost more than the passes themselves on small batches.

_MAP_FIELDS = ("start_ns", "name_id", "grid_x", "grid_y", "block_x", "grid_z", "block_y")


@lru_cache(maxsize=1)
def _map_library() -> ct.CDLL:
    """:func:`library` with the ridgeline_map.c functions declared (a library built before
    that file existed is refused in one line, as :func:`library` refuses another layout)."""
    lib = library()
    try:
        lib.rl_map_runs.restype = _I
        lib.rl_map_runs.argtypes = (_V, _I, _V, _V, _I, _V, _V, _V, _I, _V, _V, _V, _V, _V)
        lib.rl_map_phases.restype = None
        lib.rl_map_phases.argtypes = (_I, _V, _I, _V, _V, _V, _V)
        lib.rl_argmax_ranges.restype = _I
        lib.rl_argmax_ranges.argtypes = (_V, _I, _V, _V, _I, _V)
        lib.rl_end_and_devices.restype = None
        lib.rl_end_and_devices.argtypes = (_V, _I, _I, _I, _I, _V, _V)
        lib.rl_device_groups.restype = _I
        lib.rl_device_groups.argtypes = (_V, _I, _I, _I, _I, _I, _V, _V)
    except AttributeError as exc:
        raise FoldLibraryMissing(f"ridgeline: the native fold library {library_path()} was built from another "
                                 f"version ({exc}): {_hint()}") from None
    return lib


@lru_cache(maxsize=64)
def _map_offsets(dtype: np.dtype) -> np.ndarray:
    # One array per record dtype (the batches of a source share one): no per-call build.
    return np.array([dtype.fields[f][1] for f in _MAP_FIELDS], np.int64)


def map_runs(k: np.ndarray, step: np.ndarray, order: np.ndarray | None, skip: np.ndarray | None,
             consts: np.ndarray):
    """map_batch's step runs of a kernels-only batch in one pass (``rl_map_runs``):
    (kept kernels' indices in (step, start) order, each run's first position in them, its
    step, its shape hash), or None when ``order`` is None and the kernels are not in that
    order already (the caller sorts them and calls again with ``order``). ``step``: int32
    per kernel; ``skip``: bool per step (and one more slot) or None."""
    lib = _map_library()
    n = len(k)
    step = np.ascontiguousarray(step, np.int32)
    o = np.ascontiguousarray(order, np.int64) if order is not None else None
    sk = skip.view(np.uint8) if skip is not None and skip.flags.c_contiguous else \
        (np.ascontiguousarray(skip, np.uint8) if skip is not None else None)
    out_order = np.empty(n, np.int64)
    first = np.empty(n, np.int64)
    stp = np.empty(n, np.int64)
    h = np.empty(n, np.uint64)
    kept = np.zeros(1, np.int64)
    runs = lib.rl_map_runs(k.ctypes.data, k.strides[0], _map_offsets(k.dtype).ctypes.data, consts.ctypes.data, n,
                           step.ctypes.data, o.ctypes.data if o is not None else None,
                           sk.ctypes.data if sk is not None else None, len(sk) if sk is not None else 0,
                           out_order.ctypes.data, first.ctypes.data, stp.ctypes.data, h.ctypes.data,
                           kept.ctypes.data)
    if runs < 0:
        return None
    return out_order[:int(kept[0])], first[:runs], stp[:runs], h[:runs]


def map_phases(order: np.ndarray, first: np.ndarray, shape_at: np.ndarray, flat: np.ndarray,
               phase: np.ndarray) -> None:
    """Write into ``phase`` (uint8 per kernel) each kept kernel's remembered phase: run r,
    the kernels ``order[first[r]:first[r + 1]]``, gets ``flat[shape_at[r]:]`` in order
    (``rl_map_phases``). ``phase`` must be a C-contiguous uint8 array (written in place).
    ``flat[shape_at[r]:]`` must hold at least run r's length of phases (nothing checks it:
    StreamPhaser keys its shapes by (hash, length), each shape as long as its runs)."""
    if phase.dtype != np.uint8 or not phase.flags.c_contiguous:
        raise ValueError("map_phases writes a C-contiguous uint8 phase array")
    c = np.ascontiguousarray
    order, first, shape_at, flat = c(order, np.int64), c(first, np.int64), c(shape_at, np.int64), c(flat, np.uint8)
    _map_library().rl_map_phases(len(order), order.ctypes.data, len(first), first.ctypes.data,
                                 shape_at.ctypes.data, flat.ctypes.data, phase.ctypes.data)


def end_and_devices(k: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(every record's end_ns as a new contiguous array, least device, greatest device) in
    one pass over the records (at least one; ``rl_end_and_devices``): the step cut's
    device test and segment ends, which were a pass each."""
    out = np.empty(len(k), np.int64)
    rng = np.empty(2, np.int64)
    _map_library().rl_end_and_devices(k.ctypes.data, k.strides[0], _off(k, "end_ns"), _off(k, "device"), len(k),
                                      out.ctypes.data, rng.ctypes.data)
    return out, int(rng[0]), int(rng[1])


#: The widest device range :func:`device_groups` takes (its bounds are one slot per value).
MAX_DEVICE_SPAN = 4096


def device_groups(k: np.ndarray, lo: int, hi: int) -> tuple[list[int], list[np.ndarray]] | None:
    """(the distinct devices ascending, per device the ascending indices of its records) of
    records whose devices lie in [``lo``, ``hi``] (:func:`end_and_devices`), in two passes
    over the device field (``rl_device_groups``): ``np.unique(k["device"])`` and
    ``np.flatnonzero(k["device"] == d)`` for each. None when the range is wider than
    :data:`MAX_DEVICE_SPAN` or a device lies outside it."""
    idx = np.empty(len(k), np.int64)
    bounds = _device_pass(k, lo, hi, idx)
    if bounds is None:
        return None
    b = bounds.tolist()
    devs = [lo + v for v in range(hi - lo + 1) if b[v + 1] > b[v]]
    return devs, [idx[b[d - lo]:b[d - lo + 1]] for d in devs]


def distinct_devices(k: np.ndarray, lo: int, hi: int) -> list[int] | None:
    """The distinct devices of records whose devices lie in [``lo``, ``hi``], ascending
    (``np.unique(k["device"])``), in one counting pass (``rl_device_groups`` without its
    placing pass); None as :func:`device_groups`."""
    bounds = _device_pass(k, lo, hi, None)
    if bounds is None:
        return None
    return [lo + v for v, c in enumerate(bounds[1:].tolist()) if c]


def _device_pass(k: np.ndarray, lo: int, hi: int, idx: np.ndarray | None) -> np.ndarray | None:
    """``rl_device_groups`` over the records' device field: the bounds array it fills (per
    device the counts, or with ``idx`` to place into, the group starts), None as
    :func:`device_groups`."""
    span = hi - lo
    if span < 0 or span >= MAX_DEVICE_SPAN:
        return None
    bounds = np.zeros(span + 2, np.int64)
    if not _map_library().rl_device_groups(k.ctypes.data, k.strides[0], _off(k, "device"), len(k), lo, hi,
                                           bounds.ctypes.data, None if idx is None else idx.ctypes.data):
        return None
    return bounds


def argmax_ranges(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray | None:
    """Per range, the first position of the greatest of ``values[lo:hi]`` (int64 arrays),
    or None when a range is empty or out of bounds (``rl_argmax_ranges``; the numpy
    reference: aggregator/steps.py ``_argmax_in_ranges``)."""
    if values.dtype != np.int64 or not values.flags.c_contiguous:
        return None
    lo = np.ascontiguousarray(lo, np.int64)
    hi = np.ascontiguousarray(hi, np.int64)
    out = np.empty(len(lo), np.int64)
    if not _map_library().rl_argmax_ranges(values.ctypes.data, len(values), lo.ctypes.data, hi.ctypes.data, len(lo),
                                           out.ctypes.data):
        return None
    return out
