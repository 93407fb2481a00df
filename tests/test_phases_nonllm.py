"""Non-LLM transformer forwards recorded by others are never called prefill, decode or mixed.

The traces (third-party files under traces/, not kept in the project: tests/THIRD_PARTY.md
says where they come from and where they are looked for; absent, these tests skip) were profiled with the
PyTorch profiler by the TraceLens authors: Hugging Face pipelines of a BERT encoder with its
MLM head, a ViT image classifier, a TimeSformer video classifier and an OWLv2 detection
transformer on an H100, the BERT and the ViT on an MI300X, and an xDiT Stable Diffusion 3.5
(diffusion transformer) on an MI300X. Each is checked with its annotations, with annotations ignored, and
with the CPU operators stripped (kernels only): the layered rule gives the same answer in all
three modes. aotriton's attn_fwd on the MI300X does not spell its causal flag: with CPU
operators the SDPA calls' is_causal says it, without them the launch grid does (since
aotriton 0.9b a causal launch runs persistent, one-dimensional; the regular grid (query
blocks, heads, batch) is a non-causal one: ``aotriton_regular_grid``).
Issue 13.1: before the decoder-LLM gate, all of them came out prefill.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import third_party
from support.phase_traces import MODES, phases_in_mode

from ridgeline.aggregator.phases import DECODE, MIXED, OTHER, PREFILL, UNKNOWN, map_phases
from ridgeline.probes.events import CPU_OP_DTYPE, RANGE_DTYPE, Trace, empty
from ridgeline.probes.kineto import load_trace

H100_BERT = "tracelens_h100_bert_small_fill_mask.json.gz"
H100_VIT = "tracelens_h100_vit_image_classification.json.gz"
H100_TIMESFORMER = "tracelens_h100_timesformer_video_classification.json.gz"
MI300_BERT = "tracelens_mi300_bert_small_fill_mask.json.gz"
MI300_VIT = "tracelens_mi300_vit_image_classification.json.gz"
H100_OWLV2 = "tracelens_h100_owlv2_zero_shot_detection.json.gz"
MI300_SD35 = "tracelens_mi300_xdit_sd35_diffusion_transformer.json.gz"
ALL = [H100_BERT, H100_VIT, H100_TIMESFORMER, MI300_BERT, MI300_VIT, H100_OWLV2, MI300_SD35]
MI300_QWEN = "tracelens_mi300_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz"   # a decoder: tests/test_phases_sdpa.py
TRACELENS = ALL + [MI300_QWEN]

_cache: dict[str, Trace] = {}


def load(name: str) -> Trace:
    if name not in _cache:
        _cache[name] = load_trace(third_party("traces/" + name))
    return _cache[name]


def phases(name: str, mode: str):
    return phases_in_mode(load(name), mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ALL)
def test_non_llm_forward_is_never_inference(name, mode):
    pm = phases(name, mode)
    assert pm.steps
    assert not np.isin(pm.kernel_phase, (PREFILL, DECODE, MIXED)).any(), \
        [(s.phase_name, s.evidence[:2]) for s in pm.steps]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, decider", [
    (H100_BERT, "flash_fwd_kernel grid [2,1,8] x4: non-causal self-attention over 2 query blocks (Is_causal false)"),
    (H100_VIT, "flash_fwd_kernel grid [2,4,12] x12: non-causal self-attention over 2 query blocks (Is_causal false)"),
    (H100_TIMESFORMER, "non-LLM kernels (convolution/pooling"),
    (H100_OWLV2, "non-LLM kernels (convolution/pooling"),
])
def test_encoders_and_vision_transformers_are_other_with_the_same_evidence_in_every_mode(name, decider, mode):
    pm = phases(name, mode)
    assert {s.phase for s in pm.steps} == {OTHER}
    assert decider in pm.steps[0].evidence[0]


@pytest.mark.parametrize("mode", MODES)
def test_rocm_vit_is_other_by_its_sdpa_flag_with_cpu_ops_and_by_its_convolution_without(mode):
    pm = phases(MI300_VIT, mode)
    assert {s.phase for s in pm.steps} == {OTHER}
    ev = pm.steps[0].evidence
    if mode == "no_cpu_ops":
        assert ev[0].startswith("attn_fwd grid [2,12,4] x12: non-causal self-attention over 2 query blocks "
                                "(aotriton's regular grid: its causal launches run persistent, one-dimensional) "
                                "=> other")
        assert any("1 non-LLM kernels (convolution/pooling; e.g. igemm_fwd_gtcx3_nhwc_bf16" in e for e in ev)
    else:
        assert ev[0].startswith("attn_fwd grid [2,12,4] x12: non-causal self-attention over 2 query blocks "
                                "(is_causal=False and no mask on its SDPA operator) => other")
        assert any("igemm_fwd_gtcx3_nhwc_bf16" in e for e in ev)


@pytest.mark.parametrize("mode", MODES)
def test_rocm_bert_is_other_by_its_sdpa_flag_and_by_aotritons_regular_grid_from_kernels_alone(mode):
    """aotriton's attn_fwd does not spell its causal flag; the SDPA operators that launch it
    record is_causal=False with no mask in "Concrete Inputs" / "Input type": non-causal
    self-attention => other. From kernels alone its grid says so: [2,8,1] is the regular
    (query blocks, heads, batch) grid, which aotriton >= 0.9b gives only a non-causal
    launch (ROCm/aotriton c951ffa1 v2python/rules/flash/attn_fwd.py L119 ``PERSISTENT_TYPE:
    _IF_CAUSAL(2)``, v2src/flash/attn_fwd.cc L60-66; the MI300X Qwen decoder of the same
    image runs [608,1,1]). It was prefill before the decoder-LLM gate, then unknown without
    CPU operators until issue 20's fourth session."""
    pm = phases(MI300_BERT, mode)
    if mode == "no_cpu_ops":
        assert [s.phase for s in pm.steps] == [OTHER]
        assert pm.steps[0].evidence[0].startswith(
            "attn_fwd grid [2,8,1] x4: non-causal self-attention over 2 query blocks (aotriton's regular grid: its "
            "causal launches run persistent, one-dimensional) => other")
    else:
        assert [s.phase for s in pm.steps] == [OTHER]
        assert pm.steps[0].evidence[0].startswith(
            "attn_fwd grid [2,8,1] x4: non-causal self-attention over 2 query blocks (is_causal=False and no mask "
            "on its SDPA operator) => other")


def test_causal_flag_is_read_from_the_flash_kernel_template_arguments(trace_path):
    """Is_causal is the second boolean template argument of flash_fwd_kernel (flash-attention
    flash_fwd_launch_template.h): false in the BERT encoder, true in the Qwen decoder."""
    from ridgeline.aggregator.signatures import CAUSAL_NO, CAUSAL_YES, ROLE_ATTENTION, classify_kernels
    for tr, want in ((load(H100_BERT), CAUSAL_NO),
                     (load_trace(trace_path("nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559"
                                            ".json.gz")), CAUSAL_YES)):
        kc = classify_kernels(tr)
        flash = np.array(["flash_fwd_kernel" in tr.names[int(i)] for i in tr.kernels["name_id"]])
        assert flash.any() and (kc.role[flash] == ROLE_ATTENTION).all()
        assert set(kc.causal[flash].tolist()) == {want}


@pytest.mark.parametrize("name", ALL)
def test_modes_agree(name):
    """Every mode gives the same labels (the MI300X BERT and SD3.5 did not before aotriton's
    regular grid was read: unknown without CPU operators)."""
    got = {mode: [s.phase for s in phases(name, mode).steps] for mode in MODES}
    assert got["annotations"] == got["no_annotations"] == got["no_cpu_ops"], got


@pytest.mark.parametrize("mode", MODES)
def test_rocm_diffusion_transformer_is_other_where_it_convolves_and_unknown_elsewhere(mode):
    """xDiT SD3.5 on an MI300X. The VAE step (MIOpen convolutions) is other; the four MMDiT
    steps are other: with CPU operators their SDPA calls say is_causal=False, no mask; from
    kernels alone their launch grid [35,38,2] is aotriton's regular one, which only a
    non-causal launch gets (``aotriton_regular_grid``). The four text-encoder steps stay
    unknown: with CPU operators their SDPA calls say is_causal=True (from kernels alone a
    one-dimensional, persistent grid), but without an LM head or a serving kernel, next to
    non-LLM steps, a causal text tower is no decoder LLM."""
    pm = phases(MI300_SD35, mode)
    assert [s.phase for s in pm.steps] == [UNKNOWN] * 4 + [OTHER] * 5
    for s in pm.steps[4:8]:
        assert s.evidence[0].startswith("attn_fwd grid [35,38,2] x38: non-causal self-attention"), s.evidence
    if mode == "no_cpu_ops":
        for s in pm.steps[4:8]:
            assert "(aotriton's regular grid: its causal launches run persistent" in s.evidence[0], s.evidence
    else:
        assert [s.phase for s in pm.steps] == [UNKNOWN] * 4 + [OTHER] * 5
        for s in pm.steps[:4]:
            assert any("by is_causal=True on their SDPA operator) but no LM head or serving kernel, in a trace "
                       "with non-LLM steps" in e for e in s.evidence), s.evidence
    assert all(s.evidence[0].startswith("no decoder-LLM evidence") for s in pm.steps if s.phase == UNKNOWN)


def _widened_mlm_head(tmp_path: Path, vocab: int) -> Path:
    """The MI300X BERT fill-mask trace with its MLM head widened from BERT's 30522 to
    ``vocab`` columns, as a RoBERTa (50265), mBERT (119547) or XLM-R (250002) fill-mask
    would record it: the head's CPU ops (aten::linear / addmm / t / view) get the new width
    and its hipBLASLt launch (MT128x144, grid in work-items of 256) the grid of that width.
    Everything else is the recorded trace."""
    import gzip
    import json
    d = json.load(gzip.open(third_party("traces/" + MI300_BERT)))
    head_ext = 518                          # aten::addmm [[30522], [141, 512], [512, 30522]]
    for e in d["traceEvents"]:
        a = e.get("args") or {}
        if e.get("cat") == "cpu_op" and "Input Dims" in a and e.get("name") != "aten::embedding" \
                and e.get("name") != "aten::index_select":
            a["Input Dims"] = json.loads(json.dumps(a["Input Dims"]).replace("30522", str(vocab)))
        if e.get("cat") == "kernel" and a.get("External id") == head_ext:
            assert a["grid"] == [239 * 256, 1, 1]                 # ceil(30522 / 128) tiles of 256 work-items
            a["grid"] = [-(-vocab // 128) * 256, 1, 1]
    out = tmp_path / f"mi300_mlm_head_{vocab}.json.gz"
    with gzip.open(out, "wt") as f:
        json.dump(d, f)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("vocab", [50265, 250002])
def test_vocabulary_wide_mlm_head_of_an_encoder_is_not_decoder_evidence(tmp_path, vocab, mode):
    """An encoder's MLM head is as wide as a decoder's LM head (RoBERTa 50265, XLM-R 250002 are
    above VOCAB_MIN_COLS). Where the attention kernel does not spell its causal flag (aotriton
    attn_fwd here), that width alone must not turn the encoder's forward into prefill: with
    CPU operators the SDPA calls say the attention is not causal (other), without them its
    regular launch grid does (other; unknown before issue 20's fourth session)."""
    tr = load_trace(_widened_mlm_head(tmp_path, vocab))
    if mode == "no_cpu_ops":
        tr = Trace(kernels=tr.kernels, copies=tr.copies, api=tr.api, ranges=empty(RANGE_DTYPE),
                   cpu_ops=empty(CPU_OP_DTYPE), names=tr.names, devices=tr.devices, meta=tr.meta)
    pm = map_phases(tr, use_annotations=mode == "annotations")
    if mode == "no_cpu_ops":
        assert [s.phase for s in pm.steps] == [OTHER], pm.steps[0].evidence
        assert "(aotriton's regular grid: its causal launches run persistent" in pm.steps[0].evidence[0]
    else:
        assert [s.phase for s in pm.steps] == [OTHER], pm.steps[0].evidence
        assert "is_causal=False and no mask on its SDPA operator" in pm.steps[0].evidence[0]


def test_third_party_md_lists_every_tracelens_trace_with_its_licence():
    """tests/THIRD_PARTY.md lists exactly the TraceLens traces the tests use and the licence
    file that must travel with them, each with the SHA-256 of the file as copied."""
    from support.third_party_files import SERVING, listed_sha256
    listed = sorted(p for p in listed_sha256() if p.startswith("traces/"))
    assert listed == sorted(["traces/" + n for n in TRACELENS + SERVING] + ["traces/LICENSE.TraceLens"])


def test_tracelens_licence_travels_with_the_traces():
    """The MIT notice the TraceLens licence requires in every copy sits next to the traces."""
    lic = third_party("traces/LICENSE.TraceLens").read_text()
    assert "MIT License" in lic and "Copyright (c) 2024 - 2025 Advanced Micro Devices, Inc." in lic
    assert "shall be included in all" in lic
