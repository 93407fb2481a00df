"""Tolerant parser for the Prometheus text exposition format (version 0.0.4).

Why not ``prometheus_client.parser`` alone: it renames families (strips ``_total``,
folds ``_created`` into the family), and one malformed line makes it raise for the whole
scrape. The engine probe needs the raw sample names exactly as exposed (the engine
reference, section 1: ``_total`` present or not, ``_created`` gauges that must never be
read as counters, ``ray_vllm:`` prefixes) and must keep every good line of a scrape that
is cut off or has one bad line. So this parser returns flat samples with raw names and
counts the lines it could not read; the tests cross-check it against
``prometheus_client``'s parser on the real samples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


@dataclass(frozen=True)
class Sample:
    """One exposed line: raw metric name, labels, value (float; NaN/Inf allowed)."""
    name: str
    labels: dict
    value: float


@dataclass
class Exposition:
    """A parsed scrape: samples in file order, ``# TYPE``/``# HELP`` per family name,
    and the count (plus first few) of lines that could not be parsed."""
    samples: list[Sample] = field(default_factory=list)
    types: dict[str, str] = field(default_factory=dict)
    helps: dict[str, str] = field(default_factory=dict)
    bad_lines: int = 0
    bad_examples: list[str] = field(default_factory=list)


def _parse_value(text: str) -> float:
    t = text.strip()
    low = t.lower()
    if low in ("+inf", "inf"):
        return math.inf
    if low == "-inf":
        return -math.inf
    if low == "nan":
        return math.nan
    return float(t)


def _parse_labels(s: str, i: int) -> tuple[dict, int]:
    """Parse ``{k="v",...}`` starting at s[i] == '{'; return labels and index after '}'."""
    labels: dict[str, str] = {}
    i += 1
    n = len(s)
    while True:
        while i < n and s[i] in " \t,":
            i += 1
        if i >= n:
            raise ValueError("unterminated label set")
        if s[i] == "}":
            return labels, i + 1
        j = s.index("=", i)
        key = s[i:j].strip()
        if not key or not (key[0].isalpha() or key[0] == "_"):
            raise ValueError(f"bad label name {key!r}")
        i = j + 1
        while i < n and s[i] in " \t":
            i += 1
        if i >= n or s[i] != '"':
            raise ValueError("label value not quoted")
        i += 1
        buf = []
        while True:
            if i >= n:
                raise ValueError("unterminated label value")
            c = s[i]
            if c == "\\" and i + 1 < n:
                buf.append(_ESCAPES.get(s[i + 1], "\\" + s[i + 1]))
                i += 2
                continue
            if c == '"':
                i += 1
                break
            buf.append(c)
            i += 1
        labels[key] = "".join(buf)


def parse_line(line: str) -> Sample:
    """Parse one sample line; raises ValueError when it is not one."""
    s = line.strip()
    i = 0
    n = len(s)
    while i < n and (s[i].isalnum() or s[i] in "_:"):
        i += 1
    name = s[:i]
    if not name or name[0].isdigit():
        raise ValueError("no metric name")
    labels: dict = {}
    while i < n and s[i] in " \t":
        i += 1
    if i < n and s[i] == "{":
        labels, i = _parse_labels(s, i)
    rest = s[i:].split()
    if not rest or len(rest) > 2:
        raise ValueError("expected a value and an optional timestamp")
    return Sample(name, labels, _parse_value(rest[0]))


def parse(text: str, max_examples: int = 3) -> Exposition:
    """Parse a whole exposition; never raises on content, counts bad lines instead."""
    out = Exposition()
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line[1:].split(None, 2)
            if len(parts) >= 2 and parts[0] in ("TYPE", "HELP"):
                rest = parts[2] if len(parts) > 2 else ""
                if parts[0] == "TYPE":
                    out.types[parts[1]] = rest.strip()
                else:
                    out.helps[parts[1]] = rest
            continue
        try:
            out.samples.append(parse_line(line))
        except (ValueError, IndexError):
            out.bad_lines += 1
            if len(out.bad_examples) < max_examples:
                out.bad_examples.append(line[:200])
    return out
