"""The OTLP/HTTP receiver (probes.otlp_receiver): the real SDK exporter, and hostile clients.

The exporter is opentelemetry-exporter-otlp-proto-http (the one vLLM and SGLang create for
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``); bodies are decoded with the real
opentelemetry-proto schema. Hostile clients: a body declared or streamed over the bound, a
gzip bomb, slowloris, a connection flood, garbage, a span flood; after each, a good
client is still served and the receiver's memory stays bounded.
"""
from __future__ import annotations

import gzip
import os
import socket
import threading
import time
import tracemalloc

import pytest

from ridgeline.probes import otlp_receiver as orx
from ridgeline.probes import request_spans as rs

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")


@pytest.fixture
def receiver():
    r = orx.OtlpReceiver("127.0.0.1:0", max_body_bytes=256 * 1024, max_connections=8, request_timeout_s=1.0,
                         spans_per_s=1000)
    r.start()
    yield r
    r.close()


def export_with_sdk(url: str, n: int = 1, prefix: str = "cmpl") -> object:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    t = tp.get_tracer("vllm")
    for i in range(n):
        sp = t.start_span("llm_request", start_time=10**9 + i)
        sp.set_attributes({rs.VLLM_REQUEST_ID: f"{prefix}-{i}", rs.VLLM_E2E_S: 1.0, rs.VLLM_QUEUE_S: 0.1})
        sp.end(end_time=2 * 10**9 + i)
    exp = OTLPSpanExporter(endpoint=url, timeout=10)
    res = exp.export(mem.get_finished_spans())
    exp.shutdown()
    return res


def url(r):
    return f"http://127.0.0.1:{r.address[1]}/v1/traces"


def wait_for(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_real_sdk_exporter_delivers(receiver):
    from opentelemetry.sdk.trace.export import SpanExportResult
    assert export_with_sdk(url(receiver), n=10) == SpanExportResult.SUCCESS
    got = receiver.drain()
    assert sorted(s.request_id for s in got) == sorted(f"cmpl-{i}" for i in range(10))
    assert receiver.counters()["spans_accepted"] == 10


def test_real_sdk_exporter_over_unix_socket(tmp_path):
    # The SDK speaks TCP only; the unix socket is for local clients and relays: raw HTTP here.
    path = str(tmp_path / "otlp.sock")
    r = orx.OtlpReceiver(f"unix:{path}")
    r.start()
    try:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
        msg = trace_service_pb2.ExportTraceServiceRequest()
        sp = msg.resource_spans.add().scope_spans.add().spans.add()
        sp.name, sp.start_time_unix_nano, sp.end_time_unix_nano = "llm_request", 10**9, 2 * 10**9
        a = sp.attributes.add()
        a.key, a.value.string_value = rs.VLLM_REQUEST_ID, "u1"
        body = msg.SerializeToString()
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(b"POST /v1/traces HTTP/1.1\r\nhost: x\r\ncontent-type: application/x-protobuf\r\n"
                  b"content-length: %d\r\n\r\n" % len(body) + body)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        s.close()
        assert [x.request_id for x in r.drain()] == ["u1"]
    finally:
        r.close()
    assert not os.path.exists(path)


def raw(r, data: bytes, read=True, timeout=5.0) -> bytes:
    s = socket.create_connection(("127.0.0.1", r.address[1]))
    s.settimeout(timeout)
    try:
        s.sendall(data)
        return s.recv(65536) if read else b""
    finally:
        s.close()


def post(body: bytes, ctype=b"application/x-protobuf", extra=b"", length=None) -> bytes:
    n = len(body) if length is None else length
    return (b"POST /v1/traces HTTP/1.1\r\nhost: x\r\ncontent-type: " + ctype + b"\r\n" + extra
            + b"content-length: %d\r\n\r\n" % n + body)


def test_status_codes(receiver):
    assert raw(receiver, b"GET /v1/traces HTTP/1.1\r\nhost: x\r\n\r\n").startswith(b"HTTP/1.1 405")
    assert raw(receiver, b"POST /v1/metrics HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n").startswith(b"HTTP/1.1 404")
    assert raw(receiver, post(b"x", ctype=b"text/plain")).startswith(b"HTTP/1.1 415")
    assert raw(receiver, post(b"\xff" * 32)).startswith(b"HTTP/1.1 400")
    assert raw(receiver, post(b"{", ctype=b"application/json")).startswith(b"HTTP/1.1 400")
    assert raw(receiver, b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400")
    c = receiver.counters()["refused"]
    assert (c["method"], c["not_found"], c["content_type"], c["bad_body"], c["bad_http"]) == (1, 1, 1, 2, 1)


def test_huge_bodies_refused_without_reading_them(receiver):
    assert raw(receiver, post(b"", length=10**12)).startswith(b"HTTP/1.1 413")
    # Streamed (chunked) over the bound.
    s = socket.create_connection(("127.0.0.1", receiver.address[1]))
    s.sendall(b"POST /v1/traces HTTP/1.1\r\nhost: x\r\ncontent-type: application/x-protobuf\r\n"
              b"transfer-encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n" % 65536 + b"\0" * 65536 + b"\r\n"
    got = b""
    try:
        for _ in range(64):
            s.sendall(chunk)
    except OSError:
        pass
    s.settimeout(5)
    try:
        got = s.recv(4096)
    except OSError:
        pass
    s.close()
    assert got.startswith(b"HTTP/1.1 413") or receiver.counters()["refused"]["body_too_large"] == 2
    # A gzip bomb: 1 GiB of zeros in ~1 MiB... sent as 20 KiB of gzip of 20 MiB.
    bomb = gzip.compress(b"\0" * (20 * 2**20), 9)
    assert raw(receiver, post(bomb, extra=b"content-encoding: gzip\r\n")).startswith(b"HTTP/1.1 413")
    assert receiver.counters()["refused"]["body_too_large"] == 3
    from opentelemetry.sdk.trace.export import SpanExportResult
    assert export_with_sdk(url(receiver)) == SpanExportResult.SUCCESS


def test_slowloris_and_connection_flood_do_not_stall_it(receiver):
    # Eight slow clients (the connection bound) drip one header byte every 0.2 s.
    slow = []
    for _ in range(8):
        s = socket.create_connection(("127.0.0.1", receiver.address[1]))
        s.sendall(b"POST /v1/traces HTTP/1.1\r\n")
        slow.append(s)
    # The ninth is refused at once (503), not queued behind them.
    assert raw(receiver, post(b"")).startswith(b"HTTP/1.1 503")
    # The slow ones are cut at the request deadline (1 s), and the good client gets in.
    assert wait_for(lambda: receiver.counters()["refused"]["timeout"] >= 8, 30)
    for s in slow:
        s.close()
    from opentelemetry.sdk.trace.export import SpanExportResult
    assert export_with_sdk(url(receiver)) == SpanExportResult.SUCCESS
    assert receiver.counters()["refused"]["connections"] >= 1


@pytest.fixture
def frozen_receiver():
    # The bucket's clock stands still: no refill between the two posts, however slow the host.
    r = orx.OtlpReceiver("127.0.0.1:0", max_body_bytes=256 * 1024, spans_per_s=1000, clock=lambda: 1000.0)
    r.start()
    yield r
    r.close()


def test_span_flood_is_rate_bounded_and_counted(frozen_receiver):
    # 1000 spans per second bound: a 3,000-span export is partly accepted, the rest counted.
    receiver = frozen_receiver
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    msg = trace_service_pb2.ExportTraceServiceRequest()
    ss = msg.resource_spans.add().scope_spans.add()
    for i in range(3000):
        sp = ss.spans.add()
        sp.name, sp.start_time_unix_nano, sp.end_time_unix_nano = "llm_request", 10**9, 2 * 10**9
        a = sp.attributes.add()
        a.key, a.value.string_value = rs.VLLM_REQUEST_ID, f"f{i}"
    body = msg.SerializeToString()
    assert len(body) < 256 * 1024
    first = raw(receiver, post(body))
    assert first.startswith(b"HTTP/1.1 200")
    resp = trace_service_pb2.ExportTraceServiceResponse()
    resp.ParseFromString(first.split(b"\r\n\r\n", 1)[1])
    assert resp.partial_success.rejected_spans == 2000
    # At once again: the bucket is empty: 429 with Retry-After.
    again = raw(receiver, post(body))
    assert again.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in again.lower()
    c = receiver.counters()
    assert c["spans_accepted"] == 1000 and c["spans_refused"] >= 2000
    assert len(receiver.drain()) == 1000


def test_hostile_mix_memory_and_cpu_bounded(receiver, capsys):
    """Many garbage and oversized posts in a row: the receiver's heap stays bounded and a
    good export still succeeds. Prints the figures (the closing note quotes them)."""
    tracemalloc.start()
    cpu0 = time.process_time()
    t0 = time.monotonic()
    bodies = [post(os.urandom(200 * 1024)), post(b"", length=10**9), post(b"{" * 200_000, ctype=b"application/json")]
    stop = time.monotonic() + 3.0
    n = 0
    def client():
        nonlocal n
        while time.monotonic() < stop:
            try:
                raw(receiver, bodies[n % 3], timeout=5)
            except OSError:
                pass
            n += 1
    ths = [threading.Thread(target=client) for _ in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    wall = time.monotonic() - t0
    cpu = time.process_time() - cpu0
    c = receiver.counters()
    refused = sum(c["refused"].values())
    with capsys.disabled():
        print(f"\nhostile mix: {n} posts in {wall:.1f} s; heap peak {peak / 2**20:.1f} MiB (current "
              f"{cur / 2**20:.1f}); process CPU {cpu:.1f} s (clients included); refused {c['refused']}")
    assert refused >= n * 0.9
    assert peak < 64 * 2**20
    from opentelemetry.sdk.trace.export import SpanExportResult
    assert export_with_sdk(url(receiver)) == SpanExportResult.SUCCESS


def test_probe_interface():
    p = orx.OtlpProbe("127.0.0.1:0")
    assert p.check()
    assert not orx.OtlpProbe("nonsense").check()
    p.start()
    try:
        export_with_sdk(f"http://127.0.0.1:{p.receiver.address[1]}/v1/traces", n=3)
        assert wait_for(lambda: p.receiver.counters()["spans_accepted"] == 3)
        got = p.poll()
        assert len(got["requests"]) == 3 and p.counters()["records"] == 3
    finally:
        p.stop()
        p.stop()
