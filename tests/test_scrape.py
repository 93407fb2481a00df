"""``ridgeline scrape``: JSON keys on both real samples over loopback, --window deltas, errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.engine_samples import SGLANG_TEXT, V011, V026, MetricsServer, advance, free_port, sample_text

from ridgeline.agent.cli import main

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = {"engine", "kv_usage", "num_running", "num_waiting", "preemptions_total", "prefix_cache_hit_rate",
            "histograms"}


def run_json(capsys, *argv):
    assert main(["scrape", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_on_real_vllm_011(capsys):
    with MetricsServer(sample_text(V011)) as srv:
        out = run_json(capsys, srv.url)
    assert REQUIRED <= set(out)
    assert out["engine"] == "vllm" and out["version_hint"] == "vllm-v1>=0.11"
    assert (out["kv_usage"], out["num_running"], out["num_waiting"], out["preemptions_total"]) == (0, 0, 0, 0)
    assert out["kv_pool_tokens"] == 39232 and out["since_start"] is True
    assert out["prefix_cache_hit_rate"] is None            # no queries yet: not derivable
    h = out["histograms"]
    assert set(h) == {"ttft_s", "itl_s", "queue_time_s", "prefill_time_s", "decode_time_s", "e2e_latency_s",
                      "iteration_tokens"}
    assert h["itl_s"]["first_bucket_upper"] == 0.01 and h["itl_s"]["last_bucket_upper"] == 80.0
    assert h["ttft_s"]["p99"]["kind"] == "no_data"


def test_json_on_real_vllm_026_bare_host_port(capsys):
    with MetricsServer(sample_text(V026)) as srv:
        out = run_json(capsys, f"127.0.0.1:{srv.port}")     # /metrics added
    assert out["engine"] == "vllm" and out["version_hint"] == "vllm-0.2.x"
    assert out["kv_usage"] == pytest.approx(0.3885, abs=1e-4)
    assert out["num_running"] is None and out["preemptions_total"] is None
    assert out["histograms"] == {}
    assert out["generation_throughput_tokens_per_s"] == pytest.approx(842.78, abs=0.01)


def test_json_sglang_percentiles_with_bounds(capsys):
    with MetricsServer(SGLANG_TEXT) as srv:
        out = run_json(capsys, srv.url)
    assert out["engine"] == "sglang" and out["kv_usage"] == 0.91 and out["preemptions_total"] == 12
    assert out["prefix_cache_hit_rate"] == pytest.approx(0.4)
    p90 = out["histograms"]["queue_time_s"]["p90"]
    assert p90["kind"] == "interpolated" and (p90["lower_bound"], p90["upper_bound"]) == (0.2, 0.5)


def test_window_mode_reports_deltas(capsys):
    base = sample_text(V011)
    nxt = advance(base, counters={"vllm:num_preemptions_total": 2, "vllm:prefix_cache_queries_total": 400,
                                  "vllm:prefix_cache_hits_total": 100},
                  observe={"vllm:time_to_first_token_seconds": [0.07] * 10})
    with MetricsServer(base) as srv:
        srv.then = [nxt]                      # the second request sees the advanced counters
        out = run_json(capsys, srv.url, "--window", "0.4")
        assert srv.requests == 2
    assert out["since_start"] is False and out["interval_s"] > 0.3
    assert out["preemptions"] == 2 and out["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert out["histograms"]["ttft_s"]["count"] == 10
    assert out["histograms"]["ttft_s"]["p50"]["lower_bound"] == 0.06


def test_text_output(capsys):
    with MetricsServer(SGLANG_TEXT) as srv:
        assert main(["scrape", srv.url]) == 0
    text = capsys.readouterr().out
    assert "KV usage        91.0% of 472200 tokens" in text
    assert "queue_time_s" in text and "p50 0ms" in text and "p90 238ms" in text


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ridgeline", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_unreachable_url_one_line_exit_1():
    # Nothing listening is a runtime failure (exit 1), like `top` finding no agent; a
    # malformed URL is bad input (exit 2).
    r = _cli("scrape", f"http://127.0.0.1:{free_port()}/metrics", "--json", "--timeout", "2")
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ridgeline: error: http://127.0.0.1:")
    assert "Traceback" not in r.stderr
    r = _cli("scrape", "http://127.0.0.1:99999/metrics")
    assert r.returncode == 2 and r.stderr.startswith("ridgeline: error: http://127.0.0.1:99999/metrics: invalid URL")


def test_not_an_engine_endpoint_exit_2(capsys):
    with MetricsServer("process_cpu_seconds_total 1\n") as srv:
        r = _cli("scrape", srv.url)
    assert r.returncode == 2 and "no vLLM or SGLang metrics" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_url_exit_2():
    r = _cli("scrape", "http://[not-a-host/metrics")
    assert r.returncode == 2 and r.stderr.startswith("ridgeline: error:") and "Traceback" not in r.stderr
