"""Kineto traces of the schema before PyTorch 1.10 (``schemaVersion`` 1, 2020-2021).

Such a trace names categories in title case (``Kernel``, ``Memcpy``, ``Memset``,
``Runtime``, ``Driver``, ``Operator``), links GPU records to operators with ``external id``
in lower case, writes operator ``Input dims``, string thread ids (``"25738"``, and
``"stream 7"`` for GPU rows) and profiler steps as ``Operator`` events named
``ProfilerStep#N``. Such files are small (one profiler window), so they are read event by
event, chunk by chunk (memory bounded by the chunk and the kept rows), each event renamed
into the current schema's spelling and built by the reference builder
(:class:`probes.kineto_dicts.EventBuilder`). :func:`is_legacy` tells such a file from
its category counts; :func:`probes.kineto.load_trace` decides when to take this reader.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from . import json_chunks
from . import kineto_records as rec
from .events import NameTable, Trace, empty
from .kineto_dicts import EventBuilder, event_dict

__all__ = ["is_legacy", "load"]

_LEGACY_CATS = {"Kernel": "kernel", "Memcpy": "gpu_memcpy", "Memset": "gpu_memset",
                "Runtime": "cuda_runtime", "Driver": "cuda_driver", "Operator": "cpu_op",
                "User Annotation": "user_annotation", "gpu_user_annotation": "gpu_user_annotation"}
_STREAM_TID_RX = re.compile(r"^\s*stream\s+(\d+)\s*$", re.IGNORECASE)


def _legacy_id(v):
    """String ids of the old schema as ints: ``"25738"`` -> 25738, ``"stream 7"`` -> 7."""
    if isinstance(v, str):
        t = v.strip()
        if t.isdigit():
            return int(t)
        m = _STREAM_TID_RX.match(t)
        if m:
            return int(m.group(1))
    return v


def _legacy_event(e: dict) -> dict | None:
    """An old-schema event in the current schema's spelling, or None (not kept)."""
    cat = _LEGACY_CATS.get(e.get("cat"))
    if cat is None or e.get("ph") != "X":
        return None
    out = dict(e)
    name = e.get("name")
    if cat == "cpu_op" and isinstance(name, str) and name.startswith("ProfilerStep#"):
        cat = "user_annotation"
    out["cat"] = cat
    out["pid"] = _legacy_id(e.get("pid"))
    out["tid"] = _legacy_id(e.get("tid"))
    args = e.get("args")
    if isinstance(args, dict):
        a = dict(args)
        if "external id" in a and "External id" not in a:
            a["External id"] = a.pop("external id")
        if "Input dims" in a and "Input Dims" not in a:
            a["Input Dims"] = a.pop("Input dims")
        out["args"] = a
    return out


def _legacy_top(top: dict) -> dict:
    """``computeProperties`` (the oldest Kineto: ``major``, ``minor``,
    ``multiProcessorCount``) as ``deviceProperties``."""
    if top.get("deviceProperties") or not isinstance(top.get("computeProperties"), list):
        return top
    props = []
    for p in top["computeProperties"]:
        if isinstance(p, dict):
            q = dict(p)
            for old, new in (("major", "computeMajor"), ("minor", "computeMinor"), ("multiProcessorCount", "numSms")):
                if old in q and new not in q:
                    q[new] = q.pop(old)
            props.append(q)
    return dict(top, deviceProperties=props)


def is_legacy(counts: dict) -> bool:
    """Do the category counts of a file (``meta["event_counts"]``) name the old schema's?"""
    return any(counts.get(c) for c in ("Kernel", "Memcpy", "Memset", "Runtime", "Operator"))


def load(path: Path, chunk_bytes: int, budget=None) -> Trace:
    """Read a pre-1.10 Kineto trace (see the module's docstring), chunk by chunk."""
    stream = json_chunks.ArrayStream(path, "traceEvents", chunk_bytes)
    names = NameTable()
    counts: dict[str, int] = {}
    parts: dict[str, list] = {kind: [] for kind, _ in rec.KINDS}
    for chunk in stream:
        buf = chunk.scan.buf
        b = EventBuilder(names=names)    # its own counts unused: the file's are counted here
        kept = []
        for s_, e_ in zip(chunk.starts.tolist(), chunk.ends.tolist()):
            e = event_dict(buf[s_:e_ + 1])
            if type(e) is not dict:
                continue
            cat = e.get("cat")
            key = cat if isinstance(cat, str) else "<none>"
            counts[key] = counts.get(key, 0) + 1
            ev = _legacy_event(e)
            if ev is not None:
                kept.append(ev)
        b.add(kept)
        for kind, arr in b.build_all().items():
            if len(arr):
                parts[kind].append(arr)
                if budget is not None:
                    budget.charge(kind, len(arr))
        if budget is not None:
            budget.charge_names(names)
    cols = {kind: (np.concatenate(parts[kind]) if parts[kind] else empty(dtype))
            for kind, dtype in rec.KINDS}
    top = stream.top
    trace = Trace(names=names, devices=rec.document_devices(_legacy_top(top)), meta=rec.document_meta(path, top), **cols)
    trace.meta["kineto_schema"] = "pre-1.10 (title-case categories)"
    return rec.finished(trace, counts)
