"""FLOPs and bytes of GPU work, per kernel and per step, each figure tagged with its source.

Two sources, in the order of truth of design.md section 5 after hardware counters:

* ``"shapes"`` -- :func:`kernel_work_from_shapes`: the operator that launched each kernel
  (Kineto ``cpu_op`` with ``Input Dims`` / ``Input type``, linked by External id) gives
  GEMM M, N, K, attention lengths and tensor sizes. Shapes are parsed once per unique
  (operator, dims, types) group, never per kernel; an operator's work is split over the
  kernels it launched in proportion to their durations.
* ``"model"`` -- :func:`step_work_from_model`: a :class:`~aggregator.model_config.ModelShape`
  and a step's token counts: weights read once per step, KV written per token and read
  per attended context token, activations in and out of every projection, 2 FLOPs per
  multiply-add, attention QK^T and PV.

Where neither applies the figure is NaN (per kernel) or ``None`` (per step) with the
reason; nothing is filled in by guess. ``"measured"`` (PM sampling / GPM) is attributed
elsewhere (:mod:`aggregator.counters`).

Byte counts are bytes moved between the SMs and device memory assuming each operand is
read once and each result written once (no cache reuse across kernels); FLOP counts are
dense (2 per multiply-add).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import orjson

from ridgeline.probes.events import Trace
from ridgeline.probes.trace_joins import kernel_cpu_op_index

from .model_config import ModelShape

SOURCE_SHAPES = "shapes"
SOURCE_MODEL = "model"
SOURCE_MEASURED = "measured"
NO_SOURCE = "no source"

# Work categories of a kernel, from the operator that launched it.
CAT_NONE, CAT_GEMM, CAT_ATTENTION, CAT_ELEMENTWISE, CAT_REDUCTION, CAT_COPY, CAT_NORM, \
    CAT_GATHER, CAT_FUSED = range(9)
CATEGORY_NAMES = {CAT_NONE: "none", CAT_GEMM: "gemm", CAT_ATTENTION: "attention",
                  CAT_ELEMENTWISE: "elementwise", CAT_REDUCTION: "reduction", CAT_COPY: "copy",
                  CAT_NORM: "norm", CAT_GATHER: "gather", CAT_FUSED: "fused"}

# Ceiling dtype keys (aggregator.ceilings.DTYPES) as small codes for per-kernel arrays.
DTYPE_KEYS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "fp4", "int8")
_DTYPE_CODE = {k: i for i, k in enumerate(DTYPE_KEYS)}

# PyTorch "Input type" strings -> (element bytes, ceiling dtype key or None).
TORCH_TYPES: dict[str, tuple[float, str | None]] = {
    "float": (4, "fp32"), "double": (8, "fp64"), "c10::Half": (2, "fp16"),
    "c10::BFloat16": (2, "bf16"), "c10::Float8_e4m3fn": (1, "fp8"), "c10::Float8_e5m2": (1, "fp8"),
    "c10::Float8_e4m3fnuz": (1, "fp8"), "c10::Float8_e5m2fnuz": (1, "fp8"),
    "c10::Float8_e8m0fnu": (1, None), "c10::Float4_e2m1fn_x2": (1, "fp4"),
    "long int": (8, None), "int": (4, None), "short int": (2, None), "signed char": (1, "int8"),
    "unsigned char": (1, None), "bool": (1, None), "c10::complex<float>": (8, "fp32"),
    "unsigned int": (4, None), "unsigned short": (2, None), "uint64_t": (8, None),
}

_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
             "aten::linear", "aten::_scaled_mm", "aten::mv", "aten::addmv", "aten::addbmm",
             "aten::_addmm_activation"}
# Attention ops and the layout of q/k/v: "bhsd" = [batch, heads, seq, dim], "bshd" = [batch, seq, heads, dim].
_ATTENTION_OPS = {
    "aten::scaled_dot_product_attention": "bhsd",
    "aten::_scaled_dot_product_flash_attention": "bhsd",
    "aten::_scaled_dot_product_efficient_attention": "bhsd",
    "aten::_scaled_dot_product_cudnn_attention": "bhsd",
    "aten::_scaled_dot_product_attention_math": "bhsd",
    "aten::_flash_attention_forward": "bshd",
    "aten::_efficient_attention_forward": "bshd",
}
_REDUCTION_OPS = {"aten::mean", "aten::sum", "aten::amax", "aten::amin", "aten::max", "aten::min",
                  "aten::norm", "aten::linalg_vector_norm", "aten::var", "aten::std",
                  "aten::var_mean", "aten::std_mean", "aten::all", "aten::any", "aten::argmax",
                  "aten::argmin", "aten::prod", "aten::cumsum", "aten::logsumexp"}
_NORM_OPS = {"aten::native_layer_norm": 7.0, "aten::layer_norm": 7.0, "aten::_fused_rms_norm": 7.0,
             "aten::rms_norm": 7.0, "aten::_softmax": 5.0, "aten::softmax": 5.0,
             "aten::_log_softmax": 5.0, "aten::log_softmax": 5.0, "aten::native_group_norm": 7.0,
             "_C::rms_norm": 7.0, "_C::fused_add_rms_norm": 8.0, "vllm::rms_norm": 7.0}
_ELEMENTWISE_OPS = {
    "aten::add", "aten::sub", "aten::mul", "aten::div", "aten::pow", "aten::rsqrt", "aten::sqrt",
    "aten::neg", "aten::exp", "aten::log", "aten::cos", "aten::sin", "aten::tanh", "aten::sigmoid",
    "aten::silu", "aten::gelu", "aten::relu", "aten::where", "aten::masked_fill", "aten::clamp",
    "aten::eq", "aten::ne", "aten::lt", "aten::gt", "aten::le", "aten::ge", "aten::abs",
    "aten::reciprocal", "aten::maximum", "aten::minimum", "aten::triu", "aten::tril",
    "aten::bitwise_and", "aten::bitwise_or", "aten::bitwise_not", "aten::logical_and",
    "aten::logical_or", "aten::logical_not", "aten::erf", "aten::threshold_backward",
    "aten::gelu_backward", "aten::silu_backward", "aten::sigmoid_backward", "aten::hardtanh",
    "aten::leaky_relu", "aten::clamp_min", "aten::clamp_max", "aten::floor", "aten::ceil",
    "aten::round", "aten::sign", "aten::addcmul", "aten::addcdiv", "aten::lerp",
    "aten::arange", "aten::fill", "aten::zero", "aten::ones_like", "aten::zeros_like",
    "aten::dropout", "aten::native_dropout", "_C::silu_and_mul", "_C::gelu_and_mul",
    "_C::static_scaled_fp8_quant", "_C::dynamic_scaled_fp8_quant", "_C::rotary_embedding",
}
_COPY_OPS = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::to"}
_GATHER_OPS = {"aten::index_select", "aten::embedding", "aten::gather"}


@dataclass
class KernelWork:
    """Per-kernel work aligned with ``trace.kernels``; NaN where no source applies."""
    flops: np.ndarray            # float64
    bytes: np.ndarray            # float64
    dtype_code: np.ndarray       # int8, index into DTYPE_KEYS, -1 unknown
    category: np.ndarray         # uint8, CAT_*
    source: str = SOURCE_SHAPES
    notes: list[str] = field(default_factory=list)

    @property
    def known(self) -> np.ndarray:
        return ~np.isnan(self.flops) | ~np.isnan(self.bytes)

    @classmethod
    def empty(cls, n: int) -> "KernelWork":
        return cls(np.full(n, np.nan), np.full(n, np.nan), np.full(n, -1, np.int8),
                   np.zeros(n, np.uint8))


# ---------------------------------------------------------------------------------
# Operator shapes -> work (pure, per unique group)
# ---------------------------------------------------------------------------------

def _is_tensor_dims(d) -> bool:
    return isinstance(d, list) and len(d) > 0 and all(isinstance(x, int) for x in d)


def _numel(d) -> int:
    return math.prod(d) if d else 1


def _tensors(dims: list, types: list) -> list[tuple[list[int], float, str | None]]:
    """(dims, element bytes, ceiling dtype) of each tensor argument with a known dtype.
    0-d tensors show as [] in Kineto and are skipped (a scalar's bytes are negligible)."""
    out = []
    for i, d in enumerate(dims):
        t = types[i] if i < len(types) else ""
        if _is_tensor_dims(d) and t in TORCH_TYPES:
            eb, key = TORCH_TYPES[t]
            out.append((d, float(eb), key))
    return out


def op_work(name: str, dims: list, types: list) -> tuple[float, float, str | None, int, str] | None:
    """Work of one operator call from its input shapes: ``(flops, bytes, ceiling dtype,
    category, note)``, or ``None`` when the operator is not modelled or shapes are
    missing. Pure; tested with literals."""
    if not isinstance(dims, list) or not isinstance(types, list):
        return None
    if name in _GEMM_OPS:
        return _gemm_work(name, dims, types)
    if name in _ATTENTION_OPS:
        return _attention_work(_ATTENTION_OPS[name], dims, types)
    if name.startswith("triton_"):
        ts = _tensors(dims, types)
        if not ts:
            return None
        # Inductor passes outputs as arguments too: each argument is read or written once,
        # except lookup tables (e.g. a rotary cos/sin cache) that are indexed, not swept:
        # an argument over 16x the next largest is capped at that size.
        sizes = sorted((_numel(d) for d, _, _ in ts), reverse=True)
        cap = sizes[0]
        for a, b_ in zip(sizes, sizes[1:]):
            if a > 16 * b_:
                cap = b_
            else:
                break
        b = sum(min(_numel(d), cap) * eb for d, eb, _ in ts)
        return float(cap), b, None, CAT_FUSED, "fused (argument bytes; indexed tables capped)"
    if name == "_C_cache_ops::reshape_and_cache_flash" or name == "_C_cache_ops::reshape_and_cache":
        if len(dims) < 4:
            return None
        ts = _tensors(dims[:2], types[:2])
        cache = TORCH_TYPES.get(types[2] if len(types) > 2 else "", (None, None))[0]
        if len(ts) < 2 or cache is None:
            return None
        n = _numel(ts[0][0]) + _numel(ts[1][0])
        return 0.0, n * ts[0][1] + n * cache, None, CAT_COPY, "kv cache write"
    base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    inplace = base != name
    if name in _COPY_OPS or base in _COPY_OPS:
        ts = _tensors(dims, types)
        if name == "aten::copy_":
            if len(ts) < 2:
                return None
            return 0.0, _numel(ts[0][0]) * ts[0][1] + _numel(ts[1][0]) * ts[1][1], None, CAT_COPY, ""
        if not ts:
            return None
        # clone/contiguous: read and write the same tensor.
        return 0.0, 2.0 * _numel(ts[0][0]) * ts[0][1], None, CAT_COPY, ""
    if name in _GATHER_OPS:
        ts = _tensors(dims, types)
        if len(ts) < 2:
            return None
        (src, eb, _), (idx, ib, _) = ts[0], ts[-1]
        if name == "aten::gather":
            out = _numel(idx)
        else:
            out = _numel(idx) * (_numel(src[1:]) if len(src) > 1 else 1)
        return 0.0, 2.0 * out * eb + _numel(idx) * ib, None, CAT_GATHER, ""
    if name in _NORM_OPS:
        ts = _tensors(dims, types)
        if not ts:
            return None
        x = max(ts, key=lambda t: _numel(t[0]))
        n = _numel(x[0])
        b = sum(_numel(d) * eb for d, eb, _ in ts)
        if name.startswith("aten::"):
            b += n * x[1]      # aten norms return a new tensor; vLLM ones write in place
        elif name == "_C::fused_add_rms_norm":
            b *= 2             # input and residual are read and written back
        return _NORM_OPS[name] * n, b, None, CAT_NORM, ""
    if name in _REDUCTION_OPS:
        ts = _tensors(dims[:1], types[:1])
        if not ts:
            return None
        d, eb, _ = ts[0]
        return float(_numel(d)), _numel(d) * eb, None, CAT_REDUCTION, ""
    if base in _ELEMENTWISE_OPS or name in _ELEMENTWISE_OPS:
        ts = _tensors(dims, types)
        if not ts:
            return None
        big = max(ts, key=lambda t: _numel(t[0]))
        n = _numel(big[0])
        reads = sum(_numel(d) * eb for d, eb, _ in ts)
        if base in ("aten::fill", "aten::zero"):
            reads = 0.0
        if name.startswith("_C::"):
            # vLLM ops take their output as an argument: arguments are read or written once.
            return float(n), reads, None, CAT_ELEMENTWISE, ""
        write = n * big[1]
        return float(n), reads + write, None, CAT_ELEMENTWISE, "in place" if inplace else ""
    return None


def _gemm_work(name: str, dims: list, types: list):
    ts = [(i, d) for i, d in enumerate(dims) if _is_tensor_dims(d)]
    t = {i: d for i, d in ts}
    first = 1 if name in ("aten::addmm", "aten::baddbmm", "aten::addmv", "aten::addbmm",
                          "aten::_addmm_activation") else 0
    a, b = t.get(first), t.get(first + 1)
    if a is None or b is None:
        return None
    type_a = types[first] if first < len(types) else ""
    eb, key = TORCH_TYPES.get(type_a, (None, None))
    if eb is None:
        return None
    eb_b = TORCH_TYPES.get(types[first + 1] if first + 1 < len(types) else "", (eb, key))[0]
    if name == "aten::linear":
        k = a[-1]
        m = _numel(a[:-1])
        if len(b) != 2 or b[1] != k:
            return None
        n = b[0]
        batch = 1
    elif name in ("aten::mv", "aten::addmv"):
        if len(a) != 2 or len(b) != 1:
            return None
        m, k = a
        n, batch = 1, 1
    else:
        a2 = [1] + a if len(a) == 1 else a
        b2 = b + [1] if len(b) == 1 else b
        m, k = a2[-2], a2[-1]
        k2, n = b2[-2], b2[-1]
        if k != k2:
            return None
        batch = max(_numel(a2[:-2]), _numel(b2[:-2]))
        if name == "aten::addbmm":
            batch = a2[0] if len(a2) == 3 else batch
    flops = 2.0 * batch * m * n * k
    out_eb = eb if key != "fp8" else 2.0    # fp8 GEMMs write bf16/fp16
    bytes_ = (_numel(a) * eb + _numel(b) * eb_b + batch * m * n * out_eb)
    bias = t.get(0) if first == 1 else (t.get(2) if name == "aten::linear" else None)
    if bias is not None:
        bytes_ += _numel(bias) * eb
    return flops, float(bytes_), key, CAT_GEMM, f"{batch}x{m}x{n}x{k}" if batch > 1 else f"{m}x{n}x{k}"


def _attention_work(layout: str, dims: list, types: list):
    if len(dims) < 3 or not all(_is_tensor_dims(d) and len(d) == 4 for d in dims[:3]):
        # Variable-length (packed 3-D) inputs need cumulative sequence lengths, which the
        # trace does not record: no figure rather than a guess.
        return None
    eb, key = TORCH_TYPES.get(types[0] if types else "", (None, None))
    if eb is None:
        return None
    q, k, v = dims[0], dims[1], dims[2]
    if layout == "bhsd":
        bsz, h, sq, d = q
        sk, dv = k[2], v[3]
    else:
        bsz, sq, h, d = q
        sk, dv = k[1], v[3]
    pairs = float(sq) * sk
    note = ""
    if sq == sk and sq > 1:
        # Self-attention over a whole sequence in an LLM is causal; the trace does not
        # keep the is_causal flag, so this is stated with the figure.
        pairs = sq * (sq + 1) / 2.0
        note = "causal assumed (Sq == Sk)"
    flops = 2.0 * bsz * h * pairs * (d + dv)
    bytes_ = (_numel(q) + _numel(k) + _numel(v) + bsz * h * sq * dv) * eb
    return flops, float(bytes_), key, CAT_ATTENTION, note


# ---------------------------------------------------------------------------------
# Trace -> per-kernel work (vectorised; Python only per unique operator group)
# ---------------------------------------------------------------------------------

def kernel_work_from_shapes(trace: Trace, op_index: np.ndarray | None = None) -> KernelWork:
    """Per-kernel FLOPs and bytes from the shapes of the operators that launched them.

    An operator's work is divided among its kernels in proportion to kernel duration.
    Kernels without an operator, or whose operator is not modelled, get NaN.
    """
    k = trace.kernels
    n = len(k)
    work = KernelWork.empty(n)
    if n == 0 or len(trace.cpu_ops) == 0:
        work.notes.append("no operator shapes in the trace")
        return work
    oi = kernel_cpu_op_index(trace) if op_index is None else op_index
    linked = np.flatnonzero(oi >= 0)
    if not len(linked):
        work.notes.append("no kernel is linked to an operator")
        return work
    ops = trace.cpu_ops[oi[linked]]
    has_dims = ops["input_dims_id"] >= 0
    linked, ops = linked[has_dims], ops[has_dims]
    if not len(linked):
        work.notes.append("operators carry no Input Dims (record_shapes off)")
        return work
    # Unique (name, dims, types) groups via two integer keys (np.unique over rows of a
    # 2-D array sorts structured voids and is several times slower).
    width = np.int64(len(trace.names) + 1)
    pair = ops["input_dims_id"].astype(np.int64) * width + (ops["input_types_id"].astype(np.int64) + 1)
    upair, inv1 = np.unique(pair, return_inverse=True)
    ukey, inverse = np.unique(inv1.reshape(-1).astype(np.int64) * width + ops["name_id"], return_inverse=True)
    inverse = inverse.reshape(-1)
    gp = upair[ukey // width]
    uniq = np.stack([ukey % width, gp // width, gp % width - 1], axis=1)
    g_flops = np.full(len(uniq), np.nan)
    g_bytes = np.full(len(uniq), np.nan)
    g_dtype = np.full(len(uniq), -1, np.int8)
    g_cat = np.zeros(len(uniq), np.uint8)
    names = trace.names
    notes = set()
    for gi, (name_id, dims_id, types_id) in enumerate(uniq.tolist()):
        try:
            dims = orjson.loads(names[dims_id])
            types = orjson.loads(names[types_id]) if types_id >= 0 else []
        except (orjson.JSONDecodeError, IndexError):
            continue
        r = op_work(names[name_id], dims, types)
        if r is None:
            continue
        g_flops[gi], g_bytes[gi], key, g_cat[gi], note = r
        if key is not None:
            g_dtype[gi] = _DTYPE_CODE[key]
        if note and not note[0].isdigit():
            notes.add(f"{names[name_id]}: {note}")
    # Split each operator's work over its kernels by duration.
    op_of = oi[linked]
    dur = np.maximum(k["end_ns"][linked] - k["start_ns"][linked], 0).astype(np.float64)
    uop, op_inv = np.unique(op_of, return_inverse=True)
    op_inv = op_inv.reshape(-1)
    tot = np.bincount(op_inv, weights=dur, minlength=len(uop))
    cnt = np.bincount(op_inv, minlength=len(uop)).astype(np.float64)
    share = np.where(tot[op_inv] > 0, dur / np.where(tot[op_inv] > 0, tot[op_inv], 1.0),
                     1.0 / cnt[op_inv])
    work.flops[linked] = g_flops[inverse] * share
    work.bytes[linked] = g_bytes[inverse] * share
    work.dtype_code[linked] = g_dtype[inverse]
    work.category[linked] = g_cat[inverse]
    work.notes.extend(sorted(notes))
    return work


# ---------------------------------------------------------------------------------
# Analytic model -> per-step work
# ---------------------------------------------------------------------------------

@dataclass
class StepWork:
    """Work of one step from the model; ``parts`` breaks flops/bytes down by term."""
    flops: float
    bytes: float
    parts: dict[str, float]
    notes: list[str]
    source: str = SOURCE_MODEL
    # The token counts came from the kernels (KV-cache write grid, GEMM rows), not from an
    # engine's step annotation: the figures are an estimate and say so in the output.
    estimate: bool = False


ESTIMATE_NOTE = "estimate: token counts from kernel grids (no engine step annotation)"


def step_work_from_model(shape: ModelShape, prefill_tokens: int | None, decode_tokens: int | None,
                         context_len: int | None = None, tensor_parallel: int = 1,
                         estimate: bool = False, sequences=None) -> StepWork | None:
    """Analytic work of one forward step, or ``None`` when the token counts are unknown.

    ``context_len``: tokens each sequence holds (prompt length for prefill sequences,
    context length for decoding ones). Without it, attention score FLOPs and the decode
    KV read are left out and the notes say so: a step's token count alone does not tell
    how the tokens split into sequences. ``estimate``: the token counts were read from the
    kernels (the result is flagged and noted). ``tensor_parallel``: GPUs the model is split
    over; one GPU's share is taken as 1/N of every term (weights, heads and KV are
    sharded; the replicated norms and embeddings are negligible). ``sequences``: the step's
    own sums over its sequences (:class:`aggregator.phases.SequenceSums`, from an engine
    annotation that carries key lengths); used where ``context_len`` is not given, they
    give the attention pairs, the KV-cache read and the prefill sequence count exactly.
    """
    if prefill_tokens is None and decode_tokens is None:
        return None
    p = int(prefill_tokens or 0)
    d = int(decode_tokens or 0)
    t = p + d
    if t <= 0:
        return None
    notes: list[str] = []
    act = 2.0 if shape.dtype in ("bfloat16", "float16", "half", "bf16", "fp16") else \
        {"float32": 4.0, "float": 4.0}.get(shape.dtype, 2.0)
    parts: dict[str, float] = {}
    parts["linear_flops"] = t * shape.linear_flops_per_token()
    # Logits: every decode token samples; prefill sequences sample once each, which
    # needs the sequence count.
    seqs = sequences if context_len is None else None
    lm_tokens = d
    if p and context_len:
        lm_tokens += math.ceil(p / context_len)
    elif p and seqs is not None:
        # each prefill sequence samples once (a chunk that does not end its prompt does
        # not; the annotation does not tell them apart, so this counts at most one extra)
        lm_tokens += seqs.prefill_requests
    elif p:
        notes.append("LM head of prefill sequences left out (sequence count unknown)")
    parts["lm_head_flops"] = lm_tokens * shape.lm_head_flops_per_token()
    parts["weight_bytes"] = shape.weight_bytes_read(t, lm_head=lm_tokens > 0)
    parts["kv_write_bytes"] = t * shape.kv_bytes_per_token
    inter = (shape.experts_per_token * (shape.moe_intermediate_size or shape.intermediate_size)
             + shape.num_shared_experts * shape.moe_intermediate_size) if shape.is_moe \
        else shape.intermediate_size
    per_token_act = (2 * shape.hidden_size + shape.q_dim + 2 * shape.kv_dim   # qkv in/out
                     + shape.q_dim + shape.hidden_size                       # o in/out
                     + shape.hidden_size + 2 * inter + inter + shape.hidden_size)  # mlp
    parts["activation_bytes"] = t * shape.num_layers * per_token_act * act
    attn_pairs = 0.0
    kv_read = 0.0
    if context_len:
        if p:
            attn_pairs += p * (context_len + 1) / 2.0
            kv_read += p * shape.kv_bytes_per_token
        if d:
            attn_pairs += d * float(context_len)
            kv_read += d * float(context_len) * shape.kv_bytes_per_token
    elif seqs is not None:
        if p:
            # causal pairs of a sequence with q new tokens over k keys: q*k - q*(q-1)/2
            attn_pairs += seqs.prefill_query_key - (seqs.prefill_query_sq - seqs.prefill_query_tokens) / 2.0
            kv_read += float(seqs.prefill_key_tokens) * shape.kv_bytes_per_token
        if d:
            attn_pairs += float(seqs.decode_query_key)
            kv_read += float(seqs.decode_key_tokens) * shape.kv_bytes_per_token
        notes.append("attention and KV-cache read from the step annotation's per-sequence key lengths")
    else:
        if p:
            # Prefill reads back the K/V it just wrote, whatever the sequence split.
            kv_read += p * shape.kv_bytes_per_token
        notes.append("attention score FLOPs left out (sequence lengths unknown; pass --context-len)")
        if d:
            notes.append("decode KV-cache read left out (context lengths unknown; pass --context-len)")
    parts["attention_flops"] = shape.attention_flops(attn_pairs)
    parts["kv_read_bytes"] = kv_read
    if tensor_parallel > 1:
        parts = {k2: v / tensor_parallel for k2, v in parts.items()}
        notes.append(f"one GPU's share of tensor parallelism {tensor_parallel} (1/{tensor_parallel} of each term)")
    flops = parts["linear_flops"] + parts["lm_head_flops"] + parts["attention_flops"]
    bytes_ = (parts["weight_bytes"] + parts["kv_write_bytes"] + parts["kv_read_bytes"]
              + parts["activation_bytes"])
    if estimate:
        notes.insert(0, ESTIMATE_NOTE)
    return StepWork(flops=flops, bytes=bytes_, parts=parts, notes=notes, estimate=estimate)


def step_work_of(shape: ModelShape, prefill_tokens: int | None, decode_tokens: int | None, *,
                 mixed_tokens: int | None = None, estimate: bool = False, context_len: int | None = None,
                 tensor_parallel: int = 1, sequences=None) -> StepWork | None:
    """The analytic work of one step as a phase mapper labelled it (analyze and the live
    windows both call this). ``estimate``: its token counts came from the kernels.
    ``mixed_tokens``: a mixed step whose prefill/decode split is unknown (decided from
    kernels) but whose total its kernels show: the tokens are counted as prefill, which the
    linear, weight and KV-write terms do not depend on (the LM head and attention terms do;
    the notes say so). ``sequences``: the step annotation's sums over its sequences
    (:class:`aggregator.phases.SequenceSums`), see :func:`step_work_from_model`. None
    without token counts."""
    if prefill_tokens is not None or decode_tokens is not None:
        return step_work_from_model(shape, prefill_tokens, decode_tokens, context_len, tensor_parallel,
                                    estimate=estimate, sequences=sequences)
    if not mixed_tokens:
        return None
    w = step_work_from_model(shape, int(mixed_tokens), 0, context_len, tensor_parallel, estimate=True)
    if w is not None:
        w.notes.insert(1, f"mixed step, prefill/decode split unknown: its {int(mixed_tokens)} tokens counted as "
                          f"prefill (linear, weight and KV-write terms do not depend on the split)")
    return w
