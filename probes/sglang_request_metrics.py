"""SGLang's per-request metrics files, as request records: the fallback where no trace comes.

An SGLang server started with ``--export-metrics-to-file --export-metrics-to-file-dir DIR``
writes one JSON object per finished request (JSON lines) to ``DIR/sglang-request-metrics-
<YYYYmmdd_HH>.log``, a new file each hour (``FileRequestMetricsExporter`` in
``python/sglang/srt/managers/request_metrics_exporter.py``; tests/test_sglang_request_metrics.py
names the commit). A record is ``{"request_parameters": <the request, JSON-encoded in a
string: its "rid">, **meta_info}``, the response's ``meta_info``: ``id`` (the rid),
``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``e2e_latency`` (s) and, when the
server runs with metrics on, the time stamps ``request_received_ts``,
``prefill_finished_ts`` (first token) and ``decode_finished_ts`` (epoch seconds).

Contract:

* :func:`parse_line` turns one line into a :class:`probes.request_spans.RequestSpan`
  (engine ``"sglang"``), or None when it is no request record (a health check, a record
  without times); it never raises on bad input (:class:`LineError` is counted by the
  caller). Fields SGLang did not write are -1. The queue time is not in the file: -1.
* :class:`SglangRequestMetricsProbe` follows the folder: each poll reads what was appended
  since the last (from the end of the files present at start: old requests have no GPU
  steps to join), at most ``max_bytes_per_poll``, a line at most ``max_line_bytes`` (a
  longer one is skipped to its end, counted), the two newest files only (an hour's
  rotation). ``poll()`` returns ``{"requests": [RequestSpan, ...]}``, like the OTLP probe.
"""
from __future__ import annotations

import math
import os
import re

import msgspec

from .probe import Availability, Probe
from .request_spans import RequestSpan

FILE_RE = re.compile(r"^sglang-request-metrics-\d{8}_\d{2}\.log$")
MAX_LINE_BYTES = 256 * 1024
MAX_BYTES_PER_POLL = 4 * 2**20
#: Newest files followed (the current hour's and the one before, still being finished).
FOLLOWED_FILES = 2


class LineError(ValueError):
    """A line that is no JSON object."""


_DECODER = msgspec.json.Decoder()


def _seconds(v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return -1.0
    return float(v)


def _count(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > 2**40:
        return -1
    return v


def _rid(rec: dict) -> str:
    rid = rec.get("id")
    if isinstance(rid, str) and rid:
        return rid
    params = rec.get("request_parameters")
    if isinstance(params, str) and len(params) <= MAX_LINE_BYTES:
        try:
            p = _DECODER.decode(params)
        except msgspec.DecodeError:
            return ""
        rid = p.get("rid") if isinstance(p, dict) else None
        return rid if isinstance(rid, str) else ""
    return ""


def parse_line(line: bytes) -> RequestSpan | None:
    try:
        rec = _DECODER.decode(line)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise LineError(f"not a JSON line: {str(exc)[:80]}") from None
    if not isinstance(rec, dict):
        raise LineError("not a JSON object")
    rid = _rid(rec)
    if not rid or "HEALTH_CHECK" in rid:
        return None
    received = _seconds(rec.get("request_received_ts"))
    first = _seconds(rec.get("prefill_finished_ts"))
    done = _seconds(rec.get("decode_finished_ts"))
    e2e = _seconds(rec.get("e2e_latency"))
    if received < 0 or (done < 0 and e2e < 0):
        return None       # no times on the host's clock: nothing to join with the GPU steps
    start_ns = int(round(received * 1e9))
    end_ns = int(round(done * 1e9)) if done >= received else start_ns + int(round(e2e * 1e9))
    if end_ns < start_ns:
        return None
    ttft = int(round((first - received) * 1e9)) if first >= received else -1
    return RequestSpan(
        request_id=rid[:256], engine="sglang", start_ns=start_ns, end_ns=end_ns, ttft_ns=ttft,
        e2e_ns=int(round(e2e * 1e9)) if e2e >= 0 else end_ns - start_ns,
        decode_ns=end_ns - (start_ns + ttft) if ttft >= 0 else -1,
        prompt_tokens=_count(rec.get("prompt_tokens")), completion_tokens=_count(rec.get("completion_tokens")))


class SglangRequestMetricsProbe(Probe):
    name = "sglang_requests"

    def __init__(self, folder: str = "", max_bytes_per_poll: int = MAX_BYTES_PER_POLL,
                 max_line_bytes: int = MAX_LINE_BYTES, from_start: bool = False):
        super().__init__()
        self.folder = folder
        self.max_bytes_per_poll = int(max_bytes_per_poll)
        self.max_line_bytes = int(max_line_bytes)
        self.from_start = from_start            # tests: read the files present at start too
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, bytes] = {}
        self._skipping: set[str] = set()        # a file whose current line is over the bound
        self.lines_too_long = 0
        self.bad_lines = 0
        self.ignored = 0

    def check(self) -> Availability:
        if not self.folder:
            return Availability(False, "no folder set", "set probes.sglang_requests.dir to SGLang's "
                                "--export-metrics-to-file-dir")
        if not os.path.isdir(self.folder):
            return Availability(False, f"{self.folder} is not a folder", "start SGLang with --export-metrics-to-file "
                                "--export-metrics-to-file-dir DIR first, or fix probes.sglang_requests.dir")
        return Availability(True)

    def _files(self) -> list[str]:
        try:
            names = sorted(n for n in os.listdir(self.folder) if FILE_RE.match(n))
        except OSError:
            return []
        return names[-FOLLOWED_FILES:]

    def start(self) -> None:
        if not self.from_start:
            for n in self._files():
                try:
                    self._offsets[n] = os.path.getsize(os.path.join(self.folder, n))
                except OSError:
                    continue

    def poll(self):
        budget = self.max_bytes_per_poll
        out: list[RequestSpan] = []
        files = self._files()
        for n in files:
            if budget <= 0:
                break
            path = os.path.join(self.folder, n)
            off = self._offsets.get(n, 0)
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size < off:                  # truncated or replaced: start over
                        off, self._partial[n] = 0, b""
                    f.seek(off)
                    data = f.read(min(budget, max(0, size - off)))
            except OSError:
                self.errors += 1
                continue
            budget -= len(data)
            self._offsets[n] = off + len(data)
            out.extend(self._lines(n, data))
        for n in list(self._offsets):
            if n not in files:                      # rotated out of the followed files
                self._offsets.pop(n, None)
                self._partial.pop(n, None)
                self._skipping.discard(n)
        self.records += len(out)
        return {"requests": out} if out else None

    def _lines(self, n: str, data: bytes) -> list[RequestSpan]:
        out = []
        if n in self._skipping:                     # inside a line that was over the bound
            cut = data.find(b"\n")
            if cut < 0:
                return out
            self._skipping.discard(n)
            data = data[cut + 1:]
        buf = self._partial.pop(n, b"") + data
        *lines, rest = buf.split(b"\n")
        for line in lines:
            if len(line) > self.max_line_bytes:
                self.lines_too_long += 1
                continue
            try:
                rec = parse_line(line) if line.strip() else None
            except LineError:
                self.bad_lines += 1
                continue
            if rec is None:
                self.ignored += 1 if line.strip() else 0
            else:
                out.append(rec)
        if len(rest) > self.max_line_bytes:
            self.lines_too_long += 1
            self._skipping.add(n)
            rest = b""
        if rest:
            self._partial[n] = rest
        return out

    def counters(self) -> dict:
        return {"records": self.records, "drops": self.lines_too_long + self.bad_lines, "errors": self.errors,
                "lines_too_long": self.lines_too_long, "bad_lines": self.bad_lines, "ignored": self.ignored}
