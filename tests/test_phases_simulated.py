"""Kernel-only phase mapping on the simulator's vLLM runs, against the runs' own step
annotations (issue 13.2).

The simulator (agent/simulator, docs/simulator.md) emits vLLM V1's kernels with their real
names and grid conventions and, per step, the engine annotation
``execute_{T}_context_N(sq..sk..)_generation_M(sq..sk..)``. The annotation is the truth here; the mapper sees
the same run with every range removed (and through the streaming mapper, batch by batch).
This checks the kernel rules against the conventions the simulator encodes; real traces stay
the oracle for the conventions themselves (tests/test_phases_traces.py, test_phases_nonllm.py).
Before issue 13.2, 226 of 861 decode steps came out unknown and every mixed step prefill.
"""
from __future__ import annotations

import numpy as np
import pytest

from ridgeline.aggregator.phases import DECODE, MIXED, PHASE_NAMES, PREFILL, map_phases
from ridgeline.aggregator.stream_phases import StreamPhaser
from ridgeline.probes.events import RANGE_DTYPE, Trace, empty

MODEL = "llama-3-8b"
MIN_RIGHT = 0.95


def _run(rate, duration_s, prompt_mean, output_mean, run_s, budget=None, seed=1, prompt_max=None):
    from ridgeline.agent.simulator.engine import SimConfig, SimEngine
    from ridgeline.agent.simulator.scheduler import SchedulerConfig
    from ridgeline.agent.simulator.workload import Workload
    w = Workload(rate_per_s=rate, duration_s=duration_s, prompt_mean=prompt_mean,
                 prompt_max=prompt_max or 4 * prompt_mean,
                 output_mean=output_mean, output_max=2 * output_mean)
    kw = {"scheduler": SchedulerConfig(max_num_batched_tokens=budget)} if budget else {}
    e = SimEngine(SimConfig(model=MODEL, workload=w, **kw), seed=seed, metrics=False)
    e.run_until(int(run_s * 1e9))
    return e.drain()


RUNS = {
    # The memory-bound decode regime of docs/simulator.md, run until every request is done.
    "decode-regime-complete": dict(rate=40, duration_s=1, prompt_mean=128, prompt_max=256, output_mean=400,
                                   run_s=1000),
    "decode-heavy": dict(rate=40, duration_s=3, prompt_mean=128, output_mean=400, run_s=6),
    "chunked-prefill": dict(rate=20, duration_s=4, prompt_mean=1024, output_mean=256, run_s=5, budget=512, seed=2),
}


def _stripped(tr: Trace) -> Trace:
    return Trace(kernels=tr.kernels, copies=tr.copies, api=tr.api, ranges=empty(RANGE_DTYPE), cpu_ops=tr.cpu_ops,
                 names=tr.names, devices=tr.devices, meta=tr.meta)


def _score(truth, kernel_phase):
    """Per annotated step: the label most of its kernels got without annotations."""
    rows = []
    for s in truth.steps:
        got = int(np.bincount(kernel_phase[truth.kernel_step == s.index], minlength=5).argmax())
        rows.append((s.phase, got))
    return rows


@pytest.mark.parametrize("run", sorted(RUNS))
def test_kernel_only_steps_match_the_annotations(run):
    tr = _run(**RUNS[run])
    truth = map_phases(tr)
    assert {s.source for s in truth.steps} == {"annotation"}
    rows = _score(truth, map_phases(_stripped(tr)).kernel_phase)
    right = sum(a == b for a, b in rows)
    kinds = {ph: sum(a == ph for a, _ in rows) for ph in (PREFILL, DECODE, MIXED)}
    assert kinds[DECODE] > 100 and kinds[MIXED] > 20, kinds
    assert right >= MIN_RIGHT * len(rows), [(PHASE_NAMES[a], PHASE_NAMES[b]) for a, b in rows if a != b][:10]
    for ph in (DECODE, MIXED):
        hit = sum(a == b == ph for a, b in rows)
        assert hit >= MIN_RIGHT * kinds[ph], (PHASE_NAMES[ph], hit, kinds[ph])


def test_streaming_mapper_in_batches_agrees():
    tr = _run(**RUNS["decode-heavy"])
    truth = map_phases(tr)
    k = tr.kernels
    phaser = StreamPhaser(tr.names)
    phase = np.zeros(len(k), dtype=np.uint8)
    # Batches of 20,000 kernels in time order, each with the whole steps it holds (the
    # window builder carries a device's last step into the next batch the same way).
    order = np.argsort(k["start_ns"], kind="stable")
    for lo in range(0, len(order), 20_000):
        sel = order[lo:lo + 20_000]
        bp = phaser.map_batch(Trace(kernels=k[sel], names=tr.names, devices=tr.devices))
        phase[sel] = bp.kernel_phase
    rows = _score(truth, phase)
    right = sum(a == b for a, b in rows)
    assert right >= MIN_RIGHT * len(rows)
    mixed = [b for a, b in rows if a == MIXED]
    assert sum(b == MIXED for b in mixed) >= MIN_RIGHT * len(mixed)
