"""Per-step context lengths carried by the step annotation (issue 24.4).

The simulator writes vLLM's detailed step annotation (PR #37524,
``execute_{T}_context_{n}(sq..sk..sqsq..sqsk..)_generation_{m}(sq..sk..sqsq..sqsk..)``; the
form and its parser are in aggregator/phases.py and docs/phases.md), whose generation ``sk``
is the KV tokens decode reads. The analyzer takes those sums per step, so the decode bytes
include the KV-cache read without ``--context-len`` and the analysis says where the lengths
came from. The truth here is the simulator's own scheduled batch (``StepShape``: new and
cached tokens of each sequence), captured as its planner sees it.
"""
from __future__ import annotations

import json

import msgspec
import numpy as np

from ridgeline.aggregator import model_config
from ridgeline.aggregator.analysis import analyze_trace
from ridgeline.aggregator.phases import SequenceSums, map_phases, parse_step_annotation
from ridgeline.aggregator.work import step_work_from_model

MODEL = "llama-3-8b"


def test_label_round_trips_through_the_parser():
    from ridgeline.agent.simulator.engine import vllm_step_label
    q = np.array([512, 1, 1, 37, 1], dtype=np.int64)
    c = np.array([0, 900, 15, 256, 4000], dtype=np.int64)
    label = vllm_step_label(q, c)
    a = parse_step_annotation(label)
    assert a is not None and a.engine == "vllm-detailed"
    s = a.sequences
    dec = (q == 1) & (c > 0)
    k = q + c
    assert (a.prefill_tokens, a.decode_tokens) == (549, 3)
    assert (s.prefill_requests, s.prefill_query_tokens, s.prefill_key_tokens) == (2, 549, int(k[~dec].sum()))
    assert s.prefill_query_sq == 512 ** 2 + 37 ** 2 and s.prefill_query_key == 512 * 512 + 37 * 293
    assert (s.decode_requests, s.decode_query_tokens, s.decode_key_tokens) == (3, 3, 901 + 16 + 4001)
    assert s.decode_query_key == 901 + 16 + 4001


def test_sums_agree_with_a_uniform_context_length():
    """n sequences of one length L: the per-sequence sums give the same work as
    ``--context-len L`` (decode: L keys each; prefill: L new tokens, nothing cached)."""
    m = model_config.builtin(MODEL)
    n, L = 16, 1200
    dec = SequenceSums(0, 0, 0, 0, 0, n, n, n * L, n * L)
    a = step_work_from_model(m, 0, n, context_len=L)
    b = step_work_from_model(m, 0, n, sequences=dec)
    assert b.parts["kv_read_bytes"] == a.parts["kv_read_bytes"] == n * L * m.kv_bytes_per_token
    assert b.parts["attention_flops"] == a.parts["attention_flops"]
    assert b.bytes == a.bytes and b.flops == a.flops
    assert not any("left out" in x for x in b.notes)
    pre = SequenceSums(n, n * L, n * L, n * L * L, n * L * L, 0, 0, 0, 0)
    a = step_work_from_model(m, n * L, 0, context_len=L)
    b = step_work_from_model(m, n * L, 0, sequences=pre)
    assert b.parts == a.parts
    # --context-len, when given, wins over the annotation's sums
    c = step_work_from_model(m, 0, n, context_len=7, sequences=dec)
    assert c.parts["kv_read_bytes"] == n * 7 * m.kv_bytes_per_token


def test_simulated_trace_decode_includes_the_kv_read(tmp_path, capsys):
    from ridgeline.agent.simulator.engine import SimConfig, SimEngine
    from ridgeline.agent.simulator.kineto_writer import write_kineto
    from ridgeline.agent.simulator.workload import Workload
    from ridgeline.probes.kineto import load_trace
    w = Workload(rate_per_s=30, duration_s=0.5, prompt_mean=256, prompt_max=1024, output_mean=32, output_max=64)
    e = SimEngine(SimConfig(model=MODEL, workload=w), seed=3, metrics=False)
    seen = []
    plan = e.planner.plan

    def spy(shape):
        seen.append((shape.q_lens.copy(), shape.ctx_lens.copy()))
        return plan(shape)
    e.planner.plan = spy
    e.run_until(int(0.8e9))
    trace = e.drain()
    path = write_kineto(trace, tmp_path / "sim.json.gz")
    t = load_trace(str(path))
    m = model_config.builtin(MODEL)
    doc = analyze_trace(t, model=m, phase_map=map_phases(t))
    # the truth: every decode sequence the simulator scheduled reads its KV length (cached + new)
    want = sum(int((q[(q == 1) & (c > 0)] + c[(q == 1) & (c > 0)]).sum()) for q, c in seen)
    got = sum(s.model_work.parts["kv_read_bytes"] for s in doc.steps
              if s.model_work is not msgspec.UNSET and s.phase == "decode") / m.kv_bytes_per_token
    mixed = sum(int((q[(q == 1) & (c > 0)] + c[(q == 1) & (c > 0)]).sum()) for q, c in seen if (q > 1).any())
    assert want > 0 and abs(got - (want - mixed)) < 1e-6 * want
    dec = doc.phases["decode"]
    text = " ".join(str(x) for x in dec.evidence)
    assert "left out" not in text and "per-sequence key lengths" in text
    assert doc.work.context_from.startswith("the step annotations' key lengths")

    # the command takes the model the trace's metadata names (issue 24.4), and the lengths
    from ridgeline.agent.cli import main
    capsys.readouterr()
    assert main(["analyze", str(path), "--json"]) == 0
    cap = capsys.readouterr()
    cli = json.loads(cap.out)
    assert f"{path}: model {MODEL} from the trace's metadata (--model overrides)" in cap.err
    assert cli["work"]["model"]["name"] == MODEL and cli["work"]["context_from"] == doc.work.context_from
    assert cli["phases"]["decode"]["bytes"] == dec.bytes
