"""GPU facts the simulator needs: compute and bandwidth ceilings, and memory size.

Ceilings come from :mod:`aggregator.ceilings` when it is installed (one table for the
whole project); the memory size, which that table may not carry, and a fallback for the
ceilings come from the datasheet figures below (dense, no sparsity).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from probes.errors import InputError

# Datasheet figures: NVIDIA H100 SXM5 80GB (989.4 TFLOP/s dense BF16, 3.35 TB/s HBM3),
# H200 SXM 141GB (989.4 TFLOP/s, 4.8 TB/s), A100 SXM4 80GB (312 TFLOP/s, 2.039 TB/s),
# L40S 48GB (362.05 TFLOP/s dense BF16, 864 GB/s), L4 24GB (121 TFLOP/s dense BF16,
# 300 GB/s). Memory as marketed (decimal GB).
_FALLBACK = {
    "h100": ("NVIDIA H100 80GB HBM3", 989.4e12, 3.35e12, 80e9, 132),
    "h200": ("NVIDIA H200", 989.4e12, 4.8e12, 141e9, 132),
    "a100": ("NVIDIA A100-SXM4-80GB", 312e12, 2.039e12, 80e9, 108),
    "l40s": ("NVIDIA L40S", 362.05e12, 864e9, 48e9, 142),
    "l4": ("NVIDIA L4", 121e12, 300e9, 24e9, 58),
}
_SOURCE = "datasheet figures in agent/simulator/hardware.py (fallback; aggregator.ceilings absent)"


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model as the simulator uses it."""
    key: str
    name: str
    flops_per_s: float            # dense BF16 tensor FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float
    sm_count: int
    source: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ridge_flops_per_byte(self) -> float:
        return self.flops_per_s / self.hbm_bytes_per_s


def _normalise(name: str) -> str:
    n = name.lower().replace("nvidia", "").replace("-", "").replace(" ", "")
    for key in ("h200", "h100", "a100", "l40s", "l4"):
        if key in n:
            return key
    return n


def gpu_spec(name: str) -> GpuSpec:
    """The spec of GPU ``name`` (``h100``, ``H200``, ``NVIDIA A100-SXM4-80GB`` ...).

    Raises :class:`InputError` naming the known GPUs when ``name`` is unknown.
    """
    key = _normalise(name)
    fb = _FALLBACK.get(key)
    ceil = None
    try:   # the project's ceilings table wins where it knows the GPU
        from aggregator import ceilings as _ceilings
        try:
            ceil = _ceilings.lookup(name)
        except Exception:
            ceil = _ceilings.from_device_name(fb[0] if fb else name)
    except ImportError:
        ceil = None
    if ceil is None and fb is None:
        raise InputError(f"unknown GPU {name!r}; known: {', '.join(sorted(_FALLBACK))}")
    if ceil is not None:
        flops = dict(getattr(ceil, "flops_per_s", {}) or {})
        bf16 = flops.get("bf16") or flops.get("bfloat16") or flops.get("fp16") or (fb[1] if fb else None)
        mem = getattr(ceil, "memory_bytes", None) or getattr(ceil, "hbm_bytes", None) or (fb[3] if fb else None)
        if bf16 is None or mem is None:
            raise InputError(f"GPU {name!r}: ceilings table lacks bf16 FLOP/s or memory size")
        src = getattr(ceil, "source", "")
        return GpuSpec(key, getattr(ceil, "gpu", fb[0] if fb else name), float(bf16),
                       float(ceil.hbm_bytes_per_s), float(mem), fb[4] if fb else 132,
                       source=f"aggregator.ceilings: {src}" if src else "aggregator.ceilings")
    return GpuSpec(key, fb[0], fb[1], fb[2], fb[3], fb[4], source=_SOURCE)


def known_gpus() -> list[str]:
    return sorted(_FALLBACK)
