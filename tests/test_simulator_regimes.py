"""Regimes as tests: the agent's verdicts on simulated runs come out right.

Kernel side: the simulated events go through the phase mapper (aggregator.phases) and
the roofline (aggregator.analysis / aggregator.roofline), then the window verdict
(aggregator.verdict.judge). Engine side: scrapes of the simulated engine's /metrics text
go through probes.prom_text -> aggregator.engine_metrics -> aggregator.alerts /
aggregator.verdict, exactly as the agent folds a real engine's scrapes.
"""
from __future__ import annotations

import numpy as np
import pytest

from ridgeline.agent.simulator.engine import SimConfig, SimEngine
from ridgeline.agent.simulator.scheduler import SchedulerConfig
from ridgeline.agent.simulator.series import engine_windows
from ridgeline.agent.simulator.workload import Workload

analysis = pytest.importorskip("ridgeline.aggregator.analysis")
phases_mod = pytest.importorskip("ridgeline.aggregator.phases")
from ridgeline.aggregator import alerts, capacity, model_config, verdict  # noqa: E402

MODEL = "llama-3-8b"


def kernel_side(trace):
    """Roofline per phase (H2 phases + H3 roofline) and the window verdict on it."""
    res = analysis.document(analysis.analyze_trace(trace, gpu="h100-sxm", model=model_config.load(MODEL)))
    k = trace.kernels
    busy = int((k["end_ns"] - k["start_ns"]).sum())
    span = int(k["end_ns"].max() - k["start_ns"].min())
    v = verdict.judge(verdict.VerdictInputs(window_ns=span, phases=res["phases"], gpu_busy_ns=busy,
                                            gpu_idle_ns=max(0, span - busy)))
    return res["phases"], v


def test_memory_bound_decode():
    # Short prompts, long outputs: almost every step is a decode step of a few dozen sequences.
    w = Workload(rate_per_s=40, duration_s=1, prompt_mean=128, prompt_max=256, output_mean=400, output_max=800)
    e = SimEngine(SimConfig(model=MODEL, workload=w), seed=1, metrics=False)
    e.run_until(int(2e9))
    phases, v = kernel_side(e.drain())
    dec = phases["decode"]
    assert dec["share_of_gpu_time_ratio"] > 0.8
    assert dec["verdict"] == "memory-bound", dec["evidence"]
    assert dec["arithmetic_intensity"] < dec["ridge_point"] / 4     # ~ batch size FLOP/B vs ~295
    assert dec["pct_of_peak_bytes"] > 50 and dec["pct_of_peak_flops"] < 10
    assert v["verdict"] == verdict.BANDWIDTH and v["phase"] == "decode", v


def test_compute_bound_long_prompt_prefill():
    # 8k-token prompts, one output token: the steps are 8192-token prefill chunks.
    w = Workload(rate_per_s=4, duration_s=2, prompt_mean=8000, prompt_max=8192, output_mean=1, output_max=1,
                 length_sigma=0)
    e = SimEngine(SimConfig(model=MODEL, workload=w, scheduler=SchedulerConfig(max_num_batched_tokens=8192)),
                  seed=1, metrics=False)
    e.run_until(int(2e9))
    phases, v = kernel_side(e.drain())
    pre = phases["prefill"]
    assert pre["share_of_gpu_time_ratio"] > 0.9
    assert pre["verdict"] == "compute-bound", pre["evidence"]
    assert pre["arithmetic_intensity"] > pre["ridge_point"]
    assert pre["pct_of_peak_flops"] > 40
    assert v["verdict"] == verdict.COMPUTE and v["phase"] == "prefill", v


def _ramp(rates, seg_s=5.0, kv_gb=4.0, output_mean=512, seed=3):
    segs = tuple((seg_s, float(r)) for r in rates)
    w = Workload(prompt_mean=1024, output_mean=output_mean, output_max=4 * output_mean, recorded_rate=segs,
                 duration_s=seg_s * len(rates))
    return SimEngine(SimConfig(model=MODEL, kv_cache_bytes=kv_gb * 1e9, workload=w, emit_events=False), seed=seed)


def test_kv_capacity_bound_when_arrivals_fill_the_pool():
    # Arrival rate raised step by step (1 -> 18 req/s) on a 4 GB pool (~30k tokens).
    e = _ramp([1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 18])
    windows = engine_windows(e, 2.0, 70.0)
    tracker = alerts.AlertTracker()
    fired_at = None
    rows = []
    for i, w in enumerate(windows):
        rec, fig = w["record"], w["figures"]
        for ev in tracker.update(rec, int(w["t_s"] * 1e9)):
            if ev["alert"] == alerts.KV_WATERMARK and ev["event"] == "fired" and fired_at is None:
                fired_at = i
        v = verdict.judge(verdict.VerdictInputs(window_ns=2_000_000_000, engine=rec))
        rows.append({"kv": rec["kv_usage_max_ratio"] or 0.0, "pre": rec["preemptions"] or 0.0,
                     "queue": rec["queue_time_mean_s"], "ttft": rec["ttft_p50_s"],
                     "gen_per_s": (fig.get("generation_tokens") or 0.0) / 2.0, "verdict": v["verdict"]})
    kv = np.array([r["kv"] for r in rows])
    pre = np.array([r["pre"] for r in rows])
    gen = np.array([r["gen_per_s"] for r in rows])
    # Preemptions appear, and only once the pool is (nearly) full.
    assert pre.sum() > 0
    assert kv[pre > 0].min() >= 0.85
    assert pre[:5].sum() == 0
    # Queue time and TTFT rise.
    q_early = np.nanmean([r["queue"] for r in rows[:8] if r["queue"] is not None])
    q_late = np.nanmean([r["queue"] for r in rows[-8:] if r["queue"] is not None])
    t_early = np.nanmean([r["ttft"] for r in rows[:8] if r["ttft"] is not None])
    t_late = np.nanmean([r["ttft"] for r in rows[-8:] if r["ttft"] is not None])
    assert q_late > 0.5 and q_late > 20 * q_early
    assert t_late > 1.0 and t_late > 10 * t_early
    # The 85% alert fires, and before throughput falls: when it fires, tokens/s is still
    # at (or near) the best seen so far.
    assert fired_at is not None
    assert gen[fired_at] >= 0.9 * gen[:fired_at + 1].max()
    fall = [i for i in range(1, len(gen)) if gen[i] < 0.9 * gen[:i].max()]
    assert not fall or fired_at < fall[0]
    # Past saturation, throughput no longer follows the arrival rate: a plateau.
    assert gen[-10:].mean() < 1.3 * gen[fired_at]
    # The window verdict names the face.
    assert all(r["verdict"] == verdict.KV_CAPACITY for r in rows[fired_at:])
    assert all(r["verdict"] != verdict.KV_CAPACITY for r in rows[:3])


def test_capacity_triangle_longer_outputs_lower_the_ceiling_and_lengthen_the_queue():
    shape = model_config.load(MODEL)
    results = {}
    for out_len in (256, 1024):
        w = Workload(rate_per_s=6, duration_s=40, prompt_mean=512, prompt_max=512, output_mean=out_len,
                     output_max=out_len, length_sigma=0)
        e = SimEngine(SimConfig(model=MODEL, kv_cache_bytes=4e9, workload=w, emit_events=False), seed=5)
        pool_bytes = e.pool.total_blocks * e.pool.block_size * shape.kv_bytes_per_token
        per_req = capacity.kv_bytes_per_request(capacity.kv_bytes_per_token(shape), 512, out_len)
        windows = engine_windows(e, 2.0, 60.0)
        recs = [w_["record"] for w_ in windows]
        waiting = np.array([r["num_waiting_requests"] or 0 for r in recs])
        queue = [r["queue_time_mean_s"] for r in recs if r["queue_time_mean_s"] is not None]
        running = np.array([r["num_running_requests"] or 0 for r in recs])
        results[out_len] = {"per_req": per_req, "ceiling": capacity.concurrency_ceiling(pool_bytes, per_req),
                            "waiting": waiting.mean(), "queue": float(np.mean(queue)),
                            "running_max": int(running.max()), "pool_tokens": e.pool.capacity_tokens}
    s, l = results[256], results[1024]
    assert l["per_req"] > s["per_req"]                 # more KV per request
    assert l["ceiling"] < s["ceiling"]                 # lower concurrency ceiling
    assert l["waiting"] > s["waiting"] and l["queue"] > 2 * s["queue"]   # longer queue
    # The worst-case ceiling is a floor on concurrency (younger requests hold less than
    # their full length); the pool bounds it: every running request holds its prompt.
    for r in (s, l):
        assert r["running_max"] <= r["pool_tokens"] // 512
    assert l["running_max"] >= l["ceiling"]
