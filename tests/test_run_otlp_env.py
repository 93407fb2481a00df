"""``ridgeline run`` points the command's OpenTelemetry exporter at the agent's receiver
(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT): checked with the real SDK exporter, built with no
arguments in the child as vLLM's tracing builds it once its flag is on, delivering into
the real receiver."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ridgeline.probes import otlp_receiver as orx

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

CHILD = """
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
tp = TracerProvider()
tp.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter()))
sp = tp.get_tracer("vllm").start_span("llm_request", start_time=10**18)
sp.set_attribute("gen_ai.request.id", "from-the-child")
sp.end(end_time=10**18 + 10**9)
tp.shutdown()
"""


def ridgeline(*args, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "CUDA_INJECTION64_PATH"}
    e.update(env or {})
    # Any existing file stands in for the injection library: the child never initialises CUDA.
    return subprocess.run([sys.executable, "-m", "ridgeline", "run", "--library", sys.executable, *args],
                          capture_output=True, text=True, env=e, timeout=120)


def test_the_childs_default_exporter_sends_to_the_agent():
    r = orx.OtlpReceiver("127.0.0.1:0")
    r.start()
    try:
        url = f"http://127.0.0.1:{r.address[1]}/v1/traces"
        p = ridgeline("--otlp-endpoint", url, "--", sys.executable, "-c", CHILD)
        assert p.returncode == 0, p.stderr
        end = time.monotonic() + 10
        got = []
        while time.monotonic() < end and not got:
            got = r.drain()
            time.sleep(0.05)
        assert [s.request_id for s in got] == ["from-the-child"]
    finally:
        r.close()


def test_print_env_default_keeps_a_users_own_endpoint_and_none_sets_nothing():
    p = ridgeline("--print-env", "--", "true")
    env = dict(ln.split("=", 1) for ln in p.stdout.splitlines())
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://127.0.0.1:4318/v1/traces"
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    p = ridgeline("--print-env", "--", "true", env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" not in p.stdout
    p = ridgeline("--otlp-endpoint", "none", "--print-env", "--", "true")
    assert "OTEL_" not in p.stdout
    p = ridgeline("--otlp-endpoint", "ftp://x", "--", "true")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--otlp-endpoint" in p.stderr
