"""Per-engine kernel naming and grid conventions, read from
``aggregator/data/engine_kernels.toml`` (the data file documents its sources).

:func:`load_engine` returns an :class:`EngineConventions` whose op lists are plain
dicts with their size expressions already evaluated for one model.
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ridgeline.probes.errors import InputError

DATA = Path(__file__).resolve().parents[2] / "aggregator" / "data" / "engine_kernels.toml"

_TERM = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$|^\d+$")


def evaluate(expr: str | int | None, dims: dict) -> int:
    """Value of a sum of products of integers and dimension names, e.g. ``2*q_dim*dtype + 8``."""
    if expr is None:
        return 0
    if isinstance(expr, int):
        return expr
    total = 0
    for term in str(expr).split("+"):
        prod = 1
        for factor in term.split("*"):
            f = factor.strip()
            if not _TERM.match(f):
                raise InputError(f"engine_kernels.toml: bad expression {expr!r}")
            if f.isdigit():
                prod *= int(f)
            elif f in dims:
                prod *= int(dims[f])
            else:
                raise InputError(f"engine_kernels.toml: unknown dimension {f!r} in {expr!r}")
        total += prod
    return total


@dataclass
class EngineConventions:
    engine: str
    description: str
    host_overhead_ns: int
    launch_api_ns: int
    launch_api: str
    annotation: str
    attention: dict
    gemm_tiers: list[dict]
    prologue: list[dict]
    layer: list[dict]
    epilogue: list[dict]
    norm: list[dict]
    sources: list[str]

    def gemm_tier(self, m: int) -> dict:
        for tier in self.gemm_tiers:
            if m <= tier["max_m"]:
                return tier
        return self.gemm_tiers[-1]


def _ops(entries: list[dict], dims: dict) -> list[dict]:
    out = []
    for e in entries:
        op = dict(e)
        for key in ("bytes_per_token", "bytes_per_sequence", "n", "k"):
            if key in op:
                op[key] = evaluate(op[key], dims)
        op.setdefault("repeat", 1)
        out.append(op)
    return out


def load_engine(engine: str, dims: dict, path: Path = DATA) -> EngineConventions:
    """Conventions of ``engine`` (``vllm``, ``hf``) with expressions evaluated for ``dims``."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InputError(f"{path}: cannot read engine conventions ({exc})") from None
    table = data.get("engine", {})
    if engine not in table:
        raise InputError(f"unknown engine {engine!r}; known: {', '.join(sorted(table))}")
    e = table[engine]
    att = dict(e["attention"])
    for key in ("prefill", "decode", "combine"):
        att[key] = att[key].replace("{head_dim}", str(dims["head_dim"]))
    return EngineConventions(
        engine=engine, description=e.get("description", ""),
        host_overhead_ns=int(e.get("host_overhead_ns", 200_000)),
        launch_api_ns=int(e.get("launch_api_ns", 5_000)),
        launch_api=e.get("launch_api", "cudaLaunchKernel"),
        annotation=e.get("annotation", ""), attention=att,
        gemm_tiers=sorted(e["gemm"], key=lambda t: t["max_m"]),
        prologue=_ops(e.get("prologue", []), dims), layer=_ops(e.get("layer", []), dims),
        epilogue=_ops(e.get("epilogue", []), dims), norm=_ops(e.get("norm", []), dims),
        sources=list(e.get("sources", [])))
