"""The operator's answer in words, from one verdict record (pure; every view uses it).

``report`` (``ridgeline demo``), ``analyze``, ``top`` and ``tail`` print the same lines
for the same verdict: the binding face and its reasons, each other face with the figure
that rules it out (or "unknown" and why), the caveats near a threshold, and the limits
that bind. The figures themselves are computed once, in :mod:`aggregator.verdict`
(``faces``, ``caveats``, ``limits`` of :func:`verdict.judge`); this module only words them. A verdict record arrives as the dict of the window it
travelled in (the wire, a recording, a Parquet file) and is read as a :class:`VerdictRecord`.
"""
from __future__ import annotations

from typing import Any

import msgspec

FACE_WORDS = {"memory-capacity": "GPU memory (KV cache)", "bandwidth": "HBM bandwidth", "compute": "compute",
              "queue": "queueing", "host": "host / launch"}


class FaceState(msgspec.Struct):
    """One face of a verdict (``verdict._faces``): its state and the figure that says so."""
    face: str = ""
    state: str = ""              # binds | also holds | ruled out | unknown | binds (below the thresholds)
    figure: Any = None
    reasons: list[str] = []


class VerdictRecord(msgspec.Struct):
    """The fields of one verdict record (:func:`aggregator.verdict.verdict_record`) that the
    answer words; the record's other figures are ignored here."""
    device: Any = None           # the CUDA ordinal; None: an engine-only verdict
    pid: Any = None              # None or -1: no process
    verdict: str | None = None
    phase: str | None = None
    reasons: list[str] = []
    faces: list[FaceState] = []
    caveats: list[str] = []
    limits: list[str] = []


def who(rec: VerdictRecord) -> str:
    """``gpu0/pid 1234`` (or ``engine`` for a verdict without a GPU)."""
    if rec.device is None:
        return "engine"
    return f"gpu{rec.device}" + (f"/pid {rec.pid}" if rec.pid not in (None, -1) else "")


def headline(rec: VerdictRecord) -> str:
    """``gpu0/pid 1234: memory-bandwidth-bound (decode): <first reason>``."""
    ph = f" ({rec.phase})" if rec.phase else ""
    return f"{who(rec)}: {rec.verdict}{ph}" + (f": {rec.reasons[0]}" if rec.reasons else "")


def answer_lines(rec: VerdictRecord | dict, indent: str = "  ") -> list[str]:
    """The answer for one verdict record, one statement a line. A dict (a window's record,
    as top and tail hold it) is read as a :class:`VerdictRecord` first; one that is not
    gives a line saying so."""
    if isinstance(rec, dict):
        try:
            rec = msgspec.convert(rec, VerdictRecord)
        except msgspec.ValidationError as exc:     # a producer's bug: said, never a traceback
            return [f"verdict record not readable: {exc}"]
    out = [headline(rec)]
    for r in rec.reasons[1:]:
        out.append(f"{indent}because {r}")
    for f in rec.faces:
        if f.state in ("binds", "binds (below the thresholds)"):
            continue
        word = FACE_WORDS.get(f.face, f.face)
        if f.state == "unknown":
            out.append(f"{indent}{word}: unknown ({f.figure})")
        elif f.state == "also holds":
            out.append(f"{indent}{word}: also holds: {'; '.join(f.reasons) or f.figure}")
        else:
            out.append(f"{indent}{word}: ruled out: {f.figure}")
    for c in rec.caveats:
        out.append(f"{indent}caveat: {c}")
    for lim in rec.limits:
        out.append(f"{indent}limit: {lim}")
    return out


def verdict_records(v) -> list[dict]:
    """The verdict records of a window's ``verdict`` field (a list, one dict, or None)."""
    if isinstance(v, dict):
        return [v] if v.get("verdict") else []
    if isinstance(v, list):
        return [x for x in v if isinstance(x, dict) and x.get("verdict")]
    return []
