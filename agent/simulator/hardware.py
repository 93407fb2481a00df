"""GPU facts the simulator needs, from the project's ceilings table
(:mod:`aggregator.ceilings`, datasheet figures with citations).

Short names a user types resolve to the SXM parts (``h100`` -> ``h100-sxm``); any key,
display name or device name the table knows works too.
"""
from __future__ import annotations

from dataclasses import dataclass

from ridgeline.aggregator import ceilings as _ceilings
from ridgeline.probes.errors import InputError

# The ceilings table's short names, and the simulator's own default A100 part.
ALIASES = {**_ceilings.SHORT_NAMES, "a100": "a100-sxm4-80gb"}


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model as the simulator uses it."""
    key: str
    name: str
    flops_per_s: float            # dense tensor FLOP/s for the model's dtype
    hbm_bytes_per_s: float
    memory_bytes: float
    sm_count: int
    source: str = ""

    @property
    def ridge_flops_per_byte(self) -> float:
        return self.flops_per_s / self.hbm_bytes_per_s


def gpu_spec(name: str, dtype: str = "bf16") -> GpuSpec:
    """The spec of GPU ``name``; :class:`InputError` when unknown or incomplete."""
    c = _ceilings.lookup(ALIASES.get(name.lower(), name))
    flops = c.flops_per_s.get(_ceilings.normalize_dtype(dtype)) or c.flops_per_s.get("bf16")
    if not flops or not c.memory_bytes:
        raise InputError(f"GPU {name!r}: the ceilings table lacks {dtype} FLOP/s or the memory size")
    src = c.source.get("document", "") if isinstance(c.source, dict) else str(c.source)
    return GpuSpec(c.key, c.gpu, float(flops), float(c.hbm_bytes_per_s), float(c.memory_bytes),
                   int(c.sm_count or 132), source=f"aggregator.ceilings[{c.key}]: {src}")
