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

import pytest
from conftest import third_party

from ridgeline.aggregator.phases import OTHER, PREFILL, UNKNOWN, map_phases
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
