"""A preempted request in the request join, on the simulated engine: its pauses travel in
its span through the real OpenTelemetry SDK exporter (vLLM's journey events:
``journey.PREEMPTED`` then ``journey.SCHEDULED`` with ``schedule.kind`` RESUME, as
vllm/tracing.py at 03b8a674 and vllm/v1/core/sched/journey_events.py at e3b3acf1 name
them), and the join counts it a member of no step of a pause.

The truth is the simulator's own: which requests each step it ran held (its scheduler's
batches, recorded as they were made). The engine runs a KV pool small for its load (the
KV-capacity regime of tests/test_simulator_regimes.py), so that requests are preempted
(recompute) and resumed.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from ridgeline.agent.simulator.engine import SimConfig, SimEngine  # noqa: E402
from ridgeline.agent.simulator.spans import RequestSpanEmitter  # noqa: E402
from ridgeline.agent.simulator.workload import Workload  # noqa: E402
from ridgeline.aggregator import request_join as rj  # noqa: E402
from ridgeline.aggregator.phases import DECODE, MIXED, PREFILL  # noqa: E402
from ridgeline.probes.otlp_receiver import OtlpReceiver  # noqa: E402


def preempting_engine():
    w = Workload(rate_per_s=16.0, duration_s=6.0, prompt_mean=1024, output_mean=256, output_max=512)
    eng = SimEngine(SimConfig(model="llama-3-8b", kv_cache_bytes=1.5e9, workload=w, emit_events=False),
                    seed=3, keep_steps=1_000_000)
    members: list[list[int]] = []
    schedule = eng.sched.schedule

    def recording(now_ns):
        batch, pre = schedule(now_ns)
        if batch:                               # a non-empty batch is one step (SimEngine._step)
            members.append([r.rid for r, _ in batch])
        return batch, pre
    eng.sched.schedule = recording
    eng.run()
    assert len(members) == len(eng.steps)
    return eng, members


def steps_of(eng):
    st = np.zeros(len(eng.steps), rj.STEP_DTYPE)
    st["start_ns"] = [s.gpu_start_ns for s in eng.steps]
    st["end_ns"] = [s.gpu_end_ns for s in eng.steps]
    st["phase"] = [MIXED if s.prefill_tokens and s.decode_tokens else (PREFILL if s.prefill_tokens else DECODE)
                   for s in eng.steps]
    return st


def test_a_preempted_simulated_request_is_in_no_step_of_its_pause():
    eng, members = preempting_engine()
    pre = [r for r in eng.finished if r.preemptions > 0]
    assert len(pre) >= 3, "the small pool must preempt requests"
    # Every request's spans through the real SDK exporter to the receiver, as the probe sends them.
    rcv = OtlpReceiver("127.0.0.1:0")
    rcv.start()
    try:
        em = RequestSpanEmitter(f"http://127.0.0.1:{rcv.address[1]}/v1/traces", batch=False)
        for r in eng.finished:
            em.emit(f"r{r.rid}", r.arrival_ns, r.first_scheduled_ns, r.first_token_ns, r.last_token_ns, r.prompt,
                    r.generated, preemptions=r.preemptions,
                    pauses=[(a, b if b >= 0 else r.last_token_ns) for a, b in r.pauses])
        em.close()
        spans, end = [], time.monotonic() + 30
        while len(spans) < len(eng.finished) and time.monotonic() < end:
            spans += rcv.drain()
            time.sleep(0.02)
    finally:
        rcv.close()
    assert len(spans) == len(eng.finished)
    by_id = {s.request_id: s for s in spans}
    for r in pre:
        assert by_id[f"r{r.rid}"].pauses == tuple((a, b) for a, b in r.pauses), r.rid
    steps = steps_of(eng)
    order = sorted(range(len(spans)), key=lambda k: spans[k].start_ns)
    reqs = [spans[k] for k in order]
    batch = rj._Batch(reqs, steps)
    index = {s.request_id: i for i, s in enumerate(reqs)}
    mid = (steps["start_ns"] + steps["end_ns"]) // 2
    checked = 0
    for r in pre:
        i = index[f"r{r.rid}"]
        joined = set()
        for k in batch.pieces_of(i):
            joined.update(range(int(batch.pf_lo[k]), int(batch.dc_hi[k])))
        truth = {j for j, m in enumerate(members) if r.rid in m}
        in_pause = {j for j in range(len(steps)) if any(a <= mid[j] < b for a, b in r.pauses)}
        assert in_pause, r.rid
        # The join counts it in no step of its pauses, and in the steps it really ran.
        assert not joined & in_pause, r.rid
        assert not truth & in_pause, r.rid                  # (the simulator agrees: it was out)
        assert len(joined ^ truth) <= 0.02 * len(truth) + 2, (r.rid, sorted(joined ^ truth)[:10])
        checked += 1
    stories = {s.request_id: s for s in rj.join(spans, steps, report={f"r{r.rid}" for r in pre})}
    for r in pre:
        s = stories[f"r{r.rid}"]
        paused = sum(b - a for a, b in r.pauses)
        assert s.preemptions == r.preemptions and s.paused_ns == pytest.approx(paused, abs=r.preemptions * 2)
        assert s.decode_ns + s.prefill_ns + s.queue_ns + s.paused_ns == pytest.approx(s.e2e_ns, abs=10)
        assert f"paused {rj_sec(s.paused_ns)} by preemption" in rj.story_text(s)
    assert checked == len(pre)


def rj_sec(ns: int) -> str:
    return f"{ns / 1e9:.2f} s" if ns >= 1e8 else f"{ns / 1e6:.1f} ms"
