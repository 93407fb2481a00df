"""Phase mapping on real serving-engine steps recorded on MI300X (TraceLens, tests/THIRD_PARTY.md;
skipped when the files are absent, as in CI unless the steering repository provides them).

Each trace holds one engine step with the engine's own annotation (SGLang ``step[MODE ...]``
inside TraceLens's vLLM-style ``execute_...`` range; vLLM's detailed ``execute_...`` range):
the oracle for the runs with annotations stripped (issue 20, points 2 and 3).

* Steps equal the engine's: nested annotations of one step are one step (the sampler kernels
  launched after SGLang's inner range closed included), and a layer whose attention is two
  kernels (ROCm ``paged_attention_ll4mi_QKV_mfma16_kernel`` + ``..._reduce_kernel``) does not
  make every layer a "layer pattern restarts" boundary (36 steps before).
* Without annotations the steps keep their phase.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import third_party
from support.third_party_files import SERVING, SGLANG_DECODE, SGLANG_EXTEND, VLLM_DECODE, VLLM_MIXED

from ridgeline.aggregator.phases import DECODE, MIXED, PREFILL, UNKNOWN, map_phases, parse_step_annotation
from ridgeline.probes.events import CPU_OP_DTYPE, RANGE_DTYPE, Trace, empty
from ridgeline.probes.kineto import load_trace

_cache: dict[str, Trace] = {}


def load(name: str) -> Trace:
    if name not in _cache:
        _cache[name] = load_trace(third_party("traces/" + name))
    return _cache[name]


def stripped(tr: Trace) -> Trace:
    return Trace(kernels=tr.kernels, copies=tr.copies, api=tr.api, ranges=empty(RANGE_DTYPE),
                 cpu_ops=tr.cpu_ops, names=tr.names, devices=tr.devices, meta=tr.meta)


@pytest.mark.parametrize("name, phase, tokens", [
    (SGLANG_DECODE, DECODE, (0, 32)), (SGLANG_EXTEND, PREFILL, (15360, 0)),
    (VLLM_DECODE, DECODE, (0, 32)), (VLLM_MIXED, MIXED, (8155, 37))])
def test_annotated_engine_step_is_one_step(name, phase, tokens):
    """With annotations every kernel of the trace sits in the one annotated engine step,
    also where SGLang's step[...] range is nested in an execute_... range and the sampler's
    kernels are launched after the inner range closed."""
    tr = load(name)
    pm = map_phases(tr)
    assert [(s.phase, s.kernels, s.source) for s in pm.steps] == [(phase, len(tr.kernels), "annotation")]
    assert (pm.steps[0].prefill_tokens, pm.steps[0].decode_tokens) == tokens
    if name in (SGLANG_DECODE, SGLANG_EXTEND):
        assert pm.steps[0].evidence[0].startswith("annotation step[")
        assert pm.steps[0].evidence[1].startswith("enclosing annotation execute_")


@pytest.mark.parametrize("name, phase", [(SGLANG_DECODE, DECODE), (SGLANG_EXTEND, PREFILL), (VLLM_DECODE, DECODE),
                                         (VLLM_MIXED, MIXED)])
def test_stripped_engine_step_keeps_its_phase_and_its_kernels(name, phase):
    """Without annotations: one LLM step holding every kernel, as many steps as the engine
    ran (the annotation's one). In the SGLang traces the first kernel (the overlap
    scheduler's arange, sglang overlap_utils.py alloc_future_indices, launched inside the
    execute_ range) ran 463/493 ms before the rest, but its host thread launched the next
    kernel 52 us after it: the GPU waited inside the step (its stream on a copy), so that
    idle gap is no boundary (it made a lone unknown step of 1 kernel, 2 steps for the
    engine's 1). No step boundary inside the layers."""
    from ridgeline.aggregator.steps import HOST_TOGETHER_NS, launch_index
    tr = load(name)
    pm = map_phases(stripped(tr))
    assert [(s.phase, s.kernels) for s in pm.steps] == [(phase, len(tr.kernels))]
    assert not any("layer pattern restarts" in e for s in pm.steps for e in s.evidence)
    if name in (SGLANG_DECODE, SGLANG_EXTEND):
        o = np.argsort(tr.kernels["start_ns"], kind="stable")
        gap = int(tr.kernels["start_ns"][o[1]] - tr.kernels["end_ns"][o[0]])
        li = launch_index(tr)[o[:2]]
        host = int(tr.api["start_ns"][li[1]] - tr.api["start_ns"][li[0]])
        assert gap > 400_000_000 and 0 < host < HOST_TOGETHER_NS, (gap, host)
    if name == SGLANG_EXTEND:
        # 15 sequences of at most 1024 tokens (CK group-mode grid [32,15,8], tile 128) hold
        # 15360 tokens: no room for one-token decodes, so a prefill even where nothing before
        # it on the device says the engine was idle.
        assert any(e.startswith("_ZN7ck_tile6kentryILi2ENS_38FmhaBatchPrefillWithPagedKVCache grid [32,15,8]: 15360 "
                                "tokens over 15 sequences, longest query <= 1024: every sequence is a prefill")
                   for e in pm.steps[0].evidence)
        assert pm.steps[0].mixed_slots == 0
        # Without the lone arange the extend step opens its recording: still a prefill.
        o = np.argsort(tr.kernels["start_ns"], kind="stable")
        only = Trace(kernels=tr.kernels[np.sort(o[1:])], api=tr.api, cpu_ops=tr.cpu_ops, ranges=empty(RANGE_DTYPE),
                     names=tr.names, devices=tr.devices, meta=tr.meta)
        assert [s.phase for s in map_phases(only).steps] == [PREFILL]


def test_two_kernel_attention_layers_are_one_layer():
    """The SGLang decode step's 36 layers each launch paged_attention_ll4mi_QKV then
    paged_attention_ll4mi_reduce one kernel apart and 14 kernels before the next layer: the
    layer marker is one of the two names, 15 kernels per layer."""
    from ridgeline.aggregator.signatures import ROLE_ATTENTION, classify_kernels
    from ridgeline.aggregator.steps import attention_marker
    tr = load(SGLANG_DECODE)
    k = tr.kernels
    o = np.argsort(k["start_ns"], kind="stable")
    kc = classify_kernels(tr)
    at, per_layer = attention_marker(k["name_id"][o], kc.role[o] == ROLE_ATTENTION)
    assert per_layer == 15 and len(at) == 36
    assert len({tr.names[int(i)] for i in k["name_id"][o][at]}) == 1


@pytest.mark.parametrize("name", SERVING)
def test_stripped_matches_use_annotations_false(name):
    tr = load(name)
    a, b = map_phases(tr, use_annotations=False), map_phases(stripped(tr))
    assert [(s.phase, s.kernels, s.evidence) for s in a.steps] == [(s.phase, s.kernels, s.evidence) for s in b.steps]


def test_enclosing_roots_and_fold_nested_annotations_literals():
    """Ranges 0 (outer) > 1 (inner) on thread (1, 7), range 2 later on the same thread, range 3
    overlapping 0 on another thread: 0 and 1 form one group; the member with the most
    kernels keeps them all."""
    from ridgeline.aggregator.phases import fold_nested_annotations
    from ridgeline.aggregator.steps import enclosing_roots
    s = np.array([0, 10, 200, 5], dtype=np.int64)
    e = np.array([100, 90, 300, 50], dtype=np.int64)
    pid = np.array([1, 1, 1, 1])
    tid = np.array([7, 7, 7, 8])
    assert enclosing_roots(s, e, pid, tid).tolist() == [0, 0, 2, 3]
    # Three levels, a later sibling, and a range of another thread inside the same window.
    s3 = np.array([0, 10, 20, 50, 30, 120], dtype=np.int64)
    e3 = np.array([100, 90, 40, 60, 35, 130], dtype=np.int64)
    t3 = np.array([7, 7, 7, 7, 9, 7])
    assert enclosing_roots(s3, e3, np.ones(6, int), t3).tolist() == [0, 0, 0, 0, 4, 5]
    hit = np.array([0, 1, 1, 1, -1, 2, 3, 0], dtype=np.int32)
    out, folded = fold_nested_annotations(hit, s, e, pid, tid)
    assert out.tolist() == [1, 1, 1, 1, -1, 2, 3, 1] and folded == {1: [0]}
    # Not nested: unchanged.
    out, folded = fold_nested_annotations(hit, s[[0, 2]], e[[0, 2]], pid[[0, 2]], tid[[0, 2]])
    assert folded == {}


def test_kernels_in_cpu_ranges_falls_back_to_the_enclosing_range():
    """A launch after the inner range closed but inside the outer one maps to the outer."""
    from ridgeline.aggregator.steps import kernels_in_cpu_ranges
    from ridgeline.probes.events import API_DTYPE, API_LAUNCH, KERNEL_DTYPE
    from ridgeline.probes.events import Trace as T
    k = np.zeros(3, dtype=KERNEL_DTYPE)
    k["correlation_id"] = [1, 2, 3]
    a = np.zeros(3, dtype=API_DTYPE)
    a["correlation_id"] = [1, 2, 3]
    a["category"] = API_LAUNCH
    a["start_ns"] = [20, 95, 150]
    a["pid"], a["tid"] = 1, 7
    tr = T(kernels=k, api=a)
    hit = kernels_in_cpu_ranges(tr, np.array([0, 10]), np.array([100, 90]), np.array([1, 1]), np.array([7, 7]))
    assert hit.tolist() == [1, 0, -1]


# ---------------------------------------------------------------- the step's own evidence (literals)

FA3 = ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90"
       "<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, "
       "128, cutlass::bfloat16_t, float, cutlass::arch::Sm90, true, false, false, true, true, false, false, true, true, "
       "true, false, false>, flash::CollectiveEpilogueFwd<cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, "
       "cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cutlass::bfloat16_t, cutlass::arch::Sm90, 256, true, true, "
       "false, false>, flash::VarlenDynamicPersistentTileScheduler<128, 256, 128, false, true, true> > > >"
       "(flash::FlashAttnFwdSm90<...>::Params)")
ROCM_PAGED = "void paged_attention_ll4mi_QKV_mfma16_kernel<__hip_bfloat16, __hip_bfloat16, 0, 128, 16, 4, 256, true, 1>(x)"
TRITON_PREFIX_PREFILL = "_fwd_kernel"


def test_prefill_from_kv_write_tokens_and_gemm_tiles_without_a_prefill_kernel_name():
    """Issue 20.1: an eager vLLM V1 prefill with the FlashAttention-3 forward (the same kernel
    serves both phases) and no split-KV combine: its 1000 tokens (KV-cache write grid.x) and
    its large-tile GEMMs are two weak prefill classes => prefill, not unknown."""
    from support.phase_traces import TraceBuilder, layers
    b = TraceBuilder()
    layers(b, 0, 4, FA3, 1000, attention_grid=(132, 1, 1))
    pm = map_phases(b.build())
    assert [s.phase for s in pm.steps] == [PREFILL], pm.steps[0].evidence
    ev = pm.steps[0].evidence
    assert ev[0].endswith("1000 tokens in the step and no split-KV combine => prefill-leaning")
    assert "GEMMs use large tiles" in ev[1]
    assert pm.steps[0].prefill_tokens == 1000


def test_rocm_paged_decode_kernel_next_to_prefill_attention_is_not_mixed():
    """Issue 20.2: vLLM's chunked_prefill_paged_decode (vllm/v1/attention/ops/
    chunked_prefill_paged_decode.py @ 69f87df3) launches the prefill part (Triton
    _fwd_kernel) and then paged_attention_rocm over every sequence whatever the decode
    count: the ROCm decode kernel next to a prefill kernel is no decode evidence, the step is
    prefill (it was mixed). Alone (no prefill part launched) it still says decode."""
    from support.phase_traces import TraceBuilder, layers
    b = TraceBuilder()
    t = 0.0
    for _ in range(4):
        t = layers(b, t, 1, TRITON_PREFIX_PREFILL, 888)
        b.kernel(ROCM_PAGED, t - 5, grid=(3, 4, 8))
    st = map_phases(b.build()).steps
    assert [s.phase for s in st] == [PREFILL], st[0].evidence
    assert any("can run empty: not decode evidence by itself" in e for e in st[0].evidence)
    b = TraceBuilder()
    layers(b, 0, 4, ROCM_PAGED, 32, attention_grid=(32, 4, 8))
    st = map_phases(b.build()).steps
    assert [s.phase for s in st] == [DECODE]


def test_tokens_against_the_lm_head_rows():
    """The LM head samples one row per sequence: tokens == rows => decode; more tokens =>
    prefill with up to rows - 1 one-token decodes (the real vLLM mixed step below)."""
    from ridgeline.aggregator.phases import MEDIUM, STRONG, WEAK, tokens_alone_votes
    v = tokens_alone_votes(32, "k", STRONG, 32, True)
    assert [(x.phase, x.strength) for x in v] == [(DECODE, MEDIUM)]
    v = tokens_alone_votes(8192, "k", STRONG, 46, True)
    assert [(x.phase, x.strength, x.cls, x.value) for x in v] == [(PREFILL, MEDIUM, "tokens", 0),
                                                                  (UNKNOWN, 0, "mixed_slots", 45)]
    assert [(x.phase, x.strength) for x in tokens_alone_votes(1000, "k", STRONG, -1, True)] == [(PREFILL, WEAK)]
    assert [x.phase for x in tokens_alone_votes(1000, "k", STRONG, -1, False)] == [UNKNOWN]   # split-KV: decode-like
    assert [x.phase for x in tokens_alone_votes(100, "k", STRONG, -1, True)] == [UNKNOWN]


def test_vllm_mixed_step_without_annotations():
    """The real piecewise-graph mixed step (9 prefill chunks, 37 decodes, 8192 tokens)
    stripped: 8192 KV-cache writes against 46 LM-head rows => prefill with up to 45
    one-token decodes. The recording starts with it (nothing before it says the engine was
    idle): mixed, as when it continues a running batch (a decode step that ended 1 ms before
    it on the device); after an idle engine (a non-inference step, or a gap of 5 ms or more)
    it stays prefill. The kernels alone do not show the per-sequence query lengths: a
    46-prompt prefill opening a recording reads the same (a stated limit)."""
    from ridgeline.aggregator.phases import mixed_by_continuity
    tr = load(VLLM_MIXED)
    pm = map_phases(stripped(tr))
    (st,) = pm.steps
    assert st.phase == MIXED and st.mixed_slots == 45
    assert st.evidence[0].startswith("up to 45 sequences of the prefill launch can be one-token decodes, and nothing "
                                     "before this step on the device says the engine was idle")
    assert st.evidence[1] == ("reshape_and_cache_flash_kernel grid [8192,1,1]: 8192 tokens and the LM head samples "
                              "46 rows: several new tokens per sequence => prefill")
    assert (pm.kernel_phase == MIXED).all()
    # Mapped as a piece whose history is elsewhere: prefill, then decided by that history.
    for prev, phase in (([(st.start_ns - 3_000_000, st.start_ns - 1_000_000, DECODE)], MIXED),
                        ([(st.start_ns - 3_000_000, st.start_ns - 1_000_000, UNKNOWN)], PREFILL),
                        ([(st.start_ns - 30_000_000, st.start_ns - 20_000_000, DECODE)], PREFILL)):
        (piece,) = map_phases(stripped(tr), first_step_unknown_history=False).steps
        assert piece.phase == PREFILL
        assert mixed_by_continuity([piece], {piece.device: prev}) == ([0] if phase == MIXED else [])
        assert piece.phase == phase
    (seen,) = map_phases(stripped(tr), first_step_ns={st.device: st.start_ns - 1}).steps
    assert seen.phase == PREFILL
    (again,) = map_phases(stripped(tr), first_step_ns={st.device: st.start_ns}).steps   # itself, mapped again
    assert again.phase == MIXED


def kernels_only(tr: Trace) -> Trace:
    return Trace(kernels=tr.kernels, copies=tr.copies, api=tr.api, ranges=empty(RANGE_DTYPE),
                 cpu_ops=empty(CPU_OP_DTYPE), names=tr.names, devices=tr.devices, meta=tr.meta)


def test_vllm_mixed_step_from_kernels_alone():
    """Issue 20 (note item 1): the real piecewise-graph mixed step with no ranges and no CPU
    operators. The LM head's rows come from the row gather launched right before it
    (``hidden_states[logits_indices]``, one row per scheduled request: vllm v0.10.1
    vllm/v1/worker/gpu_model_runner.py L803 and L1646; PyTorch's vectorized_gather_kernel
    launches one block per row, IndexKernelUtils.cu @ 05f814fe L36): 46 rows = the
    annotation's 9 prefill chunks + 37 decodes. 8192 KV-cache writes over 46 sampled rows:
    prefill tokens with 45 one-token-decode slots, opening the recording => mixed (it was
    prefill from the weak token-count lean)."""
    tr = load(VLLM_MIXED)
    ann = [a for a in (parse_step_annotation(tr.names[int(i)]) for i in tr.ranges["name_id"]) if a]
    assert len(ann) == 1
    requests = ann[0].prefill_requests + ann[0].decode_requests
    assert requests == 46
    pm = map_phases(kernels_only(tr))
    (st,) = pm.steps
    assert st.phase == MIXED and st.mixed_slots == requests - 1
    assert st.evidence[1] == ("reshape_and_cache_flash_kernel grid [8192,1,1]: 8192 tokens and the LM head samples "
                              f"{requests} rows (grid.x of the row gather before it, vectorized_gather_kernel grid "
                              f"[{requests},2,1]): several new tokens per sequence => prefill")
    # The same rows as the LM head's CPU operator gives (aten::mm [46, 2880]) with them.
    assert map_phases(stripped(tr)).steps[0].mixed_slots == st.mixed_slots
    # After an idle engine (a gap of 5 ms or more) the same step stays prefill.
    from ridgeline.aggregator.phases import mixed_by_continuity
    (piece,) = map_phases(kernels_only(tr), first_step_unknown_history=False).steps
    assert piece.phase == PREFILL
    assert mixed_by_continuity([piece], {piece.device: [(st.start_ns - 30_000_000, st.start_ns - 20_000_000,
                                                         DECODE)]}) == []


def test_idle_gap_inside_one_host_burst_is_no_boundary():
    """A GPU idle gap over GAP_MIN_NS cuts steps, except where one host thread launched the
    kernels on both sides at most HOST_TOGETHER_NS apart (the GPU waited inside the step,
    as in the SGLang traces); launched apart (the host did a step boundary's work in
    between), or without launch records, it still cuts."""
    from support.phase_traces import ELEMENTWISE, TraceBuilder

    from ridgeline.aggregator.steps import HOST_TOGETHER_NS
    for host_gap_us, tid2, steps in ((50, 100, 1), (HOST_TOGETHER_NS / 1000 + 50, 100, 2), (50, 101, 2),
                                     (None, 100, 2)):
        b = TraceBuilder()
        c = b.kernel(ELEMENTWISE, 0)                     # the lone early kernel
        if host_gap_us is not None:
            b.launch(c, -10)
        for i in range(4):                               # 60 ms later on the GPU
            c = b.kernel(ELEMENTWISE, 60_000 + 10 * i)
            if host_gap_us is not None:
                b.launch(c, -10 + host_gap_us + i, tid=tid2)
        st = map_phases(b.build()).steps
        assert len(st) == steps, (host_gap_us, tid2, [x.evidence for x in st])


def test_lm_head_gather_rows_literals():
    """The row gather counts only right before the LM head (at most ROW_GATHER_BEFORE
    kernels), in the same step, on the same device and stream."""
    from support.phase_traces import ELEMENTWISE, GEMM_LARGE, TraceBuilder

    from ridgeline.aggregator.phases import ROW_GATHER_BEFORE, lm_head_gather_rows
    gather = ("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, long, long, "
              "bool)")
    b = TraceBuilder()
    b.kernel(gather, 0, grid=(46, 2, 1))                 # 0: step 0, feeds the head at 3
    b.kernel(ELEMENTWISE, 10)                            # 1
    b.kernel(ELEMENTWISE, 20)                            # 2
    b.kernel(GEMM_LARGE, 30)                             # 3: step 0 LM head
    b.kernel(gather, 100, grid=(7, 2, 1), stream=9)      # 4: step 1, another stream
    b.kernel(GEMM_LARGE, 110)                            # 5: step 1 LM head
    b.kernel(gather, 200, grid=(5, 2, 1))                # 6: step 2, too far before its head
    for t in range(ROW_GATHER_BEFORE):
        b.kernel(ELEMENTWISE, 210 + 10 * t)
    b.kernel(GEMM_LARGE, 300)                            # step 2 LM head
    b.kernel(gather, 400, grid=(3, 2, 1))                # step 3: no LM head
    tr = b.build()
    n = len(tr.kernels)
    step = np.array([0] * 4 + [1] * 2 + [2] * (2 + ROW_GATHER_BEFORE) + [3], dtype=np.int32)
    assert len(step) == n
    heads = np.array([3, 5, n - 2, -1])
    rows, ex = lm_head_gather_rows(tr, step, heads)
    assert rows.tolist() == [46, -1, -1, -1] and ex.tolist() == [0, -1, -1, -1]
    # Another step's gather right before a head does not count.
    rows, _ = lm_head_gather_rows(tr, np.array([0, 1, 1, 1, 2, 2] + [3] * (n - 6), dtype=np.int32),
                                  np.array([-1, 3, -1, -1]))
    assert rows.tolist() == [-1, -1, -1, -1]


@pytest.mark.parametrize("name", SERVING)
def test_live_windows_label_the_serving_steps_as_analyze_does(name):
    """Issue 20 target: live windows (kernels and launch records as CUPTI sends them, and the
    replay probe's stream with CPU operators and ranges) label the same kernels the same way
    as the whole-trace mapper, at every window size."""
    from support.window_replay import load_kernels, whole_phases, windowed_phases
    kernels_only = load_kernels(third_party("traces/" + name))
    full = load(name)
    for per_window in (100, 300, 1000):
        assert windowed_phases(kernels_only, per_window)[0] == whole_phases(kernels_only), per_window
        assert windowed_phases(full, per_window, replay=True)[0] == whole_phases(full, annotations=True), per_window
        # Annotations stripped, CPU operators kept (the vLLM mixed step opens its recording:
        # mixed in the windows too, however they cut it).
        assert windowed_phases(stripped(full), per_window, replay=True)[0] == \
            whole_phases(stripped(full), annotations=True), per_window


def test_rocm_prefill_steps_with_two_attention_kernels_per_layer_are_not_cut_per_layer():
    """Issue 20.2: vLLM's ROCm backend launches, per layer, the prefill part (_fwd_kernel) and
    then paged_attention_ll4mi over every sequence (chunked_prefill_paged_decode): attention
    launches one and five kernels apart. Taken together they made "one kernel per layer" and
    every layer a restart (80 steps per engine step); one name alone gives the 6-kernel layer.
    Three engine steps of 20 layers, each closed by an LM head and a sampler."""
    from support.phase_traces import ELEMENTWISE, GEMM_LARGE, RESHAPE_AND_CACHE, TraceBuilder
    argmax = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
              "unsigned int, long, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4>)")
    b = TraceBuilder()
    t = 0.0
    for _step in range(3):
        for _ in range(20):
            b.kernel(RESHAPE_AND_CACHE, t, grid=(700, 1, 1))
            b.kernel(GEMM_LARGE, t + 2, grid=(8, 8, 1))
            b.kernel(TRITON_PREFIX_PREFILL, t + 4, grid=(6, 8, 4))
            b.kernel(ROCM_PAGED, t + 6, grid=(4, 4, 8))
            b.kernel(GEMM_LARGE, t + 8, grid=(8, 8, 1))
            b.kernel(ELEMENTWISE, t + 10, grid=(64, 1, 1))
            t += 12
        b.kernel(GEMM_LARGE, t, grid=(8, 8, 1))
        b.kernel(argmax, t + 2)
        t += 300
    pm = map_phases(b.build())
    assert [(s.phase, s.kernels) for s in pm.steps] == [(PREFILL, 122)] * 3, \
        [(s.phase_name, s.kernels, s.evidence[-1]) for s in pm.steps][:5]
