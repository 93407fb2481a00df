"""Continuous-batching scenarios for the request join tests: the seed's example.

A tiny scheduler steps a batch: every step, each decoding request makes one token, a
prefilling request takes one chunk of its prompt. The step's GPU time is the seed's:
15 ms for a batch of short sequences, 40 ms while the 4,000-token request is in it (as a
prefill chunk or as a long sequence). The spans carry vLLM's attributes (arrival, queue,
TTFT, e2e, token counts) as ``probes.request_spans.to_record`` builds them.
"""
from __future__ import annotations

import numpy as np

from ridgeline.aggregator import request_history
from ridgeline.aggregator.phases import DECODE, MIXED, PREFILL
from ridgeline.aggregator.request_join import STEP_DTYPE
from ridgeline.probes.request_spans import RequestSpan

MS = 1_000_000
BASE_NS = 15 * MS
HEAVY_NS = 40 * MS
T0 = 1_700_000_000_000_000_000


class Req:
    """``paused``: ``(first step, step resumed)`` pairs (scheduler step numbers) during which
    the request is preempted: in no step, making no token, its context kept."""

    def __init__(self, rid, arrival_step, prompt, gen, chunk=8192, heavy=False, paused=()):
        self.rid, self.arrival_step, self.prompt, self.gen = rid, arrival_step, prompt, gen
        self.chunk, self.heavy, self.paused = chunk, heavy, tuple(paused)
        self.prefilled = self.made = 0
        self.t_arrival = self.t_sched = self.t_first = self.t_end = None
        self.pauses_ns: list[list[int]] = []

    def paused_at(self, step: int) -> bool:
        return any(a <= step < b for a, b in self.paused)


def run(reqs: list[Req], max_steps: int = 100_000, arrival_ns: dict | None = None):
    """Steps until every request finished: (steps array, RequestSpan list)."""
    t = T0
    steps = []
    for step in range(max_steps):
        live = [r for r in reqs if r.arrival_step <= step and r.t_end is None]
        for r in live:
            if r.t_arrival is None:
                r.t_arrival = t
            # Preempted between steps (vLLM's journey PREEMPTED), resumed before a step.
            if r.paused_at(step) and not r.paused_at(step - 1):
                r.pauses_ns.append([t, -1])
            elif r.pauses_ns and r.pauses_ns[-1][1] < 0 and not r.paused_at(step):
                r.pauses_ns[-1][1] = t
        live = [r for r in live if not r.paused_at(step)]
        if not live:
            if all(r.t_end is not None for r in reqs):
                break
            t += BASE_NS
            continue
        dur = HEAVY_NS if any(r.heavy for r in live) and len(live) > 1 else BASE_NS
        pf = [r for r in live if r.prefilled < r.prompt]
        dc = [r for r in live if r.prefilled >= r.prompt]
        for r in pf:
            if r.t_sched is None:
                r.t_sched = t
            r.prefilled = min(r.prompt, r.prefilled + r.chunk)
            if r.prefilled >= r.prompt:
                r.t_first = t + dur        # the first token comes with the last chunk
                r.made = 1
        for r in dc:
            r.made += 1
        for r in live:
            if r.t_first is not None and r.made >= r.gen and r.t_end is None:
                r.t_end = t + dur
        phase = MIXED if pf and dc else (PREFILL if pf else DECODE)
        steps.append((t, t + dur, phase))
        t += dur
    spans = [RequestSpan(request_id=r.rid, engine="vllm", start_ns=r.t_arrival, end_ns=r.t_end,
                         queue_ns=r.t_sched - r.t_arrival, ttft_ns=r.t_first - r.t_arrival,
                         prefill_ns=r.t_first - r.t_sched, decode_ns=r.t_end - r.t_first,
                         e2e_ns=r.t_end - r.t_arrival, prompt_tokens=r.prompt, completion_tokens=r.gen,
                         preemptions=len(r.pauses_ns), recovery_ns=sum(b - a for a, b in r.pauses_ns) if r.paused else -1,
                         pauses=tuple((a, b) for a, b in r.pauses_ns))
             for r in reqs]
    return np.array(steps, dtype=STEP_DTYPE), spans


def seed_alone():
    """The 500-token answer alone: 7.5 s of decode at 15 ms per token."""
    return run([Req("answer-500", 0, 100, 501)])


def seed_batched(with_quiet_steps: bool = True):
    """The same answer batched with a 4,000-token request (chunked prefill of 1,000-token
    chunks, then a long sequence decoding beside it). ``with_quiet_steps``: the window also
    holds an earlier short request that ran alone (steps without culprits)."""
    reqs = [Req("answer-500", 40 if with_quiet_steps else 0, 100, 501),
            Req("long-4000", 41 if with_quiet_steps else 1, 4000, 497, chunk=1000, heavy=True)]
    if with_quiet_steps:
        reqs.insert(0, Req("early-40", 0, 120, 39))
    return run(reqs)


#: Scheduler steps during which answer-500 is preempted in :func:`seed_preempted` (inside
#: its decode, while long-4000 decodes alone).
ANSWER_PAUSE = (400, 500)
#: ... and during which long-4000 is in :func:`seed_culprit_preempted`.
LONG_PAUSE = (300, 400)


def seed_preempted():
    """The batched seed example with answer-500 preempted for 100 steps of its decode
    (resumed with its context, as vLLM's recompute gives it back): the other two go on
    without it."""
    return run([Req("early-40", 0, 120, 39), Req("answer-500", 40, 100, 501, paused=[ANSWER_PAUSE]),
                Req("long-4000", 41, 4000, 497, chunk=1000, heavy=True)])


def seed_culprit_preempted():
    """The batched seed example with the culprit, long-4000, preempted for 100 steps of
    its decode: answer-500 decodes alone then (15 ms steps, nobody to blame)."""
    return run([Req("early-40", 0, 120, 39), Req("answer-500", 40, 100, 501),
                Req("long-4000", 41, 4000, 497, chunk=1000, heavy=True, paused=[LONG_PAUSE])])


def held(steps, device=0, pid=4242):
    """Steps as the window builder holds them for the request join (HELD_DTYPE rows)."""
    h = np.zeros(len(steps), request_history.HELD_DTYPE)
    for f in ("start_ns", "end_ns", "phase"):
        h[f] = steps[f]
    h["device"], h["pid"] = device, pid
    return h


def recompute_literal(pause: bool = True, late_prefill: bool = False):
    """Steps and spans, written out. B decodes throughout; R (3,000 prompt tokens) prefills
    in 2 chunks beside it, decodes 10 steps, is preempted for 5 steps (B alone), resumes
    and re-prefills its 3,011 tokens (prompt + 11 generated) in 2 chunks, then decodes 10
    more. Steps with a prefill in them take 40 ms, decode steps 15 ms. ``pause=False``: R
    is never preempted (its decode runs on, no re-prefill). ``late_prefill``: a third
    request, C, prefills in the 2 steps right after R's re-prefill (the batch stays MIXED)."""
    plan = [("B prefill", PREFILL)] + [("B", DECODE)] * 4 + [("R prefill", MIXED)] * 2 + [("R B", DECODE)] * 10
    if pause:
        plan += [("B (R paused)", DECODE)] * 5 + [("R re-prefill", MIXED)] * 2
    else:
        plan += [("R B", DECODE)] * 7
    plan += [("C prefill", MIXED) if late_prefill and k < 2 else ("R B", DECODE) for k in range(10)]
    plan += [("B", DECODE)] * 2
    steps = np.zeros(len(plan), STEP_DTYPE)
    t = T0
    for j, (_what, phase) in enumerate(plan):
        dur = 40 * MS if phase != DECODE else 15 * MS
        steps[j] = (t, t + dur, phase)
        t += dur
    start, end = steps["start_ns"], steps["end_ns"]
    r_last = len(plan) - 3                 # R's last step
    spans = [
        RequestSpan(request_id="B", engine="vllm", start_ns=int(start[0]), end_ns=int(end[-1]), queue_ns=0,
                    ttft_ns=int(end[0] - start[0]), prompt_tokens=200, completion_tokens=len(plan),
                    preemptions=0, recovery_ns=0),
        RequestSpan(request_id="R", engine="vllm", start_ns=int(start[5]), end_ns=int(end[r_last]), queue_ns=0,
                    ttft_ns=int(end[6] - start[5]), prompt_tokens=3000,
                    completion_tokens=1 + 10 + (1 + 10 if pause else 7 + 10), preemptions=1 if pause else 0,
                    recovery_ns=int(start[22] - start[17]) if pause else 0,
                    pauses=((int(start[17]), int(start[22])),) if pause else ()),
    ]
    if late_prefill:
        spans.append(RequestSpan(request_id="C", engine="vllm", start_ns=int(start[24]), end_ns=int(end[25]),
                                 queue_ns=0, ttft_ns=int(end[25] - start[24]), prompt_tokens=2000,
                                 completion_tokens=1, preemptions=0, recovery_ns=0))
    return steps, spans
