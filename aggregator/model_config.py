"""Model shape of a decoder-only transformer, from a Hugging Face ``config.json``.

Public contract:

* :class:`ModelShape` -- layer counts and widths, dtype sizes, MoE experts; derived
  :attr:`ModelShape.weight_bytes`, :attr:`ModelShape.kv_bytes_per_token`,
  :meth:`ModelShape.linear_flops_per_token`, :meth:`ModelShape.weight_bytes_read`.
* :func:`from_hf_config` -- from a parsed config dict (Llama, Qwen2/3, Mistral, Mixtral,
  Qwen-MoE, GPT-OSS key conventions; nested ``text_config`` of multimodal configs).
* :func:`load` -- from a path to ``config.json`` (or a folder holding one) or a built-in
  name (:data:`BUILTIN`); raises :class:`InputError` with one line on bad input.

Assumptions, stated once: attention has q/k/v/o projections; the MLP is gated (gate, up,
down: three matrices), which holds for every family above; norms and biases are counted
but are negligible. Consumers: the analytic work model (:mod:`aggregator.work`), capacity
planning and the simulator.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ridgeline.probes.errors import InputError

DTYPE_BYTES = {"float32": 4.0, "float": 4.0, "fp32": 4.0, "bfloat16": 2.0, "bf16": 2.0,
               "float16": 2.0, "fp16": 2.0, "half": 2.0, "float8": 1.0, "fp8": 1.0,
               "float8_e4m3fn": 1.0, "float8_e5m2": 1.0, "int8": 1.0,
               # MXFP4: 4-bit values plus one 8-bit scale per 32 values.
               "mxfp4": 4.25 / 8, "fp4": 4.25 / 8, "int4": 0.5}
# Ceiling dtype key (aggregator.ceilings) for a storage dtype: the tensor path that runs it.
CEILING_DTYPE = {"float32": "fp32", "float": "fp32", "fp32": "fp32", "bfloat16": "bf16",
                 "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
                 "float8": "fp8", "fp8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
                 "int8": "int8", "mxfp4": "fp4", "fp4": "fp4"}


@dataclass(frozen=True)
class ModelShape:
    """Shape of one decoder-only model. Sizes are element counts; ``*_bytes`` per element."""
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int          # dense MLP width (0 when every layer is MoE)
    vocab_size: int
    dtype: str = "bfloat16"         # activations and non-expert weights
    weight_dtype_bytes: float = 2.0
    kv_dtype_bytes: float = 2.0
    num_experts: int = 0            # routed experts per MoE layer (0 = dense model)
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    expert_dtype_bytes: float | None = None   # e.g. MXFP4 experts in gpt-oss
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    source: str = ""

    # ---- parameter counts -------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_params_per_layer(self) -> int:
        h = self.hidden_size
        p = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.attention_bias:
            p += self.q_dim + 2 * self.kv_dim
        return p

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gated MLP)."""
        return 3 * self.hidden_size * (self.moe_intermediate_size or self.intermediate_size)

    @property
    def dense_mlp_params_per_layer(self) -> int:
        if self.is_moe:
            shared = self.num_shared_experts * self.expert_params
            return shared + self.hidden_size * self.num_experts   # + router
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def param_count(self) -> int:
        per_layer = (self.attn_params_per_layer + self.dense_mlp_params_per_layer
                     + self.num_experts * self.expert_params + 2 * self.hidden_size)
        head = 0 if self.tie_word_embeddings else self.lm_head_params
        return self.num_layers * per_layer + self.embedding_params + head + self.hidden_size

    # ---- bytes ------------------------------------------------------------------
    @property
    def _expert_bytes(self) -> float:
        return self.expert_dtype_bytes if self.expert_dtype_bytes is not None else self.weight_dtype_bytes

    @property
    def weight_bytes(self) -> float:
        """All weights resident on the GPU (one copy, no tensor parallelism)."""
        expert = self.num_layers * self.num_experts * self.expert_params
        return (self.param_count - expert) * self.weight_dtype_bytes + expert * self._expert_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes one token occupies: K and V, every layer, every KV head."""
        return 2.0 * self.num_layers * self.kv_dim * self.kv_dtype_bytes

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct routed experts one MoE layer reads for ``tokens`` tokens,
        assuming uniform routing: E * (1 - (1 - k/E)^T)."""
        if not self.is_moe or tokens <= 0:
            return 0.0
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens)

    def weight_bytes_read(self, tokens: int, lm_head: bool = True) -> float:
        """Weight bytes one forward step over ``tokens`` tokens reads from memory: every
        dense weight once, the routed experts the tokens touch once, the LM head once
        (when ``lm_head``: some token of the step computes logits). The embedding table
        is gathered per token, not read whole."""
        if tokens <= 0:
            return 0.0
        per_layer = (self.attn_params_per_layer + self.dense_mlp_params_per_layer
                     + 2 * self.hidden_size) * self.weight_dtype_bytes
        per_layer += self.experts_touched(tokens) * self.expert_params * self._expert_bytes
        emb_rows = min(tokens, self.vocab_size) * self.hidden_size * self.weight_dtype_bytes
        return (self.num_layers * per_layer + emb_rows
                + (self.lm_head_params * self.weight_dtype_bytes if lm_head else 0.0))

    # ---- FLOPs ------------------------------------------------------------------
    def linear_flops_per_token(self) -> float:
        """2 FLOPs per multiply-add over the weights one token passes through (projections,
        MLP or its active experts, router), excluding attention scores and the LM head."""
        per_layer = (self.attn_params_per_layer + self.dense_mlp_params_per_layer
                     + self.experts_per_token * self.expert_params)
        return 2.0 * self.num_layers * per_layer

    def lm_head_flops_per_token(self) -> float:
        return 2.0 * self.lm_head_params

    def attention_flops(self, query_key_pairs: float) -> float:
        """QK^T and PV FLOPs for ``query_key_pairs`` = sum over sequences of the (query,
        key) pairs attended (causal prefill of T tokens: T(T+1)/2; decode: context)."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * query_key_pairs

    @property
    def ceiling_dtype(self) -> str:
        return CEILING_DTYPE.get(self.dtype, "bf16")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(weight_bytes=self.weight_bytes, kv_bytes_per_token=self.kv_bytes_per_token,
                 param_count=self.param_count)
        return d


def _get(cfg: dict, *keys, default=None):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def from_hf_config(cfg: dict, name: str = "") -> ModelShape:
    """Shape from a parsed Hugging Face ``config.json``; raises InputError when a
    required key (hidden size, layers, heads, vocabulary) is missing."""
    if not isinstance(cfg, dict):
        raise InputError(f"{name or 'model config'}: expected a JSON object")
    if "text_config" in cfg and isinstance(cfg["text_config"], dict) and "hidden_size" not in cfg:
        inner = dict(cfg["text_config"])
        inner.setdefault("torch_dtype", cfg.get("torch_dtype"))
        cfg = inner
    try:
        hidden = int(_get(cfg, "hidden_size", "n_embd", "d_model"))
        layers = int(_get(cfg, "num_hidden_layers", "n_layer", "num_layers"))
        heads = int(_get(cfg, "num_attention_heads", "n_head"))
        vocab = int(_get(cfg, "vocab_size"))
    except (TypeError, ValueError):
        raise InputError(f"{name or 'model config'}: needs hidden_size, num_hidden_layers, "
                         "num_attention_heads and vocab_size") from None
    kv_heads = int(_get(cfg, "num_key_value_heads", "num_kv_heads", default=heads))
    head_dim = int(_get(cfg, "head_dim", default=hidden // heads))
    experts = int(_get(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0))
    active = int(_get(cfg, "num_experts_per_tok", "experts_per_token", "num_experts_per_token",
                      default=0))
    inter = int(_get(cfg, "intermediate_size", "n_inner", default=4 * hidden) or 0)
    moe_inter = int(_get(cfg, "moe_intermediate_size", default=inter if experts else 0) or 0)
    shared = int(_get(cfg, "n_shared_experts", "num_shared_experts", default=0) or 0)
    if cfg.get("shared_expert_intermediate_size") and experts:
        # Qwen-MoE: one shared expert of its own width, expressed in routed-expert units.
        shared = max(shared, round(cfg["shared_expert_intermediate_size"] / max(moe_inter, 1)))
    dtype = str(_get(cfg, "torch_dtype", "dtype", default="bfloat16")).replace("torch.", "")
    wbytes = DTYPE_BYTES.get(dtype, 2.0)
    expert_bytes = None
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    if method == "mxfp4":
        expert_bytes = DTYPE_BYTES["mxfp4"]
    elif method in ("fp8", "fbgemm_fp8", "compressed-tensors") and "fp8" in json.dumps(q).lower():
        wbytes = 1.0
    if experts and not active:
        raise InputError(f"{name or 'model config'}: MoE config without num_experts_per_tok")
    return ModelShape(
        name=name or str(_get(cfg, "_name_or_path", "model_type", default="model")),
        hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=0 if (experts and "moe_intermediate_size" not in cfg
                                                   and not shared) else inter,
        vocab_size=vocab, dtype=dtype, weight_dtype_bytes=wbytes, kv_dtype_bytes=2.0,
        num_experts=experts, experts_per_token=active, moe_intermediate_size=moe_inter,
        num_shared_experts=shared, expert_dtype_bytes=expert_bytes,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") in ("qwen2", "qwen2_moe"))),
        source=str(cfg.get("_source", "config.json")),
    )


# Built-in shapes: the config.json keys of each model's Hugging Face repository, copied
# as numbers (the repository each came from is in ``_source``).
BUILTIN: dict[str, dict] = {
    "llama-3-8b": {"_source": "meta-llama/Meta-Llama-3-8B config.json", "model_type": "llama",
                   "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                   "torch_dtype": "bfloat16", "tie_word_embeddings": False},
    "qwen1.5-0.5b": {"_source": "Qwen/Qwen1.5-0.5B config.json", "model_type": "qwen2",
                     "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                     "num_key_value_heads": 16, "intermediate_size": 2816, "vocab_size": 151936,
                     "torch_dtype": "bfloat16", "tie_word_embeddings": True},
    "qwen3-0.6b": {"_source": "Qwen/Qwen3-0.6B config.json", "model_type": "qwen3",
                   "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
                   "vocab_size": 151936, "torch_dtype": "bfloat16", "tie_word_embeddings": True},
    "mixtral-8x7b": {"_source": "mistralai/Mixtral-8x7B-v0.1 config.json", "model_type": "mixtral",
                     "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "torch_dtype": "bfloat16"},
    "gpt-oss-120b": {"_source": "openai/gpt-oss-120b config.json", "model_type": "gpt_oss",
                     "hidden_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
                     "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
                     "vocab_size": 201088, "num_local_experts": 128, "experts_per_token": 4,
                     "num_experts_per_tok": 4, "attention_bias": True, "torch_dtype": "bfloat16",
                     "tie_word_embeddings": False, "quantization_config": {"quant_method": "mxfp4"}},
    # Layers, heads, head size, hidden size and vocabulary also read off the MI300X vLLM
    # trace (tests/THIRD_PARTY.md: 24 attention layers, q [8192, 64, 64], k [8192, 8, 64],
    # LM head [46, 2880] x [2880, 201088]); experts as the config mirrored in
    # EchoCog/gpt-oss-20b docs/gpt-oss-20b-architecture.md.
    "gpt-oss-20b": {"_source": "openai/gpt-oss-20b config.json", "model_type": "gpt_oss",
                    "hidden_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
                    "vocab_size": 201088, "num_local_experts": 32, "experts_per_token": 4,
                    "num_experts_per_tok": 4, "attention_bias": True, "torch_dtype": "bfloat16",
                    "tie_word_embeddings": False, "quantization_config": {"quant_method": "mxfp4"}},
}


def builtin(name: str) -> ModelShape:
    key = name.lower()
    if key not in BUILTIN:
        raise InputError(f"unknown built-in model {name!r}; known: {', '.join(BUILTIN)}")
    return from_hf_config(BUILTIN[key], name=key)


def load(spec: str | Path) -> ModelShape:
    """A built-in name, a ``config.json`` path, or a folder holding ``config.json``."""
    s = str(spec)
    if s.lower() in BUILTIN:
        return builtin(s)
    p = Path(s)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise InputError(f"{spec}: no such model config (and not a built-in: {', '.join(BUILTIN)})")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: cannot read model config: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{p}: not JSON: {exc.msg} at line {exc.lineno}") from None
    return from_hf_config(cfg, name=p.parent.name or p.stem)
