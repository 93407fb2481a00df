"""Phase mapping rules, each on a literal trace built with ``probes.events.empty``.

Kernel names are real ones (from the shared traces or the engines' sources, see
reference/kernel-signatures.md); timings and grids are chosen per rule. The real shared
traces are exercised in tests/test_phases_traces.py.
"""
from __future__ import annotations

import numpy as np

from ridgeline.probes.events import CPU_OP_DTYPE, RANGE_GPU_ANNOTATION, Trace, empty

STORE_KVCACHE = "store_kvcache_kernel"
PAGED_V1 = "void vllm::paged_attention_v1_kernel<__nv_bfloat16, __nv_bfloat16, 128, 16, 128, (vllm::Fp8KVCacheDataType)0, false>(x)"
POOL = ("void at::native::(anonymous namespace)::max_pool_forward_nchw<float, float>(int, float const*, long, long, "
        "long, int, int, int, int, int, int, int, int, int, int, float*, long*)")


import pytest
from support.phase_traces import (
    ADAM,
    ARGMAX,
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
    US,
    TraceBuilder,
    eager_forward,
    layers,
    lm_head,
)

from ridgeline.aggregator.phases import (
    DECODE,
    MIXED,
    OTHER,
    PHASE_NAMES,
    PREFILL,
    UNKNOWN,
    PhaseMap,
    map_phases,
    parse_step_annotation,
)
from ridgeline.probes.events import API_GRAPH_LAUNCH, RANGE_NVTX, RANGE_PROFILER_STEP, RANGE_USER_ANNOTATION


def only_step(pm: PhaseMap):
    assert len(pm.steps) == 1, [(s.phase_name, s.kernels, s.evidence[:1]) for s in pm.steps]
    return pm.steps[0]


# ------------------------------------------------------------------ annotation parsers

@pytest.mark.parametrize("text, phase, prefill, decode", [
    ("execute_context_1(888_788544)_generation_0(0)", PREFILL, 888, 0),      # B200 trace
    ("execute_context_0(0)_generation_32(32)", DECODE, 0, 32),
    ("execute_context_2(1024_524288)_generation_30(30)", MIXED, 1024, 30),
    ("execute_6147_context_2(sq6144sk7144sqsq20971520sqsk23019520)_generation_3(sq3sk6144sqsq3sqsk6144)",
     MIXED, 6144, 3),
    ("execute_8192_context_0(sq0sk0sqsq0sqsk0)_generation_32(sq32sk9000sqsq32sqsk9000)", DECODE, 0, 32),
    ("execute_512_context_1(sq512sk512sqsq262144sqsk262144)_generation_0(sq0sk0sqsq0sqsk0)", PREFILL, 512, 0),
    ("execute_context_1024_generation_64", MIXED, 1024, 64),                   # legacy, no parentheses
    ("step[EXTEND bs=15 toks=15360]", PREFILL, 15360, 0),                      # MI300X SGLang trace
    ("step[DECODE bs=32]", DECODE, 0, 32),
    ("step[EXTEND bs=2 toks=14721 flops=1.2e12 bytes=3.4e9]", PREFILL, 14721, 0),   # roofline suffix
    ("step[MIXED bs=4]", MIXED, None, None),
    ("step[IDLE bs=0]", UNKNOWN, None, None),
    ("prefill", PREFILL, None, None),
    ("decode[bs=3]", DECODE, None, None),
])
def test_parse_step_annotation(text, phase, prefill, decode):
    a = parse_step_annotation(text)
    assert a is not None
    assert (a.phase, a.prefill_tokens, a.decode_tokens) == (phase, prefill, decode)


@pytest.mark.parametrize("text", ["ProfilerStep#6", "## Call CompiledFxGraph fud64 ##", "nccl:_all_gather_base",
                                  "decoder_layer", "gpu_model_runner: forward", "execute_model", ""])
def test_parse_step_annotation_rejects_other_ranges(text):
    assert parse_step_annotation(text) is None


def test_annotation_evidence_string_names_tokens():
    a = parse_step_annotation("execute_context_1(888_788544)_generation_0(0)")
    assert a.describe("execute_context_1(888_788544)_generation_0(0)") == \
        "annotation execute_context_1(888_788544)_generation_0(0): 888 prefill tokens => prefill"
    m = parse_step_annotation("execute_context_2(1024_524288)_generation_30(30)")
    assert m.describe("x") == "annotation x: 1024 prefill tokens, 30 decode tokens => mixed"


# ------------------------------------------------------------------ layer 1: annotations on traces

def test_gpu_side_annotations_give_steps_tokens_and_kernel_labels():
    b = TraceBuilder()
    # Step 1: a vLLM prefill of 512 tokens; step 2: a mixed step; step 3: a decode of 8.
    b.range("execute_context_1(512_262144)_generation_0(0)", 0, 100, ext=1)
    layers(b, 5, 4, FLASH_FWD, 512, attention_grid=(4, 8, 16))
    b.range("execute_context_1(256_65536)_generation_7(7)", 200, 300, ext=2)
    layers(b, 205, 4, FLASH_FWD, 263, attention_grid=(2, 8, 16))
    b.range("execute_context_0(0)_generation_8(8)", 400, 500, ext=3)
    layers(b, 405, 4, PAGED_V1, 8)
    b.kernel(ELEMENTWISE, 700)          # outside every range: segmented from kernels
    tr = b.build()
    pm = map_phases(tr)
    ann = [s for s in pm.steps if s.source == "annotation"]
    assert [(s.phase, s.prefill_tokens, s.decode_tokens, s.kernels) for s in ann] == [
        (PREFILL, 512, 0, 20), (MIXED, 256, 7, 20), (DECODE, 0, 8, 20)]
    assert ann[0].evidence[0].startswith("annotation execute_context_1(512_262144)_generation_0(0): 512 prefill "
                                         "tokens => prefill (GPU-side range")
    assert "kernel evidence agrees" in ann[0].evidence[1]
    # Per-kernel arrays: aligned, typed, and every kernel's evidence names its step's decider.
    assert pm.kernel_phase.dtype == np.uint8 and pm.kernel_step.dtype == np.int32
    assert len(pm.kernel_phase) == len(tr.kernels) == len(pm.kernel_evidence)
    first = np.flatnonzero(pm.kernel_step == ann[0].index)
    assert (pm.kernel_phase[first] == PREFILL).all()
    assert all("512 prefill tokens" in pm.evidence_of(i) for i in first)
    mixed = np.flatnonzero(pm.kernel_step == ann[1].index)
    assert (pm.kernel_phase[mixed] == MIXED).all()
    last = int(np.flatnonzero(tr.kernels["start_ns"] == 700 * US)[0])
    assert pm.steps[pm.kernel_step[last]].source == "kernels"


def test_cpu_range_maps_kernels_by_launch_correlation_not_by_time():
    """A CPU range covers what its thread launched: a kernel that runs after the range
    ended belongs to it; a kernel running during the range but launched before does not."""
    b = TraceBuilder()
    b.range("step[DECODE bs=4]", 100, 150, kind=RANGE_USER_ANNOTATION, device=-1, tid=7)
    early = b.kernel(STORE_KVCACHE, 120, grid=(4, 1, 1))      # runs inside the CPU window...
    b.launch(early, 50, tid=7)                                # ...but was launched before it
    inside = []
    for i in range(6):
        c = b.kernel(GEMVX if i % 2 else SPLITKV, 200 + 10 * i, grid=(1, 2, 16))   # runs after the window
        b.launch(c, 110 + 5 * i, tid=7)
        inside.append(c)
    other_thread = b.kernel(ELEMENTWISE, 140)
    b.launch(other_thread, 115, tid=8)                        # same time, another thread
    tr = b.build()
    pm = map_phases(tr)
    ann = [s for s in pm.steps if s.source == "annotation"]
    assert len(ann) == 1 and ann[0].phase == DECODE and ann[0].decode_tokens == 4
    assert "CPU range, kernels by launch correlation" in ann[0].evidence[0]
    held = set(tr.kernels["correlation_id"][pm.kernel_step == ann[0].index].tolist())
    assert held == set(inside)


def test_gpu_copy_preferred_and_merged_with_cpu_range_of_same_annotation():
    b = TraceBuilder()
    name = "step[EXTEND bs=2 toks=640]"
    b.range(name, 0, 60, kind=RANGE_USER_ANNOTATION, device=-1, ext=5)
    b.range(name, 10, 80, kind=RANGE_GPU_ANNOTATION, device=0, ext=5)
    for i in range(5):
        c = b.kernel(RESHAPE_AND_CACHE if i == 0 else GEMM_LARGE, 12 + 10 * i, grid=(640, 1, 1))
        b.launch(c, 1 + i)
    late = b.kernel(ARGMAX, 95)        # after the GPU window, launched inside the CPU range
    b.launch(late, 55)
    pm = map_phases(b.build())
    ann = [s for s in pm.steps if s.source == "annotation"]
    assert len(ann) == 1 and ann[0].kernels == 6 and ann[0].phase == PREFILL and ann[0].prefill_tokens == 640
    assert "GPU-side range" in ann[0].evidence[0] and "some kernels by CPU range" in ann[0].evidence[0]


def test_nvtx_named_range_and_detailed_vllm_string():
    b = TraceBuilder()
    b.range("decode", 0, 50, kind=RANGE_NVTX, device=0)
    layers(b, 1, 3, SPLITKV, 2, attention_grid=(1, 2, 16), per_token=STORE_KVCACHE, gemm=GEMM_SMALL)
    detailed = "execute_4096_context_1(sq4096sk4096sqsq16777216sqsk16777216)_generation_0(sq0sk0sqsq0sqsk0)"
    b.range(detailed, 100, 300, kind=RANGE_GPU_ANNOTATION, device=0)
    layers(b, 101, 3, TRTLLM_CONTEXT, 4096)
    pm = map_phases(b.build())
    assert [(s.phase, s.prefill_tokens, s.decode_tokens) for s in pm.steps] == [(DECODE, None, None),
                                                                                 (PREFILL, 4096, 0)]
    assert pm.steps[0].evidence[0].startswith("annotation decode: decode => decode")
    assert pm.steps[1].evidence[0].startswith(f"annotation {detailed}: 4096 prefill tokens => prefill")


def test_annotation_wins_over_kernels_and_records_the_disagreement():
    b = TraceBuilder()
    b.range("step[DECODE bs=16]", 0, 100)
    layers(b, 1, 4, TRTLLM_CONTEXT, 4000)         # kernels alone say prefill
    tr = b.build()
    with_ann = only_step(map_phases(tr))
    assert with_ann.phase == DECODE
    assert any(e.startswith("kernel evidence alone would say prefill") for e in with_ann.evidence)
    assert any("4000 tokens vs 16 in the annotation" in e for e in with_ann.evidence)
    assert only_step(map_phases(tr, use_annotations=False)).phase == PREFILL


# ------------------------------------------------------------------ layer 3: per-step evidence, no annotations

def test_per_token_grid_one_token_is_decode():
    b = TraceBuilder()
    for i in range(4):
        b.kernel(STORE_KVCACHE, 10 * i, grid=(1, 1, 1))
        b.kernel(ELEMENTWISE, 10 * i + 3)
    st = only_step(map_phases(b.build()))
    assert (st.phase, st.decode_tokens, st.prefill_tokens) == (DECODE, 1, 0)
    assert st.evidence[0] == "store_kvcache_kernel grid [1,1,1]: one token in the step => decode"


def test_per_token_grid_alone_many_tokens_is_not_a_label():
    """888 tokens could be a prefill or a decode of 888 sequences: prefill-leaning (weak, as
    GEMM rows >= 512 are), no label from that alone (a weak vote decides only with a second
    weak class agreeing, e.g. large GEMM tiles)."""
    b = TraceBuilder()
    for i in range(4):
        b.kernel(RESHAPE_AND_CACHE, 10 * i, grid=(888, 1, 1))
        b.kernel(ELEMENTWISE, 10 * i + 3)
    st = only_step(map_phases(b.build()))
    assert st.phase == UNKNOWN
    assert ("reshape_and_cache_flash_kernel grid [888,1,1]: 888 tokens in the step and no split-KV combine => "
            "prefill-leaning") in st.evidence


def test_flash_fwd_query_blocks_prefill_and_single_block_not_decisive():
    b = TraceBuilder()
    layers(b, 0, 3, FLASH_FWD, 0, attention_grid=(5, 16, 16), per_token=ELEMENTWISE)
    st = only_step(map_phases(b.build()))
    assert st.phase == PREFILL
    assert st.evidence[0] == "flash_fwd_kernel grid [5,16,16]: 5 query blocks per sequence => prefill"
    b = TraceBuilder()
    layers(b, 0, 3, FLASH_FWD, 0, attention_grid=(1, 16, 16), per_token=ELEMENTWISE, gemm=ELEMENTWISE)
    st = only_step(map_phases(b.build()))
    assert st.phase == UNKNOWN
    assert any("one query block: short query, prefill or decode" in e for e in st.evidence)


def test_splitkv_combine_is_decode():
    b = TraceBuilder()
    for i in range(3):
        b.kernel(SPLITKV, 10 * i, grid=(1, 2, 16))
        b.kernel(SPLITKV_COMBINE, 10 * i + 3, grid=(8, 1, 1))
    st = only_step(map_phases(b.build()))
    assert st.phase == DECODE
    assert st.evidence[0].startswith("flash_fwd_splitkv_combine_kernel x3:")
    assert "flash_fwd_splitkv_kernel grid [1,2,16]: one query block (x3) => decode-like" in st.evidence


def test_trtllm_gen_context_and_generation_names():
    for name, phase in ((TRTLLM_CONTEXT, PREFILL), (TRTLLM_GEN, DECODE)):
        b = TraceBuilder()
        layers(b, 0, 3, name, 64, per_token=ELEMENTWISE, gemm=ELEMENTWISE)
        st = only_step(map_phases(b.build()))
        assert st.phase == phase, st.evidence


def test_gemv_majority_is_decode_but_a_single_lm_head_gemv_is_not():
    b = TraceBuilder()
    for i in range(4):
        b.kernel(GEMVX, 10 * i, grid=(256, 1, 1))
    b.kernel(STORE_KVCACHE, 50, grid=(4, 1, 1))       # decoder-LLM evidence: a KV-cache write
    st = only_step(map_phases(b.build()))
    assert st.phase == DECODE and st.evidence[0] == "gemvx::kernel GEMV: 4 of 4 GEMMs are matrix-vector => decode"
    b = TraceBuilder()
    layers(b, 0, 4, FLASH_FWD, 0, attention_grid=(3, 8, 8), per_token=ELEMENTWISE)
    b.kernel(GEMVX, 100)                   # the LM head on the last token of a prefill
    st = only_step(map_phases(b.build()))
    assert st.phase == PREFILL
    assert any("not decisive" in e for e in st.evidence)


def test_gemm_rows_from_cpu_op_input_dims():
    """aten::linear [batch, seq, hidden] with seq > 1 => prefill; seq == 1 => decode."""
    for seq, phase in ((559, PREFILL), (1, DECODE)):
        b = TraceBuilder()
        for i in range(3):
            t = 10 * i
            b.op("aten::linear", t, t + 9, ext=-1, dims=[[16, seq, 1024], [1024, 1024], []])
            b.op("aten::mm", t + 1, t + 8, ext=50 + i, dims=[[16 * seq, 1024], [1024, 1024]])
            b.kernel(GEMM_LARGE if seq > 1 else GEMM_SMALL, t + 2, ext=50 + i)
        lm_head(b, 40, 16)
        st = only_step(map_phases(b.build()))
        assert st.phase == phase, st.evidence
        word = f"{seq} tokens per sequence => prefill" if seq > 1 else "one new token per sequence => decode"
        assert st.evidence[0] == f"aten::linear [16, {seq}, 1024]: {word}"
        assert (st.prefill_tokens if phase == PREFILL else st.decode_tokens) == 16 * seq


def test_small_tile_gemm_and_small_rows_weak_votes_agree_to_decode():
    b = TraceBuilder()
    for i in range(3):
        b.op("aten::mm", 10 * i, 10 * i + 8, ext=70 + i, dims=[[3, 1024], [1024, 6144]])
        b.kernel(GEMM_SMALL, 10 * i + 1, ext=70 + i)
    lm_head(b, 40, 3)
    st = only_step(map_phases(b.build()))
    assert st.phase == DECODE
    assert "aten::mm [3, 1024]: at most 3 GEMM rows (tokens) => decode-leaning" in st.evidence
    # One weak signal alone is not enough.
    b = TraceBuilder()
    for i in range(3):
        b.kernel(GEMM_SMALL, 10 * i + 1)
    assert only_step(map_phases(b.build())).phase == UNKNOWN


def test_conflicting_evidence_is_unknown():
    b = TraceBuilder()
    for i in range(3):
        b.kernel(TRTLLM_CONTEXT, 10 * i)       # strong prefill
        b.kernel(GEMVX, 10 * i + 3)            # strong decode (all GEMMs are GEMV)
    st = only_step(map_phases(b.build()))
    assert st.phase == UNKNOWN
    assert st.evidence[0].startswith("conflicting evidence: ")
    assert "trtllm-gen FMHA context kernel => prefill" in st.evidence[0] and "=> decode" in st.evidence[0]
    assert st.prefill_tokens is None and st.decode_tokens is None


def test_prefill_and_decode_attention_in_one_step_is_mixed():
    b = TraceBuilder()
    for i in range(3):
        b.kernel(FLASH_FWD, 10 * i, grid=(3, 4, 8))        # chunked prefill
        b.kernel(PAGED_V1, 10 * i + 3, grid=(8, 16, 1))    # decode requests
    st = only_step(map_phases(b.build()))
    assert st.phase == MIXED
    assert st.evidence[0].startswith("prefill and decode attention in one step")


def test_training_kernels_and_autograd_ops_are_other():
    b = TraceBuilder()
    layers(b, 0, 2, FLASH_FWD, 0, attention_grid=(4, 8, 8), per_token=ELEMENTWISE)   # a training forward
    b.kernel(ADAM, 50)
    pm = map_phases(b.build())
    st = only_step(pm)
    assert st.phase == OTHER and st.evidence[0].startswith("1 training kernels (multi_tensor_apply_kernel")
    assert (pm.kernel_phase == OTHER).all()
    # Kernels launched from inside an autograd backward op.
    b = TraceBuilder()
    b.op("autograd::engine::evaluate_function: MmBackward0", 0, 100, tid=9)
    for i in range(3):
        c = b.kernel(GEMM_LARGE, 200 + 10 * i)
        b.launch(c, 10 + i, tid=9)
    st = only_step(map_phases(b.build()))
    assert st.phase == OTHER
    assert st.evidence[0] == "3 kernels launched from autograd/backward/optimizer CPU ops => other (not inference)"


def test_training_context_covers_forward_steps_of_the_same_device():
    b = TraceBuilder()
    layers(b, 0, 3, FLASH_FWD, 0, attention_grid=(4, 8, 8), per_token=ELEMENTWISE)
    b.kernel(ADAM, 20_000)                      # optimizer after a long idle gap: its own step
    pm = map_phases(b.build())
    assert len(pm.steps) == 2
    assert [s.phase for s in pm.steps] == [OTHER, OTHER]
    assert pm.steps[0].evidence[0].startswith("device 0 runs a training loop (1 backward/optimizer kernels")


def test_convolutions_without_transformer_kernels_are_other_and_nothing_is_unknown():
    b = TraceBuilder()
    for i in range(3):
        b.kernel(CONV, 10 * i)
        b.kernel(POOL, 10 * i + 3)
    st = only_step(map_phases(b.build()))
    assert st.phase == OTHER and st.evidence[0].startswith("6 non-LLM kernels (convolution/pooling; e.g. ")
    b = TraceBuilder()
    for i in range(3):
        b.kernel(ELEMENTWISE, 10 * i)
    st = only_step(map_phases(b.build()))
    assert st.phase == UNKNOWN and st.evidence[0] == "no phase evidence in the step's kernels => unknown"


def test_use_annotations_false_ignores_every_range():
    b = TraceBuilder()
    b.range("step[DECODE bs=4]", 0, 1000)
    b.range("ProfilerStep#3", 0, 1000, kind=RANGE_PROFILER_STEP)
    layers(b, 1, 4, FLASH_FWD, 0, attention_grid=(6, 8, 8), per_token=ELEMENTWISE)
    tr = b.build()
    assert only_step(map_phases(tr)).phase == DECODE
    st = only_step(map_phases(tr, use_annotations=False))
    assert st.phase == PREFILL and st.source == "kernels"


def test_empty_trace():
    pm = map_phases(TraceBuilder().build())
    assert pm.steps == [] and len(pm.kernel_phase) == 0 and pm.evidence_names


# ------------------------------------------------------------------ layer 2: segmentation from kernels

def kernel_steps(pm):
    return [(s.phase, s.kernels) for s in pm.steps]


def test_idle_gap_splits_steps():
    b = TraceBuilder()
    t = layers(b, 0, 3, PAGED_V1, 4, gemm=GEMVX)
    b.kernel(GEMVX, t, grid=(1002, 1, 1))                # LM head, sampling, next embedding:
    b.kernel(ARGMAX, t + 2)                              # the layer pattern ends
    b.kernel(ELEMENTWISE, t + 4)
    layers(b, t + 20_000, 3, PAGED_V1, 4, gemm=GEMVX)    # 20 ms idle
    pm = map_phases(b.build())
    assert kernel_steps(pm) == [(DECODE, 18), (DECODE, 15)]
    assert pm.steps[1].evidence[-1].startswith("step starts: GPU idle 20.0 ms")


def test_idle_gap_inside_the_layer_pattern_does_not_split_a_forward():
    """A host stall between two layers (the GPU idles 20 ms where the next layer's attention
    follows one usual layer later) is not a step boundary; a stall of 200 ms or more is."""
    for stall_ms, steps in ((20, [(DECODE, 31)]), (250, [(DECODE, 15), (DECODE, 16)])):
        b = TraceBuilder()
        t = layers(b, 0, 3, PAGED_V1, 4, gemm=GEMVX)
        t = layers(b, t + stall_ms * 1000, 3, PAGED_V1, 4, gemm=GEMVX)
        b.kernel(GEMVX, t, grid=(1002, 1, 1))
        assert kernel_steps(map_phases(b.build())) == steps, stall_ms


def test_token_count_change_splits_at_largest_gap():
    b = TraceBuilder()
    t = layers(b, 0, 3, TRTLLM_CONTEXT, 700)            # prefill of 700 tokens
    b.kernel(ARGMAX, t + 1)
    t = layers(b, t + 300, 3, TRTLLM_GEN, 5)             # 300 us later: decode of 5
    pm = map_phases(b.build())
    assert [(s.phase, s.kernels, s.prefill_tokens, s.decode_tokens) for s in pm.steps] == \
        [(PREFILL, 16, 700, 0), (DECODE, 15, 0, 5)]
    assert "tokens per step change (700 -> 5, KV-cache write grid.x)" in pm.steps[1].evidence[-1]


def test_sampling_kernel_ends_a_step_with_unchanged_token_count():
    b = TraceBuilder()
    t = 0.0
    for _ in range(3):
        t = layers(b, t, 3, PAGED_V1, 8, gemm=GEMVX)
        b.kernel(ARGMAX, t + 1)
        t += 200
    pm = map_phases(b.build())
    assert kernel_steps(pm) == [(DECODE, 16)] * 3
    assert "previous step ended with a sampling kernel" in pm.steps[1].evidence[-1]


def test_layer_pattern_restart_splits_steps():
    """Same tokens, no sampling kernel, small gaps (the H100 HF trace's situation): the
    interval between attention launches across the step boundary holds extra kernels."""
    b = TraceBuilder()
    t = layers(b, 0, 6, FLASH_FWD, 0, attention_grid=(5, 16, 16), per_token=ELEMENTWISE)
    for j in range(6):                                    # LM head + next step's embedding
        b.kernel(ELEMENTWISE, t + 2 * j)
    layers(b, t + 50, 6, FLASH_FWD, 0, attention_grid=(5, 16, 16), per_token=ELEMENTWISE)
    pm = map_phases(b.build())
    assert [s.phase for s in pm.steps] == [PREFILL, PREFILL]
    assert "layer pattern restarts (11 kernels between attention launches, 5 per layer)" in pm.steps[1].evidence[-1]


def test_cuda_graph_relaunch_splits_steps():
    b = TraceBuilder()
    t = 0.0
    for step in range(3):
        corr = 9000 + step
        b.launch(corr, t, category=API_GRAPH_LAUNCH, name="cudaGraphLaunch")
        for i in range(5):
            b.kernel([STORE_KVCACHE, GEMVX, SPLITKV, GEMVX, ELEMENTWISE][i], t + 2 * i, grid=(1, 2, 16) if i == 2
                     else (2, 1, 1), corr=corr, graph=77)
        t += 30
    pm = map_phases(b.build())
    assert kernel_steps(pm) == [(DECODE, 5)] * 3
    assert "CUDA graph 77 launched again" in pm.steps[2].evidence[-1]


def test_gpu_profiler_step_window_is_a_boundary():
    b = TraceBuilder()
    t = layers(b, 0, 3, FLASH_FWD, 0, attention_grid=(5, 16, 16), per_token=ELEMENTWISE)
    b.range("ProfilerStep#6", t + 1, t + 1000, kind=RANGE_PROFILER_STEP, device=0)
    layers(b, t + 2, 3, FLASH_FWD, 0, attention_grid=(5, 16, 16), per_token=ELEMENTWISE)
    tr = b.build()
    assert kernel_steps(map_phases(tr)) == [(PREFILL, 15), (PREFILL, 15)]
    assert "profiler step boundary" in map_phases(tr).steps[1].evidence[-1]
    assert len(map_phases(tr, use_annotations=False).steps) == 1


def test_devices_are_segmented_separately():
    b = TraceBuilder()
    layers(b, 0, 3, TRTLLM_CONTEXT, 300, device=0)
    layers(b, 0, 3, TRTLLM_GEN, 4, device=1)
    pm = map_phases(b.build())
    assert sorted((s.device, s.phase) for s in pm.steps) == [(0, PREFILL), (1, DECODE)]


def test_per_kernel_evidence_cites_the_deciding_kernel():
    b = TraceBuilder()
    layers(b, 0, 3, TRTLLM_CONTEXT, 300)
    tr = b.build()
    pm = map_phases(tr)
    att = np.flatnonzero(tr.kernels["name_id"] == tr.names.lookup(TRTLLM_CONTEXT))
    assert all(pm.evidence_of(i).startswith("trtllm-gen FMHA context kernel: ") for i in att)
    other = np.flatnonzero(tr.kernels["name_id"] == tr.names.lookup(ELEMENTWISE))
    assert all(pm.evidence_of(i).startswith("step 0 prefill: ") for i in other)
    assert PHASE_NAMES[int(pm.kernel_phase[other[0]])] == "prefill"


def test_enclosing_parent_matches_a_per_thread_scan():
    """The merged-sort containment join equals the definition, op by op: the latest-starting
    parent on the same thread at or before the query (ties: highest index), if it still
    covers the query's end."""
    from ridgeline.aggregator.phases import _enclosing_parent
    rng = np.random.default_rng(7)
    n = 400
    ops = empty(CPU_OP_DTYPE, n)
    ops["pid"] = rng.integers(1, 3, n)
    ops["tid"] = rng.integers(1, 4, n)
    ops["start_ns"] = rng.integers(0, 200, n)          # many equal starts: ties matter
    ops["end_ns"] = ops["start_ns"] + rng.integers(0, 60, n)
    par = np.sort(rng.choice(n, 150, replace=False))
    qry = rng.choice(n, 120, replace=False)            # may include parents themselves
    want = []
    for q in qry.tolist():
        best = -1
        for p in par.tolist():
            if (ops["pid"][p], ops["tid"][p]) == (ops["pid"][q], ops["tid"][q]) \
                    and ops["start_ns"][p] <= ops["start_ns"][q] \
                    and (best < 0 or ops["start_ns"][p] >= ops["start_ns"][best]):
                best = p
        want.append(best if best >= 0 and ops["end_ns"][best] >= ops["end_ns"][q] else -1)
    assert _enclosing_parent(ops, par, qry).tolist() == want
    assert _enclosing_parent(ops, par[:0], qry).tolist() == [-1] * len(qry)


def test_gemm_rows_parent_on_another_thread_gives_no_tokens_per_sequence():
    """aten::linear [16, 559, 1024] on another thread does not enclose the aten::mm: only
    the GEMM rows (16 x 559) speak, weakly."""
    b = TraceBuilder()
    for i in range(3):
        t = 10 * i
        b.op("aten::linear", t, t + 9, dims=[[16, 559, 1024], [1024, 1024], []], tid=200)
        b.op("aten::mm", t + 1, t + 8, ext=50 + i, dims=[[16 * 559, 1024], [1024, 1024]])
        b.kernel(GEMM_LARGE, t + 2, ext=50 + i)
    lm_head(b, 40, 16)
    st = only_step(map_phases(b.build()))
    assert st.evidence[0] == "aten::mm [8944, 1024]: 8944 GEMM rows (tokens) => prefill-leaning"
    assert "tokens per sequence" not in " ".join(st.evidence)


def test_eager_decoder_without_operators_is_one_step_per_forward_with_its_phase():
    """Issue 13.2: kernel-only, an eager decoder's forward stays one step through host stalls
    (8 ms, above the 5 ms idle rule) and gets its phase from the softmax rows per batched-GEMM
    head (50 query rows per head => prefill; one => decode), the LM head (50257 columns from
    its launch grid and tile) being the decoder-LLM evidence."""
    b = TraceBuilder()
    t = eager_forward(b, 0, tokens=50, context=50)
    t = eager_forward(b, t + 30_000, tokens=1, context=51)
    eager_forward(b, t + 30_000, tokens=1, context=52)
    for k in b.kernels:           # GEMV launch blocks: one output row per warp, 4 warps
        k["block_y"] = 4
    pm = map_phases(b.build())
    assert kernel_steps(pm) == [(PREFILL, 174), (DECODE, 174), (DECODE, 174)], [s.evidence[:2] for s in pm.steps]
    pre, dec = pm.steps[0], pm.steps[1]
    assert pre.evidence[0].startswith("softmax_warp_forward grid [75,1,1]: 593..600 softmax rows over 12 sequence-heads")
    assert any("LM head, 50432 output columns (from its launch grid and tile)" in e for e in pre.evidence)
    assert any("one query row each => decode" in e for e in dec.evidence)
    assert any("LM head, 50260 output columns" in e for e in dec.evidence)


FLASH_FWD_VARLEN = FLASH_FWD.replace("pytorch_flash::", "flash::")


def test_prefill_launch_continuing_a_running_batch_is_mixed():
    """One varlen flash_fwd_kernel over 8 sequences and 40 tokens (longest query <= 128):
    at least one long query, up to 7 one-token decodes. Right after a decode step of the same
    engine it is mixed; after the engine idled it is a prefill."""
    def decode_step(b, t, seqs):
        for _ in range(3):
            b.kernel(RESHAPE_AND_CACHE, t, grid=(seqs, 1, 1))
            b.kernel(SPLITKV, t + 2, grid=(1, seqs, 16))
            b.kernel(GEMM_SMALL, t + 4, grid=(8, 8, 1))
            t += 10
        b.kernel(ARGMAX, t)
        return t + 5

    def varlen_step(b, t):
        for _ in range(3):
            b.kernel(RESHAPE_AND_CACHE, t, grid=(40, 1, 1))
            b.kernel(FLASH_FWD_VARLEN, t + 2, grid=(1, 8, 16))
            b.kernel(GEMM_LARGE, t + 4, grid=(8, 8, 1))
            t += 10
        b.kernel(ARGMAX, t)
        return t + 5

    b = TraceBuilder()
    t = decode_step(b, 0, 7)
    varlen_step(b, t + 50)
    pm = map_phases(b.build())
    assert [s.phase for s in pm.steps] == [DECODE, MIXED], [s.evidence[:2] for s in pm.steps]
    assert pm.steps[1].evidence[0].startswith("up to 7 sequences of the prefill launch continue the previous step's "
                                              "batch (decode")
    assert (pm.steps[1].prefill_tokens, pm.steps[1].decode_tokens) == (None, None)
    b = TraceBuilder()
    t = decode_step(b, 0, 7)
    varlen_step(b, t + 50_000)                              # the engine idled 50 ms
    assert [s.phase for s in map_phases(b.build()).steps] == [DECODE, PREFILL]


def varlen_prefill_step(b, t, tokens=40, seqs=8, device=0):
    """Three layers of one varlen flash_fwd_kernel over ``seqs`` sequences and ``tokens``
    tokens (longest query <= 128), then a sampler."""
    for _ in range(3):
        b.kernel(RESHAPE_AND_CACHE, t, grid=(tokens, 1, 1), device=device)
        b.kernel(FLASH_FWD_VARLEN, t + 2, grid=(1, seqs, 16), device=device)
        b.kernel(GEMM_LARGE, t + 4, grid=(8, 8, 1), device=device)
        t += 10
    b.kernel(ARGMAX, t, device=device)
    return t + 5


def test_prefill_launch_opening_the_recording_is_mixed():
    """The same varlen launch with room for 7 one-token decodes as the first step on its
    device: nothing says the engine was idle before it, so its slots are taken as the
    running batch's decodes (mixed). After a step that is not inference and an idle engine
    it stays prefill. The streaming mapper, in one batch or one step per batch, labels it
    as the whole-trace mapper does."""
    from ridgeline.aggregator.stream_phases import StreamPhaser
    b = TraceBuilder()
    varlen_prefill_step(b, 0)
    varlen_prefill_step(b, 100, device=1)
    tr = b.build()
    pm = map_phases(tr)
    assert [(s.device, s.phase) for s in pm.steps] == [(0, MIXED), (1, MIXED)], [s.evidence[:2] for s in pm.steps]
    assert pm.steps[0].evidence[0].startswith("up to 7 sequences of the prefill launch can be one-token decodes, and "
                                              "nothing before this step on the device says the engine was idle")
    assert (pm.kernel_phase == MIXED).all()
    bp = StreamPhaser(tr.names).map_batch(tr)
    assert np.array_equal(bp.kernel_phase, pm.kernel_phase)
    # 1024 tokens over 8 sequences of at most 128 each: every sequence is a full prefill.
    b = TraceBuilder()
    varlen_prefill_step(b, 0, tokens=1024, seqs=8)
    assert [s.phase for s in map_phases(b.build()).steps] == [PREFILL]
    # After a convolution step and 50 ms idle: the engine was idle, a prefill.
    b = TraceBuilder()
    b.kernel(CONV, 0, grid=(8, 1, 1))
    varlen_prefill_step(b, 50_000)
    tr = b.build()
    pm = map_phases(tr)
    assert [s.phase for s in pm.steps] == [OTHER, PREFILL]
    sp = StreamPhaser(tr.names)
    first = tr.kernels["start_ns"] < 1_000_000
    for part in (first, ~first):                     # the convolution, then the prefill, in two batches
        sp.map_batch(Trace(kernels=tr.kernels[part], names=tr.names, devices=tr.devices))
    assert list(sp.first_step_ns) == [0]
    (st,) = [s for s in sp.map_batch(Trace(kernels=tr.kernels[~first], names=tr.names, devices=tr.devices)).steps]
    assert st.phase == PREFILL


def test_paged_split_kv_launch_with_more_tokens_than_sequences_continuing_a_batch_is_mixed():
    """vLLM V1 on FlashAttention-2 with a paged KV cache runs flash_fwd_splitkv_kernel for every
    step (grid (ceil(max_q / 64), b, h) when not split). 5 tokens over 5 sequences: decode;
    then 70 tokens over 6 sequences right after it: one long query, up to 5 one-token decodes,
    mixed."""
    b = TraceBuilder()
    t = 0.0
    for seqs, tokens, gx in ((5, 5, 1), (6, 70, 2)):
        for _ in range(3):
            b.kernel(RESHAPE_AND_CACHE, t, grid=(tokens, 1, 1))
            b.kernel(SPLITKV, t + 2, grid=(gx, seqs, 16))
            b.kernel(GEMM_SMALL, t + 4, grid=(8, 8, 1))
            t += 10
        b.kernel(ARGMAX, t)
        t += 50
    pm = map_phases(b.build())
    assert [s.phase for s in pm.steps] == [DECODE, MIXED], [s.evidence[:2] for s in pm.steps]
    assert pm.steps[0].evidence[0] == ("reshape_and_cache_flash_kernel grid [5,1,1]: 5 tokens over 5 sequences "
                                       "(attention grid.y): one new token per sequence => decode")
    assert pm.steps[1].evidence[0].startswith("up to 5 sequences of the prefill launch continue")
