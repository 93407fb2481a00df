"""Chunked structural scanning of one big JSON array inside a JSON document.

Chrome/Kineto traces are one JSON object whose ``traceEvents`` array holds millions of
small flat objects. Parsing the whole document materialises a Python dict per event
(gigabytes); this module instead reads the decompressed bytes in chunks and finds,
with vectorised numpy byte scanning, where each top-level element of that array starts
and ends, where every key/value colon is, at which nesting depth, and which quotes are
string delimiters. Callers extract the fields they need from those positions (see
:mod:`probes.kineto`), so memory stays bounded by the chunk size plus their output.

How the scan works, per chunk (the chunk always starts between two array elements,
outside any string, so the state at its start is known):

* quotes: ``"`` bytes not escaped by an odd run of backslashes;
* a structural byte (``{ [ } ] :``) is outside strings iff an even number of quotes
  precede it;
* depth: cumulative sum of +1 for ``{ [`` and -1 for ``} ]``; elements of the array
  are the objects opened at depth 1; the array ends where depth falls to -1.

Everything outside the array (the top-level keys: device properties, versions, ...) is
kept as text and parsed once with the array replaced by ``[]``.
"""
from __future__ import annotations

import gzip
import io
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
import orjson

from .errors import InputError

try:
    from isal import igzip, isal_zlib
    _INFLATE_ERRORS: tuple = (isal_zlib.error,)
except ImportError:   # a bundle installed without dependencies (the GPU check): zlib
    igzip = gzip
    _INFLATE_ERRORS = ()

CHUNK_BYTES = 4 << 20
PAD = 64            # spaces appended to every buffer so fixed-width windows never overrun
HEAD_LIMIT = 64 << 20   # bytes read while looking for the array (and after it) before giving up
MAX_ELEMENT_BYTES = 32 << 20   # one array element larger than this is refused (memory bound)
# The scan holds about 40 bytes per bracket (positions, quote ranks, classes, depths), so
# bytes made of brackets cost 40x their size: a buffer with more '{'/'[' than this is
# refused before it is scanned (a real Kineto event has 2-6 brackets in 200-500 bytes;
# 2M openings cost about 160 MiB at the scan's peak). Issue 18.7: 1 GiB of '[' in 1 MB
# of gzip was OOM-killed while the carry of one unfinished element grew to 36 MiB.
MAX_OPENS_PER_SCAN = 1 << 21
# Kineto nests at most 5 deep (document, traceEvents, event, args, a list of input dims,
# one of its shapes); deeper is refused, not handed to a recursive decoder.
MAX_DEPTH = 64
_BETWEEN = b" \t\r\n,"    # what may separate two elements

_QUOTE, _BSLASH = 34, 92
# classes of structural bytes: 1 '{', 2 '[', 3 '}', 4 ']', 5 ':'


@dataclass
class Scan:
    """Structure of one buffer: positions are byte offsets into ``buf``."""
    buf: bytes                 # the bytes, followed by PAD spaces
    a: np.ndarray              # uint8 view of buf (with the pad)
    n: int                     # length without the pad
    quotes: np.ndarray         # unescaped quote positions (int64): string i is quotes[2i]..quotes[2i+1]
    pos: np.ndarray            # brackets outside strings
    cls: np.ndarray            # their class: 1 '{', 2 '[', 3 '}', 4 ']'
    depth: np.ndarray          # depth after each bracket (relative to the buffer start)
    before: np.ndarray         # before[j]: number of brackets (outside strings) before quote j


_BR_CLASS = np.zeros(256, dtype=np.int8)
_BR_CLASS[ord("{")], _BR_CLASS[ord("[")], _BR_CLASS[ord("}")], _BR_CLASS[ord("]")] = 1, 2, 3, 4
_BR_DELTA = np.array([0, 1, 1, -1, -1], dtype=np.int32)


def _unescaped_quotes(a: np.ndarray, buf: bytes, n: int) -> np.ndarray:
    q = np.flatnonzero(a[:n] == _QUOTE)
    if buf.find(b"\\", 0, n) < 0 or not len(q):
        return q
    prev_bs = np.zeros(len(q), dtype=bool)
    nz = q > 0
    prev_bs[nz] = a[q[nz] - 1] == _BSLASH
    if not prev_bs.any():
        return q
    bs = np.flatnonzero(a[:n] == _BSLASH)
    # start of the run of consecutive backslashes each backslash belongs to
    new_run = np.ones(len(bs), dtype=bool)
    new_run[1:] = np.diff(bs) != 1
    run_start = np.maximum.accumulate(np.where(new_run, bs, 0))
    cand = q[prev_bs]
    j = np.searchsorted(bs, cand - 1)
    run_len = cand - run_start[j]
    escaped = np.zeros(len(q), dtype=bool)
    escaped[np.flatnonzero(prev_bs)] = (run_len & 1) == 1
    return q[~escaped]


def scan(buf: bytes, n: int) -> Scan:
    """Scan ``buf[:n]`` (which must start outside any string)."""
    a = np.frombuffer(buf, dtype=np.uint8)
    quotes = _unescaped_quotes(a, buf, n)
    t = a[:n] & 0xDF                     # folds '{' onto '[' and '}' onto ']'
    pos = np.flatnonzero((t == 0x5B) | (t == 0x5D))
    k = np.searchsorted(quotes, pos)     # quotes before each bracket
    outside = (k & 1) == 0
    pos, k = pos[outside], k[outside]
    cls = _BR_CLASS[a[pos]]
    depth = np.cumsum(_BR_DELTA[cls], dtype=np.int32)
    before = np.cumsum(np.bincount(k, minlength=len(quotes) + 1))[:len(quotes)]
    return Scan(buf, a, n, quotes, pos, cls, depth, before)


def skip(a: np.ndarray, p: np.ndarray, table: np.ndarray, steps: int = 32) -> np.ndarray:
    """Advance each position past bytes in ``table`` (bool[256]), at most ``steps``."""
    for _ in range(steps):
        m = table[a[p]]
        if not m.any():
            break
        p = p + m
    return p


WS = np.zeros(256, dtype=bool)
WS[[9, 10, 13, 32]] = True


class SplitError(Exception):
    """A byte range chosen for parallel reading does not hold whole events."""


class Unsplit(Exception):
    """:meth:`ArrayStream.pieces` cannot cut this file cheaply (an element bigger than
    ``PIECE_LIMIT``, no array end, or a cut its consumer found not to fall between two
    elements); the caller reads the file with the structural scan instead, which also
    names the exact problem of a malformed file."""


# '}' ',' '{' with only whitespace between: between two elements of an array of objects,
# unless it sits inside a string or a nested array -- then the piece it ends is not valid
# JSON, which the consumer's decoder reports (it must treat that as Unsplit).
_BOUNDARY = re.compile(rb"\}[ \t\r\n]*,[ \t\r\n]*(?=\{)")
PIECE_LIMIT = 32 << 20   # bytes without an element boundary before the scanner takes over (memory bound)
# bytes kept readable after a padded piece (ArrayStream.pieces): its closing bracket's byte
# and simdjson's SIMDJSON_PADDING (64) readable bytes, with room to spare
PIECE_PAD = 128


@dataclass
class Chunk:
    """Complete elements of the array found in one buffer."""
    scan: Scan
    starts: np.ndarray         # position of each element's '{'
    ends: np.ndarray           # position of each element's '}'
    offset: int                # offset of buf[0] in the decompressed stream


class _Reader:
    """Decompressed bytes of a file, plain or gzip (by magic), errors as InputError.

    gzip goes through ISA-L (python-isal's igzip): the same format and errors as the
    standard library's gzip module, inflated about 3x faster than zlib and 10x faster
    than ``zcat`` on Kineto traces (bench/bench_analyze.py measures it)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._f: BinaryIO = open(path, "rb")
        except FileNotFoundError:
            raise InputError(f"{path}: no such file") from None
        except IsADirectoryError:
            raise InputError(f"{path}: is a directory, expected a Kineto trace file") from None
        except PermissionError:
            raise InputError(f"{path}: permission denied") from None
        self.gz = self._f.read(2) == b"\x1f\x8b"
        self._f.seek(0)
        self._s: BinaryIO = igzip.GzipFile(fileobj=self._f) if self.gz else self._f
        # readinto: the buffered reader under the gzip file (both igzip's and the standard
        # library's GzipFile read through one), which inflates a large request straight into
        # the caller's buffer; GzipFile's own readinto reads a fresh bytes and copies it.
        inner = getattr(self._s, "_buffer", None) if self.gz else self._s
        self._into = inner.readinto if isinstance(inner, io.BufferedReader) else self._s.readinto

    def read(self, n: int) -> bytes:
        try:
            return self._s.read(n)
        except EOFError:
            raise InputError(f"{self.path}: truncated gzip file (compressed stream ends early)") from None
        except (gzip.BadGzipFile, zlib.error, *_INFLATE_ERRORS, OSError) as exc:
            raise InputError(f"{self.path}: corrupt gzip file ({exc})") from None

    def readinto(self, view: memoryview) -> int:
        """Up to ``len(view)`` bytes into ``view`` (fewer only at the end); errors as :meth:`read`."""
        try:
            return self._into(view)
        except EOFError:
            raise InputError(f"{self.path}: truncated gzip file (compressed stream ends early)") from None
        except (gzip.BadGzipFile, zlib.error, *_INFLATE_ERRORS, OSError) as exc:
            raise InputError(f"{self.path}: corrupt gzip file ({exc})") from None

    def close(self) -> None:
        self._s.close()
        self._f.close()


def _last_boundary(buf, lo: int = 0, hi: int | None = None) -> tuple[int, int] | None:
    """(end of the element before, start of the next) of the last ``},{`` in ``buf[lo:hi]``."""
    i = len(buf) if hi is None else hi
    while True:
        i = buf.rfind(b"}", lo, i)
        if i < 0:
            return None
        m = _BOUNDARY.match(buf, i, len(buf) if hi is None else hi)
        if m:
            return i + 1, m.end()


def parse_json(path: Path, data: bytes):
    """The whole document ``data`` (read from ``path``) parsed; InputError saying whether
    it is empty, truncated or otherwise not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        stripped = data.strip()
        if not stripped:
            raise InputError(f"{path}: empty file, expected a Kineto trace (JSON)") from None
        if stripped[:1] in (b"{", b"[") and exc.pos >= len(data.rstrip()) - 1:
            raise InputError(f"{path}: truncated JSON (document ends at byte {len(data)} "
                             "before it is complete)") from None
        raise InputError(f"{path}: not valid JSON ({exc.msg} at byte {exc.pos})") from None


def _read_capped(r: "_Reader", path: Path, what: str) -> bytes:
    """The rest of the stream, refused beyond HEAD_LIMIT bytes (memory bound)."""
    data = r.read(HEAD_LIMIT + 1)
    if len(data) > HEAD_LIMIT:
        raise InputError(f"{path}: the {what} is larger than {HEAD_LIMIT >> 20} MiB outside the event array")
    return data


class ArrayStream:
    """Iterate the elements of the array under top-level key ``key`` in chunks.

    After iteration, :attr:`top` holds the rest of the document (the array replaced
    by ``[]``) as parsed JSON. Raises InputError for a file that is not JSON, is
    truncated, or has no such array.
    """

    def __init__(self, path: str | Path, key: str = "traceEvents", chunk_bytes: int = CHUNK_BYTES):
        self.path = Path(path)
        self.key = key
        self.chunk_bytes = chunk_bytes
        self.top: dict = {}
        self.elements = 0
        self.top_array = False    # the document is the array itself (Chrome's JSON Array Format)
        self.padded = False       # the piece just yielded by pieces() is padded (see there)

    # -- errors ----------------------------------------------------------------------
    def _fail_whole(self, data: bytes) -> None:
        """The array was not found: classify the document and raise."""
        path = self.path
        doc = parse_json(path, data)
        raise InputError(f"{path}: not a Kineto/Chrome trace (JSON without a {self.key} array"
                         f"{'' if isinstance(doc, dict) else '; top level is not an object'})")

    def _truncated(self, offset: int, where: str) -> InputError:
        return InputError(f"{self.path}: truncated JSON (ends {where} after {self.elements} "
                          f"events, at byte {offset})")

    # -- iteration --------------------------------------------------------------------
    def __iter__(self) -> Iterator[Chunk]:
        r = _Reader(self.path)
        try:
            yield from self._iterate(r)
        finally:
            r.close()

    def _find_array(self, r: _Reader) -> tuple[bytes, bytes, int]:
        """Read until the array's '[' is found: (head text incl. '[', rest, offset of rest)."""
        data = b""
        pattern = b'"' + self.key.encode() + b'"'
        while True:
            more = r.read(self.chunk_bytes)
            data += more
            first = data.lstrip()[:1]
            if first and first != b"{":
                if first == b"[":
                    # Chrome's JSON Array Format: the document is the event array itself
                    self.top_array = True
                    at = data.index(b"[")
                    return data[:at + 1], data[at + 1:], at + 1
                raise InputError(f"{self.path}: not valid JSON (starts with {first!r})")
            if not more or len(data) > HEAD_LIMIT:
                break
            if data.find(pattern) >= 0:
                hit = self._locate(data, pattern)
                if hit is not None:
                    return data[:hit + 1], data[hit + 1:], hit + 1
        if len(data) > HEAD_LIMIT and data.find(pattern) >= 0:
            hit = self._locate(data, pattern)
            if hit is not None:
                return data[:hit + 1], data[hit + 1:], hit + 1
        if len(data) > HEAD_LIMIT:
            raise InputError(f"{self.path}: no {self.key} array in the first {HEAD_LIMIT >> 20} MiB "
                             "of the document")
        self._fail_whole(data + _read_capped(r, self.path, "document"))
        raise AssertionError("unreachable")

    def _locate(self, data: bytes, pattern: bytes) -> int | None:
        """Position of the '[' opening the array under the key at depth 1, or None."""
        i = data.find(pattern)
        while i >= 0:
            n = min(len(data), i + len(pattern) + 4096)
            s = scan(data[:n] + b" " * PAD, n)
            qi = int(np.searchsorted(s.quotes, i))
            if qi < len(s.quotes) and s.quotes[qi] == i and qi % 2 == 0:
                b = int(s.before[qi])
                if (s.depth[b - 1] if b else 0) == 1:
                    p = int(skip(s.a, np.array([i + len(pattern)]), WS)[0])
                    if s.a[p] == ord(":"):
                        p = int(skip(s.a, np.array([p + 1]), WS)[0])
                        if s.a[p] == ord("["):
                            return p
            i = data.find(pattern, i + 1)
        return None

    def pieces(self) -> Iterator[memoryview]:
        """The array's text in pieces of whole elements (``{..},{..}``, no brackets;
        memoryviews into the block read, valid until the next piece is asked for),
        about ``chunk_bytes`` each, cut at the last ``},{`` of each block read: no
        structural scan except of the last block, where the array ends. Identical
        pieces for identical bytes, so that two readers can share the work by piece
        index. After the last piece, :attr:`top` holds the rest of the document.
        Raises :class:`Unsplit` (see there) or InputError (unreadable file).

        Each block is inflated straight into one reused buffer, behind the carried tail
        (not read into a fresh ``bytes`` and copied, nor joined into a fresh one per
        block). While :attr:`padded` is True the piece just yielded lies in that buffer
        with one writable byte before it and one after it
        (the separator after its last ``}``), then at least :data:`PIECE_PAD` readable
        bytes (the carried tail, then padding; the tail must not be written): the native
        reader writes its brackets on those two bytes and parses the piece in place. The
        last piece (the array's end) is not padded."""
        r = _Reader(self.path)
        self.padded = False
        try:
            head, carry, offset = self._find_array(r)
            area = bytearray(1 + len(carry) + self.chunk_bytes + PIECE_PAD)
            area[1:1 + len(carry)] = carry
            used = len(carry)               # the carried tail: area[1:1 + used]
            del carry
            while True:
                if 1 + used + self.chunk_bytes + PIECE_PAD > len(area):
                    # a fresh buffer, not a resize: a bytearray with a view exported (the last
                    # piece yielded, until its reader lets go) cannot be resized (BufferError)
                    grown = bytearray(1 + used + self.chunk_bytes + PIECE_PAD)
                    grown[1:1 + used] = memoryview(area)[1:1 + used]
                    area = grown
                got = r.readinto(memoryview(area)[1 + used:1 + used + self.chunk_bytes])
                if not got:
                    break
                n = used + got
                cut = _last_boundary(area, 1, 1 + n)
                if cut is None:
                    if n > PIECE_LIMIT:
                        raise Unsplit(f"no element boundary in {n} bytes")
                    used = n
                    continue
                self.padded = True
                yield memoryview(area)[1:cut[0]]     # no copy: a reader skipping it pays nothing
                self.padded = False
                used = 1 + n - cut[1]
                area[1:1 + used] = area[cut[1]:1 + n]    # a copy first: the ranges may overlap
            buf = bytes(memoryview(area)[1:1 + used])
            del area
            n = len(buf)
            self._check_density(buf + b" " * PAD, offset)
            s = scan(buf + b" " * PAD, n)
            closing = np.flatnonzero(s.depth < 0)
            if not len(closing) or s.cls[closing[0]] != 4:
                raise Unsplit("the array does not end where expected")
            array_end = int(s.pos[closing[0]])
            if buf[:array_end].strip():
                yield memoryview(buf)[:array_end]
            self._parse_top(head + buf[array_end:], offset)
        finally:
            self.padded = False
            r.close()

    def head(self) -> tuple[bytes, int, int, bool]:
        """(head text up to and including the array's '[', offset just after it, file
        size, gzip?) without iterating: the seam for reading parts in parallel."""
        r = _Reader(self.path)
        try:
            head, _, offset = self._find_array(r)
            return head, offset, self.path.stat().st_size, r.gz
        finally:
            r.close()

    def iter_part(self, head: bytes, start: int, stop: int | None) -> Iterator[Chunk]:
        """Events of a plain (not gzip) file between byte offsets ``start`` (the array's
        first byte, or just after a ',' between two events) and ``stop`` (likewise, or
        None for the rest, including the array's end and the document's tail).
        Raises :class:`SplitError` when the range does not hold whole events."""
        r = _Reader(self.path)
        try:
            r._s.seek(start)
            yield from self._iterate(r, (head, b"", start), stop)
        finally:
            r.close()

    def _iterate(self, r: _Reader, found=None, stop: int | None = None) -> Iterator[Chunk]:
        head, carry, offset = found or self._find_array(r)
        eof = False
        pos = offset + len(carry)       # file offset of the next byte read
        while True:
            if not eof:
                want = self.chunk_bytes if stop is None else min(self.chunk_bytes, stop - pos)
                more = r.read(want) if want > 0 else b""
                pos += len(more)
                eof = not more
            else:
                more = b""
            if stop is not None and eof:
                if carry.strip(b" \t\r\n,"):
                    raise SplitError(f"part ending at byte {stop} ends inside an event")
                return
            buf = carry + more + b" " * PAD
            n = len(buf) - PAD
            if n == 0 and eof:
                raise self._truncated(offset, "inside the traceEvents array")
            self._check_density(buf, offset)
            s = scan(buf, n)
            self._check_depth(s, offset)
            closing = s.depth < 0
            end_at = int(np.argmax(closing)) if closing.any() else -1
            if end_at >= 0 and stop is not None:
                raise SplitError(f"part ending at byte {stop} leaves the array")
            limit = len(s.pos) if end_at < 0 else end_at
            d, c = s.depth[:limit], s.cls[:limit]
            opens = s.pos[:limit][(c == 1) & (d == 1)]
            closes = s.pos[:limit][(c == 3) & (d == 0)]
            if end_at >= 0:
                if s.cls[end_at] != 4:
                    raise InputError(f"{self.path}: not valid JSON (unbalanced brackets in "
                                     f"traceEvents near byte {offset + int(s.pos[end_at])})")
                starts, ends = opens[:len(closes)], closes
                if len(starts) != len(ends) or (len(ends) and (starts > ends).any()):
                    raise InputError(f"{self.path}: not valid JSON (malformed traceEvents near byte {offset})")
                if len(starts):
                    self.elements += len(starts)
                    yield Chunk(s, starts, ends, offset)
                array_end = int(s.pos[end_at])
                tail = buf[array_end:n] + (b"" if eof else _read_capped(r, self.path, "rest after the array"))
                self._parse_top(head + tail, offset)
                return
            if eof and self.top_array and not buf[int(closes[-1]) + 1 if len(closes) else 0:n].strip(_BETWEEN):
                # the JSON Array Format allows the closing ']' to be missing
                if len(closes):
                    self.elements += len(closes)
                    yield Chunk(s, opens[:len(closes)], closes, offset)
                return
            if eof:
                raise self._truncated(offset + n, "inside the traceEvents array")
            if not len(closes):
                carry = buf[:n]      # one element larger than the chunk: keep reading
                lead = len(carry) - len(carry.lstrip(_BETWEEN))
                carry, offset = carry[lead:], offset + lead   # separators cost nothing
                if len(carry) > MAX_ELEMENT_BYTES:
                    raise InputError(f"{self.path}: an element of {self.key} near byte {offset} is "
                                     f"larger than {MAX_ELEMENT_BYTES >> 20} MiB")
                continue
            last = int(closes[-1])
            starts = opens[:len(closes)]
            if (starts > closes).any():
                raise InputError(f"{self.path}: not valid JSON (malformed traceEvents near byte {offset})")
            self.elements += len(closes)
            yield Chunk(s, starts, closes, offset)
            carry = buf[last + 1:n]
            offset += last + 1

    def _check_density(self, buf: bytes, offset: int) -> None:
        """Refuse, before scanning, a buffer whose brackets would cost more memory than
        the scan is allowed (bytes.count: no copy, no array)."""
        opens = buf.count(b"[") + buf.count(b"{")
        if opens > MAX_OPENS_PER_SCAN:
            raise InputError(f"{self.path}: not a Kineto trace ({opens} '[' or '{{' in "
                             f"{len(buf) - PAD} bytes of {self.key} from byte {offset}; "
                             f"at most {MAX_OPENS_PER_SCAN} are read at once)")

    def _check_depth(self, s: Scan, offset: int) -> None:
        """Refuse nesting deeper than MAX_DEPTH (the buffer starts inside the array, at
        depth 1 of the document)."""
        if len(s.depth):
            deepest = int(s.depth.max()) + 1
            if deepest > MAX_DEPTH:
                at = offset + int(s.pos[int(np.argmax(s.depth))])
                raise InputError(f"{self.path}: not a Kineto trace (JSON nested {deepest} deep near byte "
                                 f"{at}; at most {MAX_DEPTH})")

    def _parse_top(self, text: bytes, offset: int) -> None:
        try:
            top = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            if exc.pos >= len(text.rstrip()) - 1:
                raise InputError(f"{self.path}: truncated JSON (the document ends after the "
                                 f"{self.key} array before it is complete)") from None
            raise InputError(f"{self.path}: not valid JSON ({exc.msg}, outside the {self.key} array)") from None
        self.top = top if isinstance(top, dict) else {}
