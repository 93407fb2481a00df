"""Measured hardware counters attributed to phases by time overlap with the kernel timeline.

Sources (collected elsewhere, passed in as plain arrays):

* CUPTI PM sampling (probes/cupti/pm_sampler.py): per sample interval, *counts* such as
  DRAM bytes read/written or tensor-pipe operations. These are extensive: a sample's
  count is split among phases in proportion to each phase's kernel time inside the
  sample interval.
* NVML GPM (probes/nvml.py): per interval, *utilisations* such as DRAM bandwidth
  utilisation or tensor utilisation (percent of cycles). These are intensive: a phase
  gets the kernel-time-weighted mean of the samples it overlaps. A DRAM utilisation can
  be turned into bytes/s with the GPU's HBM ceiling; a tensor utilisation is a cycle
  fraction and is never turned into FLOP/s (NVIDIA says there is no such conversion).

Every figure this module returns is tagged ``work_source: "measured"`` with the counter
source and the fraction of the phase's kernel time the samples covered
(``coverage_ratio``). Kernel time here is the sum of kernel durations (concurrent
kernels count twice), the same measure the roofline uses. Pure numpy, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ridgeline.probes.records import PHASE_NAMES

EXTENSIVE = "count"        # a quantity per interval (bytes, ops): split by overlap share
INTENSIVE = "ratio"        # a level over the interval (utilisation 0..1): overlap-weighted mean


@dataclass
class CounterSamples:
    """Columnar samples of one source: intervals and one array per metric.

    ``kinds[metric]`` is :data:`EXTENSIVE` or :data:`INTENSIVE`; ``units[metric]`` names
    the unit (``"bytes"``, ``"ops"``, ``"ratio"``). Intensive values are ratios (0..1),
    not percent: convert GPM percentages with ``/ 100`` before building this.
    """
    source: str                       # "cupti_pm_sampling" | "nvml_gpm"
    start_ns: np.ndarray
    end_ns: np.ndarray
    values: dict[str, np.ndarray]
    kinds: dict[str, str]
    units: dict[str, str] = field(default_factory=dict)
    device: int = -1

    def __post_init__(self):
        self.start_ns = np.asarray(self.start_ns, np.int64)
        self.end_ns = np.asarray(self.end_ns, np.int64)
        if self.start_ns.shape != self.end_ns.shape:
            raise ValueError("start_ns and end_ns differ in length")
        for k, v in self.values.items():
            v = np.asarray(v, np.float64)
            if v.shape != self.start_ns.shape:
                raise ValueError(f"metric {k}: {v.shape[0]} values for {self.start_ns.shape[0]} samples")
            if self.kinds.get(k) not in (EXTENSIVE, INTENSIVE):
                raise ValueError(f"metric {k}: kind must be {EXTENSIVE!r} or {INTENSIVE!r}")
            self.values[k] = v


def busy_ns(start_ns: np.ndarray, end_ns: np.ndarray, q_start_ns: np.ndarray, q_end_ns: np.ndarray) -> np.ndarray:
    """For each query interval, the summed overlap (ns) of all ``[start, end)`` intervals with it.

    O((n + q) log n): B(t) = sum_k clamp(t - start_k, 0, dur_k) is piecewise linear and is
    evaluated at the query bounds with sorted starts/ends and prefix sums.
    """
    s = np.asarray(start_ns, np.int64)
    e = np.maximum(np.asarray(end_ns, np.int64), s)
    qs = np.asarray(q_start_ns, np.int64)
    qe = np.asarray(q_end_ns, np.int64)
    if len(s) == 0 or len(qs) == 0:
        return np.zeros(len(qs), np.float64)
    base = min(int(s.min()), int(qs.min()))   # keep the products far from int64 overflow
    ss = np.sort(s - base).astype(np.float64)
    es = np.sort(e - base).astype(np.float64)
    cs = np.concatenate([[0.0], np.cumsum(ss)])
    ce = np.concatenate([[0.0], np.cumsum(es)])

    def b(t):
        t = (t - base).astype(np.float64)
        ns = np.searchsorted(ss, t, side="right")
        ne = np.searchsorted(es, t, side="right")
        return (ns * t - cs[ns]) - (ne * t - ce[ne])

    return np.maximum(b(np.maximum(qe, qs)) - b(qs), 0.0)


def phase_overlap_ns(samples: CounterSamples, kernel_start_ns, kernel_end_ns, kernel_phase,
                     phases=None) -> tuple[list[int], np.ndarray]:
    """``(phases, M)`` with ``M[i, j]`` = kernel time of phase ``phases[j]`` inside sample ``i``."""
    kp = np.asarray(kernel_phase)
    ks, ke = np.asarray(kernel_start_ns, np.int64), np.asarray(kernel_end_ns, np.int64)
    phases = sorted(int(p) for p in np.unique(kp)) if phases is None else list(phases)
    m = np.zeros((len(samples.start_ns), len(phases)))
    for j, p in enumerate(phases):
        sel = kp == p
        m[:, j] = busy_ns(ks[sel], ke[sel], samples.start_ns, samples.end_ns)
    return phases, m


def attribute(samples: CounterSamples, kernel_start_ns, kernel_end_ns, kernel_phase, *,
              hbm_bytes_per_s: float | None = None, phase_names: dict[int, str] | None = None) -> dict:
    """Per phase, the measured counter figures, each tagged with its source.

    Returns ``{phase_name: {metric: {"value", "unit", "source", "work_source": "measured",
    "coverage_ratio"}}}`` plus, per phase, ``"kernel_time_ns"`` (all kernels of the
    phase) and ``"sampled_kernel_time_ns"`` (inside samples). Extensive metrics also get
    ``<metric>_per_s`` over the phase's sampled kernel time. With ``hbm_bytes_per_s``, an
    intensive ``dram_bw_util_ratio`` also yields ``dram_bytes_per_s`` (utilisation x the
    ceiling). Samples that overlap no kernel are reported under ``"idle"`` for extensive
    metrics (work done while no traced kernel ran: another process, or untraced work).
    """
    names = phase_names or PHASE_NAMES
    ks, ke = np.asarray(kernel_start_ns, np.int64), np.asarray(kernel_end_ns, np.int64)
    kp = np.asarray(kernel_phase)
    phases, m = phase_overlap_ns(samples, ks, ke, kp)
    dur = np.maximum(ke - ks, 0)
    out: dict = {}
    tot = m.sum(axis=1)
    share = np.divide(m, tot[:, None], out=np.zeros_like(m), where=tot[:, None] > 0)
    for j, p in enumerate(phases):
        name = names.get(p, str(p))
        kt = float(dur[kp == p].sum())
        sampled = float(m[:, j].sum())
        cov = sampled / kt if kt > 0 else 0.0
        entry = {"kernel_time_ns": int(kt), "sampled_kernel_time_ns": int(round(sampled))}
        for metric, v in samples.values.items():
            unit = samples.units.get(metric, "")
            tag = {"unit": unit, "source": samples.source, "work_source": "measured", "coverage_ratio": cov}
            if samples.kinds[metric] == EXTENSIVE:
                val = float((v * share[:, j]).sum())
                entry[metric] = {"value": val, **tag}
                if sampled > 0:
                    entry[f"{metric}_per_s"] = {"value": val / (sampled / 1e9), **tag, "unit": f"{unit}/s"}
            else:
                ok = np.isfinite(v)          # a missing sample carries no weight
                w = np.where(ok, m[:, j], 0.0)
                if w.sum() <= 0:
                    continue
                val = float((np.where(ok, v, 0.0) * w).sum() / w.sum())
                entry[metric] = {"value": val, **tag}
                if metric == "dram_bw_util_ratio" and hbm_bytes_per_s:
                    entry["dram_bytes_per_s"] = {"value": val * hbm_bytes_per_s, **tag, "unit": "bytes/s",
                                                 "derived_from": "dram_bw_util_ratio x HBM ceiling"}
        out[name] = entry
    idle = tot <= 0
    if idle.any():
        entry = {}
        for metric, v in samples.values.items():
            if samples.kinds[metric] == EXTENSIVE:
                entry[metric] = {"value": float(v[idle].sum()), "unit": samples.units.get(metric, ""),
                                 "source": samples.source, "work_source": "measured"}
        if entry:
            out["idle"] = entry
    return out


def from_gpm_records(start_ns, end_ns, dram_bw_util_pct=None, tensor_util_pct=None,
                     device: int = -1) -> CounterSamples:
    """CounterSamples from NVML GPM percentages (probes/nvml.py ``gpm_*_pct`` keys); NaN where missing."""
    vals, kinds, units = {}, {}, {}
    if dram_bw_util_pct is not None:
        vals["dram_bw_util_ratio"] = np.asarray(dram_bw_util_pct, np.float64) / 100.0
    if tensor_util_pct is not None:
        vals["tensor_util_ratio"] = np.asarray(tensor_util_pct, np.float64) / 100.0
    for k in vals:
        kinds[k], units[k] = INTENSIVE, "ratio"   # NaN (missing sample) gets no weight in attribute()
    return CounterSamples("nvml_gpm", start_ns, end_ns, vals, kinds, units, device)
