"""Engine probe: scrapes the Prometheus ``/metrics`` endpoint of vLLM / SGLang servers.

Endpoints are configured (URLs) or discovered from target processes: the TCP ports a
served process (or one of its ancestors: vLLM's API server is the parent of the engine
core that holds the GPU, SGLang's HTTP server the parent of its schedulers) listens on,
read from ``/proc/<pid>/net/tcp{,6}`` joined with the socket inodes in
``/proc/<pid>/fd``. Only ports the server names on its command line (``--port``) or the
engines' default ports (8000, 30000) are probed, unless ``discover_any_port`` is set: an
HTTP request sent to an internal socket of the served process (ZMQ, a torch.distributed
TCPStore) could upset it. A probed port is kept only if its ``/metrics`` carries
``vllm:`` or ``sglang:`` series.

Scraping runs on a background thread with exponential back-off per endpoint; ``poll()``
only drains what was scraped. Each scrape is bounded: ``timeout_s`` in all (connect,
redirects, the whole body, however slowly it trickles) and ``max_body_bytes`` of body,
gzip-decoded in bounded steps (:func:`fetch`). Every failure is counted by kind
(:data:`FAILURE_KINDS`) in ``counters()["scrape_failures"]``.
Each scrape is returned as the raw parsed exposition plus its timestamp; normalising is
the aggregator's job (:mod:`aggregator.engine_metrics`), so this module stays thin.
"""
from __future__ import annotations

import collections
import logging
import os
import socket
import struct
import threading
import time
import urllib.parse
import zlib
from pathlib import Path
from typing import Iterable

import h11

from . import prom_text
from .errors import InputError
from .probe import Availability, Probe

log = logging.getLogger("ridgeline.engine")

DEFAULT_INTERVAL_S = 5.0
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_BACKOFF_MAX_S = 60.0
_TCP_LISTEN = "0A"
RESOLVE_RETRY_S = 30.0   # a configured URL whose listening process was not found is looked up again after this


# --------------------------------------------------------------------------- pure helpers

def backoff_delay_s(failures: int, base_s: float, max_s: float) -> float:
    """Delay before the next try after ``failures`` consecutive failures: base, 2x, 4x, ... capped."""
    if failures <= 0:
        return base_s
    return min(max_s, base_s * (2 ** (failures - 1)))


def _decode_addr(hexaddr: str) -> str:
    if len(hexaddr) == 8:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hexaddr, 16)))
    words = [int(hexaddr[i:i + 8], 16) for i in range(0, 32, 8)]
    return socket.inet_ntop(socket.AF_INET6, struct.pack("<4I", *words))


def parse_proc_net_tcp(text: str) -> list[tuple[str, int, str, int]]:
    """``/proc/net/tcp`` or ``tcp6`` text -> ``(local_ip, local_port, state_hex, inode)`` rows."""
    rows = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10 or ":" not in f[1]:
            continue
        addr, port = f[1].rsplit(":", 1)
        try:
            rows.append((_decode_addr(addr), int(port, 16), f[3].upper(), int(f[9])))
        except (ValueError, OSError, struct.error):
            continue
    return rows


def listening_endpoints(rows: Iterable[tuple[str, int, str, int]], inodes: set[int]) -> list[tuple[str, int]]:
    """Listening ``(host, port)`` among the rows whose socket inode the process owns; a
    wildcard or loopback bind is reached through 127.0.0.1."""
    out = []
    for ip, port, state, inode in rows:
        if state != _TCP_LISTEN or inode not in inodes:
            continue
        host = "127.0.0.1" if ip in ("0.0.0.0", "::", "127.0.0.1", "::1", "::ffff:127.0.0.1") else ip
        if (host, port) not in out:
            out.append((host, port))
    return out


#: Ports tried without a ``--port`` on the command line: vLLM's and SGLang's defaults.
DEFAULT_ENGINE_PORTS = frozenset({8000, 30000})
_PORT_FLAGS = ("--port", "--metrics-port", "--prometheus-port")


def cmdline_ports(argv: list[str]) -> set[int]:
    """Ports named on a server's command line (``--port 8001``, ``--port=8001``)."""
    out: set[int] = set()
    for i, a in enumerate(argv):
        for flag in _PORT_FLAGS:
            val = None
            if a == flag and i + 1 < len(argv):
                val = argv[i + 1]
            elif a.startswith(flag + "="):
                val = a[len(flag) + 1:]
            if val is not None and val.isdigit():
                out.add(int(val))
    return out


_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def loopback_port(url: str) -> int | None:
    """TCP port of an http(s) ``url`` whose host is this machine's loopback
    (``localhost``, 127.0.0.0/8, ``::1``); None for any other host or a malformed URL."""
    import ipaddress
    from urllib.parse import urlsplit
    try:
        u = urlsplit(url)
        host, port = (u.hostname or "").lower(), u.port
    except ValueError:
        return None
    if u.scheme not in ("http", "https"):
        return None
    if host not in _LOOPBACK_NAMES:
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return None
        except ValueError:
            return None
    return port if port is not None else (443 if u.scheme == "https" else 80)


def owner_pid(port: int, targets: Iterable[tuple[int, Iterable[Iterable[tuple[str, int]]]]]) -> int | None:
    """The first target pid whose process chain (itself, then its ancestors: each one's
    listening endpoints) listens on ``127.0.0.1:port`` (loopback or wildcard bind)."""
    for pid, chain in targets:
        if any(("127.0.0.1", port) in eps for eps in chain):
            return pid
    return None


def loopback_listener_inodes(rows: Iterable[tuple[str, int, str, int]], port: int) -> set[int]:
    """Inodes of the sockets listening on ``port`` that a loopback client reaches."""
    return {inode for ip, p, state, inode in rows
            if p == port and state == _TCP_LISTEN
            and ip in ("0.0.0.0", "::", "127.0.0.1", "::1", "::ffff:127.0.0.1")}


def metrics_url(host: str, port: int) -> str:
    h = f"[{host}]" if ":" in host else host
    return f"http://{h}:{port}/metrics"


# --------------------------------------------------------------------------- /proc glue

def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` has open (empty when not readable)."""
    out: set[int] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        entries = list(fd_dir.iterdir())
    except OSError:
        return out
    for e in entries:
        try:
            t = os.readlink(e)
        except OSError:
            continue
        if t.startswith("socket:["):
            out.add(int(t[8:-1]))
    return out


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm may contain spaces and parentheses: fields start after the last ')'
    return int(stat[stat.rindex(")") + 2:].split()[1])


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an exited server not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:][:1] not in ("Z", "X")


def related_pids(pid: int, max_up: int = 3) -> list[int]:
    """``pid`` and up to ``max_up`` ancestors (stopping before init)."""
    out = [pid]
    cur = pid
    for _ in range(max_up):
        p = _ppid(cur)
        if not p or p <= 1:
            break
        out.append(p)
        cur = p
    return out


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def listening_ports(pid: int) -> list[tuple[str, int]]:
    """Listening TCP endpoints of ``pid`` (IPv4 and IPv6), from /proc."""
    inodes = socket_inodes(pid)
    if not inodes:
        return []
    rows: list = []
    for name in ("tcp", "tcp6"):
        try:
            rows += parse_proc_net_tcp(Path(f"/proc/{pid}/net/{name}").read_text())
        except OSError:
            continue
    return listening_endpoints(rows, inodes)


def listener_pid(port: int, max_procs: int = 65536) -> int | None:
    """Lowest pid holding a socket that listens on loopback ``port`` in this agent's network
    namespace (``/proc/net/tcp{,6}`` joined with ``/proc/*/fd``); None when not found or
    not readable. Looks at no more than ``max_procs`` processes."""
    rows: list = []
    for name in ("tcp", "tcp6"):
        try:
            rows += parse_proc_net_tcp(Path(f"/proc/net/{name}").read_text())
        except OSError:
            continue
    inodes = loopback_listener_inodes(rows, port)
    if not inodes:
        return None
    try:
        pids = sorted(int(d) for d in os.listdir("/proc") if d.isdigit())[:max_procs]
    except OSError:
        return None
    for pid in pids:      # ascending: a forking server's parent before its workers
        if socket_inodes(pid) & inodes:
            return pid
    return None


# --------------------------------------------------------------------------- HTTP

#: Largest ``/metrics`` body read (after gzip decoding); ``probes.engine.max_body_bytes``.
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
#: Largest response head (status line and headers).
MAX_HEAD_BYTES = 64 * 1024
MAX_REDIRECTS = 3
#: Why a scrape failed; each is counted (``scrape_failures`` in the probe's counters).
FAILURE_KINDS = ("invalid_url", "connect", "timeout", "http_status", "protocol", "too_large", "decode",
                 "redirect_refused")
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class ScrapeError(InputError):
    """A failed scrape: one line, and ``kind`` (one of :data:`FAILURE_KINDS`). A bad URL is
    bad input (exit 2); the others are runtime failures (exit 1)."""

    def __init__(self, message: str, kind: str):
        super().__init__(message, exit_code=2 if kind == "invalid_url" else 1)
        self.kind = kind


class _Body:
    """Collects a body up to ``limit`` bytes, gunzipping on the way in bounded steps, so
    neither a huge body nor a small gzip bomb allocates more than ``limit`` (+ one read)."""

    def __init__(self, url: str, limit: int, gz: bool):
        self.url, self.limit = url, limit
        self._gz = zlib.decompressobj(16 + zlib.MAX_WBITS) if gz else None
        self._parts: list[bytes] = []
        self.size = 0
        self.raw = 0

    def _add(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            raise ScrapeError(f"{self.url}: body larger than {self.limit} bytes"
                              + (" once decompressed" if self._gz else "") + " (probes.engine.max_body_bytes)",
                              "too_large")
        self._parts.append(data)

    def feed(self, data: bytes) -> None:
        self.raw += len(data)
        if self.raw > self.limit:
            raise ScrapeError(f"{self.url}: body larger than {self.limit} bytes (probes.engine.max_body_bytes)",
                              "too_large")
        if self._gz is None:
            self._add(data)
            return
        try:
            while data and not self._gz.eof:
                # At most what still fits, plus one byte to notice the overflow.
                self._add(self._gz.decompress(data, self.limit - self.size + 1))
                data = self._gz.unconsumed_tail
        except zlib.error as exc:
            raise ScrapeError(f"{self.url}: bad gzip body ({exc})", "decode") from None

    def text(self) -> str:
        if self._gz is not None and not self._gz.eof:
            raise ScrapeError(f"{self.url}: gzip body ends early", "decode")
        return b"".join(self._parts).decode("utf-8", "replace")


def _split_url(url: str):
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ScrapeError(f"{url}: invalid URL ({exc})", "invalid_url") from None
    if parts.scheme not in ("http", "https"):
        raise ScrapeError(f"{url}: unsupported URL (only http:// and https://)", "invalid_url")
    if not parts.hostname:
        raise ScrapeError(f"{url}: invalid URL (no host)", "invalid_url")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), parts.netloc, target


def _get_once(url: str, deadline: float, timeout_s: float, max_body_bytes: int) -> tuple[int, str | None, str]:
    """One GET under the absolute ``deadline`` (monotonic): (status, Location, body text)."""
    scheme, host, port, netloc, target = _split_url(url)

    def left() -> float:
        r = deadline - time.monotonic()
        if r <= 0:
            raise socket.timeout()
        return r

    try:
        sock = socket.create_connection((host, port), timeout=left())
    except (socket.timeout, TimeoutError):
        raise ScrapeError(f"{url}: no answer within {timeout_s:g} s", "timeout") from None
    except OSError as exc:
        raise ScrapeError(f"{url}: cannot reach ({exc.strerror or exc})", "connect") from None
    try:
        if scheme == "https":
            import ssl
            sock.settimeout(left())
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        req = h11.Request(method="GET", target=target, headers=[
            ("Host", netloc), ("User-Agent", "ridgeline"), ("Accept-Encoding", "gzip"),
            ("Accept", "text/plain;version=0.0.4;q=1,*/*;q=0.1"), ("Connection", "close")])
        sock.settimeout(left())
        sock.sendall(conn.send(req) + conn.send(h11.EndOfMessage()))
        status, body = 0, None
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                # The deadline is total: every read gets only what is left of it, so a
                # server trickling a byte at a time is cut when the scrape's time is up.
                sock.settimeout(left())
                conn.receive_data(sock.recv(65536))
                continue
            if isinstance(ev, h11.Response):
                status = ev.status_code
                headers = {k.lower(): v for k, v in ev.headers}
                if status != 200:
                    loc = headers.get(b"location")
                    return status, loc.decode("latin-1") if loc else None, ""
                enc = headers.get(b"content-encoding", b"identity").strip().lower()
                if enc not in (b"gzip", b"identity"):
                    raise ScrapeError(f"{url}: unsupported Content-Encoding {enc.decode('latin-1')!r}", "decode")
                length = headers.get(b"content-length")
                if enc == b"identity" and length is not None and int(length) > max_body_bytes:
                    raise ScrapeError(f"{url}: body of {int(length)} bytes is larger than {max_body_bytes} "
                                      "(probes.engine.max_body_bytes)", "too_large")
                body = _Body(url, max_body_bytes, enc == b"gzip")
            elif isinstance(ev, h11.Data):
                body.feed(ev.data)
            elif isinstance(ev, (h11.EndOfMessage, h11.ConnectionClosed)):
                if body is None:
                    raise ScrapeError(f"{url}: connection closed before an answer", "protocol")
                return status, None, body.text()
            elif isinstance(ev, h11.InformationalResponse):
                continue
    except (socket.timeout, TimeoutError):
        raise ScrapeError(f"{url}: no answer within {timeout_s:g} s", "timeout") from None
    except h11.RemoteProtocolError as exc:
        raise ScrapeError(f"{url}: not a valid HTTP answer ({exc})", "protocol") from None
    except ScrapeError:
        raise
    except OSError as exc:
        raise ScrapeError(f"{url}: cannot reach ({exc.strerror or exc})", "connect") from None
    finally:
        sock.close()


def same_origin(url: str, location_url: str) -> bool:
    """Whether ``location_url`` is on the same scheme, host and port as ``url``."""
    try:
        a, b = urllib.parse.urlsplit(url), urllib.parse.urlsplit(location_url)
        pa = a.port or (443 if a.scheme == "https" else 80)
        pb = b.port or (443 if b.scheme == "https" else 80)
    except ValueError:
        return False
    return (a.scheme, (a.hostname or "").lower(), pa) == (b.scheme, (b.hostname or "").lower(), pb)


def fetch(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, client=None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, follow_redirects: bool = False) -> str:
    """GET ``url`` and return its text, within ``timeout_s`` in all (connect, redirects,
    the whole body) and at most ``max_body_bytes`` of body after gzip decoding; raises
    :class:`ScrapeError` (an :class:`InputError`) with one line and a failure kind.

    Redirects: none is followed unless ``follow_redirects``, and then only to the same
    scheme, host and port (at most :data:`MAX_REDIRECTS`). The agent runs as root and
    whoever answers on the engine's port chooses the Location: followed blindly, a 302
    makes the agent GET another local service's path (``/admin?delete=all`` on another
    loopback port) and take its answer for engine data. A refused redirect is its own
    failure kind (``redirect_refused``), counted like the others.

    A plain HTTP/1.1 client on h11 with a socket deadline per read: timeouts of a
    general client are per read, so a server sending a byte now and then would hold
    the scrape (and the probe's thread) for good. ``client`` is ignored (kept for
    callers of the old signature). Host names are resolved before the deadline starts
    counting by the system resolver; endpoints are normally addresses."""
    deadline = time.monotonic() + timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        status, location, text = _get_once(url, deadline, timeout_s, max_body_bytes)
        if status == 200:
            return text
        if status in _REDIRECTS and location:
            target = urllib.parse.urljoin(url, location)
            shown = target[:200].encode("unicode_escape", "backslashreplace").decode("ascii")
            if not follow_redirects:
                raise ScrapeError(f"{url}: HTTP {status} redirect to {shown} not followed (set "
                                  "probes.engine.follow_redirects = true to follow redirects on the same host "
                                  "and port, or configure the final URL)", "redirect_refused")
            if not same_origin(url, target):
                raise ScrapeError(f"{url}: HTTP {status} redirect to {shown} not followed: another host or "
                                  "port", "redirect_refused")
            # vLLM's older ASGI mount answered /metrics with a redirect to /metrics/.
            url = target
            continue
        raise ScrapeError(f"{url}: HTTP {status}", "http_status")
    raise ScrapeError(f"{url}: more than {MAX_REDIRECTS} redirects", "http_status")


def scrape(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, client=None,
           max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, follow_redirects: bool = False) -> dict:
    """One scrape: ``{"endpoint", "ts_ns", "exposition"}`` (a :class:`prom_text.Exposition`)."""
    text = fetch(url, timeout_s, max_body_bytes=max_body_bytes, follow_redirects=follow_redirects)
    ts = time.time_ns()
    return {"endpoint": url, "ts_ns": ts, "exposition": prom_text.parse(text)}


def is_engine_exposition(expo: prom_text.Exposition) -> bool:
    return any(s.name.startswith(("vllm:", "sglang:", "ray_vllm:", "sglang_")) for s in expo.samples) or any(
        n.startswith(("vllm:", "sglang:", "ray_vllm:")) for n in expo.types)


class _Endpoint:
    __slots__ = ("url", "failures", "next_s", "last_error", "discovered", "pid", "resolve_next_s")

    def __init__(self, url: str, discovered: bool = False, pid: int | None = None):
        self.url = url
        # The served process: the one it was discovered from, or for a configured loopback
        # URL the one resolved from its listening port (None until resolved).
        self.pid = pid
        self.resolve_next_s = 0.0
        self.failures = 0
        self.next_s = 0.0
        self.last_error: str | None = None
        self.discovered = discovered


class EngineProbe(Probe):
    """Scrapes configured and discovered engine endpoints every ``interval_s``.

    ``poll()`` returns ``{"scrapes": [{"endpoint", "ts_ns", "exposition", "pid"}, ...],
    "errors": [{"endpoint", "error"}, ...]}`` collected since the last poll, or None.
    """

    name = "engine"
    optional = True

    def __init__(self, urls: Iterable[str] = (), pids: Iterable[int] = (), interval_s: float = DEFAULT_INTERVAL_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S, backoff_max_s: float = DEFAULT_BACKOFF_MAX_S,
                 discover: bool = True, discover_any_port: bool = False, max_queued: int = 256,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, follow_redirects: bool = False):
        super().__init__()
        self.max_body_bytes = int(max_body_bytes)
        self.follow_redirects = bool(follow_redirects)
        self.scrape_failures = {k: 0 for k in FAILURE_KINDS}
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s)
        self.backoff_max_s = float(backoff_max_s)
        self.discover = discover
        self.discover_any_port = discover_any_port
        self._endpoints: dict[str, _Endpoint] = {u: _Endpoint(u) for u in urls}
        self._pids: set[int] = set(pids)
        self._rejected: set[str] = set()  # discovered ports that are not engine endpoints
        self._queue: collections.deque = collections.deque()
        self._errors: list[dict] = []
        self._max_queued = max_queued
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client = None       # no pooled client: one connection per scrape, closed after

    def set_pids(self, pids: Iterable[int]) -> None:
        """Replace the served processes whose listening ports are searched (thread-safe)."""
        with self._lock:
            self._pids = set(pids)

    def endpoints(self) -> list[str]:
        with self._lock:
            return list(self._endpoints)

    def check(self) -> Availability:
        if self._endpoints:
            return Availability(True, f"{len(self._endpoints)} configured endpoint(s)")
        if self.discover and self._pids:
            return Availability(True, f"discovering endpoints of {len(self._pids)} process(es)")
        if self.discover:
            return Availability(True, "no endpoint yet; discovering from target processes",
                                "set engine.urls in the config to scrape a known endpoint")
        return Availability(False, "no engine endpoint configured and discovery is off",
                            "set engine.urls (e.g. http://127.0.0.1:8000/metrics) or enable discovery")

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ridgeline-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            if self.discover:
                try:
                    self.discover_once()
                except Exception as exc:  # noqa: BLE001  (/proc glue must not stop the scrape loop; counted, logged)
                    self.errors += 1
                    log.warning("engine: discovery failed: %s: %s (counted; retried next interval)",
                                type(exc).__name__, exc)
            self.scrape_due(t0)
            self._stop.wait(max(0.05, self.interval_s - (time.monotonic() - t0)))

    def discover_once(self) -> list[str]:
        """Look for engine endpoints among the listening ports of the target processes."""
        with self._lock:
            pids = list(self._pids)
            known = set(self._endpoints) | self._rejected
        found = []
        for pid in pids:
            for p in related_pids(pid):
                allowed = cmdline_ports(cmdline(p)) | DEFAULT_ENGINE_PORTS
                for host, port in listening_ports(p):
                    if not self.discover_any_port and port not in allowed:
                        continue
                    url = metrics_url(host, port)
                    if url in known:
                        continue
                    known.add(url)
                    try:
                        res = scrape(url, self.timeout_s, max_body_bytes=self.max_body_bytes,
                                     follow_redirects=self.follow_redirects)
                    except InputError:
                        with self._lock:
                            self._rejected.add(url)
                        continue
                    with self._lock:
                        if is_engine_exposition(res["exposition"]):
                            self._endpoints[url] = _Endpoint(url, discovered=True, pid=pid)
                            res["pid"] = pid
                            self._push(res)
                            found.append(url)
                        else:
                            self._rejected.add(url)
        return found

    def resolve_pid(self, url: str) -> int | None:
        """Served process of a configured loopback ``url`` (see the module docstring)."""
        port = loopback_port(url)
        if port is None:
            return None
        with self._lock:
            pids = sorted(self._pids)
        found = owner_pid(port, ((pid, (listening_ports(p) for p in related_pids(pid))) for pid in pids))
        return found if found is not None else listener_pid(port)

    def _refresh_pid(self, ep: _Endpoint, now_s: float) -> None:
        if ep.discovered:
            return
        if ep.pid is not None and alive(ep.pid):
            return
        if ep.pid is None and now_s < ep.resolve_next_s:
            return
        try:
            ep.pid = self.resolve_pid(ep.url)
        except Exception as exc:  # noqa: BLE001  (/proc glue must not stop the scrape loop; counted, logged)
            self.errors += 1
            log.warning("engine: served process of %s not resolved: %s: %s", ep.url, type(exc).__name__, exc)
            ep.pid = None
        if ep.pid is None:     # not ours, or not listening yet: look again later, not every scrape
            ep.resolve_next_s = now_s + RESOLVE_RETRY_S

    def scrape_due(self, now_s: float | None = None) -> None:
        """Scrape every endpoint whose back-off has expired (the thread calls this)."""
        now_s = time.monotonic() if now_s is None else now_s
        for ep in list(self._endpoints.values()):
            if ep.next_s > now_s:
                continue
            self._refresh_pid(ep, now_s)
            try:
                res = scrape(ep.url, self.timeout_s, max_body_bytes=self.max_body_bytes,
                             follow_redirects=self.follow_redirects)
            except InputError as exc:
                kind = getattr(exc, "kind", "protocol")
                self.scrape_failures[kind] = self.scrape_failures.get(kind, 0) + 1
                ep.failures += 1
                ep.last_error = str(exc)
                ep.next_s = now_s + backoff_delay_s(ep.failures, self.interval_s, self.backoff_max_s)
                self.errors += 1
                with self._lock:
                    self._errors.append({"endpoint": ep.url, "error": str(exc), "kind": kind,
                                         "failures": ep.failures})
                    del self._errors[:-64]
                continue
            ep.failures = 0
            ep.last_error = None
            ep.next_s = now_s
            res["pid"] = ep.pid
            with self._lock:
                self._push(res)

    def _push(self, res: dict) -> None:
        if len(self._queue) >= self._max_queued:
            self._queue.popleft()
            self.drops += 1
        self._queue.append(res)
        self.records += 1
        if res["exposition"].bad_lines:
            self.errors += res["exposition"].bad_lines

    def poll(self) -> dict | None:
        with self._lock:
            if not self._queue and not self._errors:
                return None
            out = {"scrapes": list(self._queue), "errors": list(self._errors)}
            self._queue.clear()
            self._errors.clear()
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 5)
            self._thread = None

    def counters(self) -> dict:
        c = super().counters()
        c["endpoints"] = len(self._endpoints)
        c["endpoints_failing"] = sum(1 for e in self._endpoints.values() if e.failures)
        c["scrape_failures"] = dict(self.scrape_failures)
        # Whole scrapes dropped because poll() fell behind: batches, not records.
        c["dropped_batches"], c["drops"] = c["drops"], 0
        return c
