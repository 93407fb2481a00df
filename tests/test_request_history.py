"""The agent's request history (aggregator.request_history) and the window builder's step
log: requests told once, after their join delay, bounded per window; the steps the join
sees are the steps the simulated engine really ran (its own step records)."""
from __future__ import annotations

import numpy as np

import request_scenarios as sc
from ridgeline.aggregator import request_history as rh
from ridgeline.aggregator.windows import WindowBuilder


def held(steps, device=0, pid=4242):
    h = np.zeros(len(steps), rh.HELD_DTYPE)
    for f in ("start_ns", "end_ns", "phase"):
        h[f] = steps[f]
    h["device"], h["pid"] = device, pid
    return h


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
