"""Model shapes for the simulator, from :mod:`aggregator.model_config` (a built-in name,
a Hugging Face ``config.json``, or its folder), reduced to what the simulator needs.

Dense decoder models only: a mixture-of-experts model is refused with a clear error
(its per-step expert routing is not simulated).
"""
from __future__ import annotations

from dataclasses import dataclass

from ridgeline.aggregator import model_config as _mc
from ridgeline.probes.errors import InputError


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
    dtype_bytes: int
    weight_bytes: float
    kv_bytes_per_token: float

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def dims(self) -> dict:
        """The names usable in engine_kernels.toml expressions."""
        return {"hidden": self.hidden, "intermediate": self.intermediate, "q_dim": self.q_dim,
                "kv_dim": self.kv_dim, "qkv_dim": self.q_dim + 2 * self.kv_dim,
                "head_dim": self.head_dim, "heads": self.heads, "kv_heads": self.kv_heads,
                "vocab": self.vocab, "dtype": self.dtype_bytes}


def from_shape(s) -> SimModel:
    if s.is_moe:
        raise InputError(f"model {s.name}: mixture-of-experts models are not simulated (dense decoders only)")
    return SimModel(name=s.name, hidden=s.hidden_size, layers=s.num_layers, heads=s.num_heads,
                    kv_heads=s.num_kv_heads, head_dim=s.head_dim, intermediate=s.intermediate_size,
                    vocab=s.vocab_size, dtype_bytes=int(round(s.weight_dtype_bytes)),
                    weight_bytes=float(s.weight_bytes), kv_bytes_per_token=float(s.kv_bytes_per_token))


def load_model(spec: str) -> SimModel:
    """A model from a built-in name or an HF ``config.json`` path (or its folder)."""
    return from_shape(_mc.load(spec))
