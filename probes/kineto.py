"""Kineto / PyTorch-profiler Chrome-trace importer (``.json`` and ``.json.gz``).

``load_trace(path)`` reads a trace written by ``torch.profiler`` (Kineto's Chrome-trace
JSON) into a columnar :class:`probes.events.Trace`:

=====================  =====================================================
Kineto ``cat``         goes to
=====================  =====================================================
``kernel``             ``trace.kernels``
``gpu_memcpy``         ``trace.copies`` (kind memcpy, direction from the name)
``gpu_memset``         ``trace.copies`` (kind memset)
``cuda_runtime``       ``trace.api`` (domain runtime, category from the name)
``cuda_driver``        ``trace.api`` (domain driver)
``user_annotation``    ``trace.ranges`` (``RANGE_USER_ANNOTATION``; ``ProfilerStep#N``
                       as ``RANGE_PROFILER_STEP``), device -1
``gpu_user_annotation`` ``trace.ranges`` (``RANGE_GPU_ANNOTATION``; ``ProfilerStep#N``
                       as ``RANGE_PROFILER_STEP``), device >= 0, ``tid`` = stream
``cuda_sync``          ``trace.ranges`` (``RANGE_CUDA_SYNC``), device >= 0, ``tid`` = stream
``cpu_op``             ``trace.cpu_ops`` (``Input Dims`` / ``Input type`` interned as
                       compact JSON text)
everything else        not kept (python_function, flows, instants, metadata rows)
=====================  =====================================================

Only complete events (``"ph": "X"``) are kept. ``trace.meta["event_counts"]`` counts
every event of the file by ``cat`` (``"<none>"`` for events without one), kept or not.
:func:`probes.trace_joins.kernel_cpu_op_index` maps each kernel to the ``cpu_op`` that
launched it.

This module chooses the reader; each is a module of its own, with no circle between them:

=============================  ==========================================================
:mod:`probes.kineto_native`    first: the native columnar reader (ISA-L inflate, the
                               array cut into pieces of whole events, each parsed by
                               libridgeline_json.so, simdjson, straight into the columns;
                               one process). A missing library is an error naming it
:mod:`probes.kineto_typed`     the same pieces decoded by msgspec into structs of the
                               kept fields (two processes for big files): the reference
                               the native reader is tested against, and the shared parts
                               (categories, rows in file order, the reference hand-off)
:mod:`probes.kineto_scan`      a file the typed reader cannot cut: the structural
                               scanner (the decompressed bytes streamed in chunks and
                               scanned with numpy by :mod:`probes.json_chunks`; numbers
                               parsed by numpy's C parser, names sliced out in bulk)
:mod:`probes.kineto_legacy`    a file in the pre-1.10 schema
:mod:`probes.kineto_dicts`     the reference: a dict per event
                               (:func:`~probes.kineto_dicts.load_trace_via_dicts`, what
                               the tests compare against), and the builder the others
                               hand what they cannot read exactly, so results never
                               depend on the path taken
:mod:`probes.kineto_records`   the rules all of them share: names, times, ids, meta
=============================  ==========================================================

Times: Kineto writes ``ts``/``dur`` in microseconds (ints or floats with up to three
decimals); they become integer nanoseconds, exact for up to three decimals.

Kernels and copies carry, in ``pid``/``tid``, the process and thread that launched
them: joined through the runtime/driver API record with the same correlation id
(Kineto itself puts the device index and the stream there). ``-1`` when the trace has
no such API record (e.g. the tail of a previous profiler step).

``trace.meta`` holds plain facts only (path, format, Kineto schema version, CUPTI and
CUDA versions, distributed rank and world size, base time, per-category event counts);
the top-level ``metadata`` object and anything resembling an environment are never
copied, because recorders put environment variables (tokens) there.

Any problem with the file raises :class:`probes.errors.InputError` with one line
naming the file and the problem.
"""
from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import orjson

from . import json_chunks, kineto_legacy, kineto_scan
from .errors import InputError
from .events import Trace

__all__ = ["load_trace", "PARALLEL_MIN_BYTES", "PARALLEL_MIN_GZ_BYTES"]

PARALLEL_MIN_BYTES = 256 << 20   # plain files at least this big are read by two processes
PARALLEL_MIN_GZ_BYTES = 16 << 20  # gzip files likewise (Kineto JSON gzips 10-20x)

_GPU_LIKE_RX = re.compile(r"kernel|memcpy|memset|gpu|hip|stream|xpu|mtia", re.IGNORECASE)


def load_trace(path: str | Path, chunk_bytes: int = json_chunks.CHUNK_BYTES,
               parallel: bool | None = None, budget=None) -> Trace:
    """Load a Kineto trace (``.json`` or ``.json.gz``, detected by content) into a Trace.

    Streams the file in pieces of whole events (``chunk_bytes`` of decompressed bytes,
    8 MiB at the default): peak memory is a few pieces plus the output columns, whatever
    the file size. The native reader reads in this process; for a file it leaves to the
    structural scanner, a file of at least ``PARALLEL_MIN_BYTES`` (plain) or
    ``PARALLEL_MIN_GZ_BYTES`` (gzip) is read by two processes when this process may use
    two CPUs, the load average leaves one of them idle, and the caller runs a single
    thread (``parallel`` forces it on or off); the result is identical, and any trouble
    with the second reader falls back to reading the file in this process.
    Raises :class:`InputError` naming the file for a missing, unreadable, truncated,
    non-JSON or non-trace file, for a file with GPU-like events of which none could be
    read (naming its schema), and when the rows kept would pass ``budget`` (a
    :class:`probes.budget.EventBudget`, charged chunk by chunk; None: unbounded, for
    callers that bound their input otherwise). Pre-1.10 traces and Chrome's JSON Array
    Format are read too; events with unusable times are dropped and counted.
    """
    path = Path(path)
    if parallel is None:
        # fork only from a single-threaded caller (the CLI): a fork while other threads
        # hold locks is how children deadlock
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                gz = f.read(2) == b"\x1f\x8b"
            # a second reader costs CPU (the typed reader's about 6% more in all, each
            # process inflating and cutting the whole stream; the scanner's about 20%) and
            # gains wall time only where a CPU is idle: on a busy host (with the kernel's
            # per-session fair share, autogroup) the two share what one would get
            # (docs/benchmarks-analyze.md)
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            parallel = (size >= (PARALLEL_MIN_GZ_BYTES if gz else PARALLEL_MIN_BYTES)
                        and cpus >= 2 and os.getloadavg()[0] <= cpus - 1
                        and threading.active_count() == 1)
        except OSError:
            parallel = False
    # the fast path: the native columnar reader (probes.kineto_native: simdjson, rows
    # written straight into the columns); files it cannot cut or read cleanly are read by
    # the structural scanner below
    if not _has_msgspec():
        return _checked_schema(path, _scanned(path, chunk_bytes, bool(parallel), budget), budget)
    from . import kineto_native
    try:
        trace = kineto_native.load(path, max(chunk_bytes, kineto_native.CHUNK_BYTES)
                                   if chunk_bytes == json_chunks.CHUNK_BYTES else chunk_bytes, budget=budget)
        return _checked_schema(path, trace, budget)
    except json_chunks.Unsplit:
        pass
    if budget is not None:       # the native reader's charges are void: the scanner starts over
        budget = budget.fresh()
    return _checked_schema(path, _scanned(path, chunk_bytes, bool(parallel), budget), budget)


def _scanned(path: Path, chunk_bytes: int, parallel: bool, budget) -> Trace:
    """The structural scanner's reading; a string it cannot decode (a lone surrogate
    escape, which simdjson, msgspec and orjson all refuse) is one line, not a traceback."""
    try:
        return kineto_scan.load(path, chunk_bytes, parallel, budget)
    except orjson.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc.msg})") from None


def _has_msgspec() -> bool:
    """Whether msgspec, a dependency of the readers' shared parts (probes.kineto_typed), is
    there: not in a bundle installed without dependencies (the GPU check's), which reads
    with the structural scanner as it always did."""
    try:
        import msgspec  # noqa: F401  (only whether it is there)
    except ImportError:
        return False
    return True


def _checked_schema(path: Path, trace: Trace, budget=None) -> Trace:
    """The trace, re-read by the old-schema reader when it is one; InputError naming
    the schema when the file has GPU-like events but no kernel or copy was read."""
    counts = trace.meta.get("event_counts", {})
    if not counts and trace.meta.get("json_array_format"):
        raise InputError(f"{path}: not a Chrome trace (a JSON array without trace event objects)")
    if not len(trace.kernels) and not len(trace.copies) and kineto_legacy.is_legacy(counts):
        trace = kineto_legacy.load(path, json_chunks.CHUNK_BYTES, budget)
        counts = trace.meta.get("event_counts", {})
    if len(trace.kernels) or len(trace.copies):
        return trace
    gpu_like = {c: n for c, n in counts.items() if _GPU_LIKE_RX.search(c)}
    if gpu_like:
        seen = ", ".join(f"{c} x{n}" for c, n in sorted(gpu_like.items(), key=lambda x: -x[1])[:6])
        schema = trace.meta.get("kineto_schema_version", "none")
        rejected = trace.meta.get("rejected_events")
        why = f"; rejected: {rejected}" if rejected else ""
        raise InputError(f"{path}: has GPU-like events ({seen}) but no kernel or copy could be read "
                         f"(schemaVersion {schema}; reads Kineto categories kernel/gpu_memcpy/gpu_memset "
                         f"and the pre-1.10 Kernel/Memcpy/Memset{why})")
    return trace
