"""Kernel names built to make a backtracking regex engine work hard on a signature.

For every top-level alternative of a pattern, the literal words it spells are taken in
order; the names start like a match (the first word, a digit for a ``\\d+``) and then
repeat one of the later words, or all of them but the last, or fill characters, up to
``size`` characters, so that a match never completes and a backtracking engine tries
every split of the repeated part between the pattern's ``\\w*`` / ``.*`` runs (for
``fmhaSm\\d+\\w*Kernel\\w*(...Gen)\\b`` that is quadratic per start and cubic over starts:
Python's ``re`` took 0.7 s for one 4 kB name). Used by tests/test_name_regex_linear.py and
scripts/hardening-check.py. Standard library only.
"""
from __future__ import annotations

import json
import re

#: Prefixes of the helper patterns of aggregator/signatures.py (tiles, softmax, traits).
HELPER_HEADS = ("softmax_warp_forward<", "Flash_fwd_kernel_traits<", "gemm_", "nvjet_", "tilesize", "MT", "_t",
                "cutlass::Kernel<", "void (anonymous namespace)::")


def _alternatives(pattern: str) -> list[str]:
    """Top-level ``|`` branches (escapes and groups respected)."""
    out, depth, cur, i = [], 0, [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            cur.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        if c == "|" and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    out.append("".join(cur))
    return out


def _words(alt: str) -> list[str]:
    body = re.sub(r"\(\?[a-zA-Z]+\)|\(\?[:=!<]+", " ", alt)
    body = re.sub(r"\\[a-zA-Z]|\[[^\]]*\]", " ", body)
    return re.findall(r"[A-Za-z_][A-Za-z0-9_:]*", body)


def _fill(s: str, size: int) -> str:
    while len(s) < size:
        s += s
    return s[:size]


def names_for(pattern: str, size: int = 4096) -> list[str]:
    out: list[str] = []
    for alt in _alternatives(pattern):
        ws = _words(alt)
        if not ws:
            continue
        head = ws[0] + "1"
        rest = ws[1:]
        out.append(_fill(head, size))                              # the start, over and over
        for k in range(1, len(rest)):
            out.append(_fill(head + "".join(rest[:k]), size))      # start and k words, over and over
        for w in rest:
            out.append(head + _fill(w, size - len(head)))          # one later word, repeated
        if len(rest) > 1:
            out.append(head + _fill("".join(rest[:-1]), size - len(head)))   # all but the last
        for filler in ("_", "1", "a", "x_1", " <", ","):
            out.append(head + _fill(filler, size - len(head)))
    return out


def corpus(patterns: list[str], size: int = 4096) -> list[str]:
    names: dict[str, None] = {}
    for p in patterns:
        for n in names_for(p, size):
            names[n] = None
    for h in HELPER_HEADS:
        for filler in ("1,", "a,", "1x", "1x1_", "a", " <", "<"):
            names[h + _fill(filler, size - len(h))] = None
    return list(names)


def kineto_trace(names: list[str], repeat: int = 2) -> str:
    """A Kineto-format trace (torch.profiler's JSON) with one kernel per name, ``repeat`` times."""
    ev = []
    ts = 1000.0
    for _ in range(repeat):
        for n in names:
            ev.append({"ph": "X", "cat": "kernel", "name": n, "pid": 0, "tid": 7, "ts": ts, "dur": 5.0,
                       "args": {"device": 0, "stream": 7, "correlation": len(ev) + 1, "grid": [1, 1, 1],
                                "block": [128, 1, 1]}})
            ts += 10.0
    return json.dumps({"schemaVersion": 1, "deviceProperties": [], "traceEvents": ev})
