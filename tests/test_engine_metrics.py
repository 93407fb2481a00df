"""Engine metrics normalisation: real scrapes, generated successors, resets, quantile edges."""
from pathlib import Path

import pytest
from support.engine_samples import SGLANG_TEXT, V011, V026, advance, sample_text

from ridgeline.aggregator import engine_metrics as em
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
                           "kv_pool_tokens": 2452 * 16, "kv_used_tokens": 0.0}
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
    # No quantile gauges (promtool rejects a quantile label on a gauge): the engine's
    # histograms go through with their own buckets instead.
    assert not any("quantile" in dict(l) or "bound" in dict(l) for (n, l) in prom)
    hists = {name: (buckets, total) for name, _, buckets, total in em.prometheus_histograms(rec)}
    itl_buckets, _ = hists["ridgeline_engine_inter_token_latency_seconds"]
    assert itl_buckets[0] == ("0.01", 200.0) and itl_buckets[-1] == ("+Inf", 200.0)
    assert len(hists["ridgeline_engine_time_to_first_token_seconds"][0]) == 23   # 22 vLLM bounds + Inf


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


# ----------------------------------------------------------------- issue 12: segments, KV, misreads
#
# Expositions below use the exact family and label names of the engines' sources:
# * SGLang: python/sglang/srt/observability/metrics_collector.py @ 44cedc2b9c7dd31d9acae4498ea4fa0d3665feed
#   (sglang:cache_hit_rate gauge, queue_time_seconds, time_to_first_token_seconds,
#   e2e_request_latency_seconds, evicted_tokens_total, num_queue_reqs, num_running_reqs,
#   token_usage, gpu_execution_seconds_total{category}) and the later version of the same
#   file that renames it sglang:forward_execution_seconds_total{category} and adds
#   estimated_flops/read_bytes/write_bytes_per_gpu_total; func_latency_seconds{name=<function>}
#   from python/sglang/srt/metrics/func_timer.py.
# * vLLM: vllm/v1/metrics/loggers.py (PrometheusStatLogger: labelnames ["model_name", "engine"],
#   external_prefix_cache_queries/hits, prompt_tokens_cached, kv_cache_usage_perc,
#   cache_config_info{engine,num_gpu_blocks,block_size}) and vllm/v1/metrics/perf.py
#   (estimated_flops_per_gpu_total, estimated_read_bytes_per_gpu_total).

SGL_LABELS = 'engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"'


def test_sglang_cache_hit_rate_is_a_ratio_despite_func_latency_name_label():
    text = (f'sglang:func_latency_seconds_bucket{{le="0.05",name="generate_request"}} 3\n'
            f'sglang:func_latency_seconds_bucket{{le="+Inf",name="generate_request"}} 4\n'
            f'sglang:func_latency_seconds_count{{name="generate_request"}} 4\n'
            f'sglang:func_latency_seconds_sum{{name="generate_request"}} 0.1\n'
            f'sglang:cache_hit_rate{{{SGL_LABELS}}} 0.0075\n'
            f'sglang:num_running_reqs{{{SGL_LABELS}}} 3\n')
    s = snap(text)
    assert s["gauges"]["prefix_cache_hit_rate_gauge_ratio"] == pytest.approx(0.0075)   # was 0.000075
    assert s["model_names"] == ["qwen"]                  # "generate_request" is a function, not a model


def test_sglang_priority_totals_are_not_added_to_per_priority_series():
    lines = []
    for prio, running, queued in (("", 12, 7), ("0", 8, 5), ("1", 4, 2)):
        lab = f'{SGL_LABELS},priority="{prio}"'
        lines += [f"sglang:num_running_reqs{{{lab}}} {running}", f"sglang:num_queue_reqs{{{lab}}} {queued}",
                  f"sglang:token_usage{{{lab}}} 0.5"]
    g = snap("\n".join(lines) + "\n")["gauges"]
    assert g["num_running"] == 12 and g["num_waiting"] == 7       # the totals, not 24 / 14
    # Without a priority="" total the per-priority parts are summed.
    g = snap("\n".join(x for x in lines if 'priority=""' not in x) + "\n")["gauges"]
    assert g["num_running"] == 12 and g["num_waiting"] == 7


def _sgl_work(extend_s, decode_s, flops, rd, evicted, family="forward_execution_seconds_total"):
    return (f'sglang:{family}{{{SGL_LABELS},category="extend"}} {extend_s}\n'
            f'sglang:{family}{{{SGL_LABELS},category="decode"}} {decode_s}\n'
            f'sglang:estimated_flops_per_gpu_total{{{SGL_LABELS}}} {flops}\n'
            f'sglang:estimated_read_bytes_per_gpu_total{{{SGL_LABELS}}} {rd}\n'
            f'sglang:evicted_tokens_total{{{SGL_LABELS}}} {evicted}\n'
            f'sglang:num_running_reqs{{{SGL_LABELS}}} 3\n')


@pytest.mark.parametrize("family", ["forward_execution_seconds_total", "gpu_execution_seconds_total"])
def test_sglang_forward_execution_rename_and_work_estimates(family):
    a = snap(_sgl_work(0, 0, 0, 0, 0, family), T0)
    b = snap(_sgl_work(1.0, 3.0, 2e15, 4e12, 5000, family), T0 + 2 * S)
    f = em.window_figures([b], a)
    assert f["prefill_time_share_kind"] == "gpu_time" and f["prefill_time_share_ratio"] == pytest.approx(0.25)
    assert f["sources"]["gpu_execution_s"] == f"sglang:{family}"
    assert f["estimated_flops_per_gpu_per_s"] == pytest.approx(1e15)
    assert f["estimated_bytes_per_gpu_per_s"] == pytest.approx(2e12)
    assert f["estimated_arithmetic_intensity"] == pytest.approx(500.0)
    assert f["work_estimate_source"] == "engine_estimate"
    assert f["kv_eviction_rate_tokens_per_s"] == pytest.approx(2500.0)
    assert f["kv_eviction_source"] == "sglang:evicted_tokens_total"


def test_sglang_segments_are_derived_from_means_and_tagged():
    def hist(fam, bounds, obs):
        out = []
        for b in bounds + ["+Inf"]:
            n = sum(1 for o in obs if b == "+Inf" or o <= float(b))
            out.append(f'sglang:{fam}_bucket{{{SGL_LABELS},le="{b}"}} {n}')
        out += [f"sglang:{fam}_count{{{SGL_LABELS}}} {len(obs)}", f"sglang:{fam}_sum{{{SGL_LABELS}}} {sum(obs)}"]
        return out
    b = ["0.1", "0.2", "0.4", "1", "2", "4", "10"]
    zero = hist("queue_time_seconds", b, []) + hist("time_to_first_token_seconds", b, []) + \
        hist("e2e_request_latency_seconds", b, [])
    busy = hist("queue_time_seconds", b, [0.1] * 4) + hist("time_to_first_token_seconds", b, [0.4] * 4) + \
        hist("e2e_request_latency_seconds", b, [3.4] * 4)
    f = em.window_figures([snap("\n".join(busy) + "\n", T0 + S)], snap("\n".join(zero) + "\n", T0))
    assert f["queue_mean_s"] == pytest.approx(0.1) and f["ttft_mean_s"] == pytest.approx(0.4)
    assert f["prefill_mean_s"] == pytest.approx(0.3) and f["decode_mean_s"] == pytest.approx(3.0)
    assert f["segment_kinds"] == {"queue": "measured", "prefill": "derived", "decode": "derived"}
    assert f["queue_share_of_ttft_ratio"] == pytest.approx(0.25)


# SGLang's per-stage latency: two scrapes rendered by prometheus_client (multiprocess mode,
# as SGLang serves /metrics) from SGLang's own definitions (family, HELP, buckets
# exponential_buckets(0.001, 1.62, 30), scheduler labels + stage) and its observation
# points: tests/data/sglang_per_stage/ (generate.py; commits in tests/data/PROVENANCE.md).
PER_STAGE = Path(__file__).resolve().parent / "data" / "sglang_per_stage"


def per_stage_window():
    t0 = snap((PER_STAGE / "scrape_t0.prom").read_text(), T0)
    t1 = snap((PER_STAGE / "scrape_t1.prom").read_text(), T0 + 10 * S)
    return t1, em.window_figures([t1], t0)


def test_sglang_per_stage_prefill_forward_is_the_measured_prefill():
    t1, f = per_stage_window()
    h = t1["histograms"]["prefill_time_s"]
    assert len(h["bounds"]) == 30 and h["bounds"][0] == 0.001 and h["bounds"][-1] == pytest.approx(1191.0649, rel=1e-6)
    assert t1["sources"]["prefill_time_s"] == 'sglang:per_stage_req_latency_seconds{stage="prefill_forward"}'
    # The window's 8 requests, not the 10 before t0; chunked_prefill (per chunk, 0.04 s) and
    # request_process (0.002 s) are other stages and must not be mixed in.
    assert f["prefill_time_s"]["count"] == 8
    assert f["prefill_mean_s"] == pytest.approx(0.12) and f["queue_mean_s"] == pytest.approx(0.05)
    assert f["ttft_mean_s"] == pytest.approx(0.2)
    # SGLang observes no per-request decode stage: decode stays e2e - TTFT, tagged derived.
    assert f["decode_mean_s"] == pytest.approx(2.0)
    assert f["segment_kinds"] == {"queue": "measured", "prefill": "measured", "decode": "derived"}
    rec = em.engine_record(f)
    assert rec["source"]["families"]["prefill_time_s"].endswith('{stage="prefill_forward"}')
    # Passed through to /metrics with SGLang's 30 per-stage buckets.
    lh = rec["latency_histograms"]["prefill_time_s"]
    assert len(lh["bounds"]) == 30 and lh["count"] == 18


def test_sglang_per_stage_without_prefill_forward_keeps_the_derived_prefill():
    """A server whose per-stage family has no prefill_forward series (e.g. a decode node of a
    disaggregated pair) gives no measured prefill: the other stages are never taken for it."""
    def drop(text):
        return "\n".join(x for x in text.splitlines() if 'stage="prefill_forward"' not in x) + "\n"
    t0 = snap(drop((PER_STAGE / "scrape_t0.prom").read_text()), T0)
    t1 = snap(drop((PER_STAGE / "scrape_t1.prom").read_text()), T0 + 10 * S)
    assert "prefill_time_s" not in t1["histograms"]
    f = em.window_figures([t1], t0)
    assert f["segment_kinds"]["prefill"] == "derived"
    assert f["prefill_mean_s"] == pytest.approx(0.2 - 0.05)


def test_vllm_segments_measured_and_queue_share():
    base = sample_text(V011)
    f = em.window_figures([snap(busy_011(base), T0 + 5 * S)], snap(base, T0))
    assert f["prefill_mean_s"] == pytest.approx(0.5) and f["decode_mean_s"] == pytest.approx(1.5)
    assert f["segment_kinds"] == {"queue": "measured", "prefill": "measured", "decode": "measured"}
    q = sum(QUEUE_OBS) / len(QUEUE_OBS)
    t = sum(TTFT_OBS) / len(TTFT_OBS)
    assert f["queue_mean_s"] == pytest.approx(q) and f["queue_share_of_ttft_ratio"] == 1.0   # clipped: q > t
    rec = em.engine_record(f)
    assert rec["prefill_time_count"] == 30 and rec["decode_time_mean_s"] == pytest.approx(1.5)
    # vLLM exports no eviction counter: unknown, not zero.
    assert rec["kv_eviction_rate_tokens_per_s"] is None and rec["kv_eviction_source"] is None
    assert t > 0


VLLM_DP = """vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.9
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.1
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 4
vllm:num_requests_running{engine="1",model_name="m"} 1
"""


def test_vllm_data_parallel_kv_used_tokens_per_engine():
    g = snap(VLLM_DP)["gauges"]
    assert g["kv_pool_tokens"] == 32000 and g["kv_usage_ratio"] == 0.9     # the fullest binds the watermark
    assert g["kv_used_tokens"] == pytest.approx(0.9 * 16000 + 0.1 * 16000)   # 16000, not 0.9 x 32000
    assert g["num_running"] == 5


def _vllm_cache(q, h, eq, eh, prompt, cached, flops, rd):
    lab = 'engine="0",model_name="m"'
    return (f"vllm:prefix_cache_queries_total{{{lab}}} {q}\nvllm:prefix_cache_hits_total{{{lab}}} {h}\n"
            f"vllm:external_prefix_cache_queries_total{{{lab}}} {eq}\n"
            f"vllm:external_prefix_cache_hits_total{{{lab}}} {eh}\n"
            f"vllm:prompt_tokens_total{{{lab}}} {prompt}\nvllm:prompt_tokens_cached_total{{{lab}}} {cached}\n"
            f"vllm:estimated_flops_per_gpu_total{{{lab}}} {flops}\n"
            f"vllm:estimated_read_bytes_per_gpu_total{{{lab}}} {rd}\n"
            f"vllm:kv_cache_usage_perc{{{lab}}} 0.5\n")


def test_vllm_external_prefix_cache_and_cached_prompt_tokens():
    f = em.window_figures([snap(_vllm_cache(1000, 400, 600, 150, 1000, 550, 4e14, 2e12), T0 + 4 * S)],
                          snap(_vllm_cache(0, 0, 0, 0, 0, 0, 0, 0), T0))
    assert f["prefix_cache_hit_ratio"] == pytest.approx(0.4)
    assert f["external_prefix_cache_hit_ratio"] == pytest.approx(0.25)
    assert f["prompt_tokens_cached_ratio"] == pytest.approx(0.55)          # local 400 + external 150
    assert f["estimated_flops_per_gpu_per_s"] == pytest.approx(1e14)
    assert f["work_estimate_source"] == "engine_estimate"


def test_per_gpu_estimates_are_a_mean_over_ranks_not_a_sum():
    text = "".join(f'vllm:estimated_flops_per_gpu_total{{engine="{e}",model_name="m"}} {v}\n'
                   for e, v in (("0", 3e12), ("1", 1e12)))
    assert snap(text)["counters"]["estimated_flops_per_gpu"] == pytest.approx(2e12)


def test_swapped_requests_shown():
    text = 'vllm:num_requests_swapped{model_name="m"} 3\nvllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
    rec = em.engine_record(em.lifetime_figures(snap(text)))
    assert rec["num_swapped_requests"] == 3
    names = {n for n, _, _ in em.prometheus_samples(rec)}
    assert "ridgeline_engine_swapped_requests" in names


def test_new_window_fields_survive_a_recording(tmp_path):
    """Segments, KV dynamics and the engine's histograms go through the wire into a
    recording (`ridgeline record`) and come back from `load_recording` unchanged."""
    from ridgeline.agent.recording import RecordingWriter, load_recording
    from ridgeline.aggregator import wire as codec
    base = sample_text(V011)
    url = "http://127.0.0.1:8000/metrics"
    t = em.EngineTracker()
    t.update({"scrapes": [{"endpoint": url, "ts_ns": T0, "exposition": prom_text.parse(base), "pid": 7}]})
    eng = t.update({"scrapes": [{"endpoint": url, "ts_ns": T0 + 5 * S, "pid": 7,
                                 "exposition": prom_text.parse(busy_011(base, kv=0.95))}]})
    window = {"duration_ns": 5 * S, "gpus": [], "engine": {"engine": eng}}
    p = tmp_path / "r.rlrec"
    with RecordingWriter(p) as w:
        w.write(codec.encode_envelope("window", 0, codec.encode_window(window), "h", 1), 1)
    rec = load_recording(p, codec=codec).windows[0]["engine"]["engine"]["endpoints"][url]
    assert rec == eng["endpoints"][url]
    assert rec["prefill_mean_s"] == pytest.approx(0.5) and rec["preemption_episode_active"] is True
    assert rec["latency_histograms"]["ttft_s"]["cumulative"][-1] == len(TTFT_OBS)
