"""Model shapes for the simulator: a Hugging Face ``config.json`` or a built-in name.

:func:`load_model` prefers :mod:`aggregator.model_config` (the project's one parser of
model configs) and adapts its ``ModelShape`` to :class:`SimModel`; when that module is
not installed it reads the config itself (the standard HF keys only) or uses the
built-in shapes below, copied from the models' published ``config.json`` files.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from probes.errors import InputError


@dataclass(frozen=True)
class SimModel:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2
    tied_embeddings: bool = False

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return 2 * self.kv_dim * self.layers * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        per_layer = (self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
                     + 3 * self.hidden * self.intermediate + 2 * self.hidden)
        emb = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return (per_layer * self.layers + emb + self.hidden) * self.dtype_bytes

    def dims(self) -> dict:
        """The names usable in engine_kernels.toml expressions."""
        return {"hidden": self.hidden, "intermediate": self.intermediate, "q_dim": self.q_dim,
                "kv_dim": self.kv_dim, "qkv_dim": self.q_dim + 2 * self.kv_dim,
                "head_dim": self.head_dim, "heads": self.heads, "kv_heads": self.kv_heads,
                "vocab": self.vocab, "dtype": self.dtype_bytes}


# From the models' config.json on their Hugging Face model pages.
BUILTIN = {
    "qwen1.5-0.5b": SimModel("Qwen/Qwen1.5-0.5B", 1024, 24, 16, 16, 64, 2816, 151936, 2, True),
    "llama-3.1-8b": SimModel("meta-llama/Llama-3.1-8B", 4096, 32, 32, 8, 128, 14336, 128256, 2, False),
    "qwen2.5-7b": SimModel("Qwen/Qwen2.5-7B", 3584, 28, 28, 4, 128, 18944, 152064, 2, False),
    "llama-3.1-70b": SimModel("meta-llama/Llama-3.1-70B", 8192, 80, 64, 8, 128, 28672, 128256, 2, False),
}

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "float8_e4m3fn": 1}


def _from_hf_dict(name: str, cfg: dict) -> SimModel:
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return SimModel(
            name=name, hidden=hidden, layers=int(cfg["num_hidden_layers"]), heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate=int(cfg["intermediate_size"]), vocab=int(cfg["vocab_size"]),
            dtype_bytes=_DTYPE_BYTES.get(str(cfg.get("torch_dtype", "bfloat16")), 2),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{name}: not a decoder config.json this simulator understands ({exc})") from None


def _adapt(shape, name: str) -> SimModel:
    """SimModel from an aggregator.model_config.ModelShape (attribute names tolerant)."""
    def get(*names, default=None):
        for n in names:
            v = getattr(shape, n, None)
            if v is not None:
                return v
        return default
    hidden = int(get("hidden", "hidden_size"))
    heads = int(get("heads", "num_heads", "num_attention_heads"))
    return SimModel(
        name=str(get("name", default=name)), hidden=hidden, layers=int(get("layers", "num_layers")),
        heads=heads, kv_heads=int(get("kv_heads", "num_kv_heads", default=heads)),
        head_dim=int(get("head_dim", default=hidden // heads)),
        intermediate=int(get("intermediate", "intermediate_size")), vocab=int(get("vocab", "vocab_size")),
        dtype_bytes=int(get("dtype_bytes", "bytes_per_param", default=2)),
        tied_embeddings=bool(get("tied_embeddings", "tie_word_embeddings", default=False)))


def load_model(spec: str) -> SimModel:
    """A model from a built-in name or a path to an HF ``config.json`` (or its folder)."""
    key = spec.lower().split("/")[-1]
    if key in BUILTIN:
        return BUILTIN[key]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise InputError(f"model {spec!r}: neither a built-in ({', '.join(BUILTIN)}) nor a config.json path")
    try:
        from aggregator import model_config as _mc
        for fn_name in ("from_config_json", "load_config", "from_hf_config", "load"):
            fn = getattr(_mc, fn_name, None)
            if fn is not None:
                return _adapt(fn(path), path.parent.name or spec)
    except ImportError:
        pass
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot read config.json ({exc})") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{path}: config.json is not a JSON object")
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = cfg["text_config"]
    return _from_hf_dict(path.parent.name or spec, cfg)
