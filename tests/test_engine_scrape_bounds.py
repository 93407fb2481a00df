"""Engine scrapes against hostile real HTTP servers (issue 14.2): a body cap for plain and
gzip-encoded answers (decompression bounded too), a total deadline that a trickling server
cannot stretch, every failure counted by kind in the probe, the health record and /metrics,
and windows that keep coming meanwhile."""
import gzip
import socket
import socketserver
import threading
import time
import tracemalloc

import httpx
import pytest

from ridgeline.probes import engine
from ridgeline.probes.engine import EngineProbe, ScrapeError

LINE = b"vllm:num_requests_running{model_name=\"m\"} 1\n"
BIG = 50 * 2**20                      # the 50 MB of the issue
CAP = 1 * 2**20
BOMB = gzip.compress(LINE * (BIG // len(LINE)), compresslevel=9)   # ~50 MB inflated, small on the wire


def _stream(conn, head: bytes, total: int, chunked: bool = False):
    conn.sendall(head)
    block = LINE * (65536 // len(LINE))
    sent = 0
    while sent < total:
        data = block if not chunked else b"%x\r\n%s\r\n" % (len(block), block)
        conn.sendall(data)
        sent += len(block)
    if chunked:
        conn.sendall(b"0\r\n\r\n")


def huge_length(conn):
    _stream(conn, b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % BIG, BIG)


def huge_lying_length(conn):
    # Claims a small body, then the connection closes after far more... h11 stops at the
    # claimed length; claim just under the cap and send all of it: must parse fine.
    body = LINE * ((CAP // 2) // len(LINE))
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


def huge_close_delimited(conn):
    _stream(conn, b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n", BIG)


def huge_chunked(conn):
    _stream(conn, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", BIG, chunked=True)


def gzip_bomb(conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(BOMB) + BOMB)


def bad_gzip(conn):
    body = b"\x1f\x8b\x08\x00garbage" * 10
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


def trickle_body(conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    for _ in range(100):
        time.sleep(1.5)
        conn.sendall(b"#")


def trickle_head(conn):
    for b in b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello":
        time.sleep(1.5)
        conn.sendall(bytes([b]))


def silent(conn):
    time.sleep(30)


def not_http(conn):
    conn.sendall(b"\x00\xff SSH-2.0-OpenSSH\r\n\r\n" * 4)


def redirect_loop(conn):
    conn.recv(4096)
    conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: /metrics\r\nContent-Length: 0\r\n\r\n")


def redirect_once(conn):
    req = conn.recv(4096)
    if req.startswith(b"GET /metrics/ "):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(LINE) + LINE)
    else:     # vLLM's ASGI mount: /metrics -> /metrics/
        conn.sendall(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /metrics/\r\nContent-Length: 0\r\n\r\n")


class Hostile:
    """A real TCP server on loopback running ``behave(conn)`` for each connection."""

    def __init__(self, behave):
        class H(socketserver.BaseRequestHandler):
            def handle(self):
                try:
                    if behave not in (redirect_loop, redirect_once):
                        self.request.recv(4096)
                    behave(self.request)
                except OSError:
                    pass      # the client hung up: expected

        socketserver.ThreadingTCPServer.daemon_threads = True
        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/metrics"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.srv.shutdown()
        self.srv.server_close()


def _fetch_bounded(url, timeout_s=30.0, cap=CAP, **kw):
    """fetch() on a thread, joined with a generous bound so a hang fails instead of
    hanging the suite; returns (exception or text, peak traced bytes). The scrape's own
    deadline is generous too unless a test is about it: under tracemalloc on a loaded host
    reading 1 MiB can take seconds, and a deadline hit is another kind of failure."""
    out = {}

    def go():
        tracemalloc.start()
        try:
            out["res"] = engine.fetch(url, timeout_s=timeout_s, max_body_bytes=cap, **kw)
        except Exception as exc:        # noqa: BLE001 - the test inspects it
            out["res"] = exc
        out["peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout_s + 20)
    assert not t.is_alive(), "the scrape did not end at its deadline"
    return out["res"], out["peak"]


@pytest.mark.parametrize("behave", [huge_length, huge_close_delimited, huge_chunked, gzip_bomb])
def test_a_huge_body_is_cut_at_the_cap_in_bounded_memory(behave):
    with Hostile(behave) as h:
        res, peak = _fetch_bounded(h.url)
    assert isinstance(res, ScrapeError) and res.kind == "too_large", res
    assert "probes.engine.max_body_bytes" in str(res)
    assert peak < 8 * CAP, f"peak {peak} bytes for a {CAP}-byte cap"


def test_a_body_under_the_cap_is_read_whole():
    with Hostile(huge_lying_length) as h:
        res, _ = _fetch_bounded(h.url)
    assert isinstance(res, str) and res.count("\n") == (CAP // 2) // len(LINE)


@pytest.mark.parametrize("behave", [trickle_body, trickle_head, silent])
def test_a_trickling_server_is_cut_at_the_total_deadline(behave):
    # One byte every 1.5 s never trips a per-read timeout of 2 s; the deadline is total.
    with Hostile(behave) as h:
        res, _ = _fetch_bounded(h.url, timeout_s=2.0)
    assert isinstance(res, ScrapeError) and res.kind == "timeout", res
    assert "no answer within 2 s" in str(res)


@pytest.mark.parametrize("behave, kind, follow", [(bad_gzip, "decode", False), (not_http, "protocol", False),
                                                  (redirect_loop, "http_status", True),
                                                  (redirect_loop, "redirect_refused", False)])
def test_broken_answers_are_one_line_of_their_kind(behave, kind, follow):
    with Hostile(behave) as h:
        res, _ = _fetch_bounded(h.url, follow_redirects=follow)
    assert isinstance(res, ScrapeError) and res.kind == kind, res
    assert "\n" not in str(res)


def test_one_redirect_is_followed_when_configured():
    with Hostile(redirect_once) as h:
        res, _ = _fetch_bounded(h.url, follow_redirects=True)
    assert res == LINE.decode()


def test_no_redirect_is_followed_by_default():
    # issue 18.6: whoever answers on the engine's port chooses the Location
    with Hostile(redirect_once) as h:
        res, _ = _fetch_bounded(h.url)
    assert isinstance(res, ScrapeError) and res.kind == "redirect_refused", res
    assert "probes.engine.follow_redirects" in str(res) and "\n" not in str(res)


class _Recorder:
    """Another loopback service: records every request line it gets."""

    def __init__(self):
        self.lines = []
        rec = self

        class H(socketserver.BaseRequestHandler):
            def handle(self):
                rec.lines.append(self.request.recv(4096).split(b"\r\n", 1)[0])
                self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(LINE) + LINE)

        self.srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), H)
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.mark.parametrize("follow", [False, True])
def test_a_redirect_to_another_port_is_never_followed(follow):
    # issue 18.6: a 302 to another loopback port's /admin?delete=all made the agent GET it
    # and use the answer as engine data
    victim = _Recorder()
    try:
        def to_victim(conn):      # Hostile has read the request
            conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:%d/admin?delete=all\r\n"
                         b"Content-Length: 0\r\n\r\n" % victim.port)
        with Hostile(to_victim) as h:
            res, _ = _fetch_bounded(h.url, follow_redirects=follow)
            p = EngineProbe(urls=[h.url], interval_s=1.0, timeout_s=5.0, discover=False, follow_redirects=follow)
            p.scrape_due(0.0)
    finally:
        victim.close()
    assert isinstance(res, ScrapeError) and res.kind == "redirect_refused", res
    assert victim.lines == []
    assert p.counters()["scrape_failures"]["redirect_refused"] == 1
    assert p.poll()["scrapes"] == []


def test_the_probe_counts_each_failure_kind():
    with Hostile(huge_length) as big, Hostile(trickle_body) as slow, Hostile(bad_gzip) as bad:
        # a deadline the trickle (a byte every 1.5 s) trips and a loaded host's reads do not
        p = EngineProbe(urls=[big.url, slow.url, bad.url], interval_s=1.0, timeout_s=5.0,
                        max_body_bytes=CAP, discover=False)
        p.scrape_due(0.0)
    c = p.counters()
    assert c["scrape_failures"]["too_large"] == 1
    assert c["scrape_failures"]["timeout"] == 1
    assert c["scrape_failures"]["decode"] == 1
    assert c["errors"] == 3 and c["endpoints_failing"] == 3
    kinds = sorted(e["kind"] for e in p.poll()["errors"])
    assert kinds == ["decode", "timeout", "too_large"]


def test_windows_keep_coming_and_failures_reach_health_and_metrics(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from ridgeline.agent import config
    from ridgeline.agent.daemon import Agent
    from ridgeline.agent.registry import STEPS, Running
    from ridgeline.agent.sdnotify import Notifier
    from ridgeline.agent.subscriber import Subscriber
    from ridgeline.aggregator import wire as codec
    from ridgeline.probes.probe import Availability

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = config.overlay(config.defaults(), {
        "agent": {"window_s": 0.2},
        "publisher": {"endpoint": f"ipc://{tmp_path}/a.sock"},
        "prometheus": {"enabled": True, "listen": f"127.0.0.1:{port}"},
        "probes": {"enabled": []}})
    with Hostile(gzip_bomb) as bomb, Hostile(trickle_body) as slow:
        probe = EngineProbe(urls=[bomb.url, slow.url], interval_s=0.3, timeout_s=2.0, max_body_bytes=CAP,
                            discover=False, backoff_max_s=0.3)
        probe.start()
        agent = Agent(cfg, probes=[Running(STEPS["engine"], probe, Availability(True))], codec=codec,
                      notifier=Notifier({}))
        agent.start()
        t = threading.Thread(target=agent.run, daemon=True)
        t.start()
        sub = Subscriber(cfg.publisher.endpoint, codec=codec, topics=("window", "health"))
        health, windows = [], []
        def failed_both(h):
            fails = h[-1].payload["probes"]["engine"]["scrape_failures"] if h else {}
            return fails.get("too_large", 0) >= 1 and fails.get("timeout", 0) >= 1
        try:
            # until five windows and both failures came (a loaded host may take long)
            end = time.monotonic() + 60
            while time.monotonic() < end and not (len(windows) >= 5 and failed_both(health)):
                m = sub.receive(0.2)
                if m is not None:
                    (health if m.topic == "health" else windows).append(m)
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        finally:
            agent.request_stop()
            t.join(60)
            agent.shutdown()
            sub.close()
    seqs = [m.seq for m in windows]
    assert len(seqs) >= 5 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))   # none missing
    last = health[-1].payload
    fails = last["probes"]["engine"]["scrape_failures"]
    assert fails["too_large"] >= 1 and fails["timeout"] >= 1
    assert "drops" not in last and last["dropped_records"] == 0 and "dropped_batches" in last
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    got = {s.labels["kind"]: s.value for s in fams["ridgeline_agent_engine_scrape_failures"].samples
           if s.name.endswith("_total")}
    assert got["too_large"] >= 1 and got["timeout"] >= 1
