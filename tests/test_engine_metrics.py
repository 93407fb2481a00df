"""Engine metrics normalisation: real scrapes, generated successors, resets, quantile edges."""
import pytest

from ridgeline.aggregator import engine_metrics as em
from engine_samples import SGLANG_TEXT, V011, V026, advance, sample_text
from ridgeline.probes import prom_text

T0 = 1_762_438_500_000_000_000
S = 1_000_000_000


def snap(text, ts=T0, url=None):
    return em.snapshot(prom_text.parse(text), ts, url)


# Observations for one busy window after the idle 0.11 scrape (see test comments for the maths).
TTFT_OBS = [0.015] * 50 + [0.15] * 40 + [3.0] * 10
ITL_OBS = [0.006] * 200
QUEUE_OBS = [0.1] * 90 + [9000.0] * 10


def busy_011(base, preempt=4, queries=10000, hits=6500, kv=0.87, waiting=6, running=48, success=10):
    return advance(base,
                   counters={"vllm:num_preemptions_total": preempt, "vllm:prefix_cache_queries_total": queries,
                             "vllm:prefix_cache_hits_total": hits, "vllm:prompt_tokens_total": queries,
                             "vllm:generation_tokens_total": 3000, "vllm:request_success_total": success},
                   gauges={"vllm:kv_cache_usage_perc": kv, "vllm:num_requests_waiting": waiting,
                           "vllm:num_requests_running": running},
                   observe={"vllm:time_to_first_token_seconds": TTFT_OBS,
                            "vllm:inter_token_latency_seconds": ITL_OBS,
                            "vllm:request_queue_time_seconds": QUEUE_OBS,
                            "vllm:request_prefill_time_seconds": [0.5] * 30,
                            "vllm:request_decode_time_seconds": [1.5] * 30,
                            "vllm:iteration_tokens_total": [32] * 100 + [2048] * 10})


# ----------------------------------------------------------------- the real samples

def test_real_vllm_011_idle_sample_yields():
    s = snap(sample_text(V011))
    assert s["engine"] == "vllm" and s["version_hint"] == "vllm-v1>=0.11"
    assert s["model_names"] == ["Qwen/Qwen1.5-0.5B-Chat"]
    assert s["gauges"] == {"num_running": 0.0, "num_waiting": 0.0, "kv_usage_ratio": 0.0,
                           "kv_pool_tokens": 2452 * 16}
    # _created gauges (~1.76e9) are never read as counter values.
    assert s["counters"]["preemptions"] == 0.0
    assert all(v == 0.0 for v in s["counters"].values())
    assert s["sources"]["itl_s"] == "vllm:inter_token_latency_seconds"  # new name preferred
    assert s["sources"]["kv_usage_ratio"] == "vllm:kv_cache_usage_perc"
    assert s["histograms"]["queue_time_s"]["bounds"][0] == 0.3
    assert s["histograms"]["itl_s"]["bounds"][0] == 0.01
    assert len(s["histograms"]["ttft_s"]["bounds"]) == 22
    fig = em.lifetime_figures(s)
    assert fig["prefix_cache_hit_ratio"] is None          # 0 queries: n/a, not 0
    assert fig["ttft_s"]["p50"]["kind"] == "no_data"
    assert fig["kv_used_tokens"] == 0.0


def test_real_vllm_026_partial_sample_yields():
    s = snap(sample_text(V026))
    assert s["engine"] == "vllm" and s["version_hint"] == "vllm-0.2.x"
    assert s["model_names"] == ["/models/mistral-7b"]
    assert s["gauges"]["kv_usage_ratio"] == pytest.approx(0.38849487785658)
    assert s["gauges"]["generation_throughput_tokens_per_s"] == pytest.approx(842.775, abs=1e-3)
    assert s["gauges"]["prompt_throughput_tokens_per_s"] == pytest.approx(1211.600, abs=1e-3)
    # The README capture stops at the HELP line of num_requests_running: no value.
    assert "num_running" not in s["gauges"] and "num_waiting" not in s["gauges"]
    assert s["counters"] == {} and s["histograms"] == {}
    fig = em.lifetime_figures(s)
    assert fig["preemptions_total"] is None and fig["prefix_cache_hit_ratio"] is None


# ----------------------------------------------------------------- deltas

def test_window_figures_from_real_sample_advanced():
    base = sample_text(V011)
    a, b = snap(base, T0), snap(busy_011(base), T0 + 5 * S)
    f = em.window_figures([b], a)
    assert f["restarted"] is False and f["interval_s"] == 5.0
    assert f["preemptions"] == 4 and f["preemption_rate_per_s"] == pytest.approx(0.8)
    assert f["requests_finished"] == 30        # three finished_reason series summed
    assert f["preemptions_per_finished_request"] == pytest.approx(4 / 30)
    assert f["prefix_cache_hit_ratio"] == pytest.approx(0.65)
    assert f["kv_usage_ratio"] == 0.87 and f["kv_used_tokens"] == pytest.approx(0.87 * 39232)
    assert f["num_waiting_requests"] == 6 and f["num_waiting_change"] == 6
    ttft = f["ttft_s"]
    assert ttft["count"] == 100 and ttft["mean"] == pytest.approx((50 * 0.015 + 40 * 0.15 + 30) / 100)
    assert ttft["p50"] == {"q": 0.5, "value": pytest.approx(0.02), "kind": "interpolated",
                           "lower_bound": 0.01, "upper_bound": 0.02}
    assert ttft["p90"]["value"] == pytest.approx(0.25)
    assert ttft["p99"]["value"] == pytest.approx(4.75)
    assert (ttft["p99"]["lower_bound"], ttft["p99"]["upper_bound"]) == (2.5, 5.0)
    # 6 ms ITL is below the first bucket (10 ms): reported as "<= 10 ms", no invented value.
    itl = f["itl_s"]["p50"]
    assert itl["kind"] == "first_bucket" and itl["value"] is None and itl["upper_bound"] == 0.01
    q = f["queue_time_s"]
    assert q["p50"]["kind"] == "first_bucket" and q["p50"]["upper_bound"] == 0.3
    assert q["p99"]["kind"] == "above_last_bucket" and q["p99"]["lower_bound"] == 7680.0
    assert q["p99"]["value"] is None
    assert f["prefill_time_share_ratio"] == pytest.approx(15 / 60)
    assert f["prefill_time_share_kind"] == "request_wall_time"
    assert f["tokens_per_step"] == pytest.approx((3200 + 20480) / 110)
    assert f["steps_per_s"] == pytest.approx(110 / 5)


def test_counter_reset_counts_from_restart():
    base = sample_text(V011)
    a = snap(busy_011(base, preempt=10, queries=20000, hits=10000), T0)
    # After a restart the counters start again: 1 preemption, 100 queries, 80 hits so far.
    restarted = advance(base, counters={"vllm:num_preemptions_total": 1, "vllm:prefix_cache_queries_total": 100,
                                        "vllm:prefix_cache_hits_total": 80},
                        observe={"vllm:time_to_first_token_seconds": [0.05] * 4})
    b = snap(restarted, T0 + 5 * S)
    f = em.window_figures([b], a)
    assert f["restarted"] is True
    assert f["preemptions"] == 1                      # not 1 - 10 = -9
    assert f["prefix_cache_hit_ratio"] == pytest.approx(0.8)
    assert f["ttft_s"]["count"] == 4                  # the histogram restarted too
    assert f["ttft_s"]["p50"]["lower_bound"] == 0.04


def test_sequence_sums_pairwise_deltas_across_a_reset():
    base = sample_text(V011)
    s1 = snap(advance(base, counters={"vllm:num_preemptions_total": 5}), T0)
    s2 = snap(advance(base, counters={"vllm:num_preemptions_total": 7}), T0 + 5 * S)
    s3 = snap(advance(base, counters={"vllm:num_preemptions_total": 2}), T0 + 10 * S)   # restart
    s4 = snap(advance(base, counters={"vllm:num_preemptions_total": 3}), T0 + 15 * S)
    f = em.window_figures([s2, s3, s4], s1)
    assert f["preemptions"] == 2 + 2 + 1 and f["restarted"]
    assert f["preemption_rate_per_s"] == pytest.approx(5 / 15)
    assert f["preemptions_total"] == 3


def test_single_snapshot_without_baseline_has_gauges_only():
    f = em.window_figures([snap(busy_011(sample_text(V011)))])
    assert f["kv_usage_ratio"] == 0.87
    assert f["preemptions"] is None and f["preemption_rate_per_s"] is None and f["ttft_s"] is None


def test_ray_prefix_and_replicas_are_summed():
    text = busy_011(sample_text(V011))
    lines = []
    for worker in ("w1", "w2"):
        for ln in text.splitlines():
            if ln.startswith("vllm:"):
                ln = "ray_" + ln.replace('{engine="0"', '{Component="core",WorkerId="%s",engine="0"' % worker)
            elif ln.startswith("#"):
                ln = ln.replace(" vllm:", " ray_vllm:")
            lines.append(ln)
    s = snap("\n".join(lines))
    assert s["engine"] == "vllm"
    assert s["sources"]["preemptions"] == "ray_vllm:num_preemptions_total"
    assert s["counters"]["preemptions"] == 8          # two replicas, 4 each
    assert s["gauges"]["num_waiting"] == 12
    assert s["gauges"]["kv_usage_ratio"] == 0.87      # max, not sum
    assert s["histograms"]["ttft_s"]["count"] == 200


def test_v0_and_v08_names():
    text = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
# TYPE vllm:gpu_prefix_cache_hit_rate gauge
vllm:gpu_prefix_cache_hit_rate{model_name="m"} -1.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="m"} 3.0
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.01",model_name="m"} 1.0
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 2.0
vllm:time_per_output_token_seconds_count{model_name="m"} 2.0
vllm:time_per_output_token_seconds_sum{model_name="m"} 0.5
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in terms of number of queried blocks.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 10.0
vllm:gpu_prefix_cache_hits_total{model_name="m"} 4.0
"""
    s = snap(text)
    assert s["gauges"]["kv_usage_ratio"] == 0.5
    assert "prefix_cache_hit_rate_gauge_ratio" not in s["gauges"]   # -1 = caching off
    assert s["sources"]["itl_s"] == "vllm:time_per_output_token_seconds"
    assert s["prefix_cache_unit"] == "blocks"
    f = em.lifetime_figures(s)
    assert f["prefix_cache_hit_ratio"] == pytest.approx(0.4) and f["prefix_cache_unit"] == "blocks"
    assert f["itl_s"]["p99"]["kind"] == "above_last_bucket"


def test_sglang_sample_normalised():
    s = snap(SGLANG_TEXT)
    assert s["engine"] == "sglang" and s["version_hint"] == "sglang>=0.4.4"
    g = s["gauges"]
    # TP ranks repeat one scheduler view: collapsed, not doubled.
    assert g["num_running"] == 37 and g["num_waiting"] == 5
    assert g["kv_usage_ratio"] == 0.91 and g["kv_pool_tokens"] == 472200 and g["kv_used_tokens"] == 429702
    f = em.lifetime_figures(s)
    assert f["preemptions_total"] == 12 and f["preemption_source"] == "counter"
    assert f["prefix_cache_hit_ratio"] == pytest.approx(0.4)
    assert f["prefill_time_share_ratio"] == pytest.approx(0.25) and f["prefill_time_share_kind"] == "gpu_time"
    q = f["queue_time_s"]
    # SGLang's 0.0 first bucket makes "no queueing" a real value.
    assert q["p50"]["kind"] == "first_bucket" and q["p50"]["value"] == 0.0
    assert q["p90"]["value"] == pytest.approx(0.2375)
    assert q["p99"]["value"] == pytest.approx(0.775)
    assert f["ttft_s"]["p50"]["value"] == pytest.approx(0.225)
    assert f["itl_s"]["p50"]["value"] == pytest.approx(0.005 + 0.005 * 124000 / 199000)
    assert f["itl_s"]["mean"] == pytest.approx(2100 / 250000)


def test_sglang_underscore_prefix_and_035_percent_hit_rate():
    text = ('sglang_num_running_reqs{name="/m"} 3\n'
            'sglang_cache_hit_rate{name="/m"} 87.6\n')
    s = snap(text)
    assert s["engine"] == "sglang" and s["gauges"]["num_running"] == 3
    assert s["gauges"]["prefix_cache_hit_rate_gauge_ratio"] == pytest.approx(0.876)
    assert s["model_names"] == ["/m"]


def test_not_an_engine():
    s = snap("process_cpu_seconds_total 3\n")
    assert s["engine"] is None and s["gauges"] == {}


# ----------------------------------------------------------------- quantile edges

@pytest.mark.parametrize("cum,q,kind,value,lo,hi", [
    ([10, 10, 10], 0.5, "first_bucket", None, None, 1.0),
    ([0, 10, 10], 0.5, "interpolated", 1.5, 1.0, 2.0),
    ([0, 0, 10], 0.5, "above_last_bucket", None, 2.0, None),
    ([0, 0, 0], 0.5, "no_data", None, None, None),
    ([2, 4, 4], 1.0, "interpolated", 2.0, 1.0, 2.0),
])
def test_histogram_quantile_edges(cum, q, kind, value, lo, hi):
    r = em.histogram_quantile({"bounds": [1.0, 2.0], "cumulative": cum, "count": cum[-1], "sum": 0}, q)
    assert r["kind"] == kind and r["lower_bound"] == lo and r["upper_bound"] == hi
    assert (r["value"] is None) if value is None else r["value"] == pytest.approx(value)


def test_histogram_delta_layout_change_is_a_reset():
    a = {"bounds": [1.0], "cumulative": [1, 2], "count": 2, "sum": 1}
    b = {"bounds": [1.0, 2.0], "cumulative": [1, 1, 1], "count": 1, "sum": 1}
    d, reset = em.histogram_delta(a, b)
    assert reset and d is b


def test_engine_record_and_prometheus_samples():
    base = sample_text(V011)
    f = em.window_figures([snap(busy_011(base), T0 + 5 * S, "http://x/metrics")], snap(base, T0))
    rec = em.engine_record(f)
    assert rec["kv_usage_ratio"] == 0.87 and rec["preemption_rate_per_s"] == pytest.approx(0.8)
    assert rec["ttft_p50_s"] == pytest.approx(0.02) and rec["ttft_p50_kind"] == "interpolated"
    assert rec["itl_p50_s"] is None and rec["itl_p50_upper_s"] == 0.01
    assert rec["queue_time_p99_kind"] == "above_last_bucket" and rec["queue_time_p99_lower_s"] == 7680.0
    assert rec["source"]["endpoint"] == "http://x/metrics"
    assert rec["source"]["families"]["kv_usage_ratio"] == "vllm:kv_cache_usage_perc"
    prom = {(n, tuple(sorted(l.items()))): v for n, l, v in em.prometheus_samples(rec)}
    assert prom[("ridgeline_engine_kv_usage_ratio", (("engine", "vllm"),))] == 0.87
    itl = [(dict(l), v) for (n, l), v in prom.items() if n == "ridgeline_engine_itl_seconds"]
    assert {(l["quantile"], l["bound"], v) for l, v in itl} >= {("50", "le", 0.01)}


def test_engine_tracker_windows_and_alerts():
    base = sample_text(V011)
    url = "http://127.0.0.1:8000/metrics"

    def polled(text, ts):
        return {"scrapes": [{"endpoint": url, "ts_ns": ts, "exposition": prom_text.parse(text)}], "errors": []}

    t = em.EngineTracker()
    w1 = t.update(polled(base, T0))
    assert w1["endpoints"][url]["preemptions"] is None          # first scrape: no baseline yet
    w2 = t.update(polled(busy_011(base, kv=0.9), T0 + 5 * S))
    rec = w2["endpoints"][url]
    assert rec["preemptions"] == 4 and rec["alerts"]["kv_watermark"]["firing"] is True
    assert rec["alerts"]["preemption_spike"]["firing"] is True   # 0.8/s from a quiet baseline
    assert t.update(None) == {"endpoints": {}, "errors": []}
    w4 = t.update({"scrapes": [{"endpoint": "http://x/metrics", "ts_ns": T0, "exposition": prom_text.parse("up 1\n")}]})
    assert w4["errors"][0]["error"] == "no vLLM or SGLang metrics"


def test_simulated_series_are_flagged():
    text = 'vllm:num_requests_running{engine="0",model_name="m",simulated="true"} 3\n'
    s = snap(text)
    assert s["simulated"] is True and s["gauges"]["num_running"] == 3
    assert em.engine_record(em.lifetime_figures(s))["simulated"] is True
    assert snap(sample_text(V011))["simulated"] is False


def test_engine_record_is_plain_for_the_wire():
    import msgpack
    base = sample_text(V011)
    rec = em.engine_record(em.window_figures([snap(busy_011(base), T0 + 5 * S)], snap(base, T0)))
    assert msgpack.unpackb(msgpack.packb(rec)) == rec
