"""A preempted request in the request join, on the simulated engine: its pauses travel in
its span through the real OpenTelemetry SDK exporter (vLLM's journey events:
``journey.PREEMPTED`` then ``journey.SCHEDULED`` with ``schedule.kind`` RESUME, as
vllm/tracing.py at 03b8a674 and vllm/v1/core/sched/journey_events.py at e3b3acf1 name
them), and the join counts it a member of no step of a pause.

The truth is the simulator's own: which requests each step it ran held (its scheduler's
batches, recorded as they were made). The engine runs a KV pool small for its load (the
KV-capacity regime of tests/test_simulator_regimes.py), so that requests are preempted
(recompute) and resumed.

Recompute. What the engines do on a preemption, in their source:

* vLLM V1, vllm/v1/core/sched/scheduler.py, ``Scheduler._preempt_request`` (release 0.34.0,
  commit 62d4bc3c7 as its wheel's vllm/_version.py names it: def at line 1853,
  ``request.num_computed_tokens = 0`` line 1876, ``self.waiting.prepend_request(request)``
  line 1896; the same three statements at b4622cf924bc72504aed99e486062d6633fde39e): its
  KV is freed and it goes back to the waiting queue. Rescheduled from there,
  ``num_new_tokens = request.num_tokens - num_computed_tokens`` (line 1356; the comment
  above it: ``request.num_tokens`` "to consider the resumed requests, which have output
  tokens"), cut by ``long_prefill_token_threshold`` (line 1383) and the step's token
  budget (line 1396): the prompt and the tokens generated so far are prefilled again,
  in chunks, and ``_update_after_schedule`` marks it ``is_prefill_chunk`` until they are
  all computed (line 1917).
* SGLang, python/sglang/srt/managers/schedule_batch.py (release 0.5.23's wheel):
  ``ScheduleBatch.retract_decode`` (line 3451) releases each retracted request through
  ``release_req`` (line 2360), which calls ``Req.reset_for_retract`` (line 2394; that sets
  ``prefix_len = 0``, line 2054); scheduler.py puts them back in the queue
  (``_add_request_to_queue(req, is_retracted=True)``, line 4540), and the next round's
  ``refresh_fill_ids`` prefills ``origin_input_ids + output_ids`` (line 1690): the same
  re-prefill of prompt + generated (less what its radix cache still matches).

So the steps in which a resumed request re-prefills are the preemption's price, not its
decode: the join counts them in ``recompute_ns``/``recompute_steps``, and for the requests
batched with it they are a prefill chunk of prompt + generated tokens.
"""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from support import request_scenarios as sc  # noqa: E402

from ridgeline.agent.simulator.engine import SimConfig, SimEngine  # noqa: E402
from ridgeline.agent.simulator.spans import RequestSpanEmitter  # noqa: E402
from ridgeline.agent.simulator.workload import Workload  # noqa: E402
from ridgeline.aggregator import request_join as rj  # noqa: E402
from ridgeline.aggregator.phases import DECODE, MIXED, PREFILL  # noqa: E402
from ridgeline.probes.otlp_receiver import OtlpReceiver  # noqa: E402
from ridgeline.probes.request_spans import RequestSpan  # noqa: E402


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
        # (decode leaves out the re-prefills after its pauses: their time is recompute_ns)
        assert s.decode_ns + s.prefill_ns + s.queue_ns + s.paused_ns + s.recompute_ns == \
            pytest.approx(s.e2e_ns, abs=10)
        assert f"paused {rj_sec(s.paused_ns)} by preemption" in rj.story_text(s)
    assert checked == len(pre)


def rj_sec(ns: int) -> str:
    return f"{ns / 1e9:.2f} s" if ns >= 1e8 else f"{ns / 1e6:.1f} ms"


# ----------------------------------------------------------------- recompute after a pause

MS = sc.MS

literal_scenario = sc.recompute_literal


def test_why_and_requests_json_carry_the_recompute(tmp_path, capsys):
    """``ridgeline requests --json`` output (agent.request_view.as_json) read back by
    ``ridgeline why R --input``: the recompute in plain words beside the pause; the table's
    recomp column."""
    from ridgeline.agent import cli
    from ridgeline.agent.request_view import as_json, table
    steps, spans = literal_scenario()
    stories = rj.join(spans, steps)
    p = tmp_path / "requests.json"
    p.write_text(as_json(stories, 1))
    r = next(s for s in json.loads(p.read_text())["requests"] if s["request_id"] == "R")
    assert (r["recompute_ns"], r["recompute_steps"]) == (80 * MS, 2)
    assert cli.main(["why", "R", "--input", str(p)]) == 0
    out = capsys.readouterr().out
    assert "preempted 1 time(s): paused 75.0 ms by preemption" in out
    assert "recompute: 80.0 ms in 2 GPU step(s) re-prefilling its prompt and the tokens it had generated" in out
    assert cli.main(["why", "R", "--input", str(p), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recompute_steps"] == 2
    row = next(line for line in table(stories).splitlines() if line.startswith("R "))
    assert row.split()[5:7] == ["0.07", "0.08"]                    # paused s, recomp s


def test_a_re_prefill_after_a_pause_is_recompute_not_decode():
    steps, spans = literal_scenario()
    stories = {s.request_id: s for s in rj.join(spans, steps)}
    r, b = stories["R"], stories["B"]
    dur = steps["end_ns"] - steps["start_ns"]
    assert r.recompute_steps == 2 and r.recompute_ns == int(dur[22:24].sum()) == 80 * MS
    # Its decode is its 20 decode steps (10 before the pause, 10 after the re-prefill),
    # neither the pause nor the re-prefill.
    assert r.decode_steps == 20 and r.decode_ns == 20 * 15 * MS
    assert r.paused_ns == int(steps["start_ns"][22] - steps["start_ns"][17])
    assert r.prefill_chunks == 2                                   # its own first prefill only
    assert r.ns_per_token == pytest.approx(r.decode_ns / r.completion_tokens)
    assert r.alone_decode_ns == r.decode_ns - r.dragged_ns
    assert r.queue_ns + r.prefill_ns + r.decode_ns + r.paused_ns + r.recompute_ns == r.e2e_ns
    # For B, R's re-prefill is a prefill chunk of prompt + generated tokens (3,011: larger
    # than R's prompt, so it is the re-prefill that named it, not R's first prefill).
    assert [c.request_id for c in b.culprits] == ["R"]
    c = b.culprits[0]
    # (R is also a long sequence beside B in its decode: 3,000 tokens and more)
    assert "prefill_chunk" in c.kind.split("+") and c.tokens == 3000 + 11 and c.added_ns > 0
    assert b.dragged_by_prefill_ns > 0
    assert b.recompute_steps == 0 and b.decode_steps == len(steps) - 1
    # The batch's prefill tokens in those steps are R's re-prefill, half each.
    batch = rj._Batch(sorted(spans, key=lambda s: s.start_ns), steps)
    assert batch.pf[22] == batch.pf[23] == pytest.approx(3011 / 2)
    assert batch.n_dec[22] == batch.n_dec[23] == 1                # B alone decodes there
    text = rj.story_text(r)
    assert "recompute: 80.0 ms in 2 GPU step(s) re-prefilling its prompt" in text
    assert "its pauses and re-prefills left out" in text
    assert "culprit R: +" in rj.story_text(b) and "3011 tokens prefilled)" in rj.story_text(b)
    # The window's share: R's 80 ms of re-prefill against the stories' decode + re-prefill.
    w = rj.window_figures(list(stories.values()))
    assert w.recompute_ns == 80 * MS
    assert w.recompute_share_ratio == pytest.approx(80 * MS / (r.decode_ns + b.decode_ns + 80 * MS))


def test_the_re_prefill_ends_where_its_tokens_are_covered_though_the_batch_stays_mixed():
    """C prefills in the two steps right after R's re-prefill: the steps stay MIXED, but R
    decodes there (its 3,011 tokens took two chunks like its 3,000-token prompt did)."""
    steps, spans = literal_scenario(late_prefill=True)
    r = {s.request_id: s for s in rj.join(spans, steps)}["R"]
    assert r.recompute_steps == 2 and r.recompute_ns == 80 * MS
    assert r.decode_steps == 20
    assert [c.request_id for c in r.culprits] == ["C"]             # C's prefill dragged R's decode


def test_without_a_pause_nothing_is_recompute():
    steps, spans = literal_scenario(pause=False)
    stories = {s.request_id: s for s in rj.join(spans, steps)}
    r = stories["R"]
    assert (r.recompute_ns, r.recompute_steps, r.paused_ns) == (0, 0, 0)
    assert stories["B"].culprits[0].tokens == 3000          # its first prefill only: its prompt
    assert r.decode_ns == r.e2e_ns - r.prefill_ns - r.queue_ns and r.decode_steps == 27
    assert "recompute" not in rj.story_text(r)


def test_a_resume_straight_into_decode_steps_is_no_recompute():
    """The join's seed example of a pause (tests/support/request_scenarios.py): resumed
    with its context kept (no re-prefill step: the steps after it are DECODE), as before."""
    from support.request_scenarios import seed_preempted
    steps, spans = seed_preempted()
    s = {x.request_id: x for x in rj.join(spans, steps)}["answer-500"]
    assert s.paused_ns > 0 and (s.recompute_ns, s.recompute_steps) == (0, 0)
    assert s.decode_ns == s.e2e_ns - s.queue_ns - s.prefill_ns - s.paused_ns


def recompute_truth(load: dict | None = None):
    """A preempting simulated run, with the simulator's own record of which requests
    re-prefilled in each step: after a first token (its pause in the decode), scheduled
    for more than one token or for fewer than all its tokens (``computed < seq_len - 1``):
    a re-prefill chunk (agent/simulator/scheduler.py ``_preempt``: ``computed = 0``)."""
    from ridgeline.agent.simulator.scheduler import SchedulerConfig
    load = load or {}
    w = Workload(rate_per_s=load.get("rate", 16.0), duration_s=6.0, prompt_mean=load.get("prompt", 1024),
                 prompt_max=8192, output_mean=256, output_max=512)
    eng = SimEngine(SimConfig(model="llama-3-8b", kv_cache_bytes=1.5e9, workload=w, emit_events=False,
                              scheduler=SchedulerConfig(max_num_batched_tokens=load.get("budget", 8192))),
                    seed=3, keep_steps=1_000_000)
    refill: list[set[int]] = []
    schedule = eng.sched.schedule

    def recording(now_ns):
        batch, pre = schedule(now_ns)
        if batch:
            refill.append({r.rid for r, n in batch
                           if r.first_token_ns >= 0 and (n > 1 or r.computed < r.seq_len - 1)})
        return batch, pre
    eng.sched.schedule = recording
    eng.run()
    spans = [RequestSpan(request_id=f"r{r.rid}", engine="vllm", start_ns=r.arrival_ns, end_ns=r.last_token_ns,
                         queue_ns=r.first_scheduled_ns - r.arrival_ns, ttft_ns=r.first_token_ns - r.arrival_ns,
                         prompt_tokens=r.prompt, completion_tokens=r.generated, preemptions=r.preemptions,
                         pauses=tuple((a, b if b >= 0 else r.last_token_ns) for a, b in r.pauses))
             for r in eng.finished]
    return eng, steps_of(eng), spans, refill


@pytest.mark.parametrize("load", [None, {"rate": 40.0, "prompt": 1500, "budget": 1024}],
                         ids=["kv-bound", "chunked-busy"])
def test_simulated_re_prefills_are_the_joined_recompute_steps(load):
    """Against the simulator's truth. kv-bound: the small pool's run above (budget 8,192:
    every re-prefill in one step); chunked-busy: a 1,024-token budget at 40 requests/s, so
    re-prefills are chunked and steps stay MIXED around them."""
    eng, steps, spans, refill = recompute_truth(load)
    reqs = sorted(spans, key=lambda s: s.start_ns)
    batch = rj._Batch(reqs, steps)
    index = {s.request_id: i for i, s in enumerate(reqs)}
    stories = {s.request_id: s for s in rj.join(spans, steps)}
    truth_all = joined_all = both = 0
    pre = [r for r in eng.finished if r.preemptions > 0]
    assert len(pre) >= 10
    dur = steps["end_ns"] - steps["start_ns"]
    for r in pre:
        i = index[f"r{r.rid}"]
        truth = {j for j, m in enumerate(refill) if r.rid in m}
        joined = set()
        for k in batch.pieces_of(i):
            joined.update(range(int(batch.pf_lo[k]), int(batch.pf_lo[k] + batch.rc[k])) if batch.rc[k] else ())
        s = stories[f"r{r.rid}"]
        assert s.recompute_steps == len(joined) and s.recompute_ns == int(dur[sorted(joined)].sum())
        truth_all, joined_all, both = truth_all + len(truth), joined_all + len(joined), both + len(truth & joined)
    assert truth_all >= 20
    # Every re-prefill step found; at most 3% more (a re-prefill that had more of the step's
    # budget than its first prefill's chunks, finished a step sooner, is one step late).
    assert both == truth_all or both >= 0.99 * truth_all
    assert joined_all <= 1.03 * truth_all
