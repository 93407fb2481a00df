"""The structural scanner reader of Kineto traces: columns straight from the bytes.

It never builds a Python object per event. :mod:`probes.json_chunks` finds the events and
every key/value colon of a chunk; keys and category values are identified by a 64-bit
signature of their bytes; numbers are parsed from fixed-width byte windows with numpy;
only strings that become names (kernel, API and op names, shapes) are sliced out as bytes
and interned. An event the vectorised path cannot read exactly (an exponent, more than 18
digits, an unexpected shape) is parsed alone with orjson by the reference builder
(:class:`probes.kineto_dicts.EventBuilder`), so the result never depends on which path
read it.

:func:`probes.kineto.load_trace` takes this reader for the files the typed reader
(:mod:`probes.kineto_typed`) cannot cut into pieces; :func:`load` reads a file with it
alone, :func:`load_two` by this process and one forked child (None when that cannot be
done, and the caller reads it alone).
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import orjson

from . import json_chunks, sdpa
from . import kineto_records as rec
from .errors import InputError
from .events import (
    API_DOMAIN_DRIVER,
    API_DOMAIN_RUNTIME,
    API_DTYPE,
    COPY_DTYPE,
    COPY_KIND_MEMCPY,
    COPY_KIND_MEMSET,
    CPU_OP_DTYPE,
    KERNEL_DTYPE,
    MISSING,
    RANGE_CUDA_SYNC,
    RANGE_DTYPE,
    RANGE_GPU_ANNOTATION,
    RANGE_PROFILER_STEP,
    RANGE_USER_ANNOTATION,
    NameTable,
    Trace,
    empty,
)
from .kineto_dicts import EventBuilder, event_dict

__all__ = ["load", "load_two"]

_C1 = np.uint64(0x9E3779B97F4A7C15)
_C2 = np.uint64(0xC2B2AE3D27D4EB4F)
_POW10 = np.array([10 ** i for i in range(19)], dtype=np.int64)


def _would_wrap(got: np.ndarray, up: np.ndarray, m: int):
    """None when ``got * 10**up`` stays within the time range for every value; else an
    ok mask over the ``m`` windows (False: re-read by the dict path, which rejects it)."""
    lim = rec.TIME_LIMIT_NS // _POW10[np.clip(up, 0, 18)]
    over = (up > 0) & (np.abs(got) > lim)
    if not over.any():
        return None
    return ~over.reshape(m, -1).any(axis=1)


def _has_key(cf, key: str, depth: int, rowmap: np.ndarray, n: int) -> np.ndarray:
    """Per selected event: does it have ``key`` at ``depth`` (whatever its value)?"""
    m = np.zeros(n, dtype=bool)
    m[cf.rows(key, depth, rowmap)[1]] = True
    return m


def _u64(buf: bytes) -> np.ndarray:
    """Unaligned view: element i is the 8 bytes starting at buf[i] (little-endian)."""
    return np.ndarray(shape=(len(buf) - 8,), dtype="<u8", buffer=buf, strides=(1,))


def _sig(u64: np.ndarray, start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """64-bit signature of the byte strings buf[start:start+length] (first 16 bytes + length)."""
    length = length.astype(np.uint64)
    x = u64[start]
    short = length < 8
    x = np.where(short, x & ((np.uint64(1) << (length * np.uint64(8) * short)) - np.uint64(1)), x)
    with np.errstate(over="ignore"):
        h = x * _C1 + length
        long_ = np.flatnonzero(length > 8)
        if len(long_):
            l1 = length[long_] - np.uint64(8)
            y = u64[start[long_] + 8]
            y = np.where(l1 < 8, y & ((np.uint64(1) << (l1 * np.uint64(8) * (l1 < 8))) - np.uint64(1)), y)
            h[long_] += y * _C2
    return h


def _sig_of(text: str) -> int:
    b = text.encode() + b" " * 32
    return int(_sig(_u64(b), np.array([0]), np.array([len(text.encode())]))[0])


_KEYS = ["cat", "ph", "name", "pid", "tid", "ts", "dur", "args",
         "device", "stream", "context", "correlation", "External id", "registers per thread",
         "shared memory", "grid", "block", "bytes", "cbid", "Input Dims", "Input type", "Concrete Inputs"]
_K = {k: i for i, k in enumerate(_KEYS)}
_KEY_SIGS = np.array([_sig_of(k) for k in _KEYS], dtype=np.uint64)
_KEY_ORDER = np.argsort(_KEY_SIGS)
_KEY_SORTED = _KEY_SIGS[_KEY_ORDER]

# categories the importer keeps, by kind
_CATS = ["kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "cpu_op",
         "user_annotation", "gpu_user_annotation", "cuda_sync"]
_CAT_CODE = {_sig_of(c): i for i, c in enumerate(_CATS)}
_CAT_NONE = -1      # no "cat" key
_CAT_OTHER = -2     # a category we do not keep
(_C_KERNEL, _C_MEMCPY, _C_MEMSET, _C_RUNTIME, _C_DRIVER, _C_CPU_OP,
 _C_USER, _C_GPU_USER, _C_SYNC) = range(len(_CATS))


class _ChunkFields:
    """Keys and value positions of one chunk, and per-event category."""

    def __init__(self, chunk: json_chunks.Chunk, counts: dict, cat_names: dict):
        s = chunk.scan
        self.s = s
        self.buf = s.buf
        a = self.a = s.a
        self.u64 = u64 = _u64(s.buf)
        q = s.quotes
        self.q_ext = q_ext = np.concatenate([q, [s.n, s.n]])   # so j + 1, j + 2 always index
        self.starts, self.ends = starts, ends = chunk.starts, chunk.ends
        self.nev = nev = len(starts)
        self.cat = cat = np.full(nev, _CAT_NONE, dtype=np.int8)
        self._slen = None
        self._closes2 = None

        # 1. category of each event, from its depth-1 "cat" key, before anything else, so
        #    that events we do not keep (python_function, flows, instants) cost nothing more
        ck, ck_v = self._event_keys(b'"cat"')
        ck_j, ck_ev = ck
        is_str = q_ext[ck_j + 1] == ck_v
        ck_j, ck_ev, ck_v = ck_j[is_str], ck_ev[is_str], ck_v[is_str]
        vs = ck_v + 1
        ve = q_ext[ck_j + 2]
        csig = _sig(u64, vs, ve - vs)
        uniq, first, inv, cnt = np.unique(csig, return_index=True, return_inverse=True, return_counts=True)
        code = np.empty(len(uniq), dtype=np.int8)
        for i, (u, f) in enumerate(zip(uniq.tolist(), first.tolist())):
            name = cat_names.get(u)
            if name is None:
                name = cat_names[u] = _decode(self.buf[vs[f]:ve[f]])
            counts[name] = counts.get(name, 0) + int(cnt[i])
            code[i] = _CAT_CODE.get(u, _CAT_OTHER)
        cat[ck_ev] = code[inv]
        none = int((cat == _CAT_NONE).sum())
        if none:
            counts["<none>"] = counts.get("<none>", 0) + none
        (pk_j, pk_ev), pv = self._event_keys(b'"ph"')
        not_x = (a[pv] != 34) | (a[pv + 1] != ord("X")) | (a[pv + 2] != 34)
        cat[pk_ev[not_x]] = _CAT_OTHER

        # 2. every key of the kept events: closing quotes followed by ':'
        kept = np.flatnonzero(cat >= 0)
        lo = np.searchsorted(q, starts[kept])
        hi = np.searchsorted(q, ends[kept])
        lo += lo & 1 == 0                     # first closing quote (odd index) in the event
        cnt_q = np.maximum((hi - lo + 1) // 2, 0)
        total = int(cnt_q.sum())
        offs = np.cumsum(cnt_q) - cnt_q
        jc = np.repeat(lo - 2 * offs, cnt_q) + 2 * np.arange(total)
        evq = np.repeat(kept, cnt_q)
        after = q[jc] + 1
        nx = a[after]
        is_key = nx == 58
        ws = np.flatnonzero(json_chunks.WS[nx])
        if len(ws):
            p = json_chunks.skip(a, after[ws], json_chunks.WS)
            is_key[ws] = a[p] == 58
            after[ws] = p
        j, colon, ev = jc[is_key], after[is_key], evq[is_key]
        b = s.before[j]
        depth = s.depth[np.maximum(b - 1, 0)]
        keep = (depth >= 1) & (depth <= 2)
        if not keep.all():
            j, colon, ev, depth = j[keep], colon[keep], ev[keep], depth[keep]
        kopen = q[j - 1] + 1
        ksig = _sig(u64, kopen, q[j] - kopen)
        pos = np.minimum(np.searchsorted(_KEY_SORTED, ksig), len(_KEY_SORTED) - 1)
        known = np.flatnonzero(_KEY_SORTED[pos] == ksig)
        kid = _KEY_ORDER[pos[known]].astype(np.int8)
        order = np.argsort(kid, kind="stable")
        self.kid = kid[order]
        sel = known[order]
        self.cdep = depth[sel]
        self.cev = ev[sel]
        self.kj = j[sel]
        v = colon[sel] + 1
        v = v + (a[v] == 32)                  # "key": value  (one space, the common case)
        more = np.flatnonzero(json_chunks.WS[a[v]])
        if len(more):
            v[more] = json_chunks.skip(a, v[more], json_chunks.WS)
        self.v = v
        self._bounds = np.searchsorted(self.kid, np.arange(len(_KEYS) + 1))

    def _event_keys(self, pattern: bytes):
        """((quote index of the closing quote, event), value position) of the depth-1
        keys spelled ``pattern`` (with its quotes) in every event of the chunk."""
        a, s = self.a, self.s
        if self._slen is None:
            q = s.quotes
            m = len(q) // 2
            self._slen = q[1:2 * m:2] - q[0:2 * m:2] - 1   # length of every string
        L = len(pattern) - 2
        cand = np.flatnonzero(self._slen == L)
        jo = 2 * cand
        qo = s.quotes[jo]
        for i in range(L):
            ok = a[qo + 1 + i] == pattern[1 + i]
            jo, qo = jo[ok], qo[ok]
        cand = jo + 1
        after = json_chunks.skip(a, qo + L + 2, json_chunks.WS)
        ok = a[after] == 58
        cand, after = cand[ok], after[ok]
        b = s.before[cand]
        depth = np.where(b > 0, s.depth[np.maximum(b - 1, 0)], 0)
        ev = np.searchsorted(self.starts, after, side="right") - 1
        ok = (depth == 1) & (ev >= 0) & (ev < self.nev)
        cand, after, ev = cand[ok], after[ok], ev[ok]
        ok = after < self.ends[ev]
        cand, after, ev = cand[ok], after[ok], ev[ok]
        v = json_chunks.skip(self.a, after + 1, json_chunks.WS)
        return (cand, ev), v

    # -- field access for a set of events ------------------------------------------
    def rows(self, key: str, depth: int, rowmap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(key rows, output rows) of ``key`` at ``depth`` in the selected events."""
        k = _K[key]
        lo, hi = self._bounds[k], self._bounds[k + 1]
        r = lo + np.flatnonzero(self.cdep[lo:hi] == depth)
        out = rowmap[self.cev[r]]
        sel = out >= 0
        return r[sel], out[sel]

    def numbers(self, key: str, depth: int, rowmap: np.ndarray, n: int, scale: int,
                bad: np.ndarray) -> np.ndarray:
        """int64 column (MISSING where absent or not a number), value * 10**scale."""
        col = np.full(n, MISSING, dtype=np.int64)
        r, o = self.rows(key, depth, rowmap)
        if len(r):
            v = self.v[r]
            vals, status = _parse_windows(self.a, v, self.q_ext[self.kj[r] + 1], scale, 1)
            ok = status == 0
            col[o[ok]] = vals[ok, 0]
            bad[o[status == 2]] = True
        return col

    def triples(self, key: str, rowmap: np.ndarray, n: int, bad: np.ndarray) -> np.ndarray:
        """n x 3 int64 from ``[x, y, z]`` values of an args key."""
        out = np.full((n, 3), MISSING, dtype=np.int64)
        r, o = self.rows(key, 2, rowmap)
        if not len(r):
            return out
        v = self.v[r]
        is_arr = self.a[v] == ord("[")
        vals, status = _parse_windows(self.a, v + 1, self.q_ext[self.kj[r] + 1], 0, 3)
        ok = is_arr & (status == 0)
        out[o[ok]] = vals[ok]
        bad[o[~ok]] = True
        return out

    def strings(self, key: str, depth: int, rowmap: np.ndarray, n: int,
                interner: "_Interner", bad: np.ndarray) -> np.ndarray:
        """Name ids of string values (MISSING where absent)."""
        col = np.full(n, MISSING, dtype=np.int32)
        r, o = self.rows(key, depth, rowmap)
        if not len(r):
            return col
        v = self.v[r]
        qs = self.q_ext[self.kj[r] + 1]
        is_str = qs == v
        bad[o[~is_str & (self.a[v] != ord("n"))]] = True   # null is simply absent
        r, o, qs = r[is_str], o[is_str], qs[is_str]
        col[o] = interner.ids(self.a, qs + 1, self.q_ext[self.kj[r] + 2])
        return col

    def raw_json(self, key: str, rowmap: np.ndarray, n: int, interner: "_Interner",
                 bad: np.ndarray) -> np.ndarray:
        """Name ids of the compact JSON text of array values of an args key."""
        col = np.full(n, MISSING, dtype=np.int32)
        r, o = self.rows(key, 2, rowmap)
        if not len(r):
            return col
        s = self.s
        v = self.v[r]
        is_arr = self.a[v] == ord("[")
        bad[o[~is_arr & (self.a[v] != ord("n"))]] = True
        v, o = v[is_arr], o[is_arr]
        if self._closes2 is None:
            self._closes2 = s.pos[(s.depth == 2) & (s.cls >= 3)]
        closes = self._closes2
        end = closes[np.minimum(np.searchsorted(closes, v), len(closes) - 1)] + 1
        col[o] = interner.json_ids(self.a, v, end)
        return col

    def json_values(self, key: str, rowmap: np.ndarray, want: np.ndarray) -> dict[int, object]:
        """Output row -> decoded array value of an args key, for the output rows where
        ``want`` is True (a few rows: each value is decoded on its own)."""
        r, o = self.rows(key, 2, rowmap)
        sel = want[o]
        r, o = r[sel], o[sel]
        if not len(r):
            return {}
        v = self.v[r]
        is_arr = self.a[v] == ord("[")
        v, o = v[is_arr], o[is_arr]
        if self._closes2 is None:
            self._closes2 = self.s.pos[(self.s.depth == 2) & (self.s.cls >= 3)]
        closes = self._closes2
        end = closes[np.minimum(np.searchsorted(closes, v), len(closes) - 1)] + 1
        out = {}
        for row, lo, hi in zip(o.tolist(), v.tolist(), end.tolist()):
            try:
                out[row] = orjson.loads(self.a[lo:hi].tobytes())
            except orjson.JSONDecodeError:
                pass
        return out

    def event_dicts(self, events: np.ndarray) -> list[dict]:
        buf = self.buf
        return [event_dict(buf[s:e + 1]) for s, e in zip(self.starts[events].tolist(),
                                                          self.ends[events].tolist())]


# bytes kept when numbers are handed to numpy's C parser: digits, '-', '.';
# exponent characters become 'x' so that such a number fails to parse (-> slow path);
# everything else (',', '}', ']', whitespace) becomes a separator.
_NUMMAP = np.full(256, 32, dtype=np.uint8)
for _c in b"0123456789-.":
    _NUMMAP[_c] = _c
for _c in b"eE+":
    _NUMMAP[_c] = ord("x")
_MAX_WINDOW = 64


def _parse_windows(a: np.ndarray, v: np.ndarray, end: np.ndarray, scale: int,
                   per: int) -> tuple[np.ndarray, np.ndarray]:
    """Parse ``per`` JSON numbers from each window a[v:end] (a value up to the next
    quote); values times 10**scale, exactly (integer arithmetic, no float rounding).

    Returns (values n x per, status): 0 parsed, 1 not a number (string, null, bool:
    the caller treats it as absent), 2 not read exactly here (exponent, > 18 digits,
    extra decimals, wrong count): the caller re-reads that event with orjson.
    """
    n = len(v)
    vals = np.full((n, per), MISSING, dtype=np.int64)
    status = np.ones(n, dtype=np.int8)
    first = a[v]
    num = ((first >= 48) & (first <= 57)) | (first == 45)
    length = end - v
    status[num & (length > _MAX_WINDOW)] = 2
    idx = np.flatnonzero(num & (length <= _MAX_WINDOW))
    for _ in range(2):
        if not len(idx):
            return vals, status
        got, ok = _parse_selected(a, v[idx], length[idx], scale, per)
        if ok is None:
            vals[idx] = got
            status[idx] = 0
            return vals, status
        status[idx[~ok]] = 2          # drop the windows that broke the count, retry once
        idx = idx[ok]
    status[idx] = 2
    return vals, status


def _parse_selected(a, v, length, scale, per):
    """(values, None) on success, or (None, per-window ok mask) when some window does
    not hold exactly ``per`` plain numbers."""
    m = len(v)
    offsets = np.cumsum(length) - length
    total = int(length.sum())
    idx = np.repeat(v - offsets, length) + np.arange(total)
    blob = _NUMMAP[a[idx]]
    dots = np.flatnonzero(blob == 46)
    frac = np.zeros(m * per, dtype=np.int64)
    if len(dots):
        seps = np.flatnonzero(blob == 32)
        nxt = seps[np.minimum(np.searchsorted(seps, dots), len(seps) - 1)]
        nxt = np.where(nxt > dots, nxt, total)
        w = np.searchsorted(offsets, dots, side="right") - 1
        if per != 1 or (np.bincount(w, minlength=m) > 1).any():
            ok = np.ones(m, dtype=bool)
            ok[w] = False             # decimals in a triple, or two dots in a window
            return None, ok
        frac[w] = nxt - dots - 1
        blob = blob[blob != 46]
    blob_b = blob.tobytes()
    try:
        with _quiet():
            got = np.fromstring(blob_b, dtype=np.int64, sep=" ")
    except ValueError:          # trailing junk (e.g. an exponent): find the windows below
        got = np.empty(0, dtype=np.int64)
    # 19+ digit integers saturate silently in the C parser: send them to the slow path
    if len(got) != m * per or (frac > 18).any() or (np.abs(got) >= 10**18).any():
        return None, _token_counts_ok(blob, offsets if not len(dots) else None, m, per, v, a, length)
    up = scale - frac
    wraps = _would_wrap(got, up, m)
    if wraps is not None:
        return None, wraps
    scaled = np.where(up >= 0, got * _POW10[np.clip(up, 0, 18)], 0)
    down = up < 0
    if down.any():
        div = _POW10[np.clip(-up, 0, 18)]
        if (got[down] % div[down] != 0).any():
            ok = np.ones(m, dtype=bool)
            ok[np.flatnonzero(down)[got[down] % div[down] != 0] // per] = False
            return None, ok
        scaled = np.where(down, got // div, scaled)
    return scaled.reshape(m, per), None


def _token_counts_ok(blob, offsets, m, per, v, a, length):
    """Per window: does it hold exactly ``per`` tokens that are plain numbers?"""
    if offsets is None:   # dots were removed: recompute on the original bytes
        offsets = np.cumsum(length) - length
        total = int(length.sum())
        idx = np.repeat(v - offsets, length) + np.arange(total)
        blob = _NUMMAP[a[idx]]
    is_tok = blob != 32
    start = is_tok.copy()
    start[1:] &= ~is_tok[:-1]
    start[offsets] = is_tok[offsets]
    w = np.searchsorted(offsets, np.flatnonzero(start), side="right") - 1
    cnt = np.bincount(w, minlength=m)
    bad_chars = np.bincount(np.searchsorted(offsets, np.flatnonzero(blob == ord("x")), side="right") - 1,
                            minlength=m)
    ok = (cnt == per) & (bad_chars == 0)
    if ok.all():   # the count was right: a value too large for int64; all go the slow path
        ok[:] = False
    return ok


class _quiet:
    """np.fromstring(sep=...) warns on trailing junk; the count check handles it."""

    def __enter__(self):
        import warnings
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


def _decode(raw: bytes) -> str:
    if b"\\" in raw:
        return orjson.loads(b'"' + raw + b'"')
    return raw.decode("utf-8", errors="replace")


def _slices(a: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> list[bytes]:
    """buf[s:e] for many ranges at once: one gather and one C-level split instead of a
    Python slice per range. NUL separates them: JSON text never holds a raw NUL."""
    n = len(starts)
    if not n:
        return []
    L = ends - starts + 1
    offs = np.cumsum(L) - L
    idx = np.repeat(starts - offs, L) + np.arange(int(L.sum()))
    out = a[idx]
    out[offs + L - 1] = 0
    return out.tobytes().split(b"\x00")[:n]


class _Interner:
    """bytes -> name id, decoding each distinct string once."""

    def __init__(self, names: NameTable):
        self.names = names
        self.by_bytes: dict[bytes, int] = {}
        self.by_json: dict[bytes, int] = {}

    def _ids(self, d: dict, raws: list, make) -> np.ndarray:
        out = list(map(d.get, raws))
        if None in out:
            for i, r in enumerate(raws):
                if out[i] is None:
                    j = d.get(r)
                    if j is None:
                        j = d[r] = self.names.intern(make(r))
                    out[i] = j
        return np.array(out, dtype=np.int32)

    def ids(self, a: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        return self._ids(self.by_bytes, _slices(a, starts, ends), _decode)

    def json_ids(self, a: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        return self._ids(self.by_json, _slices(a, starts, ends),
                         lambda r: orjson.dumps(orjson.loads(r)).decode())


def _select(cf: _ChunkFields, codes: tuple) -> tuple[np.ndarray, np.ndarray]:
    events = np.flatnonzero(np.isin(cf.cat, codes))
    rowmap = np.full(cf.nev, -1, dtype=np.int64)
    rowmap[events] = np.arange(len(events))
    return events, rowmap


def _times(cf: _ChunkFields, rowmap, n, out, bad) -> None:
    ts = cf.numbers("ts", 1, rowmap, n, 3, bad)
    dur = cf.numbers("dur", 1, rowmap, n, 3, bad)
    bad |= ts == MISSING
    bad |= (dur == MISSING) & _has_key(cf, "dur", 1, rowmap, n)
    out["start_ns"] = ts
    out["end_ns"] = ts + np.where(dur == MISSING, 0, dur)


def _fallback(cf: _ChunkFields, events: np.ndarray, bad: np.ndarray, out: np.ndarray,
              b: EventBuilder, build) -> None:
    """Re-read the flagged events with orjson through the dict path, in place."""
    if not bad.any():
        return
    rows = np.flatnonzero(bad)
    dicts = cf.event_dicts(events[rows])
    tmp = EventBuilder(names=b.names)
    tmp.add(dicts)
    out[rows] = build(tmp)


def _chunk_rows(cf, interner, b, dtype, codes, fill, build) -> np.ndarray:
    """Rows of one event kind (categories ``codes``) of a chunk.

    The columns every kind has (times, name) are read here, the kind's own by ``fill``;
    rows the vectorised read flags ``bad`` are re-read by the dict path (``build``).
    """
    events, rowmap = _select(cf, codes)
    n = len(events)
    out = empty(dtype, n)
    if not n:
        return out
    bad = np.zeros(n, dtype=bool)
    _times(cf, rowmap, n, out, bad)
    out["name_id"] = cf.strings("name", 1, rowmap, n, interner, bad)
    fill(cf, interner, b, events, rowmap, n, out, bad)
    _fallback(cf, events, bad, out, b, build)
    return out


def _fill_kernels(cf, interner, b, events, rowmap, n, out, bad):
    for col, key in (("device", "device"), ("stream", "stream"), ("context", "context"),
                     ("correlation_id", "correlation"), ("external_id", "External id"),
                     ("registers", "registers per thread"), ("shared_mem_bytes", "shared memory")):
        out[col] = cf.numbers(key, 2, rowmap, n, 0, bad)
    for prefix in ("grid", "block"):
        xyz = cf.triples(prefix, rowmap, n, bad)
        out[prefix + "_x"], out[prefix + "_y"], out[prefix + "_z"] = xyz[:, 0], xyz[:, 1], xyz[:, 2]


def _fill_copies(cf, interner, b, events, rowmap, n, out, bad):
    for col, key in (("device", "device"), ("stream", "stream"),
                     ("correlation_id", "correlation"), ("bytes", "bytes")):
        out[col] = cf.numbers(key, 2, rowmap, n, 0, bad)
    out["kind"] = np.where(cf.cat[events] == _C_MEMSET, COPY_KIND_MEMSET, COPY_KIND_MEMCPY)


def _fill_api(cf, interner, b, events, rowmap, n, out, bad):
    out["pid"] = rec.ids32(cf.numbers("pid", 1, rowmap, n, 0, bad))
    out["tid"] = rec.ids32(cf.numbers("tid", 1, rowmap, n, 0, bad))
    out["correlation_id"] = cf.numbers("correlation", 2, rowmap, n, 0, bad)
    out["external_id"] = cf.numbers("External id", 2, rowmap, n, 0, bad)
    out["cbid"] = cf.numbers("cbid", 2, rowmap, n, 0, bad)
    out["domain"] = np.where(cf.cat[events] == _C_DRIVER, API_DOMAIN_DRIVER, API_DOMAIN_RUNTIME)


def _fill_ranges(cf, interner, b, events, rowmap, n, out, bad):
    cat = cf.cat[events]
    cpu = cat == _C_USER
    pid = rec.ids32(cf.numbers("pid", 1, rowmap, n, 0, bad))
    tid = rec.ids32(cf.numbers("tid", 1, rowmap, n, 0, bad))
    dev = rec.ids32(cf.numbers("device", 2, rowmap, n, 0, bad))
    stream = rec.ids32(cf.numbers("stream", 2, rowmap, n, 0, bad))
    # mirror the dict path: GPU rows take device from args or else pid, stream from args or tid
    has_dev = _present(cf, "device", rowmap, n)
    has_stream = _present(cf, "stream", rowmap, n)
    out["device"] = np.where(cpu, MISSING, np.where(has_dev, dev, pid))
    out["pid"] = np.where(cpu, pid, MISSING)
    out["tid"] = np.where(cpu, tid, np.where(has_stream, stream, tid))
    out["external_id"] = cf.numbers("External id", 2, rowmap, n, 0, bad)
    step_ids = np.zeros(max(len(b.names), 1), dtype=bool)
    for i, s in enumerate(b.names.strings):
        step_ids[i] = s.startswith("ProfilerStep#")
    nid = out["name_id"]
    step = np.zeros(n, dtype=bool)
    step[nid >= 0] = step_ids[nid[nid >= 0]]
    out["kind"] = np.where(cat == _C_SYNC, RANGE_CUDA_SYNC,
                           np.where(step, RANGE_PROFILER_STEP,
                                    np.where(cpu, RANGE_USER_ANNOTATION, RANGE_GPU_ANNOTATION)))


def _present(cf, key, rowmap, n) -> np.ndarray:
    m = np.zeros(n, dtype=bool)
    _, o = cf.rows(key, 2, rowmap)
    m[o] = True
    return m


def _fill_cpu_ops(cf, interner, b, events, rowmap, n, out, bad):
    out["pid"] = rec.ids32(cf.numbers("pid", 1, rowmap, n, 0, bad))
    out["tid"] = rec.ids32(cf.numbers("tid", 1, rowmap, n, 0, bad))
    out["external_id"] = cf.numbers("External id", 2, rowmap, n, 0, bad)
    # after the name: the interner numbers strings in the order met
    out["input_dims_id"] = cf.raw_json("Input Dims", rowmap, n, interner, bad)
    out["input_types_id"] = cf.raw_json("Input type", rowmap, n, interner, bad)
    out["is_causal"] = _causal_flags(cf, b, rowmap, n, out["name_id"])


def _causal_flags(cf, b, rowmap, n, name_id) -> np.ndarray:
    """The SDPA operators' causal flag (probes.sdpa); only their few rows are decoded."""
    col = np.full(n, sdpa.CAUSAL_FLAG_UNKNOWN, dtype=np.int8)
    strings = b.names.strings
    ids = [i for i in map(b.names.lookup, sdpa.SDPA_OPS) if i >= 0]
    if not ids or not n:
        return col
    want = np.isin(name_id, ids)
    if not want.any():
        return col
    concrete = cf.json_values("Concrete Inputs", rowmap, want)
    types = cf.json_values("Input type", rowmap, want)
    for row, ci in concrete.items():
        col[row] = sdpa.causal_flag(strings[int(name_id[row])], ci, types.get(row))
    return col


# kind, dtype, event categories, kind-specific columns, dict-path builder
_KINDS = (("kernels", KERNEL_DTYPE, (_C_KERNEL,), _fill_kernels, EventBuilder.build_kernels),
          ("copies", COPY_DTYPE, (_C_MEMCPY, _C_MEMSET), _fill_copies, EventBuilder.build_copies),
          ("api", API_DTYPE, (_C_RUNTIME, _C_DRIVER), _fill_api, EventBuilder.build_api),
          ("ranges", RANGE_DTYPE, (_C_USER, _C_GPU_USER, _C_SYNC), _fill_ranges, EventBuilder.build_ranges),
          ("cpu_ops", CPU_OP_DTYPE, (_C_CPU_OP,), _fill_cpu_ops, EventBuilder.build_cpu_ops))


def _read_parts(chunks, b: EventBuilder, interner: _Interner, budget=None) -> dict[str, np.ndarray]:
    """Run the per-chunk extraction over ``chunks``; one array per kind, in file order.
    Rows kept are charged to ``budget`` (an :class:`EventBudget`) chunk by chunk."""
    parts: dict[str, list] = {k[0]: [] for k in _KINDS}
    cat_names: dict[int, str] = {}
    for chunk in chunks:
        cf = _ChunkFields(chunk, b.counts, cat_names)
        for kind, dtype, codes, fill, build in _KINDS:
            arr = _chunk_rows(cf, interner, b, dtype, codes, fill, build)
            if len(arr):
                parts[kind].append(arr)
                if budget is not None:
                    budget.charge(kind, len(arr))
        if budget is not None:
            budget.charge_names(b.names)
        del cf, chunk
    cols = {}
    for kind, dtype, *_ in _KINDS:
        lst = parts.pop(kind)
        cols[kind] = np.concatenate(lst) if len(lst) > 1 else (lst[0] if lst else empty(dtype))
        del lst
    return cols


def _part_worker(path: str, chunk_bytes: int, head: bytes, start: int, conn, budget=None) -> None:
    """Child process: read the second half of a plain file, send back plain arrays."""
    try:
        stream = json_chunks.ArrayStream(path, "traceEvents", chunk_bytes)
        b = EventBuilder()
        cols = _read_parts(stream.iter_part(head, start, None), b, _Interner(b.names), budget)
        conn.send(("ok", cols, list(b.names), b.counts, stream.top))
    except BaseException as exc:  # noqa: BLE001  (a child process: any failure is sent to the parent, which reads alone)
        conn.send(("error", f"{type(exc).__name__}: {exc}", None, None, None))
    finally:
        conn.close()


def _split_point(path: Path, lo: int, size: int) -> int | None:
    """A byte offset just after the ',' between two events near the middle, or None.

    ``}`` ``,`` ``{`` ``"`` with an unescaped quote cannot occur inside a JSON string,
    so the match is between two objects; whether they are top-level events is checked
    by the readers (SplitError), and the caller falls back to one reader."""
    mid = lo + (size - lo) // 2
    with open(path, "rb") as f:
        f.seek(mid)
        window = f.read(4 << 20)
    m = re.search(rb'\}\s*,(?=\s*\{\s*"(?:ph|cat|name|pid|tid|ts)")', window)
    return mid + m.end() if m else None


def load_two(path: Path, chunk_bytes: int, budget=None) -> Trace | None:
    """The trace read by this process (first half) and a forked child (second half of a
    plain file), or None where that cannot be done (gzip, no split point, a child that
    fails or is too slow): the caller then reads the file alone."""
    import multiprocessing as mp
    stream = json_chunks.ArrayStream(path, "traceEvents", chunk_bytes)
    head, start, size, gz = stream.head()
    if gz:
        return None
    split = _split_point(path, start, size)
    if split is None:
        return None
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    half = budget.half() if budget is not None else None
    child = ctx.Process(target=_part_worker, args=(str(path), chunk_bytes, head, split, send, half), daemon=True)
    child.start()
    send.close()
    try:
        b = EventBuilder()
        interner = _Interner(b.names)
        first = _read_parts(stream.iter_part(head, start, split), b, interner, half)
        # never wait forever on the child: it must answer within a generous time
        # (5 MB/s of its half) or have died, else the file is read here alone
        deadline = time.monotonic() + max(60.0, (size - split) / 5e6)
        while not recv.poll(1.0):
            if not child.is_alive() or time.monotonic() > deadline:
                return None
        status, second, names2, counts2, top = recv.recv()
    except (json_chunks.SplitError, InputError, EOFError, OSError):
        return None
    finally:
        if child.is_alive():
            child.kill()
        child.join()
    if status != "ok":
        return None
    remap = np.array([b.names.intern(s) for s in names2] or [0], dtype=np.int32)
    cols = {}
    for kind, dtype, *_ in _KINDS:
        x = second[kind]
        for c in ("name_id", "input_dims_id", "input_types_id"):
            if c in dtype.names and len(x):
                x[c] = np.where(x[c] >= 0, remap[np.maximum(x[c], 0)], x[c])
        cols[kind] = np.concatenate([first.pop(kind), x])
        second[kind] = None
    for k, v in counts2.items():
        b.counts[k] = b.counts.get(k, 0) + v
    return rec.assembled(path, top, b.names, b.counts, cols)


def load(path: Path, chunk_bytes: int, parallel: bool, budget=None) -> Trace:
    """The trace at ``path`` read by this scanner alone (``parallel``: by two processes
    where :func:`load_two` can). The schema is not checked here: that is
    :func:`probes.kineto.load_trace`'s part."""
    if parallel:
        trace = load_two(path, chunk_bytes, budget)
        if trace is not None:
            return trace
    stream = json_chunks.ArrayStream(path, "traceEvents", chunk_bytes)
    b = EventBuilder()
    cols = _read_parts(stream, b, _Interner(b.names), budget)
    trace = rec.assembled(path, stream.top, b.names, b.counts, cols)
    if stream.top_array:
        trace.meta["json_array_format"] = True
    return trace
