"""Causality from the SDPA operator where the attention kernel's name does not spell it.

The decoder is a real Hugging Face Qwen1.5-0.5B forward recorded on an MI300X by the
TraceLens authors (third-party, not in the project: tests/THIRD_PARTY.md): aotriton's
``attn_fwd`` says nothing about causality, while the SDPA operators that launched it record
the is_causal=True Transformers passed (no mask). The same forward recorded on an H100
(shared traces) launches ``flash_fwd_kernel``, whose name spells Is_causal. The encoder cases
(MI300X BERT, ViT, SD3.5) are in tests/test_phases_nonllm.py.
"""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from conftest import third_party
from support.window_replay import kernel_stream, steps_in_order

from ridgeline.aggregator.phases import DECODE, OTHER, PREFILL, UNKNOWN, LayerStep, layers_repeated, map_phases
from ridgeline.aggregator.signatures import classify_kernels
from ridgeline.probes.events import CPU_OP_DTYPE, RANGE_DTYPE, Trace, empty
from ridgeline.probes.kineto import load_trace

MI300_QWEN = "traces/tracelens_mi300_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz"   # third_party(MI300_QWEN)
H100_QWEN = "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz"


def _bare(tr: Trace) -> Trace:
    return Trace(kernels=tr.kernels, copies=tr.copies, api=tr.api, ranges=empty(RANGE_DTYPE),
                 cpu_ops=empty(CPU_OP_DTYPE), names=tr.names, devices=tr.devices, meta=tr.meta)


@pytest.mark.parametrize("annotations", [True, False])
def test_rocm_decoder_forward_is_prefill_by_its_sdpa_is_causal(annotations):
    """Step 0 is the tail of the previous iteration (no grids, no CPU operators); step 1 the
    forward. Step 0 repeats step 1's layers kernel for kernel and time for time
    (``same_layers_by_continuity``): prefill too (unknown before issue 20's fourth session)."""
    pm = map_phases(load_trace(third_party(MI300_QWEN)), use_annotations=annotations)
    assert [s.phase for s in pm.steps] == [PREFILL, PREFILL], [s.evidence[:3] for s in pm.steps]
    assert pm.steps[0].evidence[0].startswith("repeats step 1's layers (prefill): 10 layers of the same 43 kernels, "
                                              "its 8 GEMM and attention kernels within 2% of their time there")
    ev = pm.steps[1].evidence
    assert ev[0] == "attn_fwd grid [608,1,1]: 608 query blocks per sequence => prefill", ev
    assert "24 causal attention launches (24 by is_causal=True on their SDPA operator) (decoder-LLM evidence)" in ev


def test_rocm_decoder_forward_from_kernels_alone_is_prefill_by_aotritons_causal_grid():
    """Without CPU operators (issue 20.3): aotriton sizes a persistent launch on the device's
    compute units only when it is causal (ROCm/aotriton v2src/flash/attn_fwd.cc @ 22c35371,
    ``Num_CU = is_causal ? getMultiProcessorCount(stream) : 80``): attn_fwd grid [608,1,1]
    on a 304-CU MI300X is causal, the forward prefill. The MI300X BERT (attn_fwd grid
    [2,8,1], the regular grid) is other (tests/test_phases_nonllm.py)."""
    pm = map_phases(_bare(load_trace(third_party(MI300_QWEN))))
    assert [s.phase for s in pm.steps] == [PREFILL, PREFILL], [s.evidence[:2] for s in pm.steps]
    assert pm.steps[0].evidence[0].startswith("repeats step 1's layers (prefill)")
    assert ("24 causal attention launches (24 by aotriton's causal persistent grid: a multiple of the device's 304 "
            "compute units) (decoder-LLM evidence)") in pm.steps[1].evidence


def test_same_launches_under_non_causal_sdpa_calls_are_other(tmp_path):
    """The recorded forward with every SDPA call's is_causal rewritten False (what an encoder's
    calls record, no mask): non-causal self-attention => other."""
    d = json.load(gzip.open(third_party(MI300_QWEN)))
    at = {"aten::scaled_dot_product_attention": 5, "aten::_scaled_dot_product_flash_attention": 4,
          "aten::_flash_attention_forward": 8}
    n = 0
    for e in d["traceEvents"]:
        if e.get("cat") == "cpu_op" and e.get("name") in at:
            ci = e["args"]["Concrete Inputs"]
            assert ci[at[e["name"]]] == "True"
            ci[at[e["name"]]] = "False"
            n += 1
    assert n == 72
    p = tmp_path / "qwen_noncausal.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump(d, f)
    pm = map_phases(load_trace(p))
    assert [s.phase for s in pm.steps] == [UNKNOWN, OTHER], [s.evidence[:2] for s in pm.steps]
    assert pm.steps[1].evidence[0].startswith(
        "attn_fwd grid [608,1,1] x24: non-causal self-attention over 608 query blocks (is_causal=False and no mask "
        "on its SDPA operator) => other")


def test_h100_decoder_answer_is_unchanged_where_the_kernel_name_decides(trace_path):
    """flash_fwd_kernel spells Is_causal: the kernel-name evidence decides, as before, with and
    without CPU operators (its SDPA calls agree: is_causal=True)."""
    tr = load_trace(trace_path(H100_QWEN))
    for t in (tr, _bare(tr)):
        pm = map_phases(t)
        assert [s.phase for s in pm.steps] == [PREFILL, PREFILL]
        assert "24 causal attention launches (decoder-LLM evidence)" in pm.steps[1].evidence


def _forward_and_tail():
    """The MI300X forward kernels-only (what CUPTI streams), with its two steps: 0 the tail
    (unknown alone), 1 the forward (prefill by aotriton's causal grid)."""
    t = kernel_stream(load_trace(third_party(MI300_QWEN)))
    pm = map_phases(t, use_annotations=False)
    assert [s.phase for s in pm.steps] == [PREFILL, PREFILL]
    return t, pm.kernel_step


@pytest.mark.parametrize("order, phases", [
    # P U U: the first tail copy repeats the forward before it; the second only a tail copy,
    # which the rule labelled (no neighbour for another step): unknown. Before, a forward
    # scan chained the first relabel into the second (prefill x3), a backward scan did not.
    ([1, 0, 0], [PREFILL, PREFILL, UNKNOWN]),
    # U U P, the mirror image: the same answer mirrored.
    ([0, 0, 1], [UNKNOWN, PREFILL, PREFILL]),
    ([1, 0, 1], [PREFILL, PREFILL, PREFILL]),
    ([1, 0], [PREFILL, PREFILL]),
])
def test_layer_continuity_reads_the_labels_before_the_pass(order, phases):
    """``same_layers_by_continuity`` decides every unknown step against its neighbours' own
    labels (before the pass), so its answer does not depend on the scan direction: real
    steps of the recorded forward, re-ordered 1 s apart."""
    t, ks = _forward_and_tail()
    pm = map_phases(steps_in_order(t, ks, order), use_annotations=False)
    assert [s.phase for s in pm.steps] == phases, [s.evidence[:1] for s in pm.steps]
    tails = [i for i, j in enumerate(order) if j == 0]
    assert all(pm.steps[i].layer_candidate for i in tails)
    assert not any(pm.steps[i].layer_candidate for i, j in enumerate(order) if j == 1)


def test_layer_continuity_conflicting_neighbours_leave_the_step_unknown():
    """A step whose layers repeat both neighbours' with different labels stays unknown. The
    tail between two copies of the forward, one of them labelled decode here (no recorded
    decode runs these layers in these times; the label is the only thing changed)."""
    t, ks = _forward_and_tail()
    k = t.kernels
    dur = (k["end_ns"] - k["start_ns"]).astype(np.int64)
    kc = classify_kernels(t)

    def step(j: int, phase: int) -> LayerStep:
        sel = np.flatnonzero(ks == j)
        return LayerStep(int(k["start_ns"][sel[0]]), phase, j, k["name_id"][sel], kc.role[sel], dur[sel])

    tail, fwd = step(0, UNKNOWN), step(1, PREFILL)
    assert tail.candidate and not fwd.candidate
    nb, text = layers_repeated(tail, fwd, None)
    assert nb is fwd and text.startswith("repeats step 1's layers (prefill): 10 layers of the same 43 kernels")
    assert layers_repeated(tail, None, fwd)[0] is fwd
    assert layers_repeated(tail, fwd, step(1, PREFILL))[0] is fwd
    assert layers_repeated(tail, fwd, step(1, DECODE)) is None
    assert layers_repeated(tail, step(1, UNKNOWN), None) is None
