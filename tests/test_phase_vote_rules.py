"""Each vote rule of ``aggregator.phases.VOTE_RULES`` run alone on one step: on literal steps
(real kernel names, grids chosen per rule) and on real recordings (the shared traces,
../shared/traces, and the third-party TraceLens traces of tests/THIRD_PARTY.md; skipped when
absent). The phase tests (tests/test_phases*.py) check the rules together, through
:func:`map_phases`.
"""
from __future__ import annotations

import inspect

import pytest
from conftest import shared_trace, third_party
from support.phase_traces import (
    ADAM,
    CONV,
    ELEMENTWISE,
    FLASH_FWD,
    GEMM_LARGE,
    GEMM_SMALL,
    GEMVX,
    RESHAPE_AND_CACHE,
    SPLITKV,
    SPLITKV_COMBINE,
    TRTLLM_CONTEXT,
    TRTLLM_GEN,
    TraceBuilder,
    lm_head,
)

from ridgeline.aggregator import phases
from ridgeline.aggregator.phases import (
    DECODE,
    MEDIUM,
    MIXED,
    OTHER,
    PREFILL,
    STRONG,
    UNKNOWN,
    VOTE_RULES,
    WEAK,
    StepView,
    _step_votes,
    map_phases,
    step_views,
)
from ridgeline.probes.events import RANGE_DTYPE, Trace, empty
from ridgeline.probes.kineto import load_trace

RULES = dict(VOTE_RULES)
# FA2 forward with Is_causal false (the second boolean template argument).
FLASH_FWD_NONCAUSAL = FLASH_FWD.replace(">, false, true, false, false,", ">, false, false, false, false,")
BMM_QK = ("void cutlass::Kernel2<cutlass_75_wmma_tensorop_bf16_s161616gemm_bf16_32x32_32x1_tn_align1>"
          "(cutlass_75_wmma_tensorop_bf16_s161616gemm_bf16_32x32_32x1_tn_align1::Params)")
ROCM_PAGED = ("void paged_attention_ll4mi_QKV_mfma16_kernel<__hip_bfloat16, __hip_bfloat16, "
              "(vllm::Fp8KVCacheDataType)0, 16, 128, 256, true, 1>(x)")


def softmax_warp(log2: int) -> str:
    return (f"void (anonymous namespace)::softmax_warp_forward<c10::BFloat16, c10::BFloat16, float, {log2}, false, "
            f"false>(c10::BFloat16*, c10::BFloat16 const*, int, int, int, bool const*, int, bool)")


def one_step(*kernels, ops=(), launches=()) -> StepView:
    """The view of one step holding every kernel: ``kernels`` are (name, grid) pairs, 10 us
    apart; ``ops``: (name, start_us, end_us, ext, dims) CPU operators; ``launches``: the
    position of kernels launched (tid 9, inside a training operator at 0..100 us)."""
    b = TraceBuilder()
    for name, start, end, ext, dims in ops:
        b.op(name, start, end, ext=ext, dims=dims, tid=9 if name.startswith("autograd") else 100)
    for i, (name, grid, *ext) in enumerate(kernels):
        c = b.kernel(name, 200 + 10 * i, grid=grid, ext=ext[0] if ext else -1)
        if i in launches:
            b.launch(c, 10 + i, tid=9)
    views = step_views(b.build())
    assert len(views) == 1
    return views[0]


def brief(votes) -> list[tuple]:
    return [(v.phase, v.strength, v.cls) for v in votes]


NOTHING = one_step((ELEMENTWISE, (64, 1, 1)), (ELEMENTWISE, (8, 1, 1)))


# --- the registry ---------------------------------------------------------------------------

def test_every_rule_is_registered_once_and_has_the_one_signature():
    names = [n for n, _ in VOTE_RULES]
    assert len(names) == len(set(names)) == 14
    funcs = [f for _, f in VOTE_RULES]
    assert len(set(funcs)) == len(funcs)
    module_rules = {f for n, f in vars(phases).items() if n.startswith("rule_") and callable(f)}
    assert module_rules == set(funcs), "a rule_* function is not in VOTE_RULES (or the reverse)"
    for f in funcs:
        assert list(inspect.signature(f).parameters) == ["s"], f.__name__


@pytest.mark.parametrize("name", [n for n, _ in VOTE_RULES])
def test_a_step_without_the_rules_evidence_gets_no_vote_from_it(name):
    """Two elementwise kernels: no rule has anything to say."""
    assert RULES[name](NOTHING) == []


def test_step_votes_are_the_rules_votes_in_registry_order():
    v = one_step((RESHAPE_AND_CACHE, (16, 1, 1)), (GEMM_SMALL, (8, 8, 1)), (SPLITKV, (1, 16, 8)),
                 (SPLITKV_COMBINE, (8, 1, 1)), (GEMM_SMALL, (8, 8, 1)))
    per_rule = [(n, RULES[n](v)) for n, _ in VOTE_RULES]
    assert [vote.text for _, vs in per_rule for vote in vs] == \
        [vote.text for vote in _step_votes(v.j, v.f, v.trace, v.kc, v.rows_src)]
    assert {n for n, vs in per_rule if vs} == {"causal_attention", "serving_kernels", "attention_phase", "tokens",
                                              "gemm_tiles"}


# --- each rule alone, literal steps --------------------------------------------------------------

def test_noncausal_attention_rule():
    assert brief(RULES["noncausal_attention"](one_step((FLASH_FWD_NONCAUSAL, (2, 1, 8))))) == \
        [(OTHER, MEDIUM, "noncausal")]
    # One query block: FA2 clears is_causal when seqlen_q == 1, no evidence.
    assert RULES["noncausal_attention"](one_step((FLASH_FWD_NONCAUSAL, (1, 1, 8)))) == []
    # Causal: not this rule's.
    assert RULES["noncausal_attention"](one_step((FLASH_FWD, (2, 1, 8)))) == []


def test_eager_attention_rule():
    # 100 query rows x 12 heads over 128 keys: softmax_warp log2 7, 8 rows per block.
    pre = one_step((BMM_QK, (2, 1, 12)), (ELEMENTWISE, (8, 1, 1)), (softmax_warp(7), (150, 1, 1)))
    (v,) = RULES["eager_attention"](pre)
    assert (v.phase, v.strength) == (PREFILL, MEDIUM) and "1193..1200 softmax rows over 12 sequence-heads" in v.text
    dec = one_step((BMM_QK, (2, 1, 12)), (softmax_warp(7), (2, 1, 1)))
    assert brief(RULES["eager_attention"](dec)) == [(DECODE, MEDIUM, "eager_attention")]
    # A fused attention kernel in the step: the softmax is not the attention.
    fused = one_step((BMM_QK, (2, 1, 12)), (softmax_warp(7), (150, 1, 1)), (FLASH_FWD, (2, 1, 12)))
    assert RULES["eager_attention"](fused) == []


def test_causal_attention_rule():
    (v,) = RULES["causal_attention"](one_step((FLASH_FWD, (4, 8, 8)), (FLASH_FWD, (4, 8, 8))))
    assert (v.phase, v.strength, v.cls) == (UNKNOWN, STRONG, "llm")
    assert v.text == "2 causal attention launches (decoder-LLM evidence)"
    # Next to convolutions, with no LM head or serving kernel: a causal text tower, a note.
    (v,) = RULES["causal_attention"](one_step((CONV, (8, 1, 1)), (FLASH_FWD, (4, 8, 8))))
    assert (v.strength, v.cls) == (0, "note") and "not decoder evidence" in v.text
    # ... unless a serving kernel backs it.
    (v,) = RULES["causal_attention"](one_step((CONV, (8, 1, 1)), (FLASH_FWD, (4, 8, 8)),
                                              (RESHAPE_AND_CACHE, (32, 1, 1))))
    assert (v.strength, v.cls) == (STRONG, "llm")


def test_serving_kernels_rule():
    (v,) = RULES["serving_kernels"](one_step((RESHAPE_AND_CACHE, (5, 1, 1)), (TRTLLM_GEN, (1, 8, 1))))
    assert (v.phase, v.strength, v.cls) == (UNKNOWN, STRONG, "llm") and v.text.startswith("2 serving-engine kernels")
    assert RULES["serving_kernels"](one_step((FLASH_FWD, (4, 8, 8)))) == []


def test_lm_head_rule():
    b = TraceBuilder()
    lm_head(b, 0, rows=4)
    v = step_views(b.build())[0]
    (vote,) = RULES["lm_head"](v)
    assert (vote.phase, vote.strength, vote.cls) == (UNKNOWN, WEAK, "llm")
    assert "LM head, 151936 output columns (from its CPU operator)" in vote.text
    # Below the narrowest decoder vocabulary (BERT's MLM head): no LM head.
    b = TraceBuilder()
    lm_head(b, 0, rows=4, vocab=30522)
    assert RULES["lm_head"](step_views(b.build())[0]) == []
    # Next to fused attention that does not spell its causal flag: only a note. (A
    # one-dimensional aotriton grid that is no multiple of the device's CUs; the regular
    # (blocks, heads, batch) grid says non-causal: aotriton_regular_grid.)
    b = TraceBuilder()
    b.kernel("attn_fwd", 0, grid=(24, 1, 1))
    lm_head(b, 20, rows=4)
    (vote,) = RULES["lm_head"](step_views(b.build())[0])
    assert (vote.strength, vote.cls) == (0, "note") and "encoder's MLM head is as wide" in vote.text


def test_attention_phase_rule():
    assert brief(RULES["attention_phase"](one_step((TRTLLM_CONTEXT, (4, 8, 1))))) == [(PREFILL, STRONG, "attention")]
    assert brief(RULES["attention_phase"](one_step((TRTLLM_GEN, (1, 8, 1))))) == [(DECODE, STRONG, "attention")]
    (v,) = RULES["attention_phase"](one_step((TRTLLM_CONTEXT, (4, 8, 1)), (TRTLLM_GEN, (1, 8, 1))))
    assert (v.phase, v.strength) == (MIXED, STRONG) and v.text.startswith("prefill and decode attention in one step")
    assert brief(RULES["attention_phase"](one_step((FLASH_FWD, (5, 16, 16))))) == [(PREFILL, STRONG, "attention")]
    # A decode kernel that can run empty, next to a prefill kernel: a note, not mixed.
    votes = RULES["attention_phase"](one_step((TRTLLM_CONTEXT, (4, 8, 1)), (ROCM_PAGED, (8, 8, 1))))
    assert brief(votes) == [(PREFILL, STRONG, "attention"), (UNKNOWN, 0, "note")]
    assert "can run empty" in votes[1].text


def test_tokens_rule():
    assert brief(RULES["tokens"](one_step((RESHAPE_AND_CACHE, (1, 1, 1))))) == [(DECODE, MEDIUM, "tokens")]
    # 16 tokens over the 16 sequences of an unsplit FA2 launch (grid.y): decode.
    v = one_step((RESHAPE_AND_CACHE, (16, 1, 1)), (FLASH_FWD, (1, 16, 8)))
    assert brief(RULES["tokens"](v)) == [(DECODE, STRONG, "tokens")]
    # 100 tokens over 4 sequences, longest query <= 1 x 128: prefill, 3 one-token slots.
    votes = RULES["tokens"](one_step((RESHAPE_AND_CACHE, (100, 1, 1)), (FLASH_FWD, (1, 4, 8))))
    assert brief(votes) == [(PREFILL, MEDIUM, "tokens"), (UNKNOWN, 0, "mixed_slots")]
    assert votes[1].value == 3
    # Alone: 888 tokens and no split-KV combine, prefill-leaning; 40 tokens, only a count.
    assert brief(RULES["tokens"](one_step((RESHAPE_AND_CACHE, (888, 1, 1))))) == [(PREFILL, WEAK, "tokens")]
    assert brief(RULES["tokens"](one_step((RESHAPE_AND_CACHE, (40, 1, 1))))) == [(UNKNOWN, 0, "tokens")]


def test_sequences_rule():
    (v,) = RULES["sequences"](one_step((FLASH_FWD, (1, 4, 8))))
    assert (v.cls, v.value) == ("seqs", 4)
    # A split-KV launch's grid.y is not the sequences of the whole step's tokens.
    assert RULES["sequences"](one_step((SPLITKV, (1, 4, 8)), (SPLITKV_COMBINE, (8, 1, 1)))) == []


def test_gemv_rule():
    assert brief(RULES["gemv"](one_step((GEMVX, (1024, 1, 1)), (GEMVX, (1024, 1, 1)), (GEMM_LARGE, (8, 8, 1))))) == \
        [(DECODE, STRONG, "gemm")]
    assert brief(RULES["gemv"](one_step((GEMVX, (1024, 1, 1)), (GEMM_LARGE, (8, 8, 1)), (GEMM_LARGE, (8, 8, 1))))) == \
        [(UNKNOWN, 0, "note")]


@pytest.mark.parametrize("dims, expected", [
    ([[8, 1024], [1024, 1024]], (DECODE, WEAK, "gemm_rows")),
    ([[1024, 1024], [1024, 1024]], (PREFILL, WEAK, "gemm_rows")),
    ([[100, 1024], [1024, 1024]], (UNKNOWN, 0, "note"))])
def test_gemm_rows_rule(dims, expected):
    v = one_step((GEMM_LARGE, (8, 8, 1), 7), ops=[("aten::mm", 195, 215, 7, dims)])
    (vote,) = RULES["gemm_rows"](v)
    assert (vote.phase, vote.strength, vote.cls) == expected
    assert vote.text.startswith(f"aten::mm [{dims[0][0]}, 1024]")


def test_gemm_rows_rule_tokens_per_sequence():
    v = one_step((GEMM_LARGE, (8, 8, 1), 7), ops=[("aten::linear", 190, 220, -1, [[4, 50, 1024], [1024, 1024]]),
                                                   ("aten::mm", 195, 215, 7, [[200, 1024], [1024, 1024]])])
    (vote,) = RULES["gemm_rows"](v)
    assert (vote.phase, vote.strength) == (PREFILL, MEDIUM) and vote.text == \
        "aten::linear [4, 50, 1024]: 50 tokens per sequence => prefill"


def test_gemm_tiles_rule():
    assert brief(RULES["gemm_tiles"](one_step(*[(GEMM_LARGE, (8, 8, 1))] * 3))) == [(PREFILL, WEAK, "gemm_tile")]
    assert brief(RULES["gemm_tiles"](one_step(*[(GEMM_SMALL, (8, 8, 1))] * 3))) == [(DECODE, WEAK, "gemm_tile")]
    assert RULES["gemm_tiles"](one_step((GEMM_SMALL, (8, 8, 1)), (GEMM_LARGE, (8, 8, 1)))) == []


def test_training_kernels_rule():
    (v,) = RULES["training_kernels"](one_step((ADAM, (64, 1, 1))))
    assert (v.phase, v.strength, v.cls) == (OTHER, STRONG, "training")
    assert v.text.startswith("1 training kernels (multi_tensor_apply_kernel")


def test_training_launch_rule():
    v = one_step(*[(GEMM_LARGE, (8, 8, 1))] * 3, ops=[("autograd::engine::evaluate_function: MmBackward0", 0, 100,
                                                       -1, None)], launches=(0, 1, 2))
    assert [x.text for x in RULES["training_launch"](v)] == \
        ["3 kernels launched from autograd/backward/optimizer CPU ops => other (not inference)"]
    # The same kernels launched outside it: nothing.
    v = one_step(*[(GEMM_LARGE, (8, 8, 1))] * 3, ops=[("autograd::engine::evaluate_function: MmBackward0", 0, 100,
                                                       -1, None)])
    assert RULES["training_launch"](v) == []


def test_non_llm_kernels_rule():
    (v,) = RULES["non_llm_kernels"](one_step((CONV, (8, 1, 1)), (CONV, (8, 1, 1))))
    assert (v.phase, v.strength, v.cls) == (OTHER, MEDIUM, "non_llm")
    assert v.text.startswith("2 non-LLM kernels (convolution/pooling; e.g. cudnn_ampere_scudnn_128x64")


# --- each rule alone, real recordings (annotations stripped; the steps map_phases finds) --------

B200 = "nvidia-inference/tracelens_b200_vllm_gptoss_tp8_prefill888.json.gz"
H100_QWEN = "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz"
NANO0 = "nvidia-inference/nanovllm_rtx4080laptop_decode_step0_fragment.json.gz"
NANO100 = "nvidia-inference/nanovllm_rtx4080laptop_decode_step100_fragment.json.gz"
TRAIN = "nvidia-training/hta_a100_rank0_training.json.gz"
ALEXNET = "nvidia-training/hta_a100_alexnet_benchmark.json.gz"
TP = "third-party:"
_views: dict[str, list[StepView]] = {}


def real_views(name: str) -> list[StepView]:
    if name not in _views:
        p = third_party("traces/" + name[len(TP):]) if name.startswith(TP) else shared_trace(name)
        tr = load_trace(p)
        tr = Trace(kernels=tr.kernels, copies=tr.copies, api=tr.api, ranges=empty(RANGE_DTYPE), cpu_ops=tr.cpu_ops,
                   names=tr.names, devices=tr.devices, meta=tr.meta)
        _views[name] = step_views(tr, map_phases(tr).kernel_step)
    return _views[name]


# (rule, trace, step, votes (phase, strength, class), start of the first vote's text)
REAL = [
    ("noncausal_attention", TP + "tracelens_h100_bert_small_fill_mask.json.gz", 0, [(OTHER, MEDIUM, "noncausal")],
     "flash_fwd_kernel grid [2,1,8] x4: non-causal self-attention over 2 query blocks (Is_causal false)"),
    ("noncausal_attention", TP + "tracelens_mi300_bert_small_fill_mask.json.gz", 0, [(OTHER, MEDIUM, "noncausal")],
     "attn_fwd grid [2,8,1] x4: non-causal self-attention over 2 query blocks (is_causal=False and no mask"),
    ("eager_attention", TP + "tracelens_h100_timesformer_video_classification.json.gz", 0,
     [(PREFILL, MEDIUM, "eager_attention")], "cunn_SoftMaxForward grid [301152,1,1]: 301152 softmax rows over 96"),
    ("causal_attention", H100_QWEN, 1, [(UNKNOWN, STRONG, "llm")], "24 causal attention launches (decoder-LLM"),
    ("causal_attention", TP + "tracelens_mi300_xdit_sd35_diffusion_transformer.json.gz", 0, [(UNKNOWN, 0, "note")],
     "12 causal attention launches (12 by is_causal=True on their SDPA operator) but no LM head"),
    ("serving_kernels", B200, 0, [(UNKNOWN, STRONG, "llm")], "217 serving-engine kernels (KV-cache write"),
    ("lm_head", TRAIN, 1, [(UNKNOWN, WEAK, "llm")], "cutlass_80_tensorop_s1688gemm_256x64_16x4_tn_align1 grid [512,2,4]"),
    ("lm_head", TP + "tracelens_mi300_vllm_gptoss_decode_full.json.gz", 0, [(UNKNOWN, 0, "note")],
     "Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT448x32x64_MI1"),
    ("attention_phase", B200, 0, [(PREFILL, STRONG, "attention")], "fmhaSm100aKernel_QkvE4m3OBfloat16H64PagedKvCausal"),
    ("attention_phase", NANO0, 0, [(DECODE, STRONG, "attention"), (DECODE, WEAK, "attention")],
     "flash_fwd_splitkv_combine_kernel x1: flash_fwd_splitkv_combine_kernel => decode"),
    ("attention_phase", TP + "tracelens_mi300_sglang_qwen3_8b_decode.json.gz", 0, [(DECODE, STRONG, "attention")],
     "paged_attention_ll4mi_reduce_kernel x72"),
    ("tokens", NANO100, 0, [(DECODE, MEDIUM, "tokens")], "store_kvcache_kernel grid [1,1,1]: one token in the step"),
    ("tokens", B200, 0, [(PREFILL, WEAK, "tokens")], "reshape_and_cache_flash_kernel grid [888,1,1]: 888 tokens"),
    ("tokens", TP + "tracelens_mi300_vllm_gptoss_mixed_piecewise.json.gz", 0,
     [(PREFILL, MEDIUM, "tokens"), (UNKNOWN, 0, "mixed_slots")],
     "reshape_and_cache_flash_kernel grid [8192,1,1]: 8192 tokens and the LM head samples 46 rows"),
    ("sequences", H100_QWEN, 1, [(UNKNOWN, 0, "seqs")], "16 sequences in the attention launch"),
    ("gemv", NANO100, 0, [(DECODE, STRONG, "gemm")], "gemvx::kernel GEMV: 2 of 2 GEMMs are matrix-vector"),
    ("gemv", TP + "tracelens_h100_timesformer_video_classification.json.gz", 0, [(UNKNOWN, 0, "note")],
     "gemvx::kernel GEMV x1 among 133 GEMMs"),
    ("gemm_rows", H100_QWEN, 1, [(PREFILL, MEDIUM, "gemm_rows")], "aten::matmul [16, 559, 2816]: 559 tokens per"),
    ("gemm_rows", B200, 0, [(PREFILL, WEAK, "gemm_rows")], "aten::addmm [888, 2880]: 888 GEMM rows"),
    ("gemm_rows", NANO0, 0, [(DECODE, WEAK, "gemm_rows")], "aten::mm [3, 1024]: at most 3 GEMM rows"),
    ("gemm_tiles", H100_QWEN, 1, [(PREFILL, WEAK, "gemm_tile")], "168 of 169 GEMMs use large tiles"),
    ("gemm_tiles", NANO0, 0, [(DECODE, WEAK, "gemm_tile")], "3 of 3 GEMMs use small tiles"),
    ("training_kernels", TRAIN, 0, [(OTHER, STRONG, "training")], "21 training kernels (split_embedding_backward"),
    ("training_launch", TRAIN, 1, [(OTHER, STRONG, "training")], "349 kernels launched from autograd/backward"),
    ("non_llm_kernels", ALEXNET, 1, [(OTHER, MEDIUM, "non_llm")], "1 non-LLM kernels (convolution/pooling; e.g. "
                                                                   "cudnn_ampere_scudnn_128x64_relu_xregs_large_nn_v1)"),
]


@pytest.mark.parametrize("rule, trace, step, expected, text", REAL,
                         ids=[f"{r}-{t.rsplit('/', 1)[-1].split(':')[-1][:28]}-{s}" for r, t, s, _, _ in REAL])
def test_rule_alone_on_a_real_recording(rule, trace, step, expected, text):
    votes = RULES[rule](real_views(trace)[step])
    assert brief(votes) == expected
    assert votes[0].text.startswith(text)


def test_every_rule_fires_on_some_real_recording():
    assert {r for r, *_ in REAL} == set(RULES)


# CK's group-mode batch prefill (the MI300X SGLang extend step's kernel name, mangled): tile
# TileFmhaShape<sequence<128, 128, 32, 128, 32, 128>>, FmhaFwdGroupModeKargs.
CK_GROUP_PREFILL = (
    "_ZN7ck_tile6kentryILi2ENS_38FmhaBatchPrefillWithPagedKVCacheKernelINS_40BlockFmhaBatchPrefillPipelineQRKSVSAsyncI"
    "NS_36BlockFmhaBatchPrefillPipelineProblemIDF16bDF16bDF16bffDF16bhfDF16bfDF16bNS_13TileFmhaShapeINS_8sequenceIJLi128E"
    "Li128ELi32ELi128ELi32ELi128EEEENS5_IJLi4ELi1ELi1EEEENS5_IJLi32ELi32ELi16EEEES7_S8_Lb1EEELb1ENS_17ComposedAttentionIL"
    "j0ELb1EEENS_30SimplifiedGenericAttentionMaskILb1EEELb0ELi1ENS_26TileFmhaBatchPrefillTraitsILb1ELb1ELb1ELb1ELb0ELNS_22"
    "BlockAttentionBiasEnumE0ELb0ELb0ELb0ELNS_28BlockAttentionQuantScaleEnumE0ELin1ELb0ELb0ELi1ELNS_37BlockAttentionKVCach"
    "eMemoryLayoutEnumE1ELNS_36BlockAttentionKVCacheLookupTableEnumE1ELNS_33BlockAttentionKVCacheLoadModeEnumE0EEEEENS_53B"
    "lockFmhaBatchPrefillPipelineQRKSVSAsyncDefaultPolicyEEENS_17Default2DEpilogueINS_24Default2DEpilogueProblemIfDF16bLb1E"
    "Lb1ELb1EEEvEEEEJNSS_21FmhaFwdGroupModeKargsEEEEvDpT1_")


@pytest.mark.parametrize("m_tiles, slots", [(1, None), (8, 3)])
def test_tokens_rule_slots_bounded_by_a_ck_group_mode_prefill_grid(m_tiles, slots):
    """400 tokens, 4 sampled rows (LM head operator): up to 3 one-token decodes. A CK
    group-mode launch over 4 sequences whose longest query is at most m_tiles x 128: with
    one tile (<= 128 each, 512 in all) every sequence is needed for the 400 tokens; with 8
    the bound leaves room for 3."""
    b = TraceBuilder()
    for i in range(3):
        b.kernel(RESHAPE_AND_CACHE, 10 * i, grid=(400, 1, 1))
        b.kernel(CK_GROUP_PREFILL, 10 * i + 2, grid=(32, 4, m_tiles))
    lm_head(b, 100, rows=4)
    votes = RULES["tokens"](step_views(b.build())[0])
    assert votes[0].phase == PREFILL and votes[0].text.endswith("the LM head samples 4 rows: several new tokens per "
                                                                "sequence => prefill")
    if slots is None:
        assert brief(votes[1:]) == [(UNKNOWN, 0, "note")]
        assert votes[1].text.endswith("grid [32,4,1]: 400 tokens over 4 sequences, longest query <= 128: every "
                                      "sequence is a prefill, no room for one-token decodes")
    else:
        assert [(v.cls, v.value) for v in votes[1:]] == [("mixed_slots", slots)]
