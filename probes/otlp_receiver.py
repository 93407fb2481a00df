"""An OTLP/HTTP trace receiver for the engines' per-request spans (vLLM, SGLang).

Contract:

* Listens on ``127.0.0.1:4318`` (the OTLP/HTTP port) or a unix socket, path ``/v1/traces``
  only, ``POST`` only; bodies ``application/x-protobuf`` (the real
  ``ExportTraceServiceRequest`` schema) or ``application/json`` (the OTLP/JSON mapping),
  ``Content-Encoding: gzip`` or none. Answers per the OTLP/HTTP specification: 200 with an
  ``ExportTraceServiceResponse`` in the request's encoding (``partial_success`` carries the
  spans refused by the rate bound), 400 bad body, 404 other path, 405 other method, 413 body
  over the bound, 415 other content type, 429 with ``Retry-After`` when the span rate is
  spent, 503 when all connection slots are taken (the connection is closed at once).
* Bounded: ``max_body_bytes`` (declared or, for chunked or gzip bodies, as it arrives and
  as it inflates), ``max_connections`` at once, ``request_timeout_s`` for a whole request
  from its first byte (a slowloris client is cut at the deadline), ``spans_per_s`` (a token
  bucket of one second's worth), ``max_attributes`` per span and ``max_attribute_bytes`` per
  attribute, ``max_queued_spans`` waiting for :meth:`OtlpReceiver.drain`. Every refusal is
  counted by reason in :meth:`OtlpReceiver.counters` (``refused``).
* One thread with a selector; decoding runs on it; the agent's loop only drains.
"""
from __future__ import annotations

import collections
import os
import selectors
import socket
import stat
import threading
import time
import zlib

import h11

from . import request_spans
from .probe import Availability, Probe

DEFAULT_LISTEN = "127.0.0.1:4318"
PATH = "/v1/traces"
MAX_BODY_BYTES = 4 * 2**20
MAX_CONNECTIONS = 32
REQUEST_TIMEOUT_S = 10.0
SPANS_PER_S = 5000
MAX_QUEUED_SPANS = 100_000
MAX_HEADER_BYTES = 16 * 1024
REFUSAL_KINDS = ("body_too_large", "rate", "connections", "timeout", "bad_body", "bad_http", "not_found",
                 "method", "content_type", "queue_full")


class _Conn:
    __slots__ = ("sock", "h11", "deadline", "body", "inflate", "inflated", "target", "method", "ctype", "gz",
                 "out", "closing")

    def __init__(self, sock, deadline: float):
        self.sock = sock
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.deadline = deadline
        self.reset()
        self.out = b""
        self.closing = False

    def reset(self):
        self.body = bytearray()
        self.inflate = None
        self.inflated = 0
        self.target = b""
        self.method = b""
        self.ctype = b""
        self.gz = False


def parse_listen(listen: str) -> tuple[str, object]:
    """``unix:/path`` or ``HOST:PORT`` -> (family, address); raises ValueError."""
    if listen.startswith("unix:"):
        path = listen[5:]
        if not path.startswith("/"):
            raise ValueError(f"unix socket path must be absolute: {listen!r}")
        return "unix", path
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"listen address must be HOST:PORT or unix:/path, not {listen!r}")
    return "tcp", (host.strip("[]") or "127.0.0.1", int(port))


class OtlpReceiver:
    def __init__(self, listen: str = DEFAULT_LISTEN, max_body_bytes: int = MAX_BODY_BYTES,
                 max_connections: int = MAX_CONNECTIONS, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 spans_per_s: float = SPANS_PER_S, max_attributes: int = request_spans.MAX_ATTRIBUTES,
                 max_attribute_bytes: int = request_spans.MAX_ATTRIBUTE_BYTES,
                 max_queued_spans: int = MAX_QUEUED_SPANS, clock=time.monotonic):
        self.listen = listen
        self.max_body_bytes = int(max_body_bytes)
        self.max_connections = int(max_connections)
        self.request_timeout_s = float(request_timeout_s)
        self.spans_per_s = float(spans_per_s)
        self.max_attributes = int(max_attributes)
        self.max_attribute_bytes = int(max_attribute_bytes)
        self.clock = clock
        self._queue: collections.deque = collections.deque()
        self._max_queued = int(max_queued_spans)
        self._lock = threading.Lock()
        self._tokens = self.spans_per_s
        self._tokens_at = clock()
        self.refused = {k: 0 for k in REFUSAL_KINDS}
        self.stats = request_spans.SpanStats()
        self.requests = 0
        self.spans_accepted = 0
        self.spans_refused = 0
        self.bytes_received = 0
        self.errors = 0
        self._conns: dict[int, _Conn] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        family, addr = parse_listen(listen)
        self._unix_path = addr if family == "unix" else None
        if family == "unix":
            _remove_stale_socket(addr)
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(addr)
            os.chmod(addr, 0o660)
        else:
            fam = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
            self.sock = socket.socket(fam, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(addr)
        self.sock.listen(128)
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.sock, selectors.EVENT_READ, None)

    # -- life cycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="ridgeline-otlp", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for c in list(self._conns.values()):
            self._drop(c)
        try:
            self._sel.close()
        finally:
            self.sock.close()
            if self._unix_path:
                try:
                    os.unlink(self._unix_path)
                except FileNotFoundError:
                    pass

    def drain(self) -> list[request_spans.RequestSpan]:
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out

    def counters(self) -> dict:
        with self._lock:
            return {"requests": self.requests, "spans_accepted": self.spans_accepted,
                    "spans_refused": self.spans_refused, "bytes_received": self.bytes_received,
                    "refused": dict(self.refused), "spans_seen": self.stats.spans_seen,
                    "spans_ignored": self.stats.spans_ignored,
                    "attributes_dropped": self.stats.attributes_dropped,
                    "attributes_too_long": self.stats.attributes_too_long,
                    "events_dropped": self.stats.events_dropped,
                    "connections": len(self._conns), "errors": self.errors}

    # -- serving ------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._sel.select(timeout=0.2)
            except OSError:
                self.errors += 1
                continue
            for key, mask in events:
                if key.data is None:
                    self._accept()
                    continue
                conn = key.data
                try:
                    if mask & selectors.EVENT_READ:
                        self._read(conn)
                    if conn.sock.fileno() >= 0 and mask & selectors.EVENT_WRITE:
                        self._write(conn)
                except (OSError, h11.ProtocolError):
                    self._drop(conn)
            now = self.clock()
            for c in [c for c in self._conns.values() if now > c.deadline]:
                if not c.out:
                    self._count("timeout")
                self._drop(c)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                s, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.errors += 1
                return
            if len(self._conns) >= self.max_connections:
                self._count("connections")
                try:
                    s.setblocking(False)
                    s.send(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\ncontent-length: 0\r\n"
                           b"connection: close\r\n\r\n")
                except OSError:
                    pass
                s.close()
                continue
            s.setblocking(False)
            c = _Conn(s, self.clock() + self.request_timeout_s)
            self._conns[s.fileno()] = c
            self._sel.register(s, selectors.EVENT_READ, c)

    def _drop(self, c: _Conn) -> None:
        fd = c.sock.fileno()
        if fd >= 0:
            try:
                self._sel.unregister(c.sock)
            except (KeyError, ValueError):
                pass
            self._conns.pop(fd, None)
        c.sock.close()

    def _count(self, kind: str) -> None:
        with self._lock:
            self.refused[kind] += 1

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        if c.out or c.closing:
            if not data:
                self._drop(c)
            return           # a client sending while we answer: ignored, bounded by the deadline
        with self._lock:
            self.bytes_received += len(data)
        c.h11.receive_data(data)
        while True:
            try:
                ev = c.h11.next_event()
            except h11.RemoteProtocolError:
                self._count("bad_http")
                self._answer(c, 400, b"bad HTTP request\n", close=True)
                return
            if ev is h11.NEED_DATA:
                if not data:
                    self._drop(c)
                return
            if ev is h11.PAUSED or isinstance(ev, h11.ConnectionClosed):
                if isinstance(ev, h11.ConnectionClosed):
                    self._drop(c)
                return
            if isinstance(ev, h11.Request):
                if not self._head(c, ev):
                    return
            elif isinstance(ev, h11.Data):
                if not self._body(c, ev.data):
                    return
            elif isinstance(ev, h11.EndOfMessage):
                self._finish(c)
                return

    def _head(self, c: _Conn, ev: h11.Request) -> bool:
        c.method, c.target = ev.method, ev.target.split(b"?", 1)[0]
        length = None
        for k, v in ev.headers:
            if k == b"content-type":
                c.ctype = v.split(b";", 1)[0].strip().lower()
            elif k == b"content-encoding":
                enc = v.strip().lower()
                if enc == b"gzip":
                    c.gz = True
                elif enc not in (b"", b"identity"):
                    self._count("content_type")
                    self._answer(c, 415, b"unsupported content-encoding\n", close=True)
                    return False
            elif k == b"content-length":
                length = int(v)
        if c.target != PATH.encode():
            self._count("not_found")
            self._answer(c, 404, b"not found: only POST /v1/traces\n", close=True)
            return False
        if c.method != b"POST":
            self._count("method")
            self._answer(c, 405, b"method not allowed\n", close=True, extra=[(b"allow", b"POST")])
            return False
        if c.ctype not in (b"application/x-protobuf", b"application/json"):
            self._count("content_type")
            self._answer(c, 415, b"content-type must be application/x-protobuf or application/json\n", close=True)
            return False
        if length is not None and length > self.max_body_bytes:
            self._count("body_too_large")
            self._answer(c, 413, b"body too large\n", close=True)
            return False
        if c.gz:
            c.inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        return True

    def _body(self, c: _Conn, data: bytes) -> bool:
        if c.inflate is not None:
            # Inflate in bounded steps: a gzip bomb stops at the bound, not in memory.
            room = self.max_body_bytes - len(c.body)
            try:
                out = c.inflate.decompress(data, room + 1)
            except zlib.error:
                self._count("bad_body")
                self._answer(c, 400, b"bad gzip body\n", close=True)
                return False
            if len(out) > room or c.inflate.unconsumed_tail:
                self._count("body_too_large")
                self._answer(c, 413, b"body too large (inflated)\n", close=True)
                return False
            c.body += out
            return True
        if len(c.body) + len(data) > self.max_body_bytes:
            self._count("body_too_large")
            self._answer(c, 413, b"body too large\n", close=True)
            return False
        c.body += data
        return True

    def _take_tokens(self, n: int) -> int:
        now = self.clock()
        self._tokens = min(self.spans_per_s, self._tokens + (now - self._tokens_at) * self.spans_per_s)
        self._tokens_at = now
        k = int(min(n, self._tokens))
        self._tokens -= k
        return k

    def _finish(self, c: _Conn) -> None:
        is_json = c.ctype == b"application/json"
        body = bytes(c.body)
        c.body = bytearray()
        self._take_tokens(0)       # refills the bucket for the time passed
        if self._tokens < 1:
            self._count("rate")
            self._answer(c, 429, b"span rate bound reached\n", extra=[(b"retry-after", b"1")], close=True)
            return
        try:
            if is_json:
                spans, stats = request_spans.decode_json(body, self.max_attributes, self.max_attribute_bytes)
            else:
                spans, stats = request_spans.decode_protobuf(body, self.max_attributes, self.max_attribute_bytes)
        except request_spans.SpanDecodeError as exc:
            self._count("bad_body")
            self._answer(c, 400, str(exc).encode()[:200] + b"\n", close=True)
            return
        del body
        # The rate bound counts every span the client sent (decoding them cost us).
        allowed = self._take_tokens(stats.spans_seen)
        refused_spans = stats.spans_seen - allowed
        keep = spans[:max(0, len(spans) - refused_spans)] if refused_spans else spans
        with self._lock:
            self.requests += 1
            self.stats.add(stats)
            room = self._max_queued - len(self._queue)
            if len(keep) > room:
                self.refused["queue_full"] += 1
                refused_spans += len(keep) - max(room, 0)
                keep = keep[:max(room, 0)]
            self._queue.extend(keep)
            self.spans_accepted += len(keep)
            self.spans_refused += refused_spans
            if refused_spans:
                self.refused["rate"] += 1
        self._answer(c, 200, _response(is_json, refused_spans),
                     ctype=b"application/json" if is_json else b"application/x-protobuf")

    def _answer(self, c: _Conn, status: int, body: bytes, ctype: bytes = b"text/plain",
                close: bool = False, extra: list | None = None) -> None:
        headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
        headers += extra or []
        if close:
            headers.append((b"connection", b"close"))
            c.closing = True
        try:
            c.out = (c.h11.send(h11.Response(status_code=status, headers=headers)) or b"") + \
                    (c.h11.send(h11.Data(data=body)) or b"") + (c.h11.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:
            # The request was cut mid-way (an error answer before its body ended): write raw.
            c.out = (b"HTTP/1.1 %d Error\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % (status, len(body))
                     + body)
            c.closing = True
        self._sel.modify(c.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, c)
        self._write(c)

    def _write(self, c: _Conn) -> None:
        if not c.out:
            return
        try:
            n = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            return
        c.out = c.out[n:]
        if c.out:
            return
        if c.closing:
            self._drop(c)
            return
        self._sel.modify(c.sock, selectors.EVENT_READ, c)
        try:
            c.h11.start_next_cycle()
        except h11.LocalProtocolError:
            self._drop(c)
            return
        c.reset()
        c.deadline = self.clock() + self.request_timeout_s


def _response(is_json: bool, rejected: int) -> bytes:
    if is_json:
        if not rejected:
            return b"{}"
        return (b'{"partialSuccess":{"rejectedSpans":"%d","errorMessage":"span rate bound reached"}}' % rejected)
    pb = request_spans.trace_service_pb2()
    r = pb.ExportTraceServiceResponse()
    if rejected:
        r.partial_success.rejected_spans = rejected
        r.partial_success.error_message = "span rate bound reached"
    return r.SerializeToString()


def _remove_stale_socket(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{path} exists and is not a socket")
    os.unlink(path)


class OtlpProbe(Probe):
    """The receiver as a probe: ``poll()`` returns ``{"requests": [RequestSpan, ...]}``."""

    name = "otlp"
    optional = True

    def __init__(self, listen: str = DEFAULT_LISTEN, **bounds):
        super().__init__()
        self.listen = listen
        self.bounds = bounds
        self.receiver: OtlpReceiver | None = None

    def check(self) -> Availability:
        try:
            parse_listen(self.listen)
            import opentelemetry.proto.collector.trace.v1.trace_service_pb2  # noqa: F401
        except ValueError as exc:
            return Availability(False, str(exc), "set probes.otlp.listen")
        except ImportError as exc:
            return Availability(False, f"the OTLP protobuf schema cannot be imported ({exc})",
                                "install opentelemetry-proto (a dependency of ridgeline)")
        return Availability(True)

    def start(self) -> None:
        self.receiver = OtlpReceiver(self.listen, **self.bounds)
        self.receiver.start()

    def poll(self):
        if self.receiver is None:
            return None
        spans = self.receiver.drain()
        self.records += len(spans)
        return {"requests": spans} if spans else None

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    def counters(self) -> dict:
        c = super().counters()
        if self.receiver is not None:
            r = self.receiver.counters()
            c.update(r)
            c["drops"] = r["spans_refused"]
            c["errors"] = r["errors"]
        return c
