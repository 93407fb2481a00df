"""Peak ceilings per GPU model: dense FLOP/s per dtype and device-memory bytes/s.

The table lives in ``aggregator/data/gpu_ceilings.toml``, one entry per GPU model with
the datasheet each figure comes from. A user TOML of the same layout (``--ceilings`` or
``$RIDGELINE_CEILINGS``) adds models or replaces built-in ones by ``key``.

Public contract:

* :class:`Ceilings` -- one GPU model's peaks and citation.
* :func:`lookup` -- by table key (``"h100-sxm"``), display name or device name; raises
  :class:`InputError` naming the known keys when nothing matches.
* :func:`from_device_name` -- the entry for a device name as a trace or NVML reports it
  (``"NVIDIA H100 80GB HBM3"``), disambiguated by memory size and SM count when given;
  ``None`` when the model is not in the table.
* :meth:`Ceilings.ridge_point` -- peak FLOP/s / peak bytes/s (FLOP per byte) for a dtype.
"""
from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ridgeline.probes.errors import InputError

DATA_PATH = Path(__file__).parent / "data" / "gpu_ceilings.toml"
ENV_USER_TABLE = "RIDGELINE_CEILINGS"

# Accepted dtype keys, and aliases mapped onto them (bf16 and fp16 share tensor rates on
# every GPU in the table, but both keys are kept so a table can differ).
DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "fp4", "int8")
DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16",
                 "bfloat16": "bf16", "float8": "fp8", "e4m3": "fp8", "e5m2": "fp8",
                 "mxfp4": "fp4", "nvfp4": "fp4", "float64": "fp64", "double": "fp64"}
DEFAULT_DTYPE = "bf16"


@dataclass(frozen=True)
class Ceilings:
    """Peaks of one GPU model.

    ``flops_per_s`` maps dtype key (see :data:`DTYPES`) to dense FLOP/s (OP/s for int8);
    a dtype the GPU has no tensor path for is absent. ``source`` holds ``document``,
    ``url`` and ``date`` of the datasheet; ``origin`` says which table file it came from.
    """
    key: str
    gpu: str
    hbm_bytes_per_s: float
    flops_per_s: dict[str, float]
    memory_bytes: float | None = None
    sm_count: int | None = None
    source: dict = field(default_factory=dict)
    note: str = ""
    origin: str = "builtin"
    match: tuple[str, ...] = ()

    def peak_flops_per_s(self, dtype: str | None) -> tuple[float, str]:
        """Peak for ``dtype`` and the dtype key actually used.

        Falls back to bf16, then fp16, then fp32 when the GPU has no figure for the dtype
        (e.g. fp8 on an A100, which runs fp8 models through bf16 paths).
        """
        d = normalize_dtype(dtype) if dtype else DEFAULT_DTYPE
        for k in (d, "bf16", "fp16", "fp32"):
            if k in self.flops_per_s:
                return self.flops_per_s[k], k
        raise InputError(f"ceilings for {self.gpu} have no FLOP/s figure")

    def ridge_point(self, dtype: str | None = None) -> float:
        """Arithmetic intensity (FLOP/byte) where the compute and memory roofs meet."""
        return self.peak_flops_per_s(dtype)[0] / self.hbm_bytes_per_s

    def to_dict(self) -> dict:
        return {"key": self.key, "name": self.gpu, "hbm_bytes_per_s": self.hbm_bytes_per_s,
                "flops_per_s": dict(self.flops_per_s), "memory_bytes": self.memory_bytes,
                "sm_count": self.sm_count, "source": dict(self.source), "note": self.note,
                "origin": self.origin}


def normalize_dtype(dtype: str) -> str:
    d = dtype.strip().lower().replace("torch.", "")
    d = DTYPE_ALIASES.get(d, d)
    if d not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    return d


def _parse_table(text: str, origin: str) -> list[Ceilings]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{origin}: not valid TOML: {exc}") from None
    entries = doc.get("gpu")
    if not isinstance(entries, list):
        raise InputError(f"{origin}: expected [[gpu]] tables")
    out = []
    for i, e in enumerate(entries):
        where = f"{origin}: [[gpu]] #{i + 1}"
        try:
            key = str(e["key"])
            flops = {normalize_dtype(k): float(v) for k, v in dict(e["flops_per_s"]).items()}
            bw = float(e["hbm_bytes_per_s"])
        except KeyError as exc:
            raise InputError(f"{where}: missing {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise InputError(f"{where}: bad value: {exc}") from None
        if bw <= 0 or not flops or any(v <= 0 for v in flops.values()):
            raise InputError(f"{where} ({key}): ceilings must be positive")
        patterns = tuple(str(p) for p in e.get("match", ()))
        for p in patterns:
            try:
                re.compile(p)
            except re.error as exc:
                raise InputError(f"{where} ({key}): bad match pattern {p!r}: {exc}") from None
        src = e.get("source", {})
        if isinstance(src, str):
            src = {"document": src}
        out.append(Ceilings(
            key=key, gpu=str(e.get("name", key)), hbm_bytes_per_s=bw, flops_per_s=flops,
            memory_bytes=float(e["memory_bytes"]) if "memory_bytes" in e else None,
            sm_count=int(e["sm_count"]) if "sm_count" in e else None,
            source=dict(src), note=str(e.get("note", "")), origin=origin, match=patterns))
    return out


@lru_cache(maxsize=16)
def _parsed_file(path: str, origin: str, mtime_ns: int, size: int) -> tuple[Ceilings, ...]:
    # Keyed by modification time and size: an edited file is parsed again, an unchanged
    # one is parsed once per process (the agent looks ceilings up every window).
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ceilings table: {exc.strerror or exc}") from None
    return tuple(_parse_table(text, origin))


def _table_file(path: Path, origin: str) -> tuple[Ceilings, ...]:
    try:
        st = path.stat()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ceilings table: {exc.strerror or exc}") from None
    return _parsed_file(str(path), origin, st.st_mtime_ns, st.st_size)


def load_table(user_path: str | Path | None = None) -> dict[str, Ceilings]:
    """Built-in table, overlaid with a user TOML (argument, else ``$RIDGELINE_CEILINGS``).

    User entries replace built-in entries of the same ``key``; new keys are added. Each
    file is parsed once per process while its modification time and size stay the same
    (entries are frozen; the returned dict is the caller's own).
    """
    table = {c.key: c for c in _table_file(DATA_PATH, "builtin")}
    path = user_path or os.environ.get(ENV_USER_TABLE)
    if path:
        p = Path(path)
        for c in _table_file(p, str(p)):
            table[c.key] = c
    return table


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "", s.lower())


def from_device_name(name: str, memory_bytes: float | None = None, sm_count: int | None = None,
                     table: dict[str, Ceilings] | None = None) -> Ceilings | None:
    """Entry for a device name as reported by CUDA/NVML, or ``None`` when unknown.

    Candidates are the entries with a ``match`` pattern that matches; between several,
    the one whose memory size is nearest to ``memory_bytes`` wins, then the one whose SM
    count equals ``sm_count`` (e.g. "NVIDIA A100-PG509-200" with 42 GB -> A100 SXM4 40GB).
    User entries are tried before built-in ones.
    """
    table = table if table is not None else load_table()
    name = name.strip()
    cands = [c for c in table.values() if any(re.search(p, name, re.IGNORECASE) for p in c.match)]
    if not cands:
        return None
    if len(cands) == 1:
        return cands[0]

    def rank(c: Ceilings):
        user_first = 0 if c.origin != "builtin" else 1
        sm_miss = 0 if (sm_count is None or c.sm_count is None or c.sm_count == sm_count) else 1
        mem_dist = (abs(c.memory_bytes - memory_bytes) if memory_bytes and memory_bytes > 0
                    and c.memory_bytes else 0.0)
        # Patterns listed first are the specific ones; a generic fallback pattern loses.
        specific = 0 if any(re.search(p, name, re.IGNORECASE) for p in c.match[:1]) else 1
        return (user_first, sm_miss, mem_dist, specific)

    return min(cands, key=rank)


# Short names a user types for a family with several parts: the SXM part, the one the
# simulator and demo mean by it (one table, so `capacity --gpu h100` and `demo --gpu h100`
# agree). Not "a100": its parts differ in memory (40 or 80 GB) and bandwidth, so the
# part must be named.
SHORT_NAMES = {"h100": "h100-sxm", "h200": "h200-sxm", "h800": "h800-sxm"}


def lookup(name: str, table: dict[str, Ceilings] | None = None, memory_bytes: float | None = None,
           sm_count: int | None = None) -> Ceilings:
    """Entry by key, display name, device name (case and punctuation ignored) or one of
    :data:`SHORT_NAMES`.

    Raises :class:`InputError` listing the known keys when nothing matches.
    """
    table = table if table is not None else load_table()
    if name in table:
        return table[name]
    short = SHORT_NAMES.get(name.strip().lower())
    if short in table:
        return table[short]
    n = _norm(name)
    for c in table.values():
        if n in (_norm(c.key), _norm(c.gpu)):
            return c
    c = from_device_name(name, memory_bytes, sm_count, table)
    if c is None:
        # Loose form: "h100" or "A100 80GB" style names typed by a user.
        loose = [c for c in table.values() if n and (n in _norm(c.key) or n in _norm(c.gpu))]
        if len(loose) == 1:
            return loose[0]
        known = ", ".join(sorted(table))
        if loose:
            raise InputError(f"GPU {name!r} is ambiguous: {', '.join(x.key for x in loose)}")
        raise InputError(f"unknown GPU {name!r}; known: {known} (or add one with --ceilings FILE)")
    return c
