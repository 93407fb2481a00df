"""The operator's answer in words, from one verdict record (pure; every view uses it).

``report`` (``ridgeline demo``), ``analyze``, ``top`` and ``tail`` print the same lines
for the same verdict: the binding face and its reasons, each other face with the figure
that rules it out (or "unknown" and why), the caveats near a threshold, and the limits
that bind. The figures themselves are computed once, in :mod:`aggregator.verdict`
(``faces``, ``caveats``, ``limits`` of :func:`verdict.judge`); this module only words them.
"""
from __future__ import annotations

FACE_WORDS = {"memory-capacity": "GPU memory (KV cache)", "bandwidth": "HBM bandwidth", "compute": "compute",
              "queue": "queueing", "host": "host / launch"}


def who(rec: dict) -> str:
    """``gpu0/pid 1234`` (or ``engine`` for a verdict without a GPU)."""
    if rec.get("device") is None:
        return "engine"
    pid = rec.get("pid")
    return f"gpu{rec.get('device')}" + (f"/pid {pid}" if pid not in (None, -1) else "")


def headline(rec: dict) -> str:
    """``gpu0/pid 1234: memory-bandwidth-bound (decode): <first reason>``."""
    ph = f" ({rec['phase']})" if rec.get("phase") else ""
    reasons = rec.get("reasons") or []
    return f"{who(rec)}: {rec.get('verdict')}{ph}" + (f": {reasons[0]}" if reasons else "")


def answer_lines(rec: dict, indent: str = "  ") -> list[str]:
    """The answer for one verdict record, one statement a line."""
    out = [headline(rec)]
    for r in (rec.get("reasons") or [])[1:]:
        out.append(f"{indent}because {r}")
    for f in rec.get("faces") or []:
        state = f.get("state")
        if state in ("binds", "binds (below the thresholds)"):
            continue
        word = FACE_WORDS.get(f.get("face"), f.get("face"))
        if state == "unknown":
            out.append(f"{indent}{word}: unknown ({f.get('figure')})")
        elif state == "also holds":
            out.append(f"{indent}{word}: also holds: {'; '.join(f.get('reasons') or []) or f.get('figure')}")
        else:
            out.append(f"{indent}{word}: ruled out: {f.get('figure')}")
    for c in rec.get("caveats") or []:
        out.append(f"{indent}caveat: {c}")
    for lim in rec.get("limits") or []:
        out.append(f"{indent}limit: {lim}")
    return out


def verdict_records(v) -> list[dict]:
    """The verdict records of a window's ``verdict`` field (a list, one dict, or None)."""
    if isinstance(v, dict):
        return [v] if v.get("verdict") else []
    if isinstance(v, list):
        return [x for x in v if isinstance(x, dict) and x.get("verdict")]
    return []
