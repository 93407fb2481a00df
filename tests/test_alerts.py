"""Alert hysteresis: each alert fires and clears only after its run of windows."""
import pytest

from ridgeline.aggregator import alerts as al


def feed(tracker, recs):
    out = []
    for i, r in enumerate(recs):
        out.append([(e["alert"], e["event"]) for e in tracker.update(r, ts_ns=i)])
    return out


def test_kv_watermark_hysteresis_band_does_not_flap():
    t = al.AlertTracker()
    kv = [0.70, 0.86, 0.84, 0.86, 0.82, 0.79, 0.83, 0.79, 0.78, 0.90]
    ev = feed(t, [{"kv_usage_ratio": x} for x in kv])
    assert ev == [[], [("kv_watermark", "fired")], [], [], [], [], [], [], [("kv_watermark", "resolved")],
                  [("kv_watermark", "fired")]]
    # 0.84 / 0.82 / 0.83 sit in the band (80..85%) and hold the state; 0.79 then 0.83 breaks the
    # clear run, two consecutive windows below 80% clear it.
    assert t.active()["kv_watermark"]["since_ts_ns"] == 9


def test_kv_watermark_uses_window_max_and_configurable_runs():
    t = al.AlertTracker(al.AlertThresholds(kv_fire_windows=2))
    ev = feed(t, [{"kv_usage_ratio": 0.6, "kv_usage_max_ratio": 0.9}, {"kv_usage_ratio": 0.6, "kv_usage_max_ratio": 0.88}])
    assert ev == [[], [("kv_watermark", "fired")]]


def test_queue_time_growth_over_n_windows():
    t = al.AlertTracker()
    q = [0.1, 0.2, None, 0.3, 0.45, 0.44, 0.5, 0.43]
    ev = feed(t, [{"queue_time_mean_s": x} for x in q])
    # Three rises in a row (0.1 -> 0.2 -> 0.3 -> 0.45; the None window neither helps nor breaks).
    assert ev[4] == [("queue_time_growth", "fired")]
    assert ev[5] == [] and ev[6] == []            # one dip, then a rise: still firing
    assert ev[7] == []                            # 0.43 < 0.5: first window without a rise
    ev2 = feed(t, [{"queue_time_mean_s": 0.40}])
    assert ev2 == [[("queue_time_growth", "resolved")]]


def test_queue_growth_needs_minimum_total_rise():
    t = al.AlertTracker()
    ev = feed(t, [{"queue_time_mean_s": x} for x in (0.100, 0.101, 0.102, 0.103)])
    assert all(e == [] for e in ev)


def test_preemption_rate_spike_against_baseline():
    t = al.AlertTracker()
    rates = [0.1, 0.2, 0.1, 2.0, 3.0, 0.2, 0.1]
    ev = feed(t, [{"preemption_rate_per_s": r} for r in rates])
    assert ev == [[], [], [], [("preemption_spike", "fired")], [], [], [("preemption_spike", "resolved")]]
    assert "vs limit" in t.states["preemption_spike"].message


def test_sustained_preemptions_hold_the_alert():
    t = al.AlertTracker(al.AlertThresholds(preemption_spike_min_per_s=0.1))
    ev = feed(t, [{"preemption_rate_per_s": 1.0}] * 3 + [{"preemption_rate_per_s": 0.05}] * 2)
    # From a zero baseline the first preemptions fire; the baseline learns only quiet windows,
    # so the alert holds while preemptions continue and clears after two quiet windows.
    assert ev == [[("preemption_spike", "fired")], [], [], [], [("preemption_spike", "resolved")]]


def test_prefix_hit_drop_only_when_coinciding_with_preemption():
    t = al.AlertTracker()
    recs = [{"prefix_cache_hit_ratio": 0.62, "preemptions": 0},
            {"prefix_cache_hit_ratio": 0.60, "preemptions": 0},
            {"prefix_cache_hit_ratio": 0.30, "preemptions": 0},      # drop alone: no alert
            {"prefix_cache_hit_ratio": 0.28, "preemptions": 7},      # drop + preemption: fires
            {"prefix_cache_hit_ratio": 0.58, "preemptions": 0},
            {"prefix_cache_hit_ratio": 0.60, "preemptions": 0}]
    ev = feed(t, recs)
    assert ev == [[], [], [], [(al.HIT_DROP, "fired")], [], [(al.HIT_DROP, "resolved")]]


def test_record_and_prometheus():
    t = al.AlertTracker()
    t.update({"kv_usage_ratio": 0.9}, ts_ns=5)
    rec = t.record()
    assert rec["alerts"]["kv_watermark"]["firing"] is True and rec["alerts"]["preemption_spike"]["firing"] is False
    assert rec["thresholds"]["kv_fire_ratio"] == 0.85
    prom = {l["alert"]: val for _, l, val in al.prometheus_samples(t, {"engine": "vllm"})}
    assert prom == {"kv_watermark": 1.0, "queue_time_growth": 0.0, "preemption_spike": 0.0, al.HIT_DROP: 0.0}


def test_thresholds_validated():
    with pytest.raises(ValueError):
        al.AlertThresholds(kv_fire_ratio=0.8, kv_clear_ratio=0.9)
