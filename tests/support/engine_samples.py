"""Helpers for the engine-metrics tests: the real scrapes, generated successors, a loopback server.

* :func:`sample_text` reads a real scrape from ``../shared/engine-metrics`` (skips when absent).
* :func:`advance` writes the next scrape of a server: the given text with counters and
  gauges set and histogram observations added (buckets, ``_count`` and ``_sum`` updated
  consistently). It is how the tests make the sequences the delta figures need.
* :class:`MetricsServer` serves a changeable text on 127.0.0.1 (ephemeral port) with the
  standard library's HTTP server, in a thread.
"""
from __future__ import annotations

import http.server
import os
import threading
from pathlib import Path

import pytest

from ridgeline.probes import prom_text

ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("RIDGELINE_SHARED", ROOT.parent / "shared"))
ENGINE_METRICS = SHARED / "engine-metrics"
V011 = "vllm_0.11_v1-idle_hardware-aware-router.prom"
V026 = "vllm_0.2.6_aioprometheus_vllm-windows-readme.prom"


def sample_path(name: str) -> Path:
    p = ENGINE_METRICS / name
    if not p.exists():
        pytest.skip(f"shared engine-metrics sample not present: {p}")
    return p


def sample_text(name: str) -> str:
    return sample_path(name).read_text()


def _fmt(v: float) -> str:
    return repr(float(v))


def advance(text: str, counters: dict | None = None, gauges: dict | None = None,
            observe: dict | None = None) -> str:
    """The next scrape: ``counters``/``gauges`` map an exposed sample name to its new value
    (every label set of that name), ``observe`` maps a histogram family to new observations."""
    counters = dict(counters or {})
    counters.update(gauges or {})
    observe = observe or {}
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            out.append(line)
            continue
        s = prom_text.parse_line(line)
        head = line.rstrip().rsplit(" ", 1)[0]
        v = None
        if s.name in counters:
            v = counters[s.name]
        for fam, obs in observe.items():
            if s.name == fam + "_bucket":
                le = float(s.labels["le"].replace("+Inf", "inf"))
                v = s.value + sum(1 for x in obs if x <= le)
            elif s.name == fam + "_count":
                v = s.value + len(obs)
            elif s.name == fam + "_sum":
                v = s.value + sum(obs)
        out.append(line if v is None else f"{head} {_fmt(v)}")
    return "\n".join(out) + "\n"


class MetricsServer:
    """``with MetricsServer(text) as srv:`` -> ``srv.url``; ``srv.text = ...`` changes what it
    serves; ``srv.then = [text2, ...]`` are served by the following requests, one each."""

    def __init__(self, text: str = "", status: int = 200):
        self.text = text
        self.then: list[str] = []
        self.status = status
        self.requests = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (stdlib name)
                outer.requests += 1
                body = outer.text.encode()
                if outer.then:
                    outer.text = outer.then.pop(0)
                self.send_response(outer.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self._srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._srv.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self._t = threading.Thread(target=self._srv.serve_forever, daemon=True)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._srv.shutdown()
        self._srv.server_close()
        self._t.join(timeout=5)


def free_port() -> int:
    """A loopback port nothing listens on (bound then released)."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# An SGLang >= 0.4.4 exposition written by us from the family list of
# ../shared/docs/reference/engine-metrics.md section 4 (no attributable real SGLang scrape
# exists in the shared folder). Two TP ranks report the same scheduler view.
SGLANG_TEXT = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 37.0
sglang:num_running_reqs{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="1"} 37.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 5.0
sglang:num_queue_reqs{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="1"} 5.0
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 0.91
sglang:token_usage{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="1"} 0.91
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 429702.0
sglang:num_used_tokens{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="1"} 429702.0
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 472200.0
sglang:max_total_num_tokens{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="1"} 472200.0
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 2841.5
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 0.42
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 12.0
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1200000.0
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 480000.0
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 250000.0
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 900.0
# TYPE sglang:gpu_execution_seconds_total counter
sglang:gpu_execution_seconds_total{category="extend",engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 120.0
sglang:gpu_execution_seconds_total{category="decode",engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 360.0
sglang:gpu_execution_seconds_total{category="extend",engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="1"} 120.0
sglang:gpu_execution_seconds_total{category="decode",engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="1"} 360.0
# TYPE sglang:queue_time_seconds histogram
sglang:queue_time_seconds_bucket{engine_type="unified",le="0.0",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 500.0
sglang:queue_time_seconds_bucket{engine_type="unified",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 700.0
sglang:queue_time_seconds_bucket{engine_type="unified",le="0.2",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 800.0
sglang:queue_time_seconds_bucket{engine_type="unified",le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 880.0
sglang:queue_time_seconds_bucket{engine_type="unified",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 900.0
sglang:queue_time_seconds_bucket{engine_type="unified",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 900.0
sglang:queue_time_seconds_sum{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 61.0
sglang:queue_time_seconds_count{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 900.0
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
sglang:time_to_first_token_seconds_bucket{le="0.2",model_name="meta-llama/Llama-3.1-8B-Instruct"} 400.0
sglang:time_to_first_token_seconds_bucket{le="0.4",model_name="meta-llama/Llama-3.1-8B-Instruct"} 800.0
sglang:time_to_first_token_seconds_bucket{le="0.8",model_name="meta-llama/Llama-3.1-8B-Instruct"} 900.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 900.0
sglang:time_to_first_token_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 250.0
sglang:time_to_first_token_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 900.0
# TYPE sglang:inter_token_latency_seconds histogram
sglang:inter_token_latency_seconds_bucket{le="0.002",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
sglang:inter_token_latency_seconds_bucket{le="0.005",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1000.0
sglang:inter_token_latency_seconds_bucket{le="0.01",model_name="meta-llama/Llama-3.1-8B-Instruct"} 200000.0
sglang:inter_token_latency_seconds_bucket{le="0.02",model_name="meta-llama/Llama-3.1-8B-Instruct"} 249000.0
sglang:inter_token_latency_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 250000.0
sglang:inter_token_latency_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2100.0
sglang:inter_token_latency_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 250000.0
"""


def busy_vllm_v011() -> tuple[str, str]:
    """The real vLLM 0.11 scrape (idle) and the same advanced by a busy minute: preemptions,
    prompt tokens, prefix-cache hits, KV at 90%, 7 waiting, and every latency histogram
    observed (the one busy state the /metrics tests render)."""
    base = sample_text(V011)
    busy = advance(base, counters={"vllm:num_preemptions_total": 4, "vllm:prompt_tokens_total": 1000,
                                   "vllm:prefix_cache_queries_total": 1000, "vllm:prefix_cache_hits_total": 400},
                   gauges={"vllm:kv_cache_usage_perc": 0.9, "vllm:num_requests_waiting": 7},
                   observe={"vllm:time_to_first_token_seconds": [0.02] * 10,
                            "vllm:request_queue_time_seconds": [0.4] * 10,
                            "vllm:request_prefill_time_seconds": [0.35] * 10,
                            "vllm:request_decode_time_seconds": [2.0] * 10,
                            "vllm:inter_token_latency_seconds": [0.02] * 100,
                            "vllm:e2e_request_latency_seconds": [2.5] * 10})
    return base, busy
