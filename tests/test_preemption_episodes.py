"""Preemption episodes and recovery time: literal window sequences, then the simulator's
KV-capacity regime (arrivals ramp up past the pool, then fall back), where an episode must
open, recover, and report a finite recovery time."""
import math

import pytest

from ridgeline.aggregator import engine_metrics as em
from ridgeline.aggregator.preemption_episodes import PreemptionEpisodes

S = 1_000_000_000


def rec(pre, kv, waiting):
    return {"preemptions": pre, "kv_usage_ratio": kv, "num_waiting_requests": waiting}


def test_episode_opens_extends_and_recovers_at_watermark_and_baseline_queue():
    e = PreemptionEpisodes()
    seq = [rec(0, 0.5, 2), rec(3, 0.95, 10), rec(1, 0.97, 14), rec(0, 0.90, 8),   # still over the watermark
           rec(0, 0.80, 5),                                                       # under it, queue 5 > baseline 2
           rec(0, 0.70, 2)]                                                       # recovered
    out = [e.update(r, (i + 1) * 2 * S) for i, r in enumerate(seq)]
    assert [o["preemption_episode_active"] for o in out] == [False, True, True, True, True, False]
    assert out[2]["preemption_episode_preemptions"] == 4 and out[1]["preemption_episode_baseline_waiting"] == 2
    assert out[4]["preemption_episode_elapsed_s"] == pytest.approx(6.0)
    assert out[5]["preemption_recovery_s"] == pytest.approx(8.0)       # window 2 end (4 s) -> window 6 end (12 s)
    assert out[5]["preemption_last_recovery_s"] == pytest.approx(8.0)
    assert out[5]["preemption_episodes_total"] == 1 and out[5]["preemption_episodes_recovered_total"] == 1


def test_unknown_usage_or_queue_never_recovers_an_episode():
    e = PreemptionEpisodes()
    e.update(rec(0, 0.5, 0), S)
    e.update(rec(2, 0.9, 3), 2 * S)
    o = e.update(rec(0, None, 0), 3 * S)
    assert o["preemption_episode_active"] and o["preemption_recovery_s"] is None
    o = e.update(rec(0, 0.2, None), 4 * S)
    assert o["preemption_episode_active"] and o["preemption_last_recovery_s"] is None


def test_tracker_records_carry_episode_figures():
    from ridgeline.probes import prom_text
    url = "http://127.0.0.1:8000/metrics"

    def polled(pre, kv, waiting, ts):
        text = (f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {pre}\n'
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}\n'
                f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n')
        return {"scrapes": [{"endpoint": url, "ts_ns": ts, "exposition": prom_text.parse(text)}]}

    t = em.EngineTracker()
    t.update(polled(0, 0.5, 1, S))
    r = t.update(polled(5, 0.95, 9, 3 * S))["endpoints"][url]
    assert r["preemption_episode_active"] and r["preemption_episodes_total"] == 1
    r = t.update(polled(5, 0.5, 1, 6 * S))["endpoints"][url]
    assert r["preemption_recovery_s"] == pytest.approx(3.0) and not r["preemption_episode_active"]
    names = {n for n, _, _ in em.prometheus_samples(r)}
    assert {"ridgeline_engine_preemption_recovery_seconds", "ridgeline_engine_preemption_episodes_total"} <= names


def test_recovery_time_on_the_simulated_kv_capacity_regime():
    from ridgeline.agent.simulator.engine import SimConfig, SimEngine
    from ridgeline.agent.simulator.series import engine_windows
    from ridgeline.agent.simulator.workload import Workload
    # Same pool and request shape as test_simulator_regimes' KV-capacity ramp: 4 GB (~30k
    # tokens), 1k-token prompts, 512-token outputs; arrivals 2 -> 16 req/s, then back to 1.
    segs = ((10.0, 2.0), (10.0, 16.0), (40.0, 1.0))
    w = Workload(prompt_mean=1024, output_mean=512, output_max=2048, recorded_rate=segs, duration_s=60.0)
    eng = SimEngine(SimConfig(model="llama-3-8b", kv_cache_bytes=4e9, workload=w, emit_events=False), seed=3)
    episodes = PreemptionEpisodes()
    rows = []
    for win in engine_windows(eng, 2.0, 80.0):
        r = win["record"]
        rows.append((win["t_s"], r["preemptions"], r["kv_usage_ratio"], r["num_waiting_requests"],
                     episodes.update(r, int(win["t_s"] * 1e9))))
    assert sum(p or 0 for _, p, _, _, _ in rows) > 0, "the ramp must cause preemptions"
    rec_s = [o["preemption_recovery_s"] for *_, o in rows if o["preemption_recovery_s"] is not None]
    assert rec_s, [(t, p, kv, q) for t, p, kv, q, _ in rows]
    assert all(math.isfinite(x) and x > 0 for x in rec_s)
    # Recovered: the episode closed in a window under the watermark with no preemption.
    first = next(i for i, (*_, o) in enumerate(rows) if o["preemption_recovery_s"] is not None)
    assert rows[first][2] < 0.85 and not rows[first][1]
    assert not rows[-1][4]["preemption_episode_active"]
    print("recovery times (s):", rec_s, "episodes:", rows[-1][4]["preemption_episodes_total"])
