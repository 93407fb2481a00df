"""One test per verdict (the name says which), plus the headroom rule and the window glue.

Phase figures are literals with H3's ``phase_summary`` keys, sized for Llama-3-8B (bf16)
on an H100 SXM (3.35 TB/s HBM, 989 TFLOP/s dense bf16): a decode step at batch 64 and a
prefill of 8 x 2048 tokens. Engine figures for the KV case come from the real vLLM 0.11
scrape advanced to a loaded state (tests/support/engine_samples.py).
"""
import pytest
from support.engine_samples import V011, advance, sample_text

from ridgeline.aggregator import engine_metrics as em
from ridgeline.aggregator import verdict as v
from ridgeline.probes import prom_text

WINDOW_NS = 1_000_000_000

DECODE_AT_BW = {"kernel_time_ns": 780_000_000, "kernels": 52_000, "flops": 8.4e13, "bytes": 2.03e12,
                "achieved_flops_per_s": 1.08e14, "achieved_bytes_per_s": 2.60e12, "arithmetic_intensity": 41.4,
                "pct_of_peak_flops": 10.9, "pct_of_peak_bytes": 77.6, "verdict": "memory-bound"}
PREFILL_AT_COMPUTE = {"kernel_time_ns": 820_000_000, "kernels": 9_100, "flops": 5.58e14, "bytes": 5.1e11,
                      "achieved_flops_per_s": 6.80e14, "achieved_bytes_per_s": 6.2e11,
                      "arithmetic_intensity": 1094.0, "pct_of_peak_flops": 68.8, "pct_of_peak_bytes": 18.5,
                      "verdict": "compute-bound"}
DECODE_SMALL_BATCH = dict(DECODE_AT_BW, kernel_time_ns=310_000_000, achieved_bytes_per_s=7.4e11,
                          achieved_flops_per_s=3.1e12, arithmetic_intensity=4.2, pct_of_peak_flops=0.3,
                          pct_of_peak_bytes=22.1, verdict="memory-bound")

CALM_ENGINE = {"engine": "vllm", "kv_usage_ratio": 0.52, "kv_usage_max_ratio": 0.55, "preemptions": 0.0,
               "preemption_rate_per_s": 0.0, "num_waiting_requests": 0.0, "num_waiting_change": 0.0,
               "queue_time_mean_s": 0.02, "prefix_cache_hit_ratio": 0.4}
H100_DEVICE = {"gpu_busy_time_pct": 100.0, "gpm_dram_bw_util_pct": 76.0, "gpm_sm_occupancy_pct": 38.0,
               "gpm_any_tensor_util_pct": 9.0, "clock_event_reasons": []}


def inputs(**kw):
    base = dict(window_ns=WINDOW_NS, device=0, pid=4242, phases={"decode": DECODE_AT_BW},
                gpu_busy_ns=960_000_000, gpu_idle_ns=40_000_000, engine=CALM_ENGINE, device_figures=H100_DEVICE,
                launch_thread={"tid": 4242, "comm": "python3", "on_cpu_ns": 310_000_000,
                               "runq_wait_ns": 5_000_000, "blocked_ns": 640_000_000})
    base.update(kw)
    return v.VerdictInputs(**base)


def loaded_vllm_record(kv=0.87, preempt=4, waiting=6):
    base = sample_text(V011)
    nxt = advance(base, counters={"vllm:num_preemptions_total": preempt},
                  gauges={"vllm:kv_cache_usage_perc": kv, "vllm:num_requests_waiting": waiting})
    a = em.snapshot(prom_text.parse(base), 0, "http://127.0.0.1:8000/metrics")
    b = em.snapshot(prom_text.parse(nxt), 5_000_000_000, "http://127.0.0.1:8000/metrics")
    return em.engine_record(em.window_figures([b], a))


def test_verdict_kv_capacity_bound_watermark():
    rec = loaded_vllm_record(kv=0.87, preempt=0, waiting=0)
    r = v.judge(inputs(engine=rec))
    assert r["verdict"] == v.KV_CAPACITY and r["face"] == "memory-capacity"
    assert r["reasons"] == ["KV usage 87.0% >= watermark 85%"]
    assert v.BANDWIDTH in r["also"]           # decode still at its bandwidth ceiling
    assert r["figures"]["kv_usage_ratio"] == 0.87 and r["figures"]["kv_pool_tokens"] == 39232


def test_verdict_kv_capacity_bound_preemptions_rising():
    rec = loaded_vllm_record(kv=0.70, preempt=4, waiting=0)
    r = v.judge(inputs(engine=rec))
    assert r["verdict"] == v.KV_CAPACITY
    assert r["reasons"] == ["4 preemptions in the window (0.80/s)"]


def test_verdict_kv_capacity_bound_waiting_growing_while_full():
    eng = dict(CALM_ENGINE, kv_usage_ratio=0.80, kv_usage_max_ratio=0.80, num_waiting_requests=9.0,
               num_waiting_change=4.0)
    r = v.judge(inputs(engine=eng))
    assert r["verdict"] == v.KV_CAPACITY
    assert r["reasons"] == ["waiting requests +4 (now 9) while KV usage 80.0% >= 75%"]
    # Same growth with room in the pool is not a capacity verdict.
    r2 = v.judge(inputs(engine=dict(eng, kv_usage_ratio=0.5, kv_usage_max_ratio=0.5)))
    assert r2["verdict"] != v.KV_CAPACITY


def test_verdict_memory_bandwidth_bound_decode():
    r = v.judge(inputs())
    assert r["verdict"] == v.BANDWIDTH and r["phase"] == "decode" and r["face"] == "bandwidth"
    assert "decode: 78% of peak HBM bytes/s (2.60 TB/s)" in r["reasons"][0]
    assert r["figures"]["phase"]["arithmetic_intensity"] == 41.4


def test_verdict_compute_bound_prefill():
    r = v.judge(inputs(phases={"prefill": PREFILL_AT_COMPUTE, "decode": dict(DECODE_AT_BW, kernel_time_ns=90_000_000)}))
    assert r["verdict"] == v.COMPUTE and r["phase"] == "prefill"
    assert "prefill: 69% of peak FLOP/s (680.0 TFLOP/s)" in r["reasons"][0]


def test_verdict_launch_bound():
    r = v.judge(inputs(phases={"decode": DECODE_SMALL_BATCH}, gpu_busy_ns=550_000_000, gpu_idle_ns=450_000_000,
                       launch_thread={"tid": 4242, "on_cpu_ns": 920_000_000, "runq_wait_ns": 30_000_000,
                                      "blocked_ns": 20_000_000}))
    assert r["verdict"] == v.LAUNCH and r["face"] == "launch"
    assert r["reasons"] == ["GPU idle 45% of its span",
                            "launch thread on-CPU 92% of the window (run queue 3%, blocked 2%)"]


def test_verdict_host_bound():
    r = v.judge(inputs(phases={"decode": DECODE_SMALL_BATCH}, gpu_busy_ns=600_000_000, gpu_idle_ns=400_000_000,
                       launch_thread={"tid": 4242, "on_cpu_ns": 300_000_000, "runq_wait_ns": 350_000_000,
                                      "blocked_ns": 200_000_000}))
    assert r["verdict"] == v.HOST and r["face"] == "host"
    assert r["reasons"][1] == ("launch thread off-CPU 55% of the window (run queue 35%, blocked 20%) "
                               "vs on-CPU 30%")


def test_verdict_queue_bound():
    eng = dict(CALM_ENGINE, kv_usage_ratio=0.45, kv_usage_max_ratio=0.45, num_waiting_requests=24.0,
               num_waiting_change=0.0, queue_time_mean_s=2.1)
    r = v.judge(inputs(phases={"decode": DECODE_SMALL_BATCH}, engine=eng))
    assert r["verdict"] == v.QUEUE and r["face"] == "queue"
    assert r["reasons"] == ["24 requests waiting, mean queue time 2.10 s",
                            "KV usage 45.0% below watermark; decode at 22% of peak bytes/s and 0% of peak FLOP/s"]
    # The same queue with decode at its bandwidth ceiling is a bandwidth verdict, not a queue one.
    assert v.judge(inputs(engine=eng))["verdict"] == v.BANDWIDTH


def test_verdict_undetermined():
    r = v.judge(v.VerdictInputs(window_ns=WINDOW_NS))
    assert r["verdict"] == v.UNDETERMINED and r["face"] is None
    assert set(r["missing"]) == {"engine metrics", "GPU busy/idle time", "launch-thread scheduling",
                                 "per-phase roofline", "device metrics"}


def test_roofline_verdict_fallback_below_thresholds():
    r = v.judge(inputs(phases={"decode": DECODE_SMALL_BATCH}))
    assert r["verdict"] == v.BANDWIDTH and "below the thresholds" in r["reasons"][0]


def test_gpu_busy_time_is_never_evidence_of_headroom():
    busy = v.judge(inputs(device_figures=dict(H100_DEVICE, gpu_busy_time_pct=100.0)))
    idle = v.judge(inputs(device_figures=dict(H100_DEVICE, gpu_busy_time_pct=3.0)))
    assert busy["verdict"] == idle["verdict"] == v.BANDWIDTH
    assert busy["reasons"] == idle["reasons"]
    # Shown beside the DRAM bandwidth figure, never alone.
    assert busy["figures"]["gpu_busy_time_pct"] == 100.0 and busy["figures"]["dram_bw_util_pct"] == 76.0


def test_thresholds_configurable():
    eng = dict(CALM_ENGINE, kv_usage_ratio=0.80, kv_usage_max_ratio=0.80)
    assert v.judge(inputs(engine=eng))["verdict"] == v.BANDWIDTH
    assert v.judge(inputs(engine=eng), v.Thresholds(kv_watermark_ratio=0.75))["verdict"] == v.KV_CAPACITY


def test_window_verdict_from_window_record():
    dev = {"gpu_index": 0, "gpu_name": "NVIDIA H100 80GB HBM3", "ts_ns": 1, "gpu_busy_time_pct": 100.0,
           "gpm_dram_bw_util_pct": 71.0, "source": "nvml+gpm"}
    window = {
        "start_ns": 0, "end_ns": WINDOW_NS, "duration_ns": WINDOW_NS,
        "gpus": [{"device": 0, "pid": 4242, "busy_ns": 560_000_000, "idle_ns": 440_000_000, "span_ns": WINDOW_NS,
                  "phases": {"decode": DECODE_SMALL_BATCH}}],
        "device": {"nvml": {"devices": [dev, dict(dev, ts_ns=2, gpm_dram_bw_util_pct=73.0)]}},
        "engine": {"engine": {"endpoints": {"http://127.0.0.1:8000/metrics": dict(CALM_ENGINE)}}},
        "sched": {"sched": {"threads": [
            {"pid": 4242, "tid": 4242, "comm": "python3", "on_cpu_ns": 900_000_000, "runq_wait_ns": 10_000_000,
             "blocked_ns": 50_000_000, "launches": 25_000},
            {"pid": 4242, "tid": 4300, "comm": "tokenizer", "on_cpu_ns": 950_000_000, "runq_wait_ns": 0,
             "blocked_ns": 0, "launches": 0}]}},
    }
    out = v.window_verdict(window)
    assert len(out) == 1 and out[0]["verdict"] == v.LAUNCH
    assert out[0]["figures"]["launch_thread"]["tid"] == 4242        # the launching thread, not the busiest
    assert out[0]["figures"]["dram_bw_util_pct"] == pytest.approx(72.0)
    rec = v.verdict_record(out[0])
    assert rec["verdict"] == v.LAUNCH and rec["launch_thread_on_cpu_ns"] == 900_000_000
    assert rec["source"] == {"engine": "engine", "device": "nvml", "sched": "sched", "roofline": "roofline"}
    prom = v.prometheus_samples(out[0])
    assert sum(val for _, _, val in prom) == 1.0 and len(prom) == len(v.VERDICTS)


def test_idle_gpu_is_not_bandwidth_bound_and_overcounts_are_flagged():
    phase = dict(DECODE_SMALL_BATCH, pct_of_peak_bytes=292.0, idle_ratio=0.95, verdict="host-bound",
                 evidence=["GPU idle 95% of the phase's time", "host in launch calls during 12% of the idle"])
    r = v.judge(v.VerdictInputs(window_ns=WINDOW_NS, phases={"decode": phase}))
    assert r["verdict"] == v.HOST
    assert r["reasons"][0] == "GPU idle 95% of the decode phase's time"
    assert "host in launch calls during 12% of the idle" in r["reasons"][1]
    assert r["figures"]["implausible"] == [
        "decode pct_of_peak_bytes = 292% exceeds the ceiling: work model overcounts; not used"]
    # Idle but the roofline found no host/launch cause: still not a ceiling verdict.
    r2 = v.judge(v.VerdictInputs(window_ns=WINDOW_NS, phases={"decode": dict(phase, verdict="memory-bound")}))
    assert r2["verdict"] == v.UNDETERMINED


def test_verdicts_on_recorded_traces(trace_path):
    """H2's phases and H3's roofline on two real traces, judged without engine or device data."""
    from ridgeline.aggregator.analysis import analyze_trace, document
    from ridgeline.probes.kineto import load_trace

    h100 = document(analyze_trace(load_trace(trace_path("nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz"))))
    r = v.judge(v.VerdictInputs(window_ns=WINDOW_NS, phases=h100["phases"]))
    # One busy forward pass (GPU idle < 10%): a ceiling face of the prefill phase.
    assert r["phase"] == "prefill" and r["verdict"] in (v.BANDWIDTH, v.COMPUTE)
    assert r["figures"]["gpu_idle_ratio"] < 0.2

    nano = document(analyze_trace(load_trace(trace_path(
        "nvidia-inference/nanovllm_rtx4080laptop_decode_step100_fragment.json.gz"))))
    r = v.judge(v.VerdictInputs(window_ns=WINDOW_NS, phases=nano["phases"]))
    # A decode fragment where the GPU waits for the host most of the time.
    assert r["verdict"] in (v.HOST, v.LAUNCH) and r["figures"]["gpu_idle_ratio"] > 0.5


def test_verdict_kv_capacity_bound_sglang_retraction_gauge():
    from support.engine_samples import SGLANG_TEXT
    text = SGLANG_TEXT.replace("sglang:num_retracted_requests_total", "sglang:num_retracted_reqs").replace(
        "sglang:token_usage{engine_type=\"unified\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\",pp_rank=\"0\",tp_rank=\"0\"} 0.91",
        "sglang:token_usage{engine_type=\"unified\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\",pp_rank=\"0\",tp_rank=\"0\"} 0.5").replace(
        "tp_rank=\"1\"} 0.91", "tp_rank=\"1\"} 0.5")
    rec = em.engine_record(em.lifetime_figures(em.snapshot(prom_text.parse(text), 0)))
    assert rec["preemptions"] is None and rec["retracted_requests_last_tick"] == 12
    r = v.judge(inputs(engine=rec))
    assert r["verdict"] == v.KV_CAPACITY and r["reasons"] == ["12 requests retracted at the engine's last log tick"]


def test_launch_thread_from_sched_and_uprobe_windows_in_window_layout():
    """H4's per-window arrays (its dtypes), as the window record holds them after plain()."""
    import numpy as np

    from ridgeline.aggregator.windows import plain
    from ridgeline.probes.sched_accounting import WINDOW_DTYPE
    cuda_dtype = np.dtype([("tid", "<i4"), ("tgid", "<i4"), ("launches", "<i8"), ("graph_launches", "<i8")])
    sched = np.zeros(3, WINDOW_DTYPE)
    sched["tid"], sched["tgid"] = [4242, 4300, 999], [4242, 4242, 999]
    sched["comm"] = [b"python3", b"tokenizer", b"other"]
    sched["on_cpu_ns"] = [300_000_000, 950_000_000, 990_000_000]
    sched["runq_wait_ns"] = [350_000_000, 0, 0]
    sched["blocked_ns"] = [200_000_000, 0, 0]
    cuda = np.zeros(2, cuda_dtype)
    cuda["tid"], cuda["tgid"], cuda["launches"], cuda["graph_launches"] = [4242, 4300], [4242, 4242], [31_000, 0], [12, 0]
    section = plain({"sched": {"kind": "sched", "threads": sched}, "cuda_uprobes": {"kind": "cuda", "threads": cuda}})
    lt = v.launch_thread_figures(section, 4242)
    assert lt["tid"] == 4242 and lt["comm"] == "python3" and lt["launches"] == 31_012
    assert (lt["on_cpu_ns"], lt["runq_wait_ns"], lt["blocked_ns"]) == (300_000_000, 350_000_000, 200_000_000)
    # Straight from the arrays too, and the busiest thread when no launches are known.
    assert v.launch_thread_figures({"threads": sched}, 4242)["tid"] == 4300
    r = v.judge(inputs(phases={"decode": DECODE_SMALL_BATCH}, gpu_busy_ns=600_000_000, gpu_idle_ns=400_000_000,
                       launch_thread=lt))
    assert r["verdict"] == v.HOST


def test_records_are_plain_for_the_wire():
    import msgpack
    r = v.judge(inputs(engine=loaded_vllm_record()))
    for obj in (r, v.verdict_record(r)):
        assert msgpack.unpackb(msgpack.packb(obj), strict_map_key=False) == obj


def test_window_verdict_matches_engine_endpoint_to_process():
    full = dict(CALM_ENGINE, kv_usage_ratio=0.95, kv_usage_max_ratio=0.95, pid=5000)
    calm = dict(CALM_ENGINE, pid=4242)
    window = {"duration_ns": WINDOW_NS,
              "gpus": [{"device": 0, "pid": 4242, "busy_ns": 950_000_000, "idle_ns": 50_000_000,
                        "phases": {"decode": DECODE_AT_BW}},
                       {"device": 1, "pid": 5000, "busy_ns": 950_000_000, "idle_ns": 50_000_000,
                        "phases": {"decode": DECODE_AT_BW}}],
              "engine": {"engine": {"endpoints": {"http://127.0.0.1:8000/metrics": calm,
                                                  "http://127.0.0.1:8001/metrics": full}}}}
    out = {r["device"]: r["verdict"] for r in v.window_verdict(window)}
    assert out == {0: v.BANDWIDTH, 1: v.KV_CAPACITY}
