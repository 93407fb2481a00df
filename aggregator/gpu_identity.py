"""Which physical GPU (NVML index and UUID) a served process's CUDA device is (pure).

CUPTI records name a GPU by the CUDA device ordinal *inside the profiled process*; NVML
and dcgm-exporter name it by the NVML index (PCI order over the whole host) and UUID.
The two differ whenever the process sees a subset of the GPUs: ``CUDA_VISIBLE_DEVICES=3``,
a Kubernetes pod given one GPU (device 0 inside is, say, GPU 5 of the node), a Ray
worker. Taking the ordinal for the NVML index then labels the series with another GPU's
``gpu`` and ``UUID``, and a join with dcgm-exporter silently returns the wrong GPU.

NVML lists the processes running on each GPU (``processes`` of a device record), which
places a process without trusting its environment:

* the process runs on exactly one GPU and one CUDA ordinal of it is seen: that GPU;
* it runs on several GPUs and the ordinals seen are among their NVML indices: identity
  (no ``CUDA_VISIBLE_DEVICES``; a reordering such as ``CUDA_VISIBLE_DEVICES=1,0`` of
  exactly those GPUs is the one case this cannot tell);
* anything else (several GPUs in another order, not listed by NVML, no NVML): unknown,
  ``None``; the caller must not attach a UUID it cannot vouch for.
"""
from __future__ import annotations

from typing import Iterable


def process_gpus(nvml_records: Iterable[dict]) -> dict[int, list[tuple[int, str, str]]] | None:
    """``pid -> [(NVML index, UUID, name), ...]`` (ascending index) from NVML device
    records; None when no record carries a process list (NVML did not say)."""
    out: dict[int, list[tuple[int, str, str]]] = {}
    known = False
    for r in nvml_records:
        if not isinstance(r, dict) or r.get("gpu_index") is None:
            continue
        procs = r.get("processes")
        if procs is None:
            continue
        known = True
        gpu = (int(r["gpu_index"]), str(r.get("gpu_uuid") or ""), str(r.get("gpu_name") or ""))
        for p in procs:
            try:
                pid = int(p["pid"])
            except (KeyError, TypeError, ValueError):
                continue
            if gpu not in out.setdefault(pid, []):
                out[pid].append(gpu)
    if not known:
        return None
    for gpus in out.values():
        gpus.sort()
    return out


def place(pid: int, ordinals: Iterable[int],
          placed: dict[int, list[tuple[int, str, str]]]) -> dict[int, tuple[int, str, str]]:
    """``CUDA ordinal -> (NVML index, UUID, name)`` for the ordinals of ``pid`` seen in a
    window, where NVML's process lists make it certain (module docstring); ordinals
    that cannot be placed are left out."""
    ords = sorted(set(int(o) for o in ordinals))
    gpus = placed.get(int(pid)) or []
    if len(gpus) == 1 and len(ords) == 1:
        return {ords[0]: gpus[0]}
    by_index = {g[0]: g for g in gpus}
    if len(gpus) > 1 and ords and all(o in by_index for o in ords):
        return {o: by_index[o] for o in ords}
    return {}
