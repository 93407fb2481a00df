"""Text that came from outside the agent, made safe to write into its log.

Contract: :func:`for_log` turns any value (a HELLO status field, a process name, an
exception message quoting a peer's bytes) into one line of printable text: control
characters, line breaks, escape sequences and anything unprintable are written as
Python-style escapes (``\\n``, ``\\x1b``, ``\\u2028``), and the result is cut to ``limit``
characters with a marker. Backslashes are kept as they are, so text a probe already
escaped is not escaped twice (a literal backslash cannot start a line either). A peer
can therefore never start a new log line, forge a journal field or drive the terminal
of whoever reads the log.
"""
from __future__ import annotations

LIMIT = 300


def _escape(ch: str) -> str:
    if ch.isprintable() and ch != "\x7f":
        return ch
    code = ord(ch)
    if ch == "\n":
        return "\\n"
    if ch == "\r":
        return "\\r"
    if ch == "\t":
        return "\\t"
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def for_log(value, limit: int = LIMIT) -> str:
    """One printable line for ``value`` (bytes are decoded as UTF-8 with replacement)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        text = bytes(value).decode("utf-8", "replace")
    else:
        text = str(value)
    if len(text) > limit * 4:
        text = text[:limit * 4]
    out = "".join(_escape(c) for c in text)
    if len(out) > limit:
        out = out[:limit] + f"...[{len(text)} chars]"
    return out
