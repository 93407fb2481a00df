"""Write a :class:`probes.events.Trace` as a Kineto (PyTorch profiler) JSON trace.

The layout follows what ``torch.profiler`` writes (and what the shared real traces show):
``traceEvents`` with complete (``"ph": "X"``) events of categories ``kernel``,
``gpu_memcpy``, ``cuda_runtime``, ``user_annotation`` and ``gpu_user_annotation``;
GPU events have ``pid`` = device and ``tid`` = stream; times are microseconds (floats,
nanosecond precision); kernel ``args`` carry ``device``, ``context``, ``stream``,
``correlation``, ``registers per thread``, ``shared memory``, ``grid``, ``block``;
runtime ``args`` carry ``cbid`` and ``correlation``; plus ``deviceProperties``.
A trace written from simulated events says so in ``metadata`` (``"simulated": true``),
in ``traceName`` and in the process names. A path ending ``.gz`` is gzip-compressed.
"""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import orjson

from ridgeline.probes.errors import InputError
from ridgeline.probes.events import (
    COPY_DIRECTION_NAMES,
    RANGE_GPU_ANNOTATION,
    RANGE_PROFILER_STEP,
    RANGE_USER_ANNOTATION,
    Trace,
)

_CHUNK = 20_000


def _us(ns: np.ndarray) -> list[float]:
    return (ns / 1000.0).round(3).tolist()


def _events(trace: Trace):
    names = trace.names
    label = " (simulated)" if trace.meta.get("simulated") else ""
    pids = sorted(set(trace.api["pid"].tolist()) | set(trace.kernels["pid"].tolist()) - {-1})
    for d in trace.devices:
        yield {"ph": "M", "name": "process_name", "pid": d.index, "tid": 0,
               "args": {"name": f"GPU {d.index}{label}"}}
    for p in pids:
        yield {"ph": "M", "name": "process_name", "pid": p, "tid": 0, "args": {"name": f"engine{label}"}}
    k = trace.kernels
    for lo in range(0, len(k), _CHUNK):
        c = k[lo:lo + _CHUNK]
        ts, dur = _us(c["start_ns"]), _us(c["end_ns"] - c["start_ns"])
        for i, row in enumerate(c.tolist()):
            (_, _, dev, stream, ctx, corr, ext, gx, gy, gz, bx, by, bz, regs, smem, nid, *_rest) = row
            args = {"device": dev, "context": ctx, "stream": stream, "correlation": corr,
                    "registers per thread": regs, "shared memory": smem, "grid": [gx, gy, gz], "block": [bx, by, bz]}
            if ext >= 0:
                args["External id"] = ext
            yield {"ph": "X", "cat": "kernel", "name": names[nid], "pid": dev, "tid": stream,
                   "ts": ts[i], "dur": dur[i], "args": args}
    c = trace.copies
    for i, row in enumerate(c.tolist()):
        s, e = row[0], row[1]
        direction = COPY_DIRECTION_NAMES.get(int(c["direction"][i]), "unknown")
        yield {"ph": "X", "cat": "gpu_memcpy", "name": f"Memcpy {direction} (Device -> Pageable)",
               "pid": int(c["device"][i]), "tid": int(c["stream"][i]), "ts": round(s / 1000.0, 3),
               "dur": round((e - s) / 1000.0, 3),
               "args": {"device": int(c["device"][i]), "stream": int(c["stream"][i]),
                        "correlation": int(c["correlation_id"][i]), "bytes": int(c["bytes"][i])}}
    a = trace.api
    for lo in range(0, len(a), _CHUNK):
        c = a[lo:lo + _CHUNK]
        ts, dur = _us(c["start_ns"]), _us(c["end_ns"] - c["start_ns"])
        for i, (pid, tid, corr, cbid, nid) in enumerate(zip(c["pid"].tolist(), c["tid"].tolist(),
                                                            c["correlation_id"].tolist(), c["cbid"].tolist(),
                                                            c["name_id"].tolist())):
            yield {"ph": "X", "cat": "cuda_runtime", "name": names[nid], "pid": pid, "tid": tid,
                   "ts": ts[i], "dur": dur[i], "args": {"cbid": cbid, "correlation": corr}}
    r = trace.ranges
    for row in r.tolist():
        s, e, pid, tid, dev, kind, nid, _ext = row
        if kind == RANGE_GPU_ANNOTATION:
            cat, p = "gpu_user_annotation", dev
        elif kind in (RANGE_USER_ANNOTATION, RANGE_PROFILER_STEP):
            cat, p = "user_annotation", pid
        else:
            continue
        yield {"ph": "X", "cat": cat, "name": names[nid], "pid": p, "tid": tid,
               "ts": round(s / 1000.0, 3), "dur": round((e - s) / 1000.0, 3), "args": {}}


def write_kineto(trace: Trace, path: str | Path) -> Path:
    """Write ``trace`` to ``path`` (gzip when it ends ``.gz``); returns the path."""
    path = Path(path)
    head = {
        "schemaVersion": 1,
        "traceName": f"{path.name}{' (simulated by ridgeline)' if trace.meta.get('simulated') else ''}",
        "displayTimeUnit": "ms",
        "metadata": {k: v for k, v in trace.meta.items() if isinstance(v, (str, int, float, bool))},
        "deviceProperties": [{"id": d.index, "name": d.name, "totalGlobalMem": d.memory_total_bytes,
                              "numSms": d.sm_count, "simulated": bool(d.properties.get("simulated"))}
                             for d in trace.devices],
    }
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "wb") as f:
            f.write(orjson.dumps(head)[:-1] + b',"traceEvents":[')
            first = True
            buf = []
            for ev in _events(trace):
                buf.append(orjson.dumps(ev))
                if len(buf) >= _CHUNK:
                    f.write((b"" if first else b",") + b",".join(buf))
                    first, buf = False, []
            if buf:
                f.write((b"" if first else b",") + b",".join(buf))
            f.write(b"]}")
    except OSError as exc:
        raise InputError(f"{path}: cannot write trace ({exc.strerror or exc})") from None
    return path
