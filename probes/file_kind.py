"""What a file is, from its first bytes: so a bad input is named by its content (issue 24.3),
not by the parser that happened to be tried first ("not valid JSON" for a PNG named .sqlite).

:func:`sniff` returns one of :data:`TRACE_KINDS` (what ``ridgeline analyze`` reads) or a
short description of another format; it never reads more than the bytes it is given.
The signatures are the formats' own published magic numbers: SQLite's 16-byte header
string (sqlite.org/fileformat.html, 1.3), gzip's 1f 8b (RFC 1952, 2.3.1), zstd's
28 b5 2f fd (RFC 8878, 3.1.1), xz's fd 37 7a 58 5a 00, bzip2's "BZh", zip's "PK\\x03\\x04",
ELF's 7f "ELF", PNG's 89 "PNG" 0d 0a 1a 0a, PDF's "%PDF-".
"""
from __future__ import annotations

SQLITE_MAGIC = b"SQLite format 3\x00"
RECORDING_MAGIC = b"RLREC\x00\x01\n"      # agent.recording.MAGIC (probes cannot import agent)

# Kinds analyze reads: JSON text (Kineto / Chrome trace), gzip (its .json.gz), an SQLite
# database (Nsight Systems export), a ridgeline recording.
TRACE_KINDS = ("json", "gzip", "sqlite", "recording")

_OTHER = (
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data"),
    (b"\xfd7zXZ\x00", "xz-compressed data"),
    (b"BZh", "bzip2-compressed data"),
    (b"PK\x03\x04", "a zip archive"),
    (b"\x7fELF", "an ELF binary"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"%PDF-", "a PDF document"),
)


def sniff(head: bytes) -> str:
    """The kind of a file whose first bytes are ``head`` (16 are enough): a member of
    :data:`TRACE_KINDS`, ``"empty"``, ``"recording-header-cut"`` (a recording shorter than
    its 8-byte header), or a description such as ``"a PNG image"`` or ``"binary data
    (starts cd 4f 01 ...)"``."""
    if not head:
        return "empty"
    if head.startswith(RECORDING_MAGIC):
        return "recording"
    if len(head) < len(RECORDING_MAGIC) and RECORDING_MAGIC.startswith(head) and len(head) >= 3:
        return "recording-header-cut"
    if head.startswith(SQLITE_MAGIC):
        return "sqlite"
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    text = head[3:] if head.startswith(b"\xef\xbb\xbf") else head     # UTF-8 byte order mark
    first = text.lstrip(b" \t\r\n")[:1]
    if first in (b"{", b"[") or (not first and text):
        return "json"
    for magic, what in _OTHER:
        if head.startswith(magic):
            return what
    if all(32 <= b < 127 or b in (9, 10, 13) for b in head):
        return f"text, not a JSON object or array (starts {head[:12].decode('ascii')!r})"
    return "binary data (starts " + " ".join(f"{b:02x}" for b in head[:4]) + " ...)"


def mismatch(path: str, head: bytes) -> str | None:
    """The one error line for a file whose name promises a trace its content is not, or
    None when the content is a kind analyze reads. The name's suffix says what was
    expected; the content says what it is."""
    kind = sniff(head)
    if kind in TRACE_KINDS:
        return None
    if kind == "empty":
        return f"{path}: empty file (0 bytes)"
    if kind == "recording-header-cut":
        return f"{path}: a ridgeline recording cut off inside its 8-byte header (no frames)"
    low = path.lower()
    if low.endswith((".sqlite", ".sqlite3")):
        want = "not an SQLite database (an Nsight Systems export starts with 'SQLite format 3')"
    elif low.endswith(".rlrec"):
        want = "not a ridgeline recording (no RLREC header)"
    else:
        want = "not a trace (Kineto JSON, .json.gz, Nsight Systems SQLite or a ridgeline recording)"
    return f"{path}: {want}: its content is {kind}"
