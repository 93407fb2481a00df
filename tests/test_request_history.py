"""The agent's request history (aggregator.request_history) and the window builder's step
log: requests told once, after their join delay, bounded per window; the steps the join
sees are the steps the simulated engine really ran (its own step records)."""
from __future__ import annotations

import numpy as np
from support import request_scenarios as sc
from support.request_scenarios import held

from ridgeline.aggregator import request_history as rh
from ridgeline.aggregator.windows import WindowBuilder


def test_seed_example_told_once_after_the_delay():
    steps, spans = sc.seed_batched()
    end = int(steps["end_ns"].max())
    h = rh.RequestHistory(history_s=120, join_delay_s=5)
    h.add_steps(held(steps))
    # Another process's steps at the same time (another engine on another GPU) are not used.
    other = held(steps[:50], device=1, pid=777)
    h.add_steps(other)
    h.add_requests(spans)
    w, told = h.close(end + 1_000_000_000)      # within the delay of the two that ended last
    assert [s.request_id for s in told] == ["early-40"] and w.requests == 1
    w, told = h.close(end + 6_000_000_000)
    assert {s.request_id for s in told} == {"answer-500", "long-4000"}
    ans = next(s for s in told if s.request_id == "answer-500")
    assert abs(ans.culprits[0].added_ns - 12.5e9) <= 0.1 * 12.5e9
    assert w.top_culprit_id == "long-4000" and w.top_culprit_tokens == 4000
    # Told once: a later close, or the same span sent again, tells nothing more.
    h.add_requests(spans[:1])
    w, told = h.close(end + 7_000_000_000)
    assert told == [] and w.requests_dropped == 1


def test_a_late_exported_span_waits_the_delay_from_its_arrival_for_its_batch_mates():
    """Spans exported late (a BatchSpanProcessor's schedule, a stalled host: CI once sent the
    seed's spans 2 s after they ended, past a 3 s delay counted from their end) wait the
    join delay from when they reached the agent, so the batch mate sent just after them is
    joined: before, answer-500 was told at once, "dragged: no"."""
    steps, spans = sc.seed_batched()
    end = int(steps["end_ns"].max())
    by_id = {s.request_id: s for s in spans}
    h = rh.RequestHistory(history_s=120, join_delay_s=5)
    h.add_steps(held(steps))
    s_ = 1_000_000_000
    h.add_requests([by_id["early-40"]], arrived_ns=end)
    h.add_requests([by_id["answer-500"]], arrived_ns=end + 5 * s_)
    _w, told = h.close(end + 6 * s_)            # answer-500 ended 6 s ago, but came 1 s ago
    assert [s.request_id for s in told] == ["early-40"]
    h.add_requests([by_id["long-4000"]], arrived_ns=end + 7 * s_)
    _w, told = h.close(end + 9 * s_)            # 4 s after answer-500 came: still held
    assert told == []
    _w, told = h.close(end + 10 * s_)
    assert [s.request_id for s in told] == ["answer-500"]
    assert told[0].culprits and told[0].culprits[0].request_id == "long-4000"
    assert abs(told[0].culprits[0].added_ns - 12.5e9) <= 0.1 * 12.5e9
    _w, told = h.close(end + 12 * s_)
    assert [s.request_id for s in told] == ["long-4000"]


def test_join_work_per_window_is_bounded_and_the_backlog_waits():
    steps, spans = sc.run([sc.Req(f"r{i}", i % 7, 50, 20) for i in range(rh.MAX_JOIN_PER_WINDOW + 10)])
    end = int(steps["end_ns"].max())
    h = rh.RequestHistory(history_s=120, join_delay_s=0)
    h.add_steps(held(steps))
    h.add_requests(spans)
    _w, told = h.close(end)
    assert len(told) == rh.MAX_JOIN_PER_WINDOW and h.join_backlog == 10
    _w, told2 = h.close(end + 1)
    assert len(told2) == 10 and not {s.request_id for s in told} & {s.request_id for s in told2}


def test_a_busy_server_has_100_requests_told_in_the_window_they_are_due():
    """100 requests ending within one second (a busy 8B server at high concurrency) are all
    told at that window's close, not spread over the next windows: the join's bound
    (MAX_JOIN_PER_WINDOW, from bench/bench_requests.py on a quiet host) allows it."""
    steps, spans = sc.run([sc.Req(f"r{i}", i % 7, 50, 20) for i in range(100)])
    end = int(steps["end_ns"].max())
    h = rh.RequestHistory(history_s=120, join_delay_s=0)
    h.add_steps(held(steps))
    h.add_requests(spans)
    _w, told = h.close(end)
    assert len(told) == 100 and h.join_backlog == 0


def test_history_forgets_steps_past_history_s():
    steps, spans = sc.seed_alone()
    h = rh.RequestHistory(history_s=10, join_delay_s=0)
    h.add_steps(held(steps))
    end = int(steps["end_ns"].max())
    h.close(end + 60_000_000_000)
    assert len(h._held_steps()) == 0


def test_window_builder_logs_the_steps_the_simulated_engine_ran():
    from ridgeline.agent.simulator.engine import SimConfig, SimEngine
    from ridgeline.agent.simulator.workload import Workload
    eng = SimEngine(SimConfig(workload=Workload(rate_per_s=20, duration_s=1, prompt_mean=128, prompt_max=256,
                                                output_mean=32, output_max=64)), seed=7)
    eng.run()
    b = WindowBuilder()
    b.requests = rh.RequestHistory(history_s=3600, join_delay_s=0)
    b.add_events(eng.drain(), source="simulated")
    b.close(0, 10**12, final=True)
    logged = b.requests._held_steps()
    truth = list(eng.steps)
    # Every step the engine ran, once, with its GPU span (the union of its kernels).
    assert len(logged) == len(truth)
    order = np.argsort(logged["start_ns"])
    gs = np.array([s.gpu_start_ns for s in truth])
    ge = np.array([s.gpu_end_ns for s in truth])
    assert np.abs(logged["start_ns"][order] - gs).max() <= 10_000
    assert np.abs(logged["end_ns"][order] - ge).max() <= 10_000
    assert set(np.unique(logged["pid"])) == {eng.cfg.pid}


def test_roofline_baseline_of_the_served_model_when_no_quiet_steps():
    """Without steps free of culprits the measured fit is impossible; with analysis.model
    and a known GPU the window builder gives the join the roofline model's step time
    (llama-3-8b on an H100: the 4,000-token context's KV read costs a decode step more
    than a 100-token one's), and the story says it is an estimate."""
    from ridgeline.aggregator import model_config
    from ridgeline.aggregator import request_join as rj
    from ridgeline.aggregator.request_roofline import step_time_estimator
    from ridgeline.aggregator.windows import _ceilings_obj
    shape, ceil = model_config.load("llama-3-8b"), _ceilings_obj("h100-sxm")
    est = step_time_estimator(shape, ceil)
    one, long_ctx = est(np.array([1.0]), np.array([100.0]), np.array([0.0]))[0], \
        est(np.array([2.0]), np.array([4100.0]), np.array([0.0]))[0]
    # One short decode: the weights' read (16 GB at the H100's 3.35 TB/s, ~4.8 ms) dominates.
    assert abs(one - shape.weight_bytes / ceil.hbm_bytes_per_s * 1e9) <= 0.02 * one
    kv = (4100 - 100 + 1) * shape.kv_bytes_per_token / ceil.hbm_bytes_per_s * 1e9
    assert abs((long_ctx - one) - kv) <= 0.02 * kv       # plus the long context's KV read
    steps, spans = sc.seed_batched(with_quiet_steps=False)
    b = WindowBuilder(model=model_config.load("llama-3-8b"), gpu="h100-sxm")
    b.requests = rh.RequestHistory(history_s=3600, join_delay_s=0)
    b.requests.add_steps(held(steps))
    b.requests.add_requests(spans)
    w = b.close(0, int(steps["end_ns"].max()) + 1)
    s = next(x for x in b.stories if x.request_id == "answer-500")
    assert s.dragged_source == rj.SOURCE_ESTIMATE and w.requests.dragged_source == rj.SOURCE_ESTIMATE
    assert s.culprits and s.culprits[0].request_id == "long-4000"
    assert 0 < s.dragged_ns < s.decode_ns and "ESTIMATE" in rj.story_text(s)


def test_simulator_spans_reach_the_receiver_through_the_sdk():
    """The simulated engine's spans (agent/simulator/spans.py), sent by the real SDK
    exporter, decode at the receiver with the simulator's own times, tokens and
    preemption counts."""
    import time

    import pytest
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from ridgeline.agent.simulator.probe import SimulatorProbe
    from ridgeline.probes.otlp_receiver import OtlpReceiver
    r = OtlpReceiver("127.0.0.1:0")
    r.start()
    try:
        p = SimulatorProbe(rate_per_s=30, speed=20.0, otlp_endpoint=f"http://127.0.0.1:{r.address[1]}/v1/traces")
        p.start()
        got, end = [], time.monotonic() + 30
        while time.monotonic() < end and len(got) < 5:
            p.poll()
            got += r.drain()
            time.sleep(0.05)
        eng = p.engine
        p.stop()                      # flushes the batch processor
        got += r.drain()
    finally:
        r.close()
    assert len(got) >= 5
    done = {f"sim-{eng.cfg.pid}-{i}": q for i, q in enumerate(list(eng.finished)[:eng.finished_total])}
    base = eng.cfg.time_base_ns
    for s in got:
        q = done[s.request_id]
        assert (s.start_ns, s.end_ns) == (base + q.arrival_ns, base + q.last_token_ns)
        assert s.prompt_tokens == q.prompt and s.completion_tokens == q.generated
        assert s.first_token_ns == pytest.approx(base + q.first_token_ns, abs=1_000)
        assert s.preemptions == q.preemptions
        # its pauses as journey events: evicted -> readmitted, on the wall clock
        assert s.pauses == tuple((base + a, base + (b if b >= 0 else q.last_token_ns)) for a, b in q.pauses)
        assert s.queue_ns == pytest.approx(max(q.first_scheduled_ns, q.arrival_ns) - q.arrival_ns, abs=1_000)
