"""Phase mapping: label every forward step, and every kernel, prefill / decode / mixed / other / unknown.

Layered method (shared design notes, section 4); the strongest evidence available decides
and is recorded:

1. **Engine step annotations** (``use_annotations=True``): vLLM
   ``execute_context_N(T_S)_generation_M(G)`` and the detailed form
   ``execute_{total}_context_N(sq..sk..sqsq..sqsk..)_generation_M(sq..sk..sqsq..sqsk..)``,
   SGLang ``step[DECODE bs=N]`` / ``step[EXTEND bs=N toks=T]`` (and other forward modes),
   NVTX or user ranges named ``prefill``/``decode``. They give the step boundaries and token
   counts (mixed steps: the prefill/decode token split). GPU-side copies of a range are
   preferred; a CPU-side range is mapped to the kernels whose launching API call it
   contains (correlation id). ProfilerStep ranges only give weak boundaries.
2. **Step segmentation** from the kernels alone (:mod:`aggregator.steps`).
3. **Per-step evidence** without annotations: tokens from the grid.x of per-token
   kernels and sequences from the FA2 attention grid (T == B: decode), attention-kernel
   signatures, their grids and their causal flag (parsed from the template arguments),
   eager attention (softmax rows per batched-GEMM head), GEMV vs small/large-tile GEMM, GEMM
   rows from the CPU operator's ``Input Dims`` (linked by External id), GEMM widths (from the
   operator, else launch grid x tile: the LM head), training signals (backward and optimizer
   kernels, autograd CPU ops) => other. Prefill/decode/mixed need decoder-LLM evidence
   (causal attention, a serving-engine kernel, an LM head); without it non-causal
   self-attention and convolutions are other, anything else unknown. Conflicting evidence
   => unknown. A prefill launch with room for one-token decodes that continues a running
   batch, or opens the recording, is mixed (:func:`mixed_by_continuity`). Each class of
   evidence is one rule of :data:`VOTE_RULES` (``StepView -> list of votes``).

The signature table is data (``aggregator/data/kernel_signatures.toml``). All per-kernel
work is numpy over the kernel arrays; votes are computed once per group of steps with identical
facts, and Python loops otherwise run over distinct names, (op, dims) pairs, devices and threads.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ridgeline.aggregator.signatures import (
    CAUSAL_LOCAL,
    CAUSAL_NO,
    CAUSAL_UNKNOWN,
    CAUSAL_YES,
    LARGE_TILE,
    MEDIUM,
    ROLE_ATTENTION,
    ROLE_ATTENTION_AUX,
    ROLE_GEMM,
    ROLE_GEMV,
    ROLE_NON_LLM,
    ROLE_PER_TOKEN,
    ROLE_SOFTMAX,
    ROLE_TRAINING,
    SMALL_TILE,
    STRONG,
    WEAK,
    KernelClasses,
    Signature,
    classify_kernels,
    short_name,
)
from ridgeline.aggregator.steps import (
    GAP_MIN_NS,
    enclosing_roots,
    kernels_in_cpu_ranges,
    kernels_in_gpu_ranges,
    launch_index,
    segment_kernels,
)
from ridgeline.probes.events import RANGE_GPU_ANNOTATION, RANGE_NVTX, RANGE_PROFILER_STEP, RANGE_USER_ANNOTATION, Trace
from ridgeline.probes.records import PHASE_NAMES, Phase
from ridgeline.probes.sdpa import CAUSAL_FLAG_UNKNOWN, CAUSAL_FLAG_YES
from ridgeline.probes.trace_joins import kernel_cpu_op_index

# The phase codes are probes.records.Phase; the short names are the mapper's own spelling.
UNKNOWN, PREFILL, DECODE, MIXED, OTHER = Phase.UNKNOWN, Phase.PREFILL, Phase.DECODE, Phase.MIXED, Phase.OTHER


@dataclass(frozen=True)
class SequenceSums:
    """Sums over one step's sequences that an engine annotation carries (vLLM's detailed
    annotation, :func:`parse_step_annotation`): for the prefill (context) and the decode
    (generation) sequences, the query tokens, the key tokens (each sequence's KV length,
    cached + new), the squared query lengths and query x key. Decode's key tokens are what
    it reads from the KV cache; with them the model's work needs no ``--context-len``."""
    prefill_requests: int
    prefill_query_tokens: int
    prefill_key_tokens: int
    prefill_query_sq: int
    prefill_query_key: int
    decode_requests: int
    decode_query_tokens: int
    decode_key_tokens: int
    decode_query_key: int


@dataclass
class Step:
    """One forward step: its span on one device, its label and the evidence behind it.

    ``prefill_tokens``/``decode_tokens``: tokens of each kind in the step when known (a
    mixed step from an annotation carries both), else None. ``evidence``: human-readable
    strings, the deciding one first. ``source``: "annotation" or "kernels".
    ``mixed_slots``: for a step decided from kernels, how many sequences of its single varlen
    prefill-attention launch can be one-token decodes (0: none); such a step is mixed when
    it continues a running batch (:func:`mixed_by_continuity`). ``tokens``: for a step
    decided from kernels, all its tokens as its kernels show them (KV-cache write grid.x,
    else GEMM rows), also where the split is unknown (a mixed step); None unknown.
    ``sequences``: the per-step sums over sequences when its annotation carries them
    (:class:`SequenceSums`), else None. ``layer_candidate``: unknown from its own kernels,
    with LAYER_MIN_REPEATS complete layers all alike, so that a neighbour's layers could
    label it (:func:`same_layers_by_continuity`, whether they did or not): a stream holds
    such a step until its next step is decided.
    """
    index: int
    start_ns: int
    end_ns: int
    device: int
    phase: int
    prefill_tokens: int | None = None
    decode_tokens: int | None = None
    evidence: list[str] = field(default_factory=list)
    source: str = "kernels"
    kernels: int = 0
    mixed_slots: int = 0
    tokens: int | None = None
    sequences: SequenceSums | None = None
    layer_candidate: bool = False

    @property
    def phase_name(self) -> str:
        return PHASE_NAMES[self.phase]


@dataclass
class PhaseMap:
    """Result of :func:`map_phases`. Arrays are aligned with ``trace.kernels``.

    ``kernel_phase`` (uint8, phase codes), ``kernel_step`` (int32 index into ``steps``,
    -1 = in no step), ``kernel_evidence`` (int32 index into ``evidence_names``: the
    evidence that decided the kernel's label).
    """
    steps: list[Step]
    kernel_phase: np.ndarray
    kernel_step: np.ndarray
    kernel_evidence: np.ndarray
    evidence_names: list[str]

    def evidence_of(self, kernel_index: int) -> str:
        return self.evidence_names[int(self.kernel_evidence[kernel_index])]

# ---------------------------------------------------------------------------------------------
# Layer 1: step annotations

@dataclass(frozen=True)
class StepAnnotation:
    """What an engine's step annotation says (token counts None where it does not say)."""
    phase: int
    prefill_tokens: int | None
    decode_tokens: int | None
    prefill_requests: int | None
    decode_requests: int | None
    engine: str
    sequences: SequenceSums | None = None

    def describe(self, text: str) -> str:
        parts = []
        if self.prefill_tokens:
            parts.append(f"{self.prefill_tokens} prefill tokens")
        if self.decode_tokens:
            kv = self.sequences.decode_key_tokens if self.sequences is not None else 0
            parts.append(f"{self.decode_tokens} decode tokens" + (f" reading {kv:,} KV-cache tokens" if kv else ""))
        if self.phase == DECODE and not self.decode_tokens and self.decode_requests:
            parts.append(f"{self.decode_requests} decode requests")
        tail = ", ".join(parts) if parts else PHASE_NAMES[self.phase]
        return f"annotation {text}: {tail} => {PHASE_NAMES[self.phase]}"


_VLLM = re.compile(r"^execute_context_(\d+)(?:\((\d+)(?:_(\d+))?\))?_generation_(\d+)(?:\((\d+)\))?$")
_VLLM_DETAILED = re.compile(
    r"^execute_(\d+)_context_(\d+)\(sq(\d+)sk(\d+)sqsq(\d+)sqsk(\d+)\)"
    r"_generation_(\d+)\(sq(\d+)sk(\d+)sqsq(\d+)sqsk(\d+)\)$")
_SGLANG = re.compile(r"^step\[(\w+) bs=(\d+)(?: toks=(\d+))?(?: [^\]]*)?\]$")
_NAMED = re.compile(r"^(?:(prefill|extend|context)|(decode|generation))(?:\b|_|\[|\s|$)", re.IGNORECASE)


def _label(prefill_tokens: int, decode_tokens: int) -> int:
    if prefill_tokens > 0 and decode_tokens > 0:
        return MIXED
    if prefill_tokens > 0:
        return PREFILL
    if decode_tokens > 0:
        return DECODE
    return UNKNOWN


def parse_step_annotation(text: str) -> StepAnnotation | None:
    """Parse an engine step annotation; None when ``text`` is not one.

    vLLM ``execute_context_{n}({tokens}_{sum len^2})_generation_{m}({tokens})`` (vllm PR
    #22496) and the detailed ``execute_{total}_context_{n}(sq..)_generation_{m}(sq..)``
    (PR #37524, where ``sq`` is the sum of query tokens and ``sk`` of key tokens, kept as
    :class:`SequenceSums`); SGLang ``step[MODE bs=N]`` with
    ``toks=T`` for EXTEND (``run_model`` span); ranges named ``prefill``/``extend``/``decode``
    (NVTX or record_function) give the phase without token counts.
    """
    t = text.strip()
    m = _VLLM_DETAILED.match(t)
    if m:
        ctx_req, ctx_sq, gen_req, gen_sq = int(m.group(2)), int(m.group(3)), int(m.group(7)), int(m.group(8))
        p = ctx_sq if ctx_req else 0
        d = gen_sq if gen_req else 0
        g = [int(x) for x in m.groups()]
        sums = SequenceSums(prefill_requests=ctx_req, prefill_query_tokens=ctx_sq, prefill_key_tokens=g[3],
                            prefill_query_sq=g[4], prefill_query_key=g[5], decode_requests=gen_req,
                            decode_query_tokens=gen_sq, decode_key_tokens=g[8], decode_query_key=g[10])
        return StepAnnotation(_label(p, d) if (p or d) else _label(ctx_req, gen_req), p, d, ctx_req, gen_req,
                              "vllm-detailed", sums)
    m = _VLLM.match(t)
    if m:
        ctx_req, gen_req = int(m.group(1)), int(m.group(4))
        p = int(m.group(2)) if m.group(2) is not None else None
        d = int(m.group(5)) if m.group(5) is not None else None
        if p is None and d is None:
            # Legacy form without parentheses: execute_context_{tokens}_generation_{tokens}.
            p, d = ctx_req, gen_req
            ctx_req = gen_req = None
            return StepAnnotation(_label(p, d), p, d, None, None, "vllm")
        p = p if p is not None else (0 if ctx_req == 0 else None)
        d = d if d is not None else (0 if gen_req == 0 else None)
        phase = _label(p or (ctx_req if p is None else 0), d or (gen_req if d is None else 0))
        return StepAnnotation(phase, p, d, ctx_req, gen_req, "vllm")
    m = _SGLANG.match(t)
    if m:
        mode, bs = m.group(1).upper(), int(m.group(2))
        toks = int(m.group(3)) if m.group(3) is not None else None
        if mode in ("EXTEND", "PREFILL", "DRAFT_EXTEND"):
            return StepAnnotation(PREFILL, toks, 0, bs, 0, "sglang")
        if mode in ("DECODE", "TARGET_VERIFY", "DRAFT_DECODE"):
            # One new token per request in plain decode; verify steps carry several.
            return StepAnnotation(DECODE, 0, bs if mode == "DECODE" else None, 0, bs, "sglang")
        if mode == "MIXED":
            return StepAnnotation(MIXED, None, None, None, None, "sglang")
        return StepAnnotation(UNKNOWN, None, None, None, None, "sglang")   # IDLE, DUMMY_FIRST, ...
    m = _NAMED.match(t)
    if m:
        return StepAnnotation(PREFILL if m.group(1) else DECODE, None, None, None, None, "named range")
    return None


def _is_profiler_step(name: str) -> bool:
    return name.startswith("ProfilerStep#")


# ---------------------------------------------------------------------------------------------
# CPU-operator evidence: GEMM rows (tokens) from Input Dims; training operators.

_GEMM_OPS = {"aten::mm": 0, "aten::addmm": 1, "aten::_scaled_mm": 0, "aten::linear": 0, "aten::matmul": 0}
# Where the output width N sits in each op's Input Dims: (operand, axis) of the weight.
_GEMM_COLS = {"aten::mm": (1, -1), "aten::addmm": (2, -1), "aten::_scaled_mm": (1, -1), "aten::linear": (1, 0),
              "aten::matmul": (1, -1)}
# A GEMM at least this wide, launched once in a step and at least twice as wide as any
# other GEMM of the step, is the LM head: decoder vocabularies start at 32000 (Llama-2,
# Mistral 32768, GPT-2 50257, Llama-3 128256, Qwen 151936); encoder MLM heads (BERT 30522)
# and image classifiers (ImageNet-21k: 21843) stay below.
VOCAB_MIN_COLS = 32000
# Eager attention: the batched Q K^T GEMM comes at most this many kernels before the softmax
# (scaling and the causal mask are elementwise kernels in between).
EAGER_GEMM_BEFORE = 8
_PARENT_OPS = ("aten::linear", "aten::matmul")
# GEMM families whose grid is bounded by the SM count, not the tile count (see _gemm_width).
_PERSISTENT_GEMM = re.compile(r"^sm90_xmma_gemm")
# PyTorch's layer norm launches one block per row (layer_norm_kernel.cu).
_ROW_NORM = re.compile(r"vectorized_layer_norm_kernel")
# PyTorch's row gather (aten::index / index_select on the leading dim, vectorized path):
# one block per gathered row, pytorch/pytorch aten/src/ATen/native/cuda/IndexKernelUtils.cu
# @ 05f814fe L36 (``dim3 grid = {num_ind, grid_y, 1}``; L12 ``ind = idx[blockIdx.x]``).
_ROW_GATHER = re.compile(r"vectorized_gather_kernel")
# A row gather at most this many kernels before the LM head on its stream feeds it: vLLM V1
# gathers each request's last scheduled token before compute_logits (vllm v0.10.1
# vllm/v1/worker/gpu_model_runner.py L803 ``logits_indices = query_start_loc[1:] - 1``, L1646
# ``sample_hidden_states = hidden_states[logits_indices]``); the MI300X vLLM mixed step:
# vectorized_gather_kernel grid [46,2,1] right before the LM head, 46 requests.
ROW_GATHER_BEFORE = 3
_TRAINING_OP = re.compile(r"autograd::engine::evaluate_function|Backward\d*$|^Optimizer\.step|"
                          r"^Optimizer\.zero_grad|torch::autograd::AccumulateGrad|optimizer\.step", re.IGNORECASE)


def _dims(trace: Trace, dims_id: int):
    if dims_id < 0:
        return None
    try:
        return json.loads(trace.names[dims_id])
    except (ValueError, IndexError):
        return None


def _name_codes(trace: Trace, wanted: dict[str, int] | tuple[str, ...]) -> np.ndarray:
    """Lookup table over name ids: the position of the name in ``wanted`` (-1 otherwise).

    One slot longer than the name table so that a missing name id (-1) reads -1.
    """
    lut = np.full(len(trace.names) + 1, -1, dtype=np.int8)
    for c, name in enumerate(wanted):
        i = trace.names.lookup(name)
        if i >= 0:
            lut[i] = c
    return lut


def _names_matching(trace: Trace, name_ids: np.ndarray, pattern: re.Pattern) -> np.ndarray:
    """Lookup table over name ids (one slot longer: id -1 reads False): True where the name
    is among ``name_ids`` and matches ``pattern``. Linear in the ids (a presence table, no
    sort); the pattern runs once per distinct name."""
    lut = np.zeros(len(trace.names) + 1, dtype=bool)
    if len(name_ids):
        lut[name_ids] = True
        lut[-1] = False
        for i in np.flatnonzero(lut).tolist():
            lut[i] = bool(pattern.search(trace.names[i]))
    return lut


def _present_keys(key: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values of a non-negative int64 ``key`` below ``size`` (sorted) and, per
    element, the position of its value among them. A counting pass over a dense table
    (linear) when the table is small against the data, else a sort (np.unique)."""
    if size <= 4 * len(key) + (1 << 20):
        seen = np.zeros(size, dtype=bool)
        seen[key] = True
        uniq = np.flatnonzero(seen)
        pos = np.zeros(size, dtype=np.int64)
        pos[uniq] = np.arange(len(uniq))
        return uniq, pos[key]
    uniq, inv = np.unique(key, return_inverse=True)
    return uniq, inv.reshape(-1)


def _enclosing_parent(ops: np.ndarray, par: np.ndarray, qry: np.ndarray) -> np.ndarray:
    """For each op in ``qry``: the op of ``par`` on the same thread (pid, tid) with the
    latest start at or before the query's start (ties: the highest op index), if it ends
    at or after the query ends; else -1. One merged sort of both lists, no per-thread loop:
    in (thread, start, parents-before-queries, index) order, the candidate of a query is the
    last parent before it, found with a running maximum."""
    if not len(par) or not len(qry):
        return np.full(len(qry), -1, dtype=np.int64)
    both = np.concatenate((par, qry))
    thread = (ops["pid"][both].astype(np.int64) << 32) | (ops["tid"][both].astype(np.int64) & 0xFFFFFFFF)
    is_q = np.r_[np.zeros(len(par), dtype=np.int8), np.ones(len(qry), dtype=np.int8)]
    order = np.lexsort((both, is_q, ops["start_ns"][both], thread))
    last_par = np.maximum.accumulate(np.where(is_q[order] == 0, np.arange(len(order)), -1))
    q_at = np.flatnonzero(is_q[order] == 1)           # sorted positions of the queries
    cand_at = last_par[q_at]
    ok = cand_at >= 0
    ok[ok] = thread[order[cand_at[ok]]] == thread[order[q_at[ok]]]
    cand = np.where(ok, both[order[np.maximum(cand_at, 0)]], -1)
    q = both[order[q_at]]
    ok &= ops["end_ns"][np.maximum(cand, 0)] >= ops["end_ns"][q]
    out = np.full(len(qry), -1, dtype=np.int64)
    out[order[q_at] - len(par)] = np.where(ok, cand, -1)
    return out


def _gemm_rows(trace: Trace, op_of_kernel: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], np.ndarray]:
    """Per kernel: GEMM rows M, tokens per sequence S (-1 unknown) from the launching CPU op.

    The kernel links to its innermost CPU op (``op_of_kernel``, default
    :func:`probes.trace_joins.kernel_cpu_op_index`: External id, or the enclosing op for older
    Kineto). For aten::mm/addmm/_scaled_mm/linear/matmul, M is the row count of the
    activation operand. S comes from an enclosing aten::linear/matmul whose input is
    [batch, seq, hidden] (HF models); vLLM flattens tokens, so S stays unknown there. Also
    returns, per kernel, an index into a list of texts ("aten::mm [888, 2880]") naming the
    operand behind the figure, and the GEMM's output width N from the weight operand (-1
    unknown).

    Linear in the number of operators: each distinct (op name, Input Dims) pair is parsed
    once and looked up through a table over (name code, dims id); no Python loop per op.
    """
    k, ops = trace.kernels, trace.cpu_ops
    rows = np.full(len(k), -1, dtype=np.int64)
    seq = np.full(len(k), -1, dtype=np.int64)
    src = np.full(len(k), -1, dtype=np.int64)
    cols = np.full(len(k), -1, dtype=np.int64)
    texts: list[str] = []
    if not len(k) or not len(ops):
        return rows, seq, src, texts, cols
    width = len(trace.names) + 1
    gemm_ops = list(_GEMM_OPS)
    gemm_code = _name_codes(trace, gemm_ops)[ops["name_id"]]
    g = np.flatnonzero((gemm_code >= 0) & (ops["input_dims_id"] >= 0))
    if not len(g):
        return rows, seq, src, texts, cols
    # Rows per distinct (op name, dims) pair: each parsed once.
    pairs, inv = _present_keys(gemm_code[g].astype(np.int64) * width + ops["input_dims_id"][g], len(gemm_ops) * width)
    pm = np.full(len(pairs), -1, dtype=np.int64)
    ps = np.full(len(pairs), -1, dtype=np.int64)
    pt = np.full(len(pairs), -1, dtype=np.int64)
    pn = np.full(len(pairs), -1, dtype=np.int64)
    for j, (code, did) in enumerate(zip((pairs // width).tolist(), (pairs % width).tolist())):
        d = _dims(trace, did)
        which = _GEMM_OPS[gemm_ops[code]]
        w_at, w_axis = _GEMM_COLS[gemm_ops[code]]
        if isinstance(d, list) and len(d) > w_at and isinstance(d[w_at], list) and len(d[w_at]) == 2 \
                and all(isinstance(x, int) for x in d[w_at]):
            pn[j] = d[w_at][w_axis]
        if isinstance(d, list) and len(d) > which and isinstance(d[which], list) and len(d[which]) >= 2 \
                and all(isinstance(x, int) for x in d[which]):
            shape = d[which]
            pm[j] = int(np.prod(shape[:-1]))
            if len(shape) == 3:
                ps[j] = shape[1]
            texts.append(f"{gemm_ops[code]} {json.dumps(shape)}")
            pt[j] = len(texts) - 1
    op_m, op_s, op_t, op_n = pm[inv], ps[inv], pt[inv], pn[inv]
    # S from an enclosing aten::linear/matmul on the same thread (time containment).
    par_code = _name_codes(trace, _PARENT_OPS)[ops["name_id"]]
    par = np.flatnonzero((par_code >= 0) & (ops["input_dims_id"] >= 0))
    on_g = np.flatnonzero(op_s < 0)
    cand = _enclosing_parent(ops, par, g[on_g])
    hit = cand >= 0
    if hit.any():
        c = cand[hit]
        ukeys, cinv = _present_keys(par_code[c].astype(np.int64) * width + ops["input_dims_id"][c],
                                    len(_PARENT_OPS) * width)
        u_s = np.full(len(ukeys), -1, dtype=np.int64)
        u_t = np.full(len(ukeys), -1, dtype=np.int64)
        for j, (code, did) in enumerate(zip((ukeys // width).tolist(), (ukeys % width).tolist())):
            d = _dims(trace, did)
            if isinstance(d, list) and d and isinstance(d[0], list) and len(d[0]) == 3 \
                    and all(isinstance(x, int) for x in d[0]):
                texts.append(f"{_PARENT_OPS[code]} {json.dumps(d[0])}")
                u_s[j], u_t[j] = d[0][1], len(texts) - 1
        got = u_t[cinv] >= 0
        at = on_g[hit][got]
        op_s[at], op_t[at] = u_s[cinv][got], u_t[cinv][got]
    # Kernel -> launching CPU op (External id, or the enclosing op for older Kineto).
    if op_of_kernel is None:
        op_of_kernel = kernel_cpu_op_index(trace)
    slot = np.full(len(ops), -1, dtype=np.int32 if len(g) < 2 ** 31 else np.int64)
    slot[g] = np.arange(len(g))
    j = np.full(len(k), -1, dtype=np.int64)
    linked = op_of_kernel >= 0
    j[linked] = slot[op_of_kernel[linked]]
    ok = j >= 0
    rows[ok], seq[ok], src[ok], cols[ok] = op_m[j[ok]], op_s[j[ok]], op_t[j[ok]], op_n[j[ok]]
    return rows, seq, src, texts, cols


def _gemm_width(trace: Trace, kc: KernelClasses, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per kernel: the output width N of a GEMM (-1 unknown) and whether it was estimated
    from the launch. N comes from the CPU operator's weight when one is linked; otherwise
    from the launch: the grid holds one block per output tile (tiles over N times tiles over
    the token rows), so grid.x * grid.y * the output-side tile of the name is N when the
    token rows fit one tile (decode, an LM head on the sampled rows) and a multiple of N
    otherwise (checked on real traces: nvjet_tst_144x128 grid 140 = 20 x 7 tiles of
    [888, 512] x [512, 2880]; cutlass 256x128 grid 16 x 15 = 120 x 2 tiles of BERT's
    [141, 512] x [512, 30522]); the LM-head vote checks the rows against the step's tokens
    (:func:`_step_votes`). Persistent kernels (Hopper ``sm90_xmma``) launch at most one block
    per SM whatever the tile count: no estimate for them (a 256-wide tile times 126 blocks
    read as 32256 columns). hipBLASLt launches count work-items: divided by the block size
    first."""
    k = trace.kernels
    out = cols.copy()
    gemm = ((kc.role == ROLE_GEMM) | (kc.role == ROLE_GEMV)) & (out < 0) & (kc.tile_out > 0) \
        & (k["grid_x"] > 0) & (k["grid_y"] > 0)
    # cuBLAS gemvx: one output row per warp, block (warp, rows): the output length is
    # grid.x * block.y (nano-vllm [1,1024]x[1024,4096]: grid 1024, block (16,4); TraceLens
    # TimeSformer [1,768]x[768,400]: grid 100, block (32,4)).
    gemv = (kc.role == ROLE_GEMV) & (out < 0) & (k["grid_x"] > 0) & (k["block_y"] > 0)
    if gemv.any():
        ids = np.unique(k["name_id"][gemv])
        vx = ids[[("gemvx::kernel" in trace.names[int(i)]) for i in ids.tolist()]]
        gemv &= np.isin(k["name_id"], vx)
        out[gemv] = k["grid_x"][gemv].astype(np.int64) * k["block_y"][gemv]
    if gemm.any():
        # Persistent GEMMs launch at most one block per SM, each looping over tiles: their
        # grid says nothing about the width. Real H100 launches of sm90_xmma (segment_k off,
        # linked to their aten::linear): OWLv2 [5184, 1024] x [1024, 768] tile 256x128 grid
        # 126 for 21 x 6 (or 41 x 3) tiles, read as 32256 columns; ViT [788, 3072] x [3072,
        # 768] 128x64 grid 98 for 84 tiles; Qwen [8944, 1024] x [1024, 1024] grid 30 x 4 for
        # 560 tiles; BERT [141, 2048] x [2048, 512] 64x64 grid 30 for 24 tiles.
        gemm &= ~_names_matching(trace, k["name_id"][gemm], _PERSISTENT_GEMM)[k["name_id"]]
    g = np.flatnonzero(gemm)
    blocks = k["grid_x"][g].astype(np.int64) * k["grid_y"][g]
    wi = kc.grid_in_work_items[g] & (k["block_x"][g] > 0)
    if wi.any():
        threads = k["block_x"][g[wi]].astype(np.int64) * np.maximum(k["block_y"][g[wi]], 1)
        blocks[wi] //= threads
    out[g] = blocks * kc.tile_out[g]
    return out, gemm | gemv


def _op_causal(trace: Trace) -> np.ndarray:
    """Per kernel: the causal flag of the CPU operator that launched it (probes.sdpa: 1 causal,
    0 not causal and no mask, -1 unknown or not an SDPA operator; -1 without CPU operators).
    The innermost operator is PyTorch's SDPA backend call (aten::_flash_attention_forward,
    _efficient_attention_forward ...), which carries the flag the kernel runs with."""
    n = len(trace.kernels)
    if not len(trace.cpu_ops) or not n:
        return np.full(n, CAUSAL_FLAG_UNKNOWN, dtype=np.int8)
    op = kernel_cpu_op_index(trace)
    flags = trace.cpu_ops["is_causal"]
    return np.where(op >= 0, flags[np.maximum(op, 0)], CAUSAL_FLAG_UNKNOWN).astype(np.int8)


def _training_launched(trace: Trace, launch: np.ndarray) -> np.ndarray:
    """Per kernel: launched from inside an autograd/backward/optimizer CPU op."""
    k, ops = trace.kernels, trace.cpu_ops
    out = np.zeros(len(k), dtype=bool)
    if not len(ops) or not len(k):
        return out
    op_ids = np.unique(ops["name_id"][ops["name_id"] >= 0])
    ids = op_ids[[bool(_TRAINING_OP.search(trace.names[int(i)])) for i in op_ids]] if len(op_ids) else op_ids
    t = np.flatnonzero(np.isin(ops["name_id"], ids))
    if not len(t):
        return out
    hit = kernels_in_cpu_ranges(trace, ops["start_ns"][t], ops["end_ns"][t], ops["pid"][t], ops["tid"][t], launch=launch)
    out[hit >= 0] = True
    return out


# ---------------------------------------------------------------------------------------------
# Layer 3: per-step evidence from kernels

@dataclass
class _Vote:
    phase: int
    strength: int
    text: str
    cls: str
    sig: int = -1        # signature that carried the vote (per-kernel evidence), -1 none
    value: int = 0       # a count the vote carries (sequences, one-token slots)


def lm_head_gather_rows(trace: Trace, kernel_step: np.ndarray, lm_head: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per step: the rows the LM head runs on from the row gather launched just before it
    (grid.x of a ``vectorized_gather_kernel`` at most ROW_GATHER_BEFORE kernels before the
    LM head, same step, device and stream) and that gather kernel; -1 where none. The engine
    gathers one row per sampled sequence before its LM head (vLLM V1 ``logits_indices``,
    SGLang's extend-mode ``hidden_states[last_index]``), so kernels alone give the sampled
    rows. Linear in the kernels of the steps with an LM head; nothing without a gather."""
    k = trace.kernels
    n_steps = len(lm_head)
    rows = np.full(n_steps, -1, dtype=np.int64)
    ex = np.full(n_steps, -1, dtype=np.int64)
    heads = np.flatnonzero(lm_head >= 0)
    if not len(heads) or not len(k):
        return rows, ex
    nid = k["name_id"]
    gathers = _names_matching(trace, np.unique(nid), _ROW_GATHER)[nid] & (kernel_step >= 0)
    if not gathers.any():
        return rows, ex
    idx = np.flatnonzero(np.isin(kernel_step, heads))
    o = idx[np.lexsort((k["start_ns"][idx], k["stream"][idx], k["device"][idx], kernel_step[idx]))]
    pos = np.full(len(k), -1, dtype=np.int64)
    pos[o] = np.arange(len(o))
    head_k = lm_head[heads]
    p = pos[head_k]
    todo = np.ones(len(heads), dtype=bool)
    for back in range(1, ROW_GATHER_BEFORE + 1):
        q = p - back
        ok = todo & (q >= 0)
        cand = o[np.maximum(q, 0)]
        ok &= ((kernel_step[cand] == kernel_step[head_k]) & (k["device"][cand] == k["device"][head_k])
               & (k["stream"][cand] == k["stream"][head_k]) & gathers[cand] & (k["grid_x"][cand] > 0))
        rows[heads[ok]] = k["grid_x"][cand[ok]]
        ex[heads[ok]] = cand[ok]
        todo &= ~ok
    return rows, ex


def _grid_text(k: np.ndarray, i: int) -> str:
    return f"[{int(k['grid_x'][i])},{int(k['grid_y'][i])},{int(k['grid_z'][i])}]"


class _StepFacts:
    """Per-step aggregates of the kernel classes, computed with numpy for all steps at once
    (bincount and ufunc.at over step ids: linear, no sort, no Python loop per kernel).

    Per (step, signature) arrays of shape (steps, signatures): ``sig_count``; ``max_example``
    (the kernel with the largest grid.x, the latest such kernel on ties; -1 none) and
    ``min_gx`` (smallest grid.x). Per step: role counts, tile counts, GEMM rows and tokens per
    sequence from CPU ops with the kernel that carries the largest figure.
    """

    def __init__(self, trace: Trace, kc: KernelClasses, kernel_step: np.ndarray, n_steps: int,
                 rows: np.ndarray, seq: np.ndarray, training_launch: np.ndarray, width: np.ndarray | None = None,
                 width_estimated: np.ndarray | None = None, op_causal: np.ndarray | None = None):
        k = trace.kernels
        self.n = n_steps
        in_step = kernel_step >= 0
        st = kernel_step[in_step]
        idx = np.flatnonzero(in_step)
        nsig = len(kc.signatures)
        self.nsig = nsig
        sig = kc.sig[in_step]
        has = sig >= 0
        key = st[has].astype(np.int64) * nsig + sig[has]
        cells = n_steps * nsig
        self.sig_count = np.bincount(key, minlength=cells).reshape(n_steps, nsig)
        # Grid extremes per (step, signature): the kernel with the largest and smallest grid.x.
        gx = k["grid_x"][idx[has]].astype(np.int64)
        ki = idx[has]
        big = np.iinfo(np.int64).max
        gmax = np.full(cells, np.iinfo(np.int64).min, dtype=np.int64)
        np.maximum.at(gmax, key, gx)
        gmin = np.full(cells, big, dtype=np.int64)
        np.minimum.at(gmin, key, gx)
        at_max = gx == gmax[key]
        max_ex = np.full(cells, -1, dtype=np.int64)
        np.maximum.at(max_ex, key[at_max], ki[at_max])
        self.max_example = max_ex.reshape(n_steps, nsig)
        self.min_gx = np.where(gmin == big, -1, gmin).reshape(n_steps, nsig)
        role = kc.role[in_step]
        self.role_count = {r: np.bincount(st[role == r], minlength=n_steps) for r in
                           (ROLE_ATTENTION, ROLE_ATTENTION_AUX, ROLE_PER_TOKEN, ROLE_GEMM, ROLE_GEMV,
                            ROLE_TRAINING, ROLE_NON_LLM)}
        # Token-side tile of the GEMM names (the second side: PyTorch's transposed cuBLAS call
        # puts the output features first).
        tile = kc.tile_tok[in_step]
        gemm = role == ROLE_GEMM
        self.small_tile = np.bincount(st[gemm & (tile > 0) & (tile <= SMALL_TILE)], minlength=n_steps)
        self.large_tile = np.bincount(st[gemm & (tile >= LARGE_TILE)], minlength=n_steps)
        self.tiled = np.bincount(st[gemm & (tile > 0)], minlength=n_steps)
        # Attention causality (decoder evidence) and query-block launches.
        causal = kc.causal[in_step]
        att = (role == ROLE_ATTENTION) | (role == ROLE_ATTENTION_AUX)
        # Where the kernel name does not spell its causal flag (aotriton attn_fwd, CK, FA3),
        # the SDPA operator that launched it may: is_causal=True, or False with no mask.
        from_op = np.zeros(len(causal), dtype=bool)
        if op_causal is not None:
            oc = op_causal[in_step]
            from_op = att & (causal == CAUSAL_UNKNOWN) & (oc != CAUSAL_FLAG_UNKNOWN)
            causal = np.where(from_op, np.where(oc == CAUSAL_FLAG_YES, CAUSAL_YES, CAUSAL_NO), causal).astype(causal.dtype)
        self.causal_from_op = np.bincount(st[from_op & (causal == CAUSAL_YES)], minlength=n_steps)
        from_grid = att & (causal == CAUSAL_UNKNOWN) & aotriton_causal_grid(trace, kc, idx)
        causal = np.where(from_grid, CAUSAL_YES, causal).astype(causal.dtype)
        self.causal_from_grid = np.bincount(st[from_grid], minlength=n_steps)
        # aotriton's regular (query blocks, heads, batch) grid: a causal launch that is not
        # varlen always runs persistent (a one-dimensional grid), so this one is not causal.
        nc_grid = att & (causal == CAUSAL_UNKNOWN) & aotriton_regular_grid(trace, kc, idx)
        causal = np.where(nc_grid, CAUSAL_NO, causal).astype(causal.dtype)
        self.causal = np.bincount(st[att & ((causal == CAUSAL_YES) | (causal == CAUSAL_LOCAL))], minlength=n_steps)
        # Fused attention that does not spell its causal flag (aotriton attn_fwd, CK, FA3,
        # xformers): an encoder's launch reads the same as a decoder's.
        unk = (role == ROLE_ATTENTION) & (causal == CAUSAL_UNKNOWN)
        self.causal_unknown = np.bincount(st[unk], minlength=n_steps)
        self.causal_unknown_example = self._example(st, unk, k["grid_x"][idx].astype(np.int64), idx, n_steps)
        self.split = np.bincount(st[role == ROLE_ATTENTION_AUX], minlength=n_steps)
        qb = att & (kc.grid_rule[in_step] == 1) & (k["grid_x"][idx] > 0)          # GRID_QUERY_BLOCKS
        gx_all = k["grid_x"][idx].astype(np.int64)
        noncausal = qb & (causal == CAUSAL_NO) & ~kc.inference_only[in_step] & (gx_all > 1)
        self.noncausal = np.bincount(st[noncausal], minlength=n_steps)
        self.noncausal_example = self._example(st, noncausal, gx_all, idx, n_steps)
        # Non-LLM evidence anywhere in the trace (non-causal self-attention, convolution/pooling).
        self.non_llm_in_trace = bool(noncausal.any() or (role == ROLE_NON_LLM).any())
        # whether that example's flag came from its operator (the evidence text says so)
        nc_op = np.zeros(len(k), dtype=bool)
        nc_op[idx[from_op]] = True
        self.noncausal_from_op = (self.noncausal_example >= 0) & nc_op[np.maximum(self.noncausal_example, 0)]
        nc_g = np.zeros(len(k), dtype=bool)
        nc_g[idx[nc_grid]] = True
        self.noncausal_from_grid = (self.noncausal_example >= 0) & nc_g[np.maximum(self.noncausal_example, 0)]
        self.qb_example = self._example(st, qb & ~noncausal, gx_all, idx, n_steps)
        self.qb_count = np.bincount(st[qb & ~noncausal], minlength=n_steps)
        # LM head: the widest GEMM of the step, launched once, vocabulary-wide and at least
        # twice as wide as every other GEMM of the step.
        self.lm_head = np.full(n_steps, -1, dtype=np.int64)
        self.lm_width = np.full(n_steps, -1, dtype=np.int64)
        self.lm_estimated = np.zeros(n_steps, dtype=bool)
        if width is not None:
            w = width[in_step]
            g = ((role == ROLE_GEMM) | (role == ROLE_GEMV)) & (w > 0)
            wmax = np.full(n_steps, -1, dtype=np.int64)
            np.maximum.at(wmax, st[g], w[g])
            at = g & (w == wmax[st])
            n_at = np.bincount(st[at], minlength=n_steps)
            w2 = np.full(n_steps, -1, dtype=np.int64)
            np.maximum.at(w2, st[g & ~at], w[g & ~at])
            ok = (wmax >= VOCAB_MIN_COLS) & (n_at == 1) & (2 * w2 <= wmax)
            ex = np.full(n_steps, -1, dtype=np.int64)
            np.maximum.at(ex, st[at], idx[at])
            self.lm_head = np.where(ok, ex, -1)
            self.lm_width = np.where(ok, wmax, -1)
            if width_estimated is not None:
                self.lm_estimated = ok & width_estimated[np.maximum(ex, 0)]
        # Rows of the LM head from its CPU operator (the sampled sequences: one row per request
        # in vLLM V1 and SGLang, every verified token with speculative decoding); -1 unknown.
        self.lm_rows = np.where(self.lm_head >= 0, rows[np.maximum(self.lm_head, 0)], -1) if len(rows) \
            else np.full(n_steps, -1, dtype=np.int64)
        # Without a CPU operator: the grid.x of the row gather that feeds the LM head (the
        # gather kernel in ``lm_rows_gather``, -1 where the rows came from the operator).
        g_rows, g_ex = lm_head_gather_rows(trace, kernel_step, self.lm_head)
        use = (self.lm_rows < 0) & (g_rows > 0)
        self.lm_rows = np.where(use, g_rows, self.lm_rows)
        self.lm_rows_gather = np.where(use, g_ex, -1)
        self._eager_attention(k, kc, st, idx, role, n_steps)
        # Rows of PyTorch's row-wise layer norm (one block per row: grid.x = rows): the rows
        # the step's GEMMs around it run on (OWLv2's vision tower: 5185).
        self.norm_rows = np.zeros(n_steps, dtype=np.int64)
        nid = k["name_id"][idx]
        lut = _names_matching(trace, nid, _ROW_NORM)
        on = lut[nid]
        if on.any():
            np.maximum.at(self.norm_rows, st[on], k["grid_x"][idx[on]].astype(np.int64))
        self.training_launch = np.bincount(st[training_launch[in_step]], minlength=n_steps)
        self.inference_only = np.bincount(st[kc.inference_only[in_step]], minlength=n_steps)
        # GEMM rows from CPU ops.
        r = rows[in_step]
        s = seq[in_step]
        self.max_rows, self.rows_example = self._max_and_example(st, r, idx, n_steps)
        self.max_seq, self.seq_example = self._max_and_example(st, s, idx, n_steps)
        self.seq_known = np.bincount(st[s >= 0], minlength=n_steps)

    def _eager_attention(self, k, kc, st, idx, role, n_steps) -> None:
        """Eager attention (batched GEMM Q K^T, softmax, batched GEMM P V): per step, the
        softmax launch with the most query rows per sequence-head, its row bounds and the
        grid.z (sequences x heads) of the batched GEMM launched at most EAGER_GEMM_BEFORE
        kernels before it in the same step. ``eager_example`` -1: none."""
        self.eager_example = np.full(n_steps, -1, dtype=np.int64)
        self.eager_heads = np.zeros(n_steps, dtype=np.int64)
        self.eager_rows_lo = np.zeros(n_steps, dtype=np.int64)
        self.eager_rows_hi = np.zeros(n_steps, dtype=np.int64)
        soft = (role == ROLE_SOFTMAX) & (kc.rows_per_block[idx] > 0) & (k["grid_x"][idx] > 0)
        if not soft.any():
            return
        o = np.lexsort((k["start_ns"][idx], st))
        so, io = st[o], idx[o]
        pos = np.arange(len(o))
        bmm = (role[o] == ROLE_GEMM) & (k["grid_z"][io] > 1) & ~kc.grid_in_work_items[io]
        last = np.maximum.accumulate(np.where(bmm, pos, -1))
        sp = np.flatnonzero(soft[o])
        lb = last[sp]
        ok = (lb >= 0) & (sp - lb <= EAGER_GEMM_BEFORE)
        ok[ok] = so[lb[ok]] == so[sp[ok]]
        sp, lb = sp[ok], lb[ok]
        if not len(sp):
            return
        z = k["grid_z"][io[lb]].astype(np.int64)
        gx = k["grid_x"][io[sp]].astype(np.int64)
        rpb = kc.rows_per_block[io[sp]].astype(np.int64)
        lo, hi = (gx - 1) * rpb + 1, gx * rpb
        # The launch with the most rows per sequence-head speaks for the step.
        ratio = lo * 1_000_000 // z
        best = np.full(n_steps, -1, dtype=np.int64)
        sst = so[sp]
        np.maximum.at(best, sst, ratio)
        at = ratio == best[sst]
        pick = np.full(n_steps, -1, dtype=np.int64)
        np.maximum.at(pick, sst[at], np.flatnonzero(at))
        has = pick >= 0
        p_ = pick[has]
        self.eager_example[has] = io[sp[p_]]
        self.eager_heads[has] = z[p_]
        self.eager_rows_lo[has] = lo[p_]
        self.eager_rows_hi[has] = hi[p_]

    @staticmethod
    def _example(st: np.ndarray, sel: np.ndarray, gx: np.ndarray, idx: np.ndarray, n_steps: int) -> np.ndarray:
        """Per step: among the selected kernels, the latest one with the largest grid.x (-1 none)."""
        best = np.full(n_steps, -1, dtype=np.int64)
        np.maximum.at(best, st[sel], gx[sel])
        at = sel & (gx == best[st])
        ex = np.full(n_steps, -1, dtype=np.int64)
        np.maximum.at(ex, st[at], idx[at])
        return ex

    @staticmethod
    def _max_and_example(st: np.ndarray, v: np.ndarray, idx: np.ndarray, n_steps: int):
        """Per step: max of ``v`` (-1 when none) and the latest kernel holding it when it is >= 0."""
        vmax = np.full(n_steps, -1, dtype=np.int64)
        np.maximum.at(vmax, st, v)
        at = (v >= 0) & (v == vmax[st])
        ex = np.full(n_steps, -1, dtype=np.int64)
        np.maximum.at(ex, st[at], idx[at])
        return vmax, ex

    def group_of_steps(self, trace: Trace, rows_at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Steps whose votes are necessarily identical share a group: returns (group per
        step, one representative step per group). The key holds every fact the votes read:
        counts, and the name and grid of each example kernel (they appear in the evidence
        texts), so a step's votes are its group representative's."""
        n = self.n
        if not n:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        k = trace.kernels
        cols = np.flatnonzero(self.sig_count.any(axis=0))
        ex = self.max_example[:, cols]
        exc = np.maximum(ex, 0)
        parts = [self.sig_count[:, cols], self.min_gx[:, cols],
                 np.where(ex >= 0, k["name_id"][exc], -1), np.where(ex >= 0, k["grid_x"][exc], -1),
                 np.where(ex >= 0, k["grid_y"][exc], -1), np.where(ex >= 0, k["grid_z"][exc], -1)]
        cols1 = [self.role_count[r] for r in sorted(self.role_count)]
        cols1 += [self.small_tile, self.large_tile, self.tiled, self.training_launch, self.inference_only > 0,
                  self.max_rows, self.max_seq, self.seq_known > 0, self.causal > 0, self.split > 0,
                  self.noncausal, self.noncausal_from_op, self.noncausal_from_grid, self.causal_from_op, self.causal_from_grid, self.qb_count, self.lm_width, self.lm_estimated, self.lm_rows, self.eager_heads,
                  self.eager_rows_lo, self.eager_rows_hi, self.norm_rows]
        for ex in (self.noncausal_example, self.qb_example, self.lm_head, self.eager_example,
                   self.causal_unknown_example, self.lm_rows_gather):
            exc = np.maximum(ex, 0)
            cols1 += [np.where(ex >= 0, k["name_id"][exc], -1), np.where(ex >= 0, k["grid_x"][exc], -1),
                      np.where(ex >= 0, k["grid_y"][exc], -1), np.where(ex >= 0, k["grid_z"][exc], -1)]
        cols1 += [
                  self._text_key(k, rows_at, self.rows_example), self._text_key(k, rows_at, self.seq_example)]
        mat = np.concatenate([p.astype(np.int64) for p in parts] + [np.stack(cols1, axis=1).astype(np.int64)],
                             axis=1)
        _, first, group = np.unique(mat, axis=0, return_index=True, return_inverse=True)
        return group.reshape(-1), first

    @staticmethod
    def _text_key(k: np.ndarray, rows_at: np.ndarray, example: np.ndarray) -> np.ndarray:
        """What names a rows/seq figure in the evidence: the CPU-op text index, else the
        example kernel's name (-2 - name id), -1 without an example."""
        e = np.maximum(example, 0)
        t = rows_at[e] if len(rows_at) else np.full(len(e), -1, dtype=np.int64)
        return np.where(example < 0, -1, np.where(t >= 0, t, -2 - k["name_id"][e].astype(np.int64)))


@dataclass(frozen=True)
class StepView:
    """What a vote rule reads about one step: step ``j`` of the per-step facts ``f`` of
    ``trace`` (kernel classes ``kc``; ``rows_src``: the per-kernel CPU-op text index and
    the texts, from :func:`_gemm_rows`, that name GEMM-rows figures in the evidence)."""
    j: int
    f: _StepFacts
    trace: Trace
    kc: KernelClasses
    rows_src: tuple

    @property
    def k(self) -> np.ndarray:
        return self.trace.kernels

    @property
    def sigs(self) -> list[Signature]:
        return self.kc.signatures

    def present(self) -> list[int]:
        """Signatures with at least one kernel in the step."""
        return np.flatnonzero(self.f.sig_count[self.j]).tolist()

    def name(self, kernel_index: int) -> str:
        return short_name(self.trace.names[int(self.k["name_id"][kernel_index])])

    def example_name(self, s_i: int) -> str:
        """Name of the step's widest kernel of signature ``s_i`` (the label without one)."""
        ex = int(self.f.max_example[self.j, s_i])
        return self.name(ex) if ex >= 0 else self.sigs[s_i].label

    def role_count(self, role: int) -> int:
        return int(self.f.role_count[role][self.j])


# A vote rule: one class of evidence of a step, read alone; [] when the step has none.
VoteRule = Callable[[StepView], list[_Vote]]
_PHASE_CODE = {"prefill": PREFILL, "decode": DECODE, "mixed": MIXED}
_STRENGTH_CODE = {"weak": WEAK, "medium": MEDIUM, "strong": STRONG}


def _signature_attention_votes(s: StepView) -> list[_Vote]:
    """Attention kernels whose name signature carries a phase (not the query-block ones)."""
    out = []
    for s_i in s.present():
        sig = s.sigs[s_i]
        if sig.role in ("attention", "attention_aux") and sig.grid_rule != "query_blocks" \
                and sig.phase in _PHASE_CODE:
            n = int(s.f.sig_count[s.j, s_i])
            out.append(_Vote(_PHASE_CODE[sig.phase], _STRENGTH_CODE[sig.strength],
                             f"{s.example_name(s_i)} x{n}: {sig.label} => {sig.phase}", "attention", s_i))
    return out


def _query_block_votes(s: StepView) -> list[_Vote]:
    """Query-block attention (grid.x = ceil(query tokens / kBlockM)): the widest launch that
    is not known to be non-causal."""
    ex = int(s.f.qb_example[s.j])
    if ex < 0:
        return []
    k = s.k
    s_i = int(s.kc.sig[ex])
    n = int(s.f.sig_count[s.j, s_i])
    head = f"{s.name(ex)} grid {_grid_text(k, ex)}"
    gx_max = int(k["grid_x"][ex])
    if gx_max > 1:
        return [_Vote(PREFILL, STRONG, f"{head}: {gx_max} query blocks per sequence => prefill", "attention", s_i)]
    if s.sigs[s_i].phase in ("decode", "neutral"):
        return [_Vote(DECODE, WEAK, f"{head}: one query block (x{n}) => decode-like", "attention", s_i)]
    return [_Vote(UNKNOWN, 0, f"{head}: one query block: short query, prefill or decode", "attention", s_i)]


def attention_sequences(s: StepView) -> int:
    """Sequences of the step's query-block attention launch (FA2 grid.y over an unsplit
    launch), -1 unknown."""
    ex = int(s.f.qb_example[s.j])
    if ex < 0 or s.sigs[int(s.kc.sig[ex])].seqs_axis != "y" or s.f.split[s.j] or s.k["grid_y"][ex] <= 0:
        return -1
    return int(s.k["grid_y"][ex])


def rule_noncausal_attention(s: StepView) -> list[_Vote]:
    """Non-causal self-attention over several query blocks => other (medium)."""
    nc = int(s.f.noncausal_example[s.j])
    if nc < 0:
        return []
    k = s.k
    flag = ("is_causal=False and no mask on its SDPA operator" if s.f.noncausal_from_op[s.j]
            else "aotriton's regular grid: its causal launches run persistent, one-dimensional"
            if s.f.noncausal_from_grid[s.j] else "Is_causal false")
    return [_Vote(OTHER, MEDIUM, f"{s.name(nc)} grid {_grid_text(k, nc)} x{int(s.f.noncausal[s.j])}: non-causal "
                  f"self-attention over {int(k['grid_x'][nc])} query blocks ({flag}) => other "
                  f"(encoder or vision transformer, not a decoder LLM)", "noncausal", int(s.kc.sig[nc]))]


def rule_eager_attention(s: StepView) -> list[_Vote]:
    """Eager attention (no fused attention kernel): softmax rows per sequence-head."""
    f, j = s.f, s.j
    sx = int(f.eager_example[j])
    if sx < 0 or s.role_count(ROLE_ATTENTION) or s.role_count(ROLE_ATTENTION_AUX):
        return []
    z, lo, hi = int(f.eager_heads[j]), int(f.eager_rows_lo[j]), int(f.eager_rows_hi[j])
    rows = f"{lo}" if lo == hi else f"{lo}..{hi}"
    head = (f"{s.name(sx)} grid {_grid_text(s.k, sx)}: {rows} softmax rows over {z} sequence-heads (grid.z of the "
            f"batched Q.K GEMM before it)")
    if lo > z:
        return [_Vote(PREFILL, MEDIUM, f"{head}: several query rows each => prefill", "eager_attention")]
    if hi < 2 * z:
        return [_Vote(DECODE, MEDIUM, f"{head}: one query row each => decode", "eager_attention")]
    return []


def rule_causal_attention(s: StepView) -> list[_Vote]:
    """Causal attention launches: decoder-LLM evidence (strong), but only a note for a causal
    text tower (no LM head or serving kernel, in a trace with non-LLM steps)."""
    f, j = s.f, s.j
    if not f.causal[j]:
        return []
    by_op = f" ({int(f.causal_from_op[j])} by is_causal=True on their SDPA operator)" if f.causal_from_op[j] else ""
    if f.causal_from_grid[j]:
        by_op += (f" ({int(f.causal_from_grid[j])} by aotriton's causal persistent grid: a multiple of the "
                  f"device's {_cu_count(s.trace)} compute units)")
    backed = (f.lm_head[j] >= 0 and not f.lm_estimated[j]) or f.inference_only[j]
    if backed or not f.non_llm_in_trace:
        return [_Vote(UNKNOWN, STRONG, f"{int(f.causal[j])} causal attention launches{by_op} (decoder-LLM evidence)",
                      "llm")]
    # A diffusion or detection pipeline's causal text tower (CLIP's) reads like a decoder
    # forward without its LM head; next to non-LLM steps, it is not one.
    return [_Vote(UNKNOWN, 0, f"{int(f.causal[j])} causal attention launches{by_op} but no LM head or serving kernel, "
                  f"in a trace with non-LLM steps (non-causal self-attention, convolution): a causal text encoder "
                  f"(CLIP) reads the same; not decoder evidence", "note")]


def rule_serving_kernels(s: StepView) -> list[_Vote]:
    """Inference-only kernels (KV-cache writes, paged/decode attention, samplers): decoder-LLM
    evidence (strong)."""
    n = int(s.f.inference_only[s.j])
    if not n:
        return []
    kinds = sorted({s.sigs[i].label for i in s.present() if s.sigs[i].inference_only})
    return [_Vote(UNKNOWN, STRONG, f"{n} serving-engine kernels ({', '.join(kinds[:3])}) (decoder-LLM evidence)",
                  "llm")]


def rule_lm_head(s: StepView) -> list[_Vote]:
    """An LM-head-wide GEMM: decoder-LLM evidence (weak), or a note where the width may be a
    token-tile multiple or an encoder's MLM head."""
    f, j, k = s.f, s.j, s.k
    if f.lm_head[j] < 0:
        return []
    lm = int(f.lm_head[j])
    width = int(f.lm_width[j])
    how = "from its launch grid and tile" if f.lm_estimated[j] else "from its CPU operator"
    head = f"{s.name(lm)} grid {_grid_text(k, lm)}"
    ua = int(f.causal_unknown_example[j])
    # The LM head's own rows where known (its operator, or the row gather feeding it).
    rows = int(f.lm_rows[j]) if f.lm_rows[j] > 0 else _rows_seen(j, f, s.kc, s.trace)
    tm = int(s.kc.tile_tok[lm])
    if f.lm_estimated[j] and tm > 0 and rows > tm and width // -(-rows // tm) < VOCAB_MIN_COLS:
        # A launch-grid width is N only when the GEMM's rows fit one token-side tile; over
        # R rows it is N x ceil(R / tile). Where the step runs on more rows than a tile,
        # a token-tile count times a narrow N reads as wide: no decoder evidence.
        tiles = -(-rows // tm)
        return [_Vote(UNKNOWN, 0, f"{head}: {width} columns from its launch grid and tile, but the step runs on "
                      f"{rows} rows per GEMM (over {tiles} tiles of {tm}): as likely {width // tiles} columns over "
                      f"all of them; not decoder evidence", "note")]
    if ua >= 0 and not f.causal[j]:
        # An encoder's MLM head is as wide as a decoder's LM head (RoBERTa 50265, mBERT
        # 119547, XLM-R 250002): next to fused attention that could have said it is
        # causal and does not, the width is no decoder evidence.
        return [_Vote(UNKNOWN, 0, f"{head}: {width} output columns ({how}), LM-head wide, but no decoder-LLM "
                      f"evidence: the step's attention ({s.name(ua)}) does not say whether it is causal, and an "
                      f"encoder's MLM head is as wide", "note")]
    return [_Vote(UNKNOWN, WEAK, f"{head}: LM head, {width} output columns ({how}) (decoder-LLM evidence)", "llm")]


def rule_attention_phase(s: StepView) -> list[_Vote]:
    """Attention kernels' phase: name signatures and query-block grids; a decode kernel that
    can run empty is no evidence next to a prefill one; prefill and decode attention side by
    side (>= medium each) => mixed (strong)."""
    att = discount_empty_capable(_signature_attention_votes(s) + _query_block_votes(s), s.sigs)
    pv, dv = _strongest(att, PREFILL), _strongest(att, DECODE)
    if pv is not None and dv is not None and min(pv.strength, dv.strength) >= MEDIUM:
        return [_Vote(MIXED, STRONG, f"prefill and decode attention in one step ({pv.text}; {dv.text}) => mixed",
                      "attention")]
    # Phase votes first, then what says no phase, as notes.
    return [v for v in att if v.phase != UNKNOWN] + [_Vote(UNKNOWN, 0, v.text, "note") for v in att
                                                     if v.phase == UNKNOWN]


def _strongest(votes: list[_Vote], phase: int) -> _Vote | None:
    """The first of the strongest votes for ``phase`` (None without one)."""
    best = None
    for v in votes:
        if v.phase == phase and (best is None or v.strength > best.strength):
            best = v
    return best


def rule_tokens(s: StepView) -> list[_Vote]:
    """Tokens in the step (grid.x of per-token kernels) against the attention launch's
    sequences, else against the LM head's sampled rows (:func:`tokens_alone_votes`); one
    varlen launch with room for one-token decodes gives mixed slots."""
    f, j = s.f, s.j
    tok = _tokens(j, f, s.kc, s.trace)
    if tok is None:
        return []
    t, text, rank = tok
    seqs = attention_sequences(s)
    if t == 1:
        out = [_Vote(DECODE, MEDIUM, f"{text}: one token in the step => decode", "tokens")]
    elif rank == STRONG and seqs > 1 and t == seqs:
        out = [_Vote(DECODE, STRONG, f"{text}: {t} tokens over {seqs} sequences (attention grid.y): one new token per "
                     f"sequence => decode", "tokens")]
    elif rank == STRONG and 0 < seqs < t:
        out = [_Vote(PREFILL, MEDIUM, f"{text}: {t} tokens over {seqs} sequences (attention grid.y): several new "
                     f"tokens per sequence => prefill", "tokens")]
    else:
        g = int(f.lm_rows_gather[j])
        out = tokens_alone_votes(t, text, rank, int(f.lm_rows[j]), not bool(f.split[j]),
                                 rows_from=f" (grid.x of the row gather before it, {s.name(g)} grid "
                                           f"{_grid_text(s.k, g)})" if g >= 0 else "")
    if rank == STRONG and seqs > 1 and t > seqs:
        out += _varlen_mixed_slots(s, t, seqs)
    return _bound_mixed_slots(s, t, out)


# CK's group-mode (varlen) batch prefill over a paged KV cache: the mangled name carries the
# tile (TileFmhaShape<sequence<kM0, kN0, kK0, kN1, kK1, kQKHeaddim>>) and the argument kind.
_CK_GROUP_PREFILL = re.compile(r"FmhaBatchPrefillWithPagedKVCacheKernel.*?TileFmhaShapeINS_\d+sequenceIJ"
                               r"Li(\d+)ELi\d+ELi\d+ELi(\d+)ELi\d+ELi(\d+)E.*FmhaFwdGroupModeKargs")


def ck_group_prefill_bound(s: StepView) -> tuple[int, int, int] | None:
    """(kernel, sequences, longest query bound) of the step's CK group-mode batch-prefill
    launch, None without one. ROCm/composable_kernel
    include/ck_tile/ops/fmha/kernel/fmha_batch_prefill_kernel.hpp (``GridSize``, group mode):
    grid (nhead, batch, ceil(max_seqlen_q / kM0) * ceil(hdim_v / kN1)); hdim_v is taken as
    the name's kQKHeaddim. The MI300X SGLang extend step: grid [32,15,8], tile 128 x ... x 128:
    15 sequences, longest query <= 1024."""
    k = s.k
    for s_i in s.present():
        ex = int(s.f.max_example[s.j, s_i])
        if ex < 0 or k["grid_y"][ex] <= 0 or k["grid_z"][ex] <= 0:
            continue
        m = _CK_GROUP_PREFILL.search(s.trace.names[int(k["name_id"][ex])])
        if m is None:
            continue
        km0, kn1, hdim = (int(x) for x in m.groups())
        tiles_m = int(k["grid_z"][ex]) // max(-(-hdim // max(kn1, 1)), 1)
        if km0 > 0 and tiles_m > 0:
            return ex, int(k["grid_y"][ex]), tiles_m * km0
    return None


def _bound_mixed_slots(s: StepView, tokens: int, votes: list[_Vote]) -> list[_Vote]:
    """One-token-decode slots capped by a varlen launch that bounds the longest query (CK
    group-mode batch prefill): B sequences and T tokens need at least p_min = ceil((T - B) /
    (q_max - 1)) long ones; with p_min = B no sequence can be a one-token decode."""
    if not any(v.cls == "mixed_slots" for v in votes):
        return votes
    bound = ck_group_prefill_bound(s)
    if bound is None:
        return votes
    ex, seqs, q_max = bound
    if seqs <= 0 or tokens < seqs:
        return votes
    p_min = min(-(-(tokens - seqs) // max(q_max - 1, 1)), seqs)
    room = seqs - p_min
    out = []
    for v in votes:
        if v.cls != "mixed_slots":
            out.append(v)
        elif room <= 0:
            out.append(_Vote(UNKNOWN, 0, f"{s.name(ex)} grid {_grid_text(s.k, ex)}: {tokens} tokens over {seqs} "
                             f"sequences, longest query <= {q_max}: every sequence is a prefill, no room for "
                             f"one-token decodes", "note"))
        else:
            out.append(dataclasses.replace(v, value=min(v.value, room)))
    return out


def _varlen_mixed_slots(s: StepView, tokens: int, seqs: int) -> list[_Vote]:
    """One varlen launch over B sequences and T tokens whose longest query is at most
    grid.x * kBlockM: at least p_min sequences carry the T - B extra tokens; the other
    B - p_min may be one-token decodes (decided against the previous step)."""
    ex = int(s.f.qb_example[s.j])
    bm = int(s.kc.block_m[ex]) if s.kc.block_m[ex] > 0 else 128
    q_max = int(s.k["grid_x"][ex]) * bm
    p_min = -(-(tokens - seqs) // max(q_max - 1, 1))
    if p_min >= seqs:
        return []
    return [_Vote(UNKNOWN, 0, f"{tokens} tokens over {seqs} sequences, longest query <= {q_max}: {seqs - p_min} of "
                  f"them may be one-token decodes", "mixed_slots", value=seqs - p_min)]


def rule_sequences(s: StepView) -> list[_Vote]:
    """The attention launch's sequence count, carried as a value (no phase)."""
    seqs = attention_sequences(s)
    return [_Vote(UNKNOWN, 0, f"{seqs} sequences in the attention launch", "seqs", value=seqs)] if seqs > 0 else []


def rule_gemv(s: StepView) -> list[_Vote]:
    """GEMV kernels at least half of the step's GEMMs => decode (strong); a minority is noted."""
    n_gemv, n_gemm = s.role_count(ROLE_GEMV), s.role_count(ROLE_GEMM)
    if not n_gemv:
        return []
    s_i = next(i for i in s.present() if s.sigs[i].role == "gemv")
    ex = int(s.f.max_example[s.j, s_i])
    name = s.name(ex) if ex >= 0 else "GEMV"
    if n_gemv * 2 >= n_gemv + n_gemm:
        return [_Vote(DECODE, STRONG, f"{name} GEMV: {n_gemv} of {n_gemv + n_gemm} GEMMs are matrix-vector => decode",
                      "gemm", s_i)]
    return [_Vote(UNKNOWN, 0, f"{name} GEMV x{n_gemv} among {n_gemv + n_gemm} GEMMs (LM head or small op, not "
                  f"decisive)", "note")]


def rule_gemm_rows(s: StepView) -> list[_Vote]:
    """GEMM rows from the CPU operators: tokens per sequence (medium), else flattened rows
    (weak at <= 16 or >= 512)."""
    f, j = s.f, s.j
    src, texts = s.rows_src
    if f.seq_known[j] and f.seq_example[j] >= 0:
        s_max = int(f.max_seq[j])
        txt = _rows_text(int(f.seq_example[j]), src, texts, s.trace)
        if s_max > 1:
            return [_Vote(PREFILL, MEDIUM, f"{txt}: {s_max} tokens per sequence => prefill", "gemm_rows")]
        if s_max == 1:
            return [_Vote(DECODE, MEDIUM, f"{txt}: one new token per sequence => decode", "gemm_rows")]
        return []
    if f.max_rows[j] <= 0:
        return []
    m = int(f.max_rows[j])
    txt = _rows_text(int(f.rows_example[j]), src, texts, s.trace)
    if m <= 16:
        return [_Vote(DECODE, WEAK, f"{txt}: at most {m} GEMM rows (tokens) => decode-leaning", "gemm_rows")]
    if m >= 512:
        return [_Vote(PREFILL, WEAK, f"{txt}: {m} GEMM rows (tokens) => prefill-leaning", "gemm_rows")]
    return [_Vote(UNKNOWN, 0, f"{txt}: {m} GEMM rows (tokens)", "note")]


def rule_gemm_tiles(s: StepView) -> list[_Vote]:
    """Token-side GEMM tiles: mostly small => decode-leaning, mostly large => prefill-leaning (weak)."""
    tiled = int(s.f.tiled[s.j])
    if not tiled:
        return []
    small, large = int(s.f.small_tile[s.j]), int(s.f.large_tile[s.j])
    if small * 2 > tiled:
        return [_Vote(DECODE, WEAK, f"{small} of {tiled} GEMMs use small tiles (<= {SMALL_TILE} rows/cols) "
                      f"=> decode-leaning", "gemm_tile")]
    if large * 2 > tiled:
        return [_Vote(PREFILL, WEAK, f"{large} of {tiled} GEMMs use large tiles (>= {LARGE_TILE}) => prefill-leaning",
                      "gemm_tile")]
    return []


def rule_training_kernels(s: StepView) -> list[_Vote]:
    """Backward and optimizer kernels => other (strong)."""
    n = s.role_count(ROLE_TRAINING)
    if not n:
        return []
    s_i = next(i for i in s.present() if s.sigs[i].role == "training")
    return [_Vote(OTHER, STRONG, f"{n} training kernels ({s.example_name(s_i)}: {s.sigs[s_i].label}) => other (not "
                  f"inference)", "training", s_i)]


def rule_training_launch(s: StepView) -> list[_Vote]:
    """Kernels launched from autograd/backward/optimizer CPU ops => other (strong)."""
    n = int(s.f.training_launch[s.j])
    if not n:
        return []
    return [_Vote(OTHER, STRONG, f"{n} kernels launched from autograd/backward/optimizer CPU ops => other (not "
                  f"inference)", "training")]


def rule_non_llm_kernels(s: StepView) -> list[_Vote]:
    """Convolution/pooling and embedding-bag kernels => other (medium) unless decoder evidence."""
    n = s.role_count(ROLE_NON_LLM)
    if not n:
        return []
    kinds = [i for i in s.present() if s.sigs[i].role == "non_llm"]
    s_i = max(kinds, key=lambda i: s.f.sig_count[s.j, i])
    labels = " / ".join(s.sigs[i].label for i in kinds)
    return [_Vote(OTHER, MEDIUM, f"{n} non-LLM kernels ({labels}; e.g. {s.example_name(s_i)}) => other (not LLM "
                  f"inference) unless the step shows a decoder LLM", "non_llm", s_i)]


# Every vote rule, in the order their votes are listed (the order evidence texts appear in
# a step's evidence; :func:`_decide` reads the votes, not the order, except that the first
# vote of the deciding kind is quoted first). Registered here explicitly: a rule not in this
# list is not run.
VOTE_RULES: tuple[tuple[str, VoteRule], ...] = (
    ("noncausal_attention", rule_noncausal_attention),
    ("eager_attention", rule_eager_attention),
    ("causal_attention", rule_causal_attention),
    ("serving_kernels", rule_serving_kernels),
    ("lm_head", rule_lm_head),
    ("attention_phase", rule_attention_phase),
    ("tokens", rule_tokens),
    ("sequences", rule_sequences),
    ("gemv", rule_gemv),
    ("gemm_rows", rule_gemm_rows),
    ("gemm_tiles", rule_gemm_tiles),
    ("training_kernels", rule_training_kernels),
    ("training_launch", rule_training_launch),
    ("non_llm_kernels", rule_non_llm_kernels),
)


def _step_votes(j: int, f: _StepFacts, trace: Trace, kc: KernelClasses, rows_src: tuple) -> list[_Vote]:
    """Votes of step ``j``: every rule of :data:`VOTE_RULES` in order."""
    view = StepView(j, f, trace, kc, rows_src)
    return [v for _, rule in VOTE_RULES for v in rule(view)]


# aotriton's attention forward: the kernel symbol is plain ``attn_fwd``.
_AOTRITON_ATTN_FWD = re.compile(r"^attn_fwd$")
# Non-causal persistent launches size their grid on 80 "CUs" (aotriton attn_fwd.cc).
AOTRITON_NONCAUSAL_CUS = 80


def _cu_count(trace: Trace) -> int:
    counts = {int(d.sm_count) for d in trace.devices if isinstance(d.sm_count, int) and d.sm_count > 0}
    return counts.pop() if len(counts) == 1 else 0


def aotriton_causal_grid(trace: Trace, kc: KernelClasses, idx: np.ndarray) -> np.ndarray:
    """Per kernel of ``idx``: an aotriton ``attn_fwd`` launch whose grid says it is causal.

    ROCm/aotriton v2src/flash/attn_fwd.cc @ 22c35371 (``_attn_fwd_common``): the regular grid
    is (query blocks, heads, batch); a persistent kernel (PERSISTENT_TYPE != 0, a tuning
    choice) gets (min(Num_CU * GRID_CU_MULTIP, blocks x heads x batch), 1, 1) with ``Num_CU =
    is_causal ? getMultiProcessorCount(stream) : 80``. A one-dimensional grid (heads > 1 in
    every real model, so not the regular one) that is a multiple of the device's compute
    units and not of 80 is a causal launch (the MI300X HF Qwen forward: [608,1,1] = 2 x 304
    CUs). Unknown device CU count: nothing. Only "causal" is read: a non-causal launch can
    be cut by the block count."""
    k = trace.kernels
    cu = _cu_count(trace)
    out = np.zeros(len(idx), dtype=bool)
    if cu <= 0 or cu % AOTRITON_NONCAUSAL_CUS == 0 or not len(idx):
        return out
    nid = k["name_id"][idx]
    lut = _names_matching(trace, nid, _AOTRITON_ATTN_FWD)
    gx = k["grid_x"][idx].astype(np.int64)
    out = lut[nid] & (k["grid_y"][idx] == 1) & (k["grid_z"][idx] == 1) & (gx > 0) & (gx % cu == 0) \
        & (gx % AOTRITON_NONCAUSAL_CUS != 0)
    return out


def aotriton_regular_grid(trace: Trace, kc: KernelClasses, idx: np.ndarray) -> np.ndarray:
    """Per kernel of ``idx``: an aotriton ``attn_fwd`` launch on its regular grid (query
    blocks, heads, batch), which since aotriton 0.9b only a non-causal launch gets.

    ROCm/aotriton 3f9310c9 ("Enable Persistent Dynamic for Causal if input is not varlen",
    0.9b); at c951ffa1 ``v2python/rules/flash/attn_fwd.py`` L119 ``PERF_CHOICES``
    ``PERSISTENT_TYPE: _IF_CAUSAL(2)`` (every causal kernel is persistent-dynamic, every
    other one 0; at 30ae9671 ``modules/flash/aot/attn_fwd.py`` L159 ``derives('PERSISTENT_TYPE',
    to=2, when=ne('CAUSAL_TYPE', 0))``), and ``v2src/flash/attn_fwd.cc`` L60-66: the regular
    grid ``{nblocks, Q->size(1), Batch}`` only when ``PERSISTENT_TYPE == 0`` or the input is
    varlen, else the one-dimensional ``{min(Num_CU * GRID_CU_MULTIP, ...), 1, 1}``. So a
    launch with grid.y > 1 (heads) is not causal, except a varlen one (PyTorch's nested or
    varlen attention, not its dense SDPA call), one of aotriton before 0.9b, or vLLM's own
    Triton kernel of the same name (vllm-project/vllm @ bed874fa
    ``vllm/attention/ops/triton_flash_attention.py`` ``_attention.forward``: the grid
    (query blocks, heads, batch) causal or not) (stated limits, docs/phases.md)."""
    k = trace.kernels
    if not len(idx):
        return np.zeros(0, dtype=bool)
    nid = k["name_id"][idx]
    lut = _names_matching(trace, nid, _AOTRITON_ATTN_FWD)
    return lut[nid] & (k["grid_x"][idx] > 0) & (k["grid_y"][idx] > 1) & (k["grid_z"][idx] > 0)


def discount_empty_capable(att_votes: list[_Vote], sigs: list[Signature]) -> list[_Vote]:
    """Decode-attention votes of kernels that can run empty (``runs_empty`` signatures) are no
    evidence next to a prefill attention kernel: vLLM's chunked_prefill_paged_decode (ROCm
    and Triton backends) launches its decode kernel over every sequence after the prefill
    part, whether or not the batch holds a decode (programs of longer queries return). Such a
    vote becomes a note; a step with only that kernel (no prefill part launched) stays decode."""
    if not any(v.phase == PREFILL and v.strength >= MEDIUM for v in att_votes):
        return att_votes
    out = []
    for v in att_votes:
        if v.phase == DECODE and v.sig >= 0 and sigs[v.sig].runs_empty:
            out.append(_Vote(UNKNOWN, 0, f"{v.text.split(' => ')[0]}: launched over every sequence next to the "
                             f"prefill attention, it can run empty: not decode evidence by itself", "note", v.sig))
        else:
            out.append(v)
    return out


# KV-cache writes over at least this many tokens are prefill-sized, as GEMM rows are (the
# CPU-operator rule above: >= 512 rows => prefill-leaning); a decode batch that large is
# possible (a stated limit), hence only a weak vote, which needs a second weak class (GEMM
# tiles) to decide.
PREFILL_MIN_TOKENS = 512


def tokens_alone_votes(tokens: int, text: str, rank: int, sampled_rows: int, unsplit: bool,
                       rows_from: str = "") -> list[_Vote]:
    """Votes from a step's token count (``tokens``, from the grid of its per-token kernels;
    ``rank`` the family's strength) when the attention launch does not give the sequences.

    ``sampled_rows``: the LM head's rows from its CPU operator, else from the row gather
    feeding it (``rows_from`` names that gather in the text; -1 unknown): one row per
    sequence sampled (vLLM V1 computes logits at each request's last scheduled token,
    SGLang likewise; a speculative verify step samples every token). Tokens equal to the
    sampled rows: one new token per sequence => decode; more tokens than rows: several per
    sequence => prefill, where up to rows - 1 sequences may be one-token decodes (mixed when
    the step continues a running batch, :func:`mixed_by_continuity`). Without sampled rows,
    a KV-cache write over PREFILL_MIN_TOKENS or more with no split-KV combine in the step
    (``unsplit``) is prefill-leaning (weak)."""
    if rank == STRONG and sampled_rows > 0:
        if tokens == sampled_rows:
            return [_Vote(DECODE, MEDIUM, f"{text}: {tokens} tokens and the LM head samples {sampled_rows} rows"
                          f"{rows_from}: one new token per sequence => decode", "tokens")]
        if tokens > sampled_rows:
            out = [_Vote(PREFILL, MEDIUM, f"{text}: {tokens} tokens and the LM head samples {sampled_rows} rows"
                         f"{rows_from}: several new tokens per sequence => prefill", "tokens")]
            if sampled_rows > 1:
                out.append(_Vote(UNKNOWN, 0, f"{tokens} tokens over {sampled_rows} sampled sequences: up to "
                                 f"{sampled_rows - 1} of them may be one-token decodes", "mixed_slots",
                                 value=sampled_rows - 1))
            return out
    if rank == STRONG and unsplit and tokens >= PREFILL_MIN_TOKENS:
        return [_Vote(PREFILL, WEAK, f"{text}: {tokens} tokens in the step and no split-KV combine => "
                      f"prefill-leaning", "tokens")]
    return [_Vote(UNKNOWN, 0, f"{text}: {tokens} tokens in the step", "tokens")]


def _rows_seen(j: int, f: _StepFacts, kc: KernelClasses, trace: Trace) -> int:
    """Rows the step's GEMMs run on, as far as its kernels tell (0: unknown): the most of the
    tokens of its per-token kernels (grid.x), the rows of its layer norms and the query rows
    per sequence-head of its eager attention softmax."""
    tok = _tokens(j, f, kc, trace)
    rows = max(tok[0] if tok is not None else 0, int(f.norm_rows[j]))
    if f.eager_example[j] >= 0 and f.eager_heads[j] > 0:
        rows = max(rows, int(f.eager_rows_lo[j]) // int(f.eager_heads[j]))
    return rows


def _rows_text(kernel_index: int, src: np.ndarray, texts: list[str], trace: Trace) -> str:
    """Evidence text naming the CPU op and input dims behind a GEMM-rows vote."""
    t = int(src[kernel_index]) if kernel_index >= 0 else -1
    if t >= 0:
        return texts[t]
    return f"{short_name(trace.names[int(trace.kernels['name_id'][kernel_index])])} (CPU op dims)"


def _tokens(j: int, f: _StepFacts, kc: KernelClasses, trace: Trace) -> tuple[int, str, int] | None:
    """Tokens in step j from per-token kernels (grid.x), strongest family first: (tokens,
    evidence text, strength of the family)."""
    best = None
    for s_i in np.flatnonzero(f.sig_count[j]).tolist():
        s = kc.signatures[s_i]
        if s.grid_rule != "tokens":
            continue
        ex = int(f.max_example[j, s_i])
        if ex < 0 or trace.kernels["grid_x"][ex] <= 0:
            continue
        gmax, gmin = int(trace.kernels["grid_x"][ex]), int(f.min_gx[j, s_i])
        rank = {"strong": 3, "medium": 2, "weak": 1}[s.strength]
        name = short_name(trace.names[int(trace.kernels["name_id"][ex])])
        text = (f"{name} grid {_grid_text(trace.kernels, ex)}" if gmin == gmax
                else f"{name} grid.x {gmin}..{gmax}")
        if best is None or rank > best[0]:
            best = (rank, gmax, text)
    return (best[1], best[2], best[0]) if best else None


def query_block_tokens(j: int, f: _StepFacts, kc: KernelClasses, trace: Trace) -> tuple[int, str] | None:
    """An estimate of the tokens of prefill step ``j`` that has no per-token kernel and no
    GEMM rows, from its widest query-block attention launch with a known block height:
    FlashAttention-2's grid (num_m_block, batch, heads) with num_m_block = ceil(seqlen_q /
    kBlockM) (flash_fwd_launch_template.h ``grid(num_m_block, b, h)``; kBlockM from
    ``Flash_fwd_kernel_traits<hdim, kBlockM, ...>``): batch x (num_m_block - 1/2) x kBlockM,
    the middle of the range the grid allows when the batch's sequences are equally long (a
    padded batch, as Hugging Face runs). None without such a launch."""
    ex = int(f.qb_example[j])
    if ex < 0:
        return None
    k = trace.kernels
    bm, gx, gy = int(kc.block_m[ex]), int(k["grid_x"][ex]), int(k["grid_y"][ex])
    if bm <= 0 or gx <= 0 or gy <= 0:
        return None
    t = gy * (gx * bm - bm // 2)
    lo, hi = gy * ((gx - 1) * bm + 1), gy * gx * bm
    name = short_name(trace.names[int(k["name_id"][ex])])
    return t, (f"{name} grid {_grid_text(k, ex)}: about {t} tokens (an estimate: {gy} sequences of {gx} query "
               f"blocks of {bm} rows, {lo}..{hi} tokens if equally long)")


def _decide(votes: list[_Vote], training_context: str | None) -> tuple[int, list[_Vote], str | None]:
    """Label from votes. Returns (phase, deciding votes, conflict text or None).

    ``training_context``: set when the step's device runs a training loop elsewhere in the
    trace and the step holds no inference-only kernel; the step is then "other".

    Prefill, decode and mixed need evidence of a decoder LLM (class "llm"): strong (causal
    attention, a serving-engine kernel: KV-cache write, paged/decode attention, sampler) or
    weak (an LM-head-wide GEMM), the weak kind only when the step shows no non-LLM evidence
    (non-causal self-attention, convolution/pooling): an encoder's MLM head is vocabulary-wide
    too, and a width estimated from a launch grid can be a wide GEMM over many rows. Without
    it a step with non-LLM evidence is "other", anything else "unknown".
    """
    other = [v for v in votes if v.phase == OTHER and v.strength >= STRONG]
    if other:
        return OTHER, other, None
    inf = [v for v in votes if v.phase in (PREFILL, DECODE, MIXED)]
    if training_context:
        return OTHER, [_Vote(OTHER, MEDIUM, training_context, "training")], None
    llm = [v for v in votes if v.cls == "llm"]
    noncausal = [v for v in votes if v.cls == "noncausal"]
    non_llm = noncausal + [v for v in votes if v.phase == OTHER and v.cls != "noncausal"]
    if not any(v.strength >= STRONG for v in llm) and (non_llm or not llm):
        if non_llm:
            return OTHER, non_llm, None
        if inf:
            best = max(inf, key=lambda v: v.strength)
            return UNKNOWN, [], (f"no decoder-LLM evidence (causal attention, KV-cache write, paged KV attention, "
                                 f"sampler, LM head) for {best.text} => unknown")
        return UNKNOWN, [], None
    firm = [v for v in inf if v.strength >= MEDIUM]
    mixed = [v for v in firm if v.phase == MIXED]
    if mixed:
        return MIXED, mixed, None
    dirs = {v.phase for v in firm}
    if len(dirs) > 1:
        pv = max((v for v in firm if v.phase == PREFILL), key=lambda v: v.strength)
        dv = max((v for v in firm if v.phase == DECODE), key=lambda v: v.strength)
        return UNKNOWN, [], f"conflicting evidence: {pv.text} / {dv.text} => unknown"
    if dirs:
        ph = dirs.pop()
        return ph, sorted((v for v in firm if v.phase == ph), key=lambda v: -v.strength), None
    weak = [v for v in inf if v.strength == WEAK]
    wdirs = {v.phase for v in weak}
    if len(wdirs) == 1 and len({v.cls for v in weak}) >= 2:
        ph = wdirs.pop()
        return ph, weak, None
    return UNKNOWN, [], None


# ---------------------------------------------------------------------------------------------

def fold_nested_annotations(hit: np.ndarray, starts_ns: np.ndarray, ends_ns: np.ndarray, pids: np.ndarray,
                            tids: np.ndarray) -> tuple[np.ndarray, dict[int, list[int]]]:
    """Per kernel, the CPU step annotation it is mapped to (``hit``, -1 none), with nested
    annotations of one thread folded into one: every range of a nesting group
    (:func:`aggregator.steps.enclosing_roots`) maps to the member holding the most kernels
    (the engine's own step range; earliest on ties). Returns the new mapping and, per kept
    range, the ranges folded into it."""
    root = enclosing_roots(starts_ns, ends_ns, pids, tids)
    n = len(root)
    if not n or bool((root == np.arange(n)).all()):
        return hit, {}
    n_of = np.bincount(hit[hit >= 0], minlength=n)
    # Per group: the member with the most kernels (earliest index on ties) is the first of
    # the (group, -kernels, index) order.
    o = np.lexsort((np.arange(n), -n_of, root))
    first = np.r_[True, root[o][1:] != root[o][:-1]]
    best_of_root = np.empty(n, dtype=np.int64)
    best_of_root[root[o][first]] = o[first]
    rep = best_of_root[root]
    folded: dict[int, list[int]] = {}
    for i in np.flatnonzero(rep != np.arange(n)).tolist():     # only the nested ranges
        folded.setdefault(int(rep[i]), []).append(i)
    out = np.where(hit >= 0, rep[np.maximum(hit, 0)], -1).astype(hit.dtype)
    return out, folded


def _merge_gpu_copies(trace: Trace, sel: np.ndarray):
    """GPU-side copies of one annotation (one per stream) merged: (name_id, ext, device) -> span."""
    r = trace.ranges[sel]
    if not len(r):
        return [], np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int32), []
    key = np.stack([r["name_id"].astype(np.int64), r["external_id"], r["device"].astype(np.int64)], axis=1)
    # A missing external id must not merge distinct ranges: give each its own key.
    key[:, 1] = np.where(r["external_id"] >= 0, r["external_id"], -1 - np.arange(len(r)))
    uk, inv = np.unique(key, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    starts = np.full(len(uk), np.iinfo(np.int64).max, dtype=np.int64)
    ends = np.full(len(uk), np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(starts, inv, r["start_ns"])
    np.maximum.at(ends, inv, r["end_ns"])
    return [int(x) for x in uk[:, 0]], starts, ends, uk[:, 2].astype(np.int32), [int(x) for x in uk[:, 1]]


def map_phases(trace: Trace, use_annotations: bool = True, *, first_step_ns: Mapping[int, int] | None = None,
               first_step_unknown_history: bool = True,
               previous_layers: dict[int, list[LayerStep]] | None = None) -> PhaseMap:
    """Label every step and kernel of ``trace`` (see the module docstring for the method).

    ``use_annotations=False`` ignores every range (engine annotations, NVTX, ProfilerStep)
    and decides from kernel events (and CPU operators) alone. ``first_step_ns``: per device,
    the start of the earliest step seen elsewhere (a stream's previous batches): a step here
    that starts after it is not the first of the recording; ``first_step_unknown_history=False``:
    no step here is (a piece of a stream mapped alone). See :func:`mixed_by_continuity`.
    ``previous_layers``: per device, the last steps of a stream's earlier batches (read and
    updated, :func:`same_layers_by_continuity`).
    """
    kc = classify_kernels(trace)
    launch = launch_index(trace)
    # 1. Engine step annotations (and ProfilerStep windows as weak boundaries).
    if use_annotations and len(trace.ranges) and len(trace.kernels):
        kernel_step, steps, ann_of_step, hint = _annotation_steps(trace, launch)
    else:
        kernel_step, steps, ann_of_step, hint = np.full(len(trace.kernels), -1, dtype=np.int32), [], {}, None
    # 2. The kernels left over, cut into steps from the kernels alone.
    boundary = _kernel_segment_steps(trace, kc, launch, kernel_step, steps, hint)
    kernel_step, steps, ann_of_step, boundary = _in_time_order(kernel_step, steps, ann_of_step, boundary)
    # 3. Each step's own evidence, its label and tokens; then mixed by continuity.
    decisive_sig = _label_steps(trace, kc, launch, kernel_step, steps, ann_of_step, boundary)
    same_layers_by_continuity(trace, kc, kernel_step, steps, previous_layers)
    mixed_by_continuity(steps, first_step_ns=first_step_ns, first_step_unknown_history=first_step_unknown_history)
    return _kernel_arrays(kc, kernel_step, steps, decisive_sig)


def _annotation_steps(trace: Trace, launch: np.ndarray):
    """Layer 1: one step per (engine step annotation, device) that holds kernels (GPU-side
    ranges first, then CPU ranges by launch correlation; nested annotations of one step
    folded), and the ProfilerStep windows as a weak per-kernel hint for the kernels left
    over. Returns (kernel_step, steps, annotation of each step, hint or None)."""
    k = trace.kernels
    names = trace.names
    kernel_step = np.full(len(k), -1, dtype=np.int32)
    steps: list[Step] = []
    ann_of_step: dict[int, tuple[StepAnnotation, str]] = {}
    hint = None
    r = trace.ranges
    parsed: dict[int, StepAnnotation] = {}
    for i in np.unique(r["name_id"][r["name_id"] >= 0]).tolist():
        text = names[i]
        if not _is_profiler_step(text) and len(text) < 512:
            a = parse_step_annotation(text)
            if a is not None:
                parsed[i] = a
    ann_ids = np.fromiter(parsed, dtype=np.int64, count=len(parsed))
    kinds = (RANGE_GPU_ANNOTATION, RANGE_USER_ANNOTATION, RANGE_NVTX)
    named = np.isin(r["kind"], kinds) & np.isin(r["name_id"], ann_ids)
    gpu_sel = np.flatnonzero(named & (r["device"] >= 0))
    # CPU-side ranges map the kernels the GPU-side copies do not hold (a range without a
    # GPU copy, or kernels the copy's window misses) by launch correlation.
    cpu_sel = np.flatnonzero(named & (r["device"] < 0))
    name_ids, g_start, g_end, g_dev, g_ext_ids = _merge_gpu_copies(trace, gpu_sel)
    hit_gpu = kernels_in_gpu_ranges(trace, g_start, g_end, g_dev)
    free = hit_gpu < 0
    hit_cpu = kernels_in_cpu_ranges(trace, r["start_ns"][cpu_sel], r["end_ns"][cpu_sel], r["pid"][cpu_sel],
                                    r["tid"][cpu_sel], launch=launch, candidates=free)
    hit_cpu, folded = fold_nested_annotations(hit_cpu, r["start_ns"][cpu_sel], r["end_ns"][cpu_sel],
                                              r["pid"][cpu_sel], r["tid"][cpu_sel])
    # One step per (range, device) that holds kernels.
    # One step per (annotation, device): the GPU-side copy and the CPU range of one
    # annotation (same name and external id) are the same step.
    g_ext = np.asarray(g_ext_ids, dtype=np.int64)
    c_ext = np.where(r["external_id"][cpu_sel] >= 0, r["external_id"][cpu_sel], -(10 ** 12) - np.arange(len(cpu_sel)))
    step_of_key: dict[tuple[int, int, int], int] = {}
    for src, hits, nid_of, ext_of in (("GPU-side range", hit_gpu, lambda h: name_ids[h], lambda h: int(g_ext[h])),
                                      ("CPU range, kernels by launch correlation", hit_cpu,
                                       lambda h: int(r["name_id"][cpu_sel[h]]), lambda h: int(c_ext[h]))):
        on = np.flatnonzero(hits >= 0)
        if not len(on):
            continue
        # (range, device) pairs as one int64 key: 1-D unique is far cheaper than axis=0.
        dev_of = k["device"][on].astype(np.int64)
        dmin = int(dev_of.min())
        span = int(dev_of.max()) - dmin + 1
        ukey, inv = np.unique(hits[on].astype(np.int64) * span + (dev_of - dmin), return_inverse=True)
        inv = inv.reshape(-1)
        up = np.stack([ukey // span, ukey % span + dmin], axis=1)
        first = np.full(len(up), np.iinfo(np.int64).max, dtype=np.int64)
        last = np.full(len(up), np.iinfo(np.int64).min, dtype=np.int64)
        np.minimum.at(first, inv, k["start_ns"][on])
        np.maximum.at(last, inv, k["end_ns"][on])
        idx_of_u = np.empty(len(up), dtype=np.int32)
        for u, (h, dev) in enumerate(up.tolist()):
            nid = nid_of(h)
            key = (nid, ext_of(h), int(dev))
            j = step_of_key.get(key)
            if j is not None:
                st = steps[j]
                st.start_ns, st.end_ns = min(st.start_ns, int(first[u])), max(st.end_ns, int(last[u]))
                if src.startswith("CPU") and "some kernels" not in st.evidence[0]:
                    st.evidence[0] = st.evidence[0][:-1] + "; some kernels by CPU range and launch correlation)"
            else:
                text = names[nid]
                ann = parsed[nid]
                j = len(steps)
                steps.append(Step(index=j, start_ns=int(first[u]), end_ns=int(last[u]), device=int(dev),
                                  phase=ann.phase, prefill_tokens=ann.prefill_tokens,
                                  decode_tokens=ann.decode_tokens, evidence=[ann.describe(text) + f" ({src})"],
                                  source="annotation", sequences=ann.sequences))
                ann_of_step[j] = (ann, text)
                step_of_key[key] = j
                if src.startswith("CPU"):
                    for fo in folded.get(int(h), []):
                        steps[j].evidence.append(f"enclosing annotation {names[int(r['name_id'][cpu_sel[fo]])]} "
                                                 f"is the same engine step (its kernels are in this step)")
            idx_of_u[u] = j
        kernel_step[on] = idx_of_u[inv]
    # ProfilerStep ranges: weak boundaries for the kernels left over.
    ps_ids = np.array([i for i in np.unique(r["name_id"][r["name_id"] >= 0]).tolist()
                       if _is_profiler_step(names[i])], dtype=np.int64)
    ps_sel = np.flatnonzero(np.isin(r["kind"], (RANGE_GPU_ANNOTATION, RANGE_USER_ANNOTATION, RANGE_PROFILER_STEP))
                            & np.isin(r["name_id"], ps_ids))
    if len(ps_sel):
        gp = ps_sel[r["device"][ps_sel] >= 0]
        cp = ps_sel[r["device"][ps_sel] < 0]
        _, p_start, p_end, p_dev, _ = _merge_gpu_copies(trace, gp)
        hint = kernels_in_gpu_ranges(trace, p_start, p_end, p_dev).astype(np.int64)
        # Kernels between GPU-side windows form their own groups (-2 - preceding window
        # position): a window edge on the GPU timeline is a real boundary. -1 stays
        # "no information" (devices without GPU-side windows, CPU-mapped misses).
        for dev in np.unique(p_dev).tolist():
            w = np.sort(p_start[p_dev == dev])
            out = np.flatnonzero((hint < 0) & (k["device"] == dev))
            hint[out] = -2 - np.searchsorted(w, k["start_ns"][out], side="right")
        rest = hint == -1
        hc = kernels_in_cpu_ranges(trace, r["start_ns"][cp], r["end_ns"][cp], r["pid"][cp], r["tid"][cp],
                                   launch=launch, candidates=rest)
        hint[rest & (hc >= 0)] = len(p_start) + hc[rest & (hc >= 0)]
    return kernel_step, steps, ann_of_step, hint


def _kernel_segment_steps(trace: Trace, kc: KernelClasses, launch: np.ndarray, kernel_step: np.ndarray,
                          steps: list[Step], hint: np.ndarray | None) -> list[str]:
    """Layer 2: the kernels no annotation holds, cut into steps (:func:`segment_kernels`),
    appended to ``steps`` and numbered in ``kernel_step`` (both updated in place). Returns per
    step why a kernel segment starts where it does ("" for annotated steps)."""
    leftover = kernel_step < 0
    seg = segment_kernels(trace, kc, mask=leftover, hint=hint, launch=launch)
    base = len(steps)
    boundary = [""] * base          # per step: why a kernel segment starts where it does
    for i, sgm in enumerate(seg.segments):
        steps.append(Step(index=base + i, start_ns=sgm.start_ns, end_ns=sgm.end_ns, device=sgm.device, phase=UNKNOWN,
                          evidence=[], source="kernels"))
        boundary.append(sgm.reasons[0] if sgm.reasons else "")
    kernel_step[leftover] = np.where(seg.kernel_step[leftover] >= 0, seg.kernel_step[leftover] + base, -1)
    return boundary


def _in_time_order(kernel_step: np.ndarray, steps: list[Step], ann_of_step: dict, boundary: list[str]):
    """Steps renumbered in time order (annotation steps were made per range name, segments
    per device), with the per-kernel step ids, annotations and boundaries that go with them."""
    order = np.lexsort((np.arange(len(steps)), np.array([st.device for st in steps], dtype=np.int64),
                        np.array([st.start_ns for st in steps], dtype=np.int64)))
    new_index = np.empty(len(steps) + 1, dtype=np.int32)
    new_index[order] = np.arange(len(steps), dtype=np.int32)
    new_index[len(steps)] = -1
    kernel_step = new_index[np.where(kernel_step >= 0, kernel_step, len(steps))]
    ann_of_step = {int(new_index[i]): v for i, v in ann_of_step.items()}
    steps = [steps[i] for i in order.tolist()]
    boundary = [boundary[i] for i in order.tolist()]
    for i, st in enumerate(steps):
        st.index = i
    return kernel_step, steps, ann_of_step, boundary


def _decision(votes: list[_Vote], ctx: str | None) -> tuple:
    """A step's label from its votes (:func:`_decide`) with its evidence list, deciding
    items first: (phase, deciding votes, conflict text or None, evidence, deciding signature)."""
    ph, dec, conflict = _decide(votes, ctx)
    if conflict:
        ev = [conflict]
    elif dec:
        ev = [v.text for v in dec]
    else:
        ev = ["no phase evidence in the step's kernels => unknown"]
    used = set(ev)
    ev.extend(v.text for v in votes if v.text not in used and v.text not in (conflict or ""))
    sig = next((v.sig for v in dec if v.sig >= 0), -1) if dec and not conflict else -1
    return ph, dec, conflict, ev, sig


def _note_kernel_evidence(st: Step, ann: StepAnnotation, decision: tuple, tok: tuple | None) -> None:
    """An annotated step keeps its label; its kernel evidence is recorded as agreement or
    disagreement, and a per-token grid.x that differs from the annotation's token total."""
    ph, dec, conflict, _, _ = decision
    if conflict:
        st.evidence.append(f"kernel evidence inconclusive: {conflict}")
    elif dec and ph == st.phase:
        st.evidence.append("kernel evidence agrees: " + "; ".join(v.text for v in dec[:3]))
    elif dec:
        st.evidence.append(f"kernel evidence alone would say {PHASE_NAMES[ph]}: "
                           + "; ".join(v.text for v in dec[:3]) + " (annotation kept)")
    if tok is not None and ann.prefill_tokens is not None and ann.decode_tokens is not None:
        total = (ann.prefill_tokens or 0) + (ann.decode_tokens or 0)
        if tok[0] != total:
            st.evidence.append(f"{tok[1]}: {tok[0]} tokens vs {total} in the annotation")


def _set_step_tokens(st: Step, tok: tuple | None, facts: _StepFacts, kc: KernelClasses, trace: Trace) -> None:
    """A kernel step's tokens: the per-token kernels' grid.x, else its GEMM rows, else (a
    prefill) the estimate from its attention's query blocks (noted in its evidence)."""
    t = tok[0] if tok is not None else None
    if t is None and facts.max_rows[st.index] > 0 and st.phase in (PREFILL, DECODE):
        t = int(facts.max_rows[st.index])
    if t is None and st.phase == PREFILL:
        qt = query_block_tokens(st.index, facts, kc, trace)
        if qt is not None:
            t = qt[0]
            st.evidence.append(qt[1])
    if st.phase in (PREFILL, DECODE, MIXED):
        st.tokens = t
    if st.phase == PREFILL:
        st.prefill_tokens, st.decode_tokens = t, (0 if t is not None else None)
    elif st.phase == DECODE:
        st.prefill_tokens, st.decode_tokens = (0 if t is not None else None), t


def _label_steps(trace: Trace, kc: KernelClasses, launch: np.ndarray, kernel_step: np.ndarray, steps: list[Step],
                 ann_of_step: dict, boundary: list[str]) -> np.ndarray:
    """Layer 3: every step's kernel evidence (votes once per group of steps with identical
    facts), its label and token counts for kernel steps; agreement or disagreement recorded
    on annotated ones. Updates ``steps`` in place; returns per step the signature that
    carried its deciding vote (-1 none)."""
    facts, rows_at, rows_texts, trained = _evidence_facts(trace, kc, launch, kernel_step, len(steps))
    training_ctx = _training_context(trace, kc, trained)
    counts = np.bincount(kernel_step[kernel_step >= 0], minlength=len(steps))
    decisive_sig = np.full(len(steps), -1, dtype=np.int32)
    # Votes depend only on a step's facts: computed once per group of steps with identical
    # facts (a serving trace repeats a few step shapes thousands of times).
    group, rep = facts.group_of_steps(trace, rows_at)
    group_votes = [_step_votes(int(j), facts, trace, kc, (rows_at, rows_texts)) for j in rep.tolist()]
    group_tok = [_tokens(int(j), facts, kc, trace) for j in rep.tolist()]
    decided: dict[tuple[int, str | None], tuple] = {}
    for st, g in zip(steps, group.tolist()):
        st.kernels = int(counts[st.index])
        ctx = None if st.source == "annotation" or facts.inference_only[st.index] \
            else training_ctx.get(st.device)
        if (g, ctx) not in decided:
            decided[(g, ctx)] = _decision(group_votes[g], ctx)
        decision = decided[(g, ctx)]
        if st.source == "annotation":
            _note_kernel_evidence(st, ann_of_step[st.index][0], decision, group_tok[g])
            continue
        st.phase, st.evidence = decision[0], st.evidence + list(decision[3])
        decisive_sig[st.index] = decision[4]
        _set_step_tokens(st, group_tok[g], facts, kc, trace)
        if boundary[st.index]:
            st.evidence.append(f"step starts: {boundary[st.index]}")
        st.mixed_slots = _vote_value(group_votes[g], "mixed_slots")
    return decisive_sig


def _kernel_arrays(kc: KernelClasses, kernel_step: np.ndarray, steps: list[Step], decisive_sig: np.ndarray) -> PhaseMap:
    """The per-kernel phase and evidence codes of the labelled steps: a kernel cites its own
    signature when it carried its step's deciding vote, else its step's deciding evidence."""
    phase_of_step = np.array([s.phase for s in steps] + [UNKNOWN], dtype=np.uint8)
    look = np.where(kernel_step >= 0, kernel_step, len(steps))
    kernel_phase = phase_of_step[look]
    evidence_names: list[str] = ["in no step (no annotation range or kernel segment holds it)"]
    evidence_names += [f"step {st.index} {PHASE_NAMES[st.phase]}: {st.evidence[0]}" for st in steps]
    step_code = np.r_[np.arange(1, len(steps) + 1, dtype=np.int32), 0]      # step i -> evidence_names[i + 1]
    kernel_evidence = step_code[look]
    kernel_evidence[kernel_step < 0] = 0
    # Kernels whose own signature carried the step's deciding vote cite themselves.
    own = (kernel_step >= 0) & (kc.sig >= 0)
    own &= kc.sig == np.r_[decisive_sig, -2][look]
    if own.any():
        width = len(kc.signatures) + 1
        pair_keys, inv = np.unique(kernel_step[own].astype(np.int64) * width + kc.sig[own], return_inverse=True)
        first_code = len(evidence_names)
        evidence_names += [f"{kc.signatures[s_i].label}: {steps[stp].evidence[0]} (step {stp})"
                           for stp, s_i in zip((pair_keys // width).tolist(), (pair_keys % width).tolist())]
        kernel_evidence[own] = first_code + inv.reshape(-1)
    return PhaseMap(steps=steps, kernel_phase=kernel_phase, kernel_step=kernel_step,
                    kernel_evidence=kernel_evidence.astype(np.int32), evidence_names=evidence_names)


def _evidence_facts(trace: Trace, kc: KernelClasses, launch: np.ndarray, kernel_step: np.ndarray, n_steps: int):
    """Per-step facts of the steps of ``kernel_step``, with the GEMM-rows texts and the
    per-kernel training-launch flags they were computed from."""
    rows, seq, rows_at, rows_texts, cols = _gemm_rows(trace)
    width, width_est = _gemm_width(trace, kc, cols)
    trained = _training_launched(trace, launch)
    facts = _StepFacts(trace, kc, kernel_step, n_steps, rows, seq, trained, width, width_est, _op_causal(trace))
    return facts, rows_at, rows_texts, trained


def step_views(trace: Trace, kernel_step: np.ndarray | None = None) -> list[StepView]:
    """What the vote rules read about each step of ``kernel_step`` (int per kernel, -1 in no
    step; default: every kernel in one step), as :func:`map_phases` computes it: for running
    one rule of :data:`VOTE_RULES` alone on a step."""
    if kernel_step is None:
        kernel_step = np.zeros(len(trace.kernels), dtype=np.int32)
    kernel_step = np.asarray(kernel_step, dtype=np.int32)
    n_steps = int(kernel_step.max()) + 1 if len(kernel_step) else 0
    kc = classify_kernels(trace)
    facts, rows_at, rows_texts, _ = _evidence_facts(trace, kc, launch_index(trace), kernel_step, n_steps)
    return [StepView(j, facts, trace, kc, (rows_at, rows_texts)) for j in range(n_steps)]


def _vote_value(votes: list[_Vote], cls: str) -> int:
    return next((v.value for v in votes if v.cls == cls), 0)


def mixed_by_continuity(steps: list, previous: dict | None = None, first_step_ns: Mapping[int, int] | None = None,
                        first_step_unknown_history: bool = True) -> list[int]:
    """Relabel kernel-decided prefill steps as mixed where a continuous-batching engine ran
    decodes in the same varlen launch (in place; ``steps`` in time order per device; each
    has ``device``, ``start_ns``, ``end_ns``, ``phase``, ``mixed_slots``, ``evidence``).
    Returns the positions relabelled.

    A single unsplit FlashAttention-2 varlen launch (``flash_fwd_kernel``, or the
    ``flash_fwd_splitkv_kernel`` vLLM V1 runs with a paged KV cache) over B sequences and T
    tokens, whose longest query is at most grid.x * kBlockM, needs at least p_min long sequences for the T - B extra tokens;
    the other B - p_min can be one-token decodes (``mixed_slots``). They are taken to be
    decodes when the previous step on the device was LLM inference (prefill, decode or
    mixed) that ended less than GAP_MIN_NS before: the engine kept running and its requests
    go on decoding. A pure prefill batch after an idle engine (a step that is not inference,
    or a gap of GAP_MIN_NS or more, before it) stays prefill; one scheduled right after a
    decode step by an engine that does not mix would be called mixed (a stated limit).

    The first step seen on a device (no step before it in the recording or the stream) has
    no history: whether the engine was idle is unknown. Its slots are taken to be decodes
    too: a continuous-batching engine (vLLM V1, SGLang) schedules its running requests'
    decodes in every step, so a step of several sequences with prefill tokens is mixed
    except right after the engine was idle, which a recording that starts with the step
    cannot show. A multi-request prefill that opens a recording is then called mixed (a
    stated limit). ``previous``: device -> the last few (start_ns, end_ns, phase) seen before
    ``steps`` (streaming); updated in place. ``first_step_ns``: per device, the start of the
    earliest step seen before, also by a path that keeps no ``previous`` (a stream's annotated
    batches): only a step starting at or before it can be the recording's first (a held step
    mapped again stays the first). ``first_step_unknown_history=False``: no step of ``steps``
    is the recording's first (one step mapped alone to be cached as a shape).
    """
    last = previous if previous is not None else {}
    out = []
    for i, st in enumerate(steps):
        # The latest step of the device that started before this one (a batch tail mapped
        # again in the next batch is dropped from the history and recorded anew).
        hist = [h for h in last.get(st.device, []) if h[0] < st.start_ns]
        prev = hist[-1] if hist else None
        text = _mixed_slots_taken(st, prev, first_step_ns, first_step_unknown_history)
        if text is not None:
            st.phase = MIXED
            if isinstance(st.evidence, list):
                st.evidence.insert(0, text)
                st.prefill_tokens = st.decode_tokens = None
            else:
                st.evidence = f"mixed: {text}; {st.evidence}"
            out.append(i)
        last[st.device] = (hist + [(st.start_ns, st.end_ns, st.phase)])[-4:]
    return out


def _mixed_slots_taken(st, prev: tuple | None, first_step_ns: Mapping[int, int] | None,
                       first_step_unknown_history: bool) -> str | None:
    """Why a prefill step's one-token-decode slots are taken as decodes (None: they are not):
    it continues a running batch (``prev``: the device's previous step), or it is the first
    step of the recording on its device (:func:`mixed_by_continuity`)."""
    if st.phase != PREFILL or st.mixed_slots <= 0:
        return None
    if prev is None:
        first = (first_step_ns or {}).get(st.device)
        if not first_step_unknown_history or (first is not None and st.start_ns > first):
            return None
        return (f"up to {st.mixed_slots} sequences of the prefill launch can be one-token decodes, and nothing "
                f"before this step on the device says the engine was idle (the recording starts with it): taken "
                f"to continue a running batch, as a continuous-batching engine's steps with several sequences do "
                f"=> mixed")
    if prev[2] in (PREFILL, DECODE, MIXED) and st.start_ns - prev[1] < GAP_MIN_NS:
        return (f"up to {st.mixed_slots} sequences of the prefill launch continue the previous step's batch "
                f"({PHASE_NAMES[prev[2]]}, ended {(st.start_ns - prev[1]) / 1e3:.0f} us before) as one-token "
                f"decodes => mixed")
    return None


# A step repeats its neighbour's layers when at least this many of its layers are the
# neighbour's layer kernel for kernel, and its GEMM and attention kernels take the
# neighbour's time to within LAYER_TIME_RATIO (the same kernel on the same shapes).
LAYER_MIN_REPEATS = 3
LAYER_TIME_RATIO = 1.25


@dataclass(frozen=True)
class _Layers:
    """A step's complete layers as :func:`layers_repeated` compares them."""
    count: int                # complete layers (attention launch to attention launch)
    usual: tuple              # the most common layer's name ids
    uniform: bool             # every layer is the usual one
    timed: np.ndarray         # per position of the usual layer: a GEMM or attention kernel
    median_ns: np.ndarray     # per position, the median duration over the usual layers


@dataclass
class LayerStep:
    """One step's kernels as the layer-continuity rule reads them (in start order): name
    ids, roles (:mod:`aggregator.signatures` ``ROLE_*``) and durations, with the step's
    label before the rule ran (``phase``) and its index (-1: a step of an earlier batch).
    Its layers are computed when first read (most steps are never compared)."""
    start_ns: int
    phase: int
    index: int
    name_id: np.ndarray
    role: np.ndarray
    dur_ns: np.ndarray
    _layers: _Layers | None = field(default=None, init=False, repr=False)
    _read: bool = field(default=False, init=False, repr=False)

    @property
    def layers(self) -> _Layers | None:
        """Its complete layers (None: fewer than LAYER_MIN_REPEATS)."""
        if not self._read:
            self._read = True
            at = np.flatnonzero(self.role == ROLE_ATTENTION)
            layers = [tuple(self.name_id[a:b].tolist()) for a, b in zip(at[:-1].tolist(), at[1:].tolist())]
            if len(layers) >= LAYER_MIN_REPEATS:
                usual = Counter(layers).most_common(1)[0][0]
                is_usual = np.array([t == usual for t in layers])
                starts = at[:-1][is_usual]
                w = len(usual)
                timed = (self.role == ROLE_ATTENTION) | (self.role == ROLE_GEMM)
                self._layers = _Layers(len(layers), usual, bool(is_usual.all()), timed[starts[0]:starts[0] + w],
                                       np.median(self.dur_ns[starts[:, None] + np.arange(w)[None, :]], axis=0))
        return self._layers

    @property
    def candidate(self) -> bool:
        """Unknown with LAYER_MIN_REPEATS complete layers all alike: a neighbour's layers
        may give it that neighbour's phase."""
        lay = self.layers if self.phase == UNKNOWN else None
        return lay is not None and lay.uniform


def _repeat_ratio(mine: _Layers, theirs: _Layers) -> float | None:
    """The largest time ratio of ``mine``'s GEMM and attention kernels to ``theirs`` when
    every layer of ``mine`` is ``theirs``' usual layer and each ratio is within
    LAYER_TIME_RATIO, else None."""
    if not mine.uniform or mine.usual != theirs.usual:
        return None
    t = theirs.timed
    a, b = mine.median_ns[t], theirs.median_ns[t]
    if not t.any() or (a <= 0).any() or (b <= 0).any():
        return None
    ratio = float(np.maximum(a / b, b / a).max())
    return ratio if ratio <= LAYER_TIME_RATIO else None


def layers_repeated(mine: LayerStep, before: LayerStep | None, after: LayerStep | None) -> tuple[LayerStep, str] | None:
    """The neighbour (the device's step ``before`` or ``after`` ``mine``) whose phase the
    unknown step ``mine`` takes because it runs that neighbour's layers again, with the
    evidence; None when neither does, or when both do with different phases (a conflict:
    it stays unknown). Only a neighbour's own label (``phase``, prefill or decode, as it was
    before the rule ran) counts, never one the rule gave it."""
    if not mine.candidate:
        return None
    hits = []
    for nb in (before, after):
        if nb is None or nb.phase not in (PREFILL, DECODE) or nb.layers is None:
            continue
        ratio = _repeat_ratio(mine.layers, nb.layers)
        if ratio is not None:
            hits.append((nb, ratio))
    if not hits or len({nb.phase for nb, _ in hits}) > 1:
        return None
    nb, ratio = hits[0]
    lay = mine.layers
    who = f"step {nb.index}'s" if nb.index >= 0 else "the device's previous step's"
    return nb, (f"repeats {who} layers ({PHASE_NAMES[nb.phase]}): {lay.count} layers of the same {len(lay.usual)} "
                f"kernels, its {int(nb.layers.timed.sum())} GEMM and attention kernels within "
                f"{100 * (ratio - 1):.0f}% of their time there (the same shapes) => {PHASE_NAMES[nb.phase]}")


def same_layers_by_continuity(trace: Trace, kc: KernelClasses, kernel_step: np.ndarray, steps: list[Step],
                              previous: dict[int, list[LayerStep]] | None = None) -> None:
    """Label an unknown kernel step with the phase of the step next to it on its device
    (prefill or decode) when it runs that step's layers again: at least LAYER_MIN_REPEATS
    complete layers (attention launch to attention launch), every one the neighbour's usual
    layer name for name, and each GEMM and attention kernel of the layer within
    LAYER_TIME_RATIO of the neighbour's median time at that position. A GEMM kernel of one
    name over the same weights takes the same time only over about the same rows (a decode
    layer's GEMMs on one token per sequence run in a fraction of a prefill layer's), so the
    step ran the same model on the same tokens: the same phase. The MI300X HF Qwen forward's
    first step (the previous forward's last 10 layers, launched before the recording, no
    grids) repeats the profiled forward's 43-kernel layer with its 8 GEMM/attention times
    within 2%.

    Every step is decided against its neighbours' labels as they were before the pass (a
    step the rule labels is no neighbour for another), so the result does not depend on the
    order the steps are visited in: of a run of unknown steps that repeat one another's
    layers, only the two ends, next to a labelled step, can take its phase; the inner ones
    stay unknown. A step both of whose neighbours match with different phases stays
    unknown. In place (``steps`` in time order per device; kernel-decided steps only);
    each relabelled step's evidence says so, and ``layer_candidate`` marks every unknown
    step the rule could have labelled.

    ``previous`` (a stream, :class:`aggregator.stream_phases.StreamPhaser`): device -> the
    last steps seen before ``steps`` (:class:`LayerStep`), the neighbour before a device's
    first step here; updated in place with the last step of each device."""
    if not steps:
        return
    k = trace.kernels
    order = np.lexsort((k["start_ns"], kernel_step))
    ks = kernel_step[order]
    bounds = np.searchsorted(ks, np.arange(len(steps) + 1))
    dur_all = (k["end_ns"] - k["start_ns"]).astype(np.int64)
    seen: dict[int, LayerStep] = {}

    def at(i: int) -> LayerStep:
        # The step's label as it was before the pass: each is read before any relabel.
        if i not in seen:
            sel = order[bounds[i]:bounds[i + 1]]
            seen[i] = LayerStep(int(steps[i].start_ns), int(steps[i].phase), int(steps[i].index), k["name_id"][sel],
                                kc.role[sel], dur_all[sel])
        return seen[i]

    by_device: dict[int, list[int]] = {}
    for i, st in enumerate(steps):
        by_device.setdefault(st.device, []).append(i)
    found: list[tuple[int, LayerStep, str]] = []
    for dev, seq in by_device.items():
        hist = [h for h in (previous or {}).get(dev, []) if h.start_ns < steps[seq[0]].start_ns]
        for p, i in enumerate(seq):
            if steps[i].phase != UNKNOWN or steps[i].source != "kernels":
                continue
            mine = at(i)
            if not mine.candidate:
                continue
            steps[i].layer_candidate = True
            before = at(seq[p - 1]) if p else (hist[-1] if hist else None)
            after = at(seq[p + 1]) if p + 1 < len(seq) else None
            hit = layers_repeated(mine, before, after)
            if hit is not None:
                found.append((i, *hit))
        if previous is not None:
            # Three kept: a stream holds up to two steps of a device (its open step and an
            # unknown one waiting for it) and maps them again in the next batch, after the
            # one before them.
            previous[dev] = (hist + [at(i) for i in seq[-3:]])[-3:]
    for i, nb, text in found:
        st = steps[i]
        st.phase = nb.phase
        if st.evidence:
            st.evidence[0] = f"its kernels alone: {st.evidence[0]}"
        st.evidence.insert(0, text)


def _training_context(trace: Trace, kc: KernelClasses, trained: np.ndarray) -> dict[int, str]:
    """Devices whose kernels include training work anywhere in the trace, with the evidence."""
    k = trace.kernels
    out: dict[int, str] = {}
    is_train = kc.role == ROLE_TRAINING
    for dev in np.unique(k["device"][is_train | trained]).tolist():
        nk = int((is_train & (k["device"] == dev)).sum())
        nl = int((trained & (k["device"] == dev)).sum())
        parts = []
        if nk:
            parts.append(f"{nk} backward/optimizer kernels")
        if nl:
            parts.append(f"{nl} kernels launched from autograd/optimizer CPU ops")
        out[int(dev)] = (f"device {dev} runs a training loop ({', '.join(parts)} in the trace) and this step has no "
                         f"inference-only kernel (KV-cache write, paged/decode attention) => other (not inference)")
    return out
