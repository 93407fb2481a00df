"""Capacity planning: how many requests fit in the KV-cache pool at once (pure).

The concurrency ceiling of a serving engine is ``floor(KV pool / KV per request)``:

* KV pool = GPU memory x the engine's memory fraction - weights - a reserve for
  activations, CUDA graphs and the allocator (vLLM: ``gpu_memory_utilization`` x total
  minus the weights and the profiled activation peak); or given directly, or read from the
  engine (``kv_pool_tokens``, e.g. vLLM ``num_gpu_blocks x block_size``).
* KV per request = bytes per token (2 x layers x KV heads x head dim x KV dtype bytes,
  :attr:`aggregator.model_config.ModelShape.kv_bytes_per_token`) x the tokens a request
  holds at its longest (prompt + output).

The ceiling is a worst case for requests that all reach that length; paged KV lets more
shorter requests share the pool. Raising the maximum output length raises KV per request,
lowers the ceiling and lengthens the queue (the capacity triangle of the design notes).
"""
from __future__ import annotations

import math
from typing import Any

GB = 1e9
GiB = float(1 << 30)


def kv_bytes_per_token(shape: Any) -> float:
    """KV bytes per token of a model shape (``aggregator.model_config.ModelShape`` or any
    object with ``kv_bytes_per_token`` as a property or method)."""
    v = shape.kv_bytes_per_token
    return float(v() if callable(v) else v)


def kv_pool_bytes(gpu_memory_bytes: float, weight_bytes: float, memory_fraction: float = 1.0,
                  reserve_bytes: float = 0.0) -> float:
    """Bytes left for the KV cache: ``gpu x fraction - weights - reserve`` (never negative)."""
    if gpu_memory_bytes <= 0:
        raise ValueError("GPU memory must be positive")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {memory_fraction}")
    return max(0.0, gpu_memory_bytes * memory_fraction - weight_bytes - reserve_bytes)


def kv_bytes_per_request(bytes_per_token: float, prompt_tokens: int, output_tokens: int = 0) -> float:
    """KV bytes one request holds at its longest (prompt plus generated tokens)."""
    if prompt_tokens < 0 or output_tokens < 0:
        raise ValueError("token counts must not be negative")
    return bytes_per_token * (prompt_tokens + output_tokens)


def concurrency_ceiling(pool_bytes: float, per_request_bytes: float) -> int:
    """How many requests of ``per_request_bytes`` fit in ``pool_bytes`` at once."""
    if per_request_bytes <= 0:
        raise ValueError("KV per request must be positive")
    # A hair of tolerance so 60 GB / 0.5 GB is 120, not 119 from float rounding.
    return int(math.floor(pool_bytes / per_request_bytes + 1e-9))


def plan(*, gpu_memory_bytes: float | None = None, weight_bytes: float | None = None,
         pool_bytes: float | None = None, memory_fraction: float = 1.0, reserve_bytes: float = 0.0,
         per_request_bytes: list[float] | None = None, bytes_per_token: float | None = None,
         context_tokens: list[int] | None = None, output_tokens: int = 0) -> dict:
    """Capacity plan: the pool and one row per request footprint.

    Give ``pool_bytes``, or ``gpu_memory_bytes`` and ``weight_bytes`` (with the engine's
    ``memory_fraction`` and a ``reserve_bytes``); and either ``per_request_bytes`` or
    ``bytes_per_token`` with ``context_tokens`` (prompt lengths) and ``output_tokens``.
    """
    warnings = []
    if pool_bytes is None:
        if gpu_memory_bytes is None or weight_bytes is None:
            raise ValueError("need the KV pool size, or GPU memory and weight bytes")
        pool_bytes = kv_pool_bytes(gpu_memory_bytes, weight_bytes, memory_fraction, reserve_bytes)
        pool_source = "gpu_memory x fraction - weights - reserve"
        if pool_bytes <= 0:
            # Every ceiling below is then 0: say why rather than print zeros as a plan.
            warnings.append(f"weights {weight_bytes / GB:.1f} GB + reserve {reserve_bytes / GB:.1f} GB leave no KV "
                            f"pool in {gpu_memory_bytes / GB:.1f} GB x {memory_fraction:.2f}: the model does not "
                            "fit on this GPU (give the weights per GPU when it is split across GPUs)")
    else:
        pool_source = "given"
    rows = []
    for b in per_request_bytes or []:
        rows.append({"kv_per_request_bytes": b, "context_tokens": None,
                     "concurrency_ceiling": concurrency_ceiling(pool_bytes, b)})
    if bytes_per_token is not None:
        for ctx in context_tokens or []:
            b = kv_bytes_per_request(bytes_per_token, ctx, output_tokens)
            rows.append({"kv_per_request_bytes": b, "context_tokens": ctx + output_tokens,
                         "concurrency_ceiling": concurrency_ceiling(pool_bytes, b)})
    if not rows:
        raise ValueError("need a KV footprint per request (bytes, or bytes per token and context lengths)")
    return {"gpu_memory_bytes": gpu_memory_bytes, "weight_bytes": weight_bytes,
            "memory_fraction": memory_fraction, "reserve_bytes": reserve_bytes,
            "kv_pool_bytes": pool_bytes, "kv_pool_source": pool_source,
            "kv_bytes_per_token": bytes_per_token, "output_tokens": output_tokens, "rows": rows,
            "warnings": warnings}


def ceiling_from_pool_tokens(pool_tokens: float, tokens_per_request: float) -> int:
    """Ceiling from an engine-reported pool in tokens (vLLM blocks x block size)."""
    if tokens_per_request <= 0:
        raise ValueError("tokens per request must be positive")
    return int(math.floor(pool_tokens / tokens_per_request + 1e-9))


_UNITS = {"b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 1024.0, "mib": float(1 << 20), "gib": GiB, "tib": float(1 << 40)}


def parse_size(text: str, default_unit: str = "gb") -> float:
    """``"80GB"``, ``"0.5 GiB"``, ``"60"`` (in ``default_unit``) -> bytes; ValueError if not a size."""
    s = str(text).strip().lower().replace(" ", "")
    i = len(s)
    while i and s[i - 1].isalpha():
        i -= 1
    num, unit = s[:i], s[i:] or default_unit
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (use B, MB, GB, GiB, ...)")
    try:
        v = float(num)
    except ValueError:
        raise ValueError(f"not a size: {text!r}") from None
    if v < 0 or not math.isfinite(v):
        raise ValueError(f"not a size: {text!r}")
    return v * _UNITS[unit]
