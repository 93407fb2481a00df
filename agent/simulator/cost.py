"""Roofline cost of one forward step: the kernels an engine launches and how long each runs.

Every kernel's duration is ``max(flops / (peak_flops * eff), bytes / (peak_bytes_per_s *
eff)) + kernel_fixed_ns`` (the fixed part is the launch-to-finish floor of any kernel:
ramp-up, tail, and the gap the GPU front end leaves between back-to-back kernels).
The efficiencies are stated, not fitted per kernel (see :class:`Efficiency` and
docs/calibration.md for how they compare with a real trace).

:func:`plan_step` returns one step's kernels in launch order, columnar.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .conventions import EngineConventions
from .hardware import GpuSpec
from .model import SimModel

CLASSES = ("gemm", "attention", "norm", "elementwise", "other")
CLASS_INDEX = {c: i for i, c in enumerate(CLASSES)}


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet ceilings the kernels reach, and the per-kernel floor."""
    gemm_flops_ratio: float = 0.70
    attention_flops_ratio: float | None = None   # None: the engine's stated ratio (engine_kernels.toml)
    bytes_ratio: float = 0.80
    kernel_fixed_ns: int = 2_500


@dataclass(frozen=True)
class StepShape:
    """What one engine step computes.

    ``q_lens[i]``: new tokens of scheduled sequence i in this step; ``ctx_lens[i]``: its
    tokens already in the KV cache before the step; ``samples[i]``: whether it produces
    a token at the end of the step (last chunk of a prefill, or a decode).
    """
    q_lens: np.ndarray
    ctx_lens: np.ndarray
    samples: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.q_lens.sum())

    @property
    def sequences(self) -> int:
        return int(len(self.q_lens))

    @property
    def sampling(self) -> int:
        return int(self.samples.sum())

    @property
    def decode_only(self) -> bool:
        return bool(len(self.q_lens)) and bool((self.q_lens == 1).all() & (self.ctx_lens > 0).all())


@dataclass
class StepPlan:
    """One step's kernels in launch order (columnar) and the names they index."""
    names: list[str]
    name_idx: np.ndarray      # int32 index into names
    dur_ns: np.ndarray        # int64
    grid: np.ndarray          # int32 (n, 3)
    block_x: np.ndarray       # int32
    cls: np.ndarray           # uint8 index into CLASSES
    flops: np.ndarray         # float64
    bytes: np.ndarray         # float64


class _Builder:
    def __init__(self, gpu: GpuSpec, eff: Efficiency):
        self.gpu, self.eff = gpu, eff
        self.names: list[str] = []
        self._index: dict[str, int] = {}
        self.rows: list[tuple] = []

    def add(self, name: str, flops: float, nbytes: float, flops_ratio: float, grid, block_x: int, cls: str):
        t_f = flops / (self.gpu.flops_per_s * flops_ratio) if flops else 0.0
        t_b = nbytes / (self.gpu.hbm_bytes_per_s * self.eff.bytes_ratio)
        dur = int(max(t_f, t_b) * 1e9) + self.eff.kernel_fixed_ns
        i = self._index.get(name)
        if i is None:
            i = self._index[name] = len(self.names)
            self.names.append(name)
        self.rows.append((i, dur, int(grid[0]), int(grid[1]), int(grid[2]), int(block_x),
                          CLASS_INDEX[cls], float(flops), float(nbytes)))


def _elementwise(b: _Builder, op: dict, tokens: int, sequences: int):
    nbytes = op.get("bytes_per_token", 0) * tokens + op.get("bytes_per_sequence", 0) * sequences
    gx = op.get("grid_x")
    if gx == "tokens":
        grid_x = tokens
    elif gx == "sequences":
        grid_x = sequences
    else:   # PyTorch elementwise: one block per 4 x block_x elements of 2 bytes or so
        grid_x = max(1, math.ceil(nbytes / (8 * op.get("block_x", 128) * 2)))
    b.add(op["name"], 0.0, nbytes, 1.0, (max(1, grid_x), 1, 1), op.get("block_x", 128), op["class"])


def _gemm(b: _Builder, conv: EngineConventions, model: SimModel, m: int, n: int, k: int, cls: str):
    tier = conv.gemm_tier(m)
    tm, tn = tier["tile_m"], tier["tile_n"]
    m_pad = math.ceil(m / tm) * tm          # tile quantisation: a partial tile costs a full one
    flops = 2.0 * m_pad * n * k
    nbytes = (n * k + m * k + m * n) * model.dtype_bytes
    grid = (math.ceil(n / tn), math.ceil(m / tm), 1)
    b.add(tier["name"], flops, nbytes, b.eff.gemm_flops_ratio, grid, tier.get("block_x", 384), cls)


def _attention(b: _Builder, conv: EngineConventions, model: SimModel, shape: StepShape):
    att = conv.attention
    ratio = b.eff.attention_flops_ratio or att.get("flops_ratio", 0.45)
    q, c = shape.q_lens.astype(np.float64), shape.ctx_lens.astype(np.float64)
    flops = 4.0 * model.heads * model.head_dim * float((q * c + q * (q + 1) / 2).sum())
    kv_bytes = float((q + c).sum()) * model.kv_dim * 2 * model.dtype_bytes
    qo_bytes = float(q.sum()) * model.q_dim * 2 * model.dtype_bytes
    nbytes = kv_bytes + qo_bytes
    b_ = shape.sequences
    h = model.heads
    if shape.decode_only:
        # FA2 num_splits heuristic (flash_api.cpp): split the KV when b*h blocks
        # under-fill the SMs; bounded by the KV blocks of the longest context.
        n_blocks = math.ceil(float((c + q).max()) / att["block_n_decode"])
        if b_ * h >= 0.8 * b.gpu.sm_count:
            splits = 1
        else:
            splits = max(1, min(128, n_blocks, math.ceil(b.gpu.sm_count / (b_ * h))))
        grid = (1, splits if splits > 1 else b_, b_ * h if splits > 1 else h)
        b.add(att["decode"], flops, nbytes, ratio, grid, att["block_x"], "attention")
        if splits > 1:
            comb_bytes = b_ * h * splits * model.head_dim * 4.0
            b.add(att["combine"], 0.0, comb_bytes, 1.0, (math.ceil(b_ * h / 4), 1, 1), 128, "attention")
    else:
        grid = (math.ceil(float(q.max()) / att["block_m"]), b_, h)
        b.add(att["prefill"], flops, nbytes, ratio, grid, att["block_x"], "attention")


def _ops(b: _Builder, conv: EngineConventions, model: SimModel, shape: StepShape, ops: list[dict]):
    tokens, seqs = shape.tokens, shape.sequences
    for op in ops:
        for _ in range(op["repeat"]):
            cost = op["cost"]
            if cost in ("elementwise", "kv_write", "embed", "sample"):
                _elementwise(b, op, tokens, seqs if cost != "sample" else max(1, shape.sampling))
            elif cost == "gemm":
                m = {"tokens": tokens, "sequences": max(1, shape.sampling)}[op.get("m", "tokens")]
                _gemm(b, conv, model, m, op["n"], op["k"], op["class"])
            elif cost == "attention":
                _attention(b, conv, model, shape)
            elif cost == "norm_group":
                _ops(b, conv, model, shape, conv.norm)
            else:
                raise ValueError(f"unknown cost kind {cost!r}")


class Planner:
    """Plans steps for one (engine, model, GPU, efficiency). Everything but attention
    depends only on (tokens, sequences, sampling sequences), so those rows are cached
    (bounded) and only the attention rows are costed per step."""

    def __init__(self, conv: EngineConventions, model: SimModel, gpu: GpuSpec, eff: Efficiency,
                 cache_size: int = 4096):
        self.conv, self.model, self.gpu, self.eff = conv, model, gpu, eff
        att = [i for i, op in enumerate(conv.layer) if op["cost"] == "attention"]
        cut = att[0] if att else len(conv.layer)
        self._pre, self._post = conv.layer[:cut], conv.layer[cut + (1 if att else 0):]
        self._has_attention = bool(att)
        self._cache: dict[tuple, tuple] = {}
        self._cache_size = cache_size

    def _fixed(self, shape: StepShape):
        key = (shape.tokens, shape.sequences, shape.sampling)
        hit = self._cache.get(key)
        if hit is None:
            parts = []
            for ops in (self.conv.prologue, self._pre, self._post, self.conv.epilogue):
                b = _Builder(self.gpu, self.eff)
                _ops(b, self.conv, self.model, shape, ops)
                parts.append(b)
            if len(self._cache) >= self._cache_size:
                self._cache.clear()
            hit = self._cache[key] = tuple(parts)
        return hit

    def plan(self, shape: StepShape) -> StepPlan:
        pro, pre, post, epi = self._fixed(shape)
        att = _Builder(self.gpu, self.eff)
        if self._has_attention:
            _attention(att, self.conv, self.model, shape)
        index: dict[str, int] = {}

        def rows_of(b: _Builder) -> np.ndarray:
            if not b.rows:
                return np.zeros((0, 9))
            remap = np.array([index.setdefault(n, len(index)) for n in b.names], dtype=np.float64)
            rows = np.array(b.rows, dtype=np.float64)
            rows[:, 0] = remap[rows[:, 0].astype(np.int64)]
            return rows

        layer = np.concatenate([rows_of(pre), rows_of(att), rows_of(post)])
        rows = np.concatenate([rows_of(pro), np.tile(layer, (self.model.layers, 1)), rows_of(epi)])
        return StepPlan(names=list(index), name_idx=rows[:, 0].astype(np.int32), dur_ns=rows[:, 1].astype(np.int64),
                        grid=rows[:, 2:5].astype(np.int32), block_x=rows[:, 5].astype(np.int32),
                        cls=rows[:, 6].astype(np.uint8), flops=rows[:, 7], bytes=rows[:, 8])


def plan_step(conv: EngineConventions, model: SimModel, gpu: GpuSpec, eff: Efficiency,
              shape: StepShape) -> StepPlan:
    """The kernels of one forward step over ``shape`` in launch order.

    The per-layer block is costed once and tiled over the model's layers (identical
    layers), so the cost of planning does not grow with the layer count.
    """
    return Planner(conv, model, gpu, eff).plan(shape)
