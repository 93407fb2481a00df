"""agent.top: the rich view rendered from literal windows (no sockets)."""
from rich.console import Console

from ridgeline.agent.top import TopState, bar, render

WINDOW = {
    "host": "gpu-host-1", "duration_ns": 1_000_000_000, "sources": ["simulated"],
    "gpus": [{
        "device": 0, "pid": 4242, "gpu": "NVIDIA H100 80GB HBM3", "source": "simulated", "kernels": 41000,
        "span_ns": 1_000_000_000, "busy_ns": 960_000_000, "launch": {"p50_ns": 3200},
        "ceilings": {"hbm_bytes_per_s": 3.35e12, "flops_per_s": {"bf16": 989.4e12}},
        "phases": {
            "decode": {"time_share_pct": 90.0, "kernel_time_ns": 9e8, "achieved_bytes_per_s": 2.2e12,
                       "achieved_flops_per_s": 30e12, "arithmetic_intensity": 14.2, "verdict": "memory-bound"},
            "prefill": {"time_share_pct": 10.0, "kernel_time_ns": 1e8, "achieved_bytes_per_s": 1.1e12,
                        "achieved_flops_per_s": 505e12, "arithmetic_intensity": 467.0, "verdict": "compute-bound"},
        }}],
    "engine": {"engine": {"endpoints": {"http://127.0.0.1:8000/metrics": {
        "kv_usage_ratio": 0.91, "queue_time_p50_s": 0.004, "ttft_p50_s": 0.015, "ttft_p99_s": 0.0199,
        "itl_p50_s": 0.0123, "itl_p99_s": 0.0156, "num_running_requests": 5, "num_waiting_requests": 2,
        "num_swapped_requests": 1, "queue_mean_s": 0.004, "prefill_mean_s": 0.011, "decode_mean_s": 2.5,
        "e2e_mean_s": 2.515, "ttft_mean_s": 0.016, "queue_share_of_ttft_ratio": 0.25,
        "segment_kinds": {"queue": "measured", "prefill": "derived", "decode": "derived"},
        "prefix_cache_hit_ratio": 0.4, "external_prefix_cache_hit_ratio": 0.25, "prompt_tokens_cached_ratio": 0.55,
        "kv_eviction_source": None, "preemption_episode_active": True, "preemption_episode_elapsed_s": 6.0,
        "preemption_episode_preemptions": 4, "preemption_last_recovery_s": 8.0,
        "alerts": {"kv_watermark": {"firing": True}}}}}},
    "sched": {"sched": {"threads": [
        {"pid": 4242, "tid": 4242, "comm": "python", "on_cpu_ns": 93_600_000, "runq_wait_ns": 211_500_000,
         "blocked_ns": 973_400_000},
        {"pid": 4242, "tid": 4300, "comm": "idle", "on_cpu_ns": 0, "runq_wait_ns": 0, "blocked_ns": 10**9}]}},
    "verdict": [{"device": 0, "pid": 4242, "verdict": "kv-capacity-bound"}],
    "agent": {"cpu_pct": 1.5, "rss_bytes": 80 * 2**20, "records_per_s": 25000, "publisher_drops": 3,
              "probes": {"sched": {"drops": 0}, "simulator": {"drops": 7}}, "bpf_run_time_ns": 2_000_000},
}


def text_of(window, state=None, width=160):
    c = Console(width=width, record=True, force_terminal=False)
    c.print(render(window, state))
    return c.export_text()


def test_render_shows_every_part():
    t = text_of(WINDOW, TopState(windows=3, gaps={"window": 2}, restarts=1))
    assert "[SIMULATED DATA" in t and "gpu-host-1" in t
    assert "gpu0/4242: kv-capacity-bound" in t
    assert "pid 4242" in t and "[simulated]" in t and "busy 96%" in t and "launch p50 3.2 µs" in t
    assert "decode" in t and "2.20" in t and "30.0" in t and "14.2" in t and "memory-bound" in t
    assert "prefill" in t and "505.0" in t and "compute-bound" in t
    assert "(peak 3.35)" in t and "(peak 989)" in t
    assert "KV" in t and "91%" in t and "alert at 85%" in t and "ALERT kv_watermark" in t
    assert "TTFT p50 15.0 ms" in t and "ITL p50 12.3 ms" in t and "queue p50 4.0 ms" in t
    assert "swapped 1" in t
    assert "queue 4.0 ms | prefill* 11.0 ms | decode* 2500.0 ms" in t and "(queue 25% of it)" in t
    assert "* derived from means" in t
    assert "prefix hit 40% external 25% cached prompt 55%" in t and "eviction unknown (not exported)" in t
    assert "preemption episode open 6 s (4 preemptions)" in t and "last recovery 8.0 s" in t
    assert "93.6 ms" in t and "211.5 ms" in t and "973.4 ms" in t
    assert "idle" not in t.split("launch threads")[1].split("agent:")[0]   # threads that did nothing are left out
    assert "1.5% CPU" in t and "RSS 80 MiB" in t and "simulator 7" in t and "stream drops 3" in t
    assert "gaps seen 2" in t and "agent restarts seen 1" in t and "BPF run time 2.0 ms" in t


def test_phases_sorted_by_time_and_missing_figures_shown_as_such():
    w = {"gpus": [{"device": 0, "pid": -1, "phases": {"unknown": {"time_share_pct": 100.0, "kernel_time_ns": 5}}}],
         "agent": {}}
    t = text_of(w)
    assert "pid ?" in t and "unknown" in t and "n/a" in t
    assert "no GPU events" in text_of({"agent": {}})


def test_bar_marks_the_alert_line():
    b = bar(0.5, width=20, mark=0.85).plain
    assert len(b) == 20 and b[17] == "│" and b.count("█") == 10
    assert bar(None, width=5).plain == "n/a  "
    assert bar(7.0, width=4).plain == "████"


def test_an_engine_that_does_not_answer_is_shown_absent():
    """Issue 24.3: the real engine probe's failed scrape, through the real window builder,
    shows in top as the endpoint not answering, with the error (no panel at all before)."""
    import socket

    from ridgeline.aggregator.windows import WindowBuilder
    from ridgeline.probes.engine import EngineProbe
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/metrics"
    probe = EngineProbe(urls=[dead], discover=False, timeout_s=2.0)
    probe.scrape_due(1e6)
    b = WindowBuilder(host="h")
    b.add_engine(probe.poll(), "engine")
    window = b.close(0, 1_000_000_000)
    t = text_of(window)
    assert f"{dead}: not answering: cannot reach (Connection refused)" in t, t
    # An endpoint that still has figures (kept until stale) shows those, not the line.
    eng = dict(WINDOW["engine"]["engine"], errors=[{"endpoint": "http://127.0.0.1:8000/metrics", "error": "x"},
                                                   {"endpoint": dead, "error": f"{dead}: HTTP 503"}])
    t = text_of(dict(WINDOW, engine={"engine": eng}))
    assert "KV" in t and "127.0.0.1:8000/metrics: not answering" not in t
    assert f"{dead}: not answering: HTTP 503" in t


def test_a_window_of_the_wrong_shape_is_one_line():
    t = text_of({"gpus": [{"phases": {"decode": {"kernel_time_ns": "long"}}}]}, TopState(windows=4))
    assert t.strip().splitlines() == [line for line in t.strip().splitlines() if line]
    assert t.startswith("window #4 not readable as a window record: ") and "$.gpus[0].phases[...].kernel_time_ns" in t
