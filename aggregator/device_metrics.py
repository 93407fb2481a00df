"""Device (NVML/GPM) figures of one window, folded from the NVML probe's samples (pure).

The NVML probe (:mod:`probes.nvml`) delivers one record per GPU per sample interval;
a window may hold several. :func:`window_figures` folds them per GPU: the latest memory
state, means and maxima of the rates and utilisations, energy used in the window from
the cumulative energy counter, NVLink bytes/s from the cumulative byte counters (or GPM's
rates), and every clock-event reason seen.

Busy-time (``gpu_busy_time_pct``) is kept beside ``gpm_dram_bw_util_pct`` on purpose: the
first says a kernel was running, the second how much of the bandwidth it used.
"""
from __future__ import annotations

from typing import Any, Iterable

_MEAN_MAX = ("gpu_busy_time_pct", "memory_busy_time_pct", "power_w", "temperature_c",
             "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s", "gpm_sm_util_pct", "gpm_sm_occupancy_pct",
             "gpm_any_tensor_util_pct", "gpm_hmma_tensor_util_pct", "gpm_dram_bw_util_pct",
             "gpm_fp64_util_pct", "gpm_fp32_util_pct", "gpm_fp16_util_pct",
             "gpm_nvlink_rx_bytes_per_s", "gpm_nvlink_tx_bytes_per_s")
_LAST = ("gpu_name", "gpu_uuid", "memory_total_bytes", "memory_used_bytes", "memory_free_bytes",
         "memory_reserved_bytes", "processes", "power_limit_w", "sm_clock_max_mhz", "mem_clock_max_mhz")
# Memory health (probes.nvml.decode_health): counters and states, the latest sample's.
_HEALTH_LAST = ("ecc_corrected_volatile_errors_total", "ecc_uncorrected_volatile_errors_total",
                "ecc_corrected_aggregate_errors_total", "ecc_uncorrected_aggregate_errors_total",
                "retired_pages_single_bit_count", "retired_pages_double_bit_count", "retired_pages_pending",
                "remapped_rows_correctable_count", "remapped_rows_uncorrectable_count", "remapped_rows_pending",
                "remapped_rows_failed")
MAX_XIDS_PER_WINDOW = 16


def _max_key(k: str) -> str:
    """``power_w`` -> ``power_max_w``: the unit stays last."""
    for unit in ("_bytes_per_s", "_pct", "_w", "_c"):
        if k.endswith(unit):
            return k[: -len(unit)] + "_max" + unit
    return k + "_max"


def _vals(recs: list[dict], k: str) -> list[float]:
    return [r[k] for r in recs if r.get(k) is not None]


def _counter_rate(recs: list[dict], k: str) -> float | None:
    pts = [(r["ts_ns"], r[k]) for r in recs if r.get(k) is not None and r.get("ts_ns") is not None]
    if len(pts) < 2:
        return None
    (t0, v0), (t1, v1) = pts[0], pts[-1]
    if t1 <= t0 or v1 < v0:  # counter reset (driver reload): no rate this window
        return None
    return (v1 - v0) / ((t1 - t0) / 1e9)


def fold(recs: list[dict]) -> dict:
    """Window figures of one GPU from its samples (oldest first)."""
    if not recs:
        raise ValueError("fold needs at least one device record")
    last = recs[-1]
    out: dict[str, Any] = {"gpu_index": last.get("gpu_index"), "samples": len(recs),
                           "start_ts_ns": recs[0].get("ts_ns"), "end_ts_ns": last.get("ts_ns")}
    for k in _LAST:
        out[k] = last.get(k)
    for k in _MEAN_MAX:
        v = _vals(recs, k)
        out[k] = sum(v) / len(v) if v else None
        out[_max_key(k)] = max(v) if v else None
    out["memory_used_max_bytes"] = max(_vals(recs, "memory_used_bytes"), default=None)
    for k in ("sm_clock_mhz", "mem_clock_mhz"):
        v = _vals(recs, k)
        out[k] = sum(v) / len(v) if v else None
        out[k.replace("_mhz", "_min_mhz")] = min(v) if v else None
    reasons: list[str] = []
    slowed = 0
    for r in recs:
        for name in r.get("clock_event_reasons") or []:
            if name not in reasons:
                reasons.append(name)
        slowed += bool(r.get("clock_slowdown"))
    out["clock_event_reasons"] = reasons
    out["clock_slowdown_ratio"] = slowed / len(recs)
    e = [(r["ts_ns"], r["energy_total_j"]) for r in recs if r.get("energy_total_j") is not None]
    out["energy_j"] = (e[-1][1] - e[0][1]) if len(e) >= 2 and e[-1][1] >= e[0][1] else None
    out["energy_total_j"] = e[-1][1] if e else None      # NVML's counter since the driver loaded
    out["nvlink_tx_bytes_per_s"] = _counter_rate(recs, "nvlink_tx_total_bytes")
    out["nvlink_rx_bytes_per_s"] = _counter_rate(recs, "nvlink_rx_total_bytes")
    if out["nvlink_tx_bytes_per_s"] is None:
        out["nvlink_tx_bytes_per_s"] = out["gpm_nvlink_tx_bytes_per_s"]
    if out["nvlink_rx_bytes_per_s"] is None:
        out["nvlink_rx_bytes_per_s"] = out["gpm_nvlink_rx_bytes_per_s"]
    out.update(_health(recs))
    out["gpm"] = any(r.get("source", "").endswith("+gpm") for r in recs)
    out["source"] = "nvml+gpm" if out["gpm"] else "nvml"
    return out


def _health(recs: list[dict]) -> dict:
    """Memory health of the latest sample, and every Xid of the window: Xid errors arrive
    as events, each sample holding those since the one before (the latest
    MAX_XIDS_PER_WINDOW codes are kept, and how many came)."""
    out = {k: recs[-1].get(k) for k in _HEALTH_LAST}
    xs = [r for r in recs if r.get("xid_errors_count") is not None]
    out["xid_errors_count"] = sum(r["xid_errors_count"] for r in xs) if xs else None
    codes = [x for r in xs for x in r.get("xid_errors") or []]
    out["xid_errors"] = codes[-MAX_XIDS_PER_WINDOW:] if xs else None
    out["xid_last"] = codes[-1] if codes else None
    return out


def window_figures(records: Iterable[dict]) -> dict[int, dict]:
    """``{gpu_index: fold(samples of that GPU)}`` from a window's NVML records."""
    by: dict[int, list[dict]] = {}
    for r in records:
        if isinstance(r, dict) and r.get("gpu_index") is not None:
            by.setdefault(int(r["gpu_index"]), []).append(r)
    return {i: fold(sorted(rs, key=lambda r: r.get("ts_ns") or 0)) for i, rs in by.items()}


def device_record(fig: dict) -> dict:
    """Flat record of one GPU's window figures for the wire (units in keys, ``source``)."""
    rec = {k: v for k, v in fig.items() if k != "processes"}
    procs = fig.get("processes")
    rec["processes"] = None if procs is None else [dict(p) for p in procs]
    rec["source"] = {"probe": "nvml", "gpm": fig.get("gpm", False),
                     "note": "gpu_busy_time_pct is a busy-time fraction, not a use fraction; "
                             "see gpm_dram_bw_util_pct"}
    return rec


# figure -> (metric name, factor to the base unit, HELP). Base units and 0..1 ratios
# (Prometheus naming conventions): percentages / 100, MHz x 1e6 (hertz).
_PROM = {
    "memory_used_bytes": ("ridgeline_gpu_memory_used_bytes", 1.0, "GPU memory in use (NVML)"),
    "memory_total_bytes": ("ridgeline_gpu_memory_total_bytes", 1.0, "GPU memory size (NVML)"),
    "memory_reserved_bytes": ("ridgeline_gpu_memory_reserved_bytes", 1.0, "GPU memory reserved by the driver"),
    "gpu_busy_time_pct": ("ridgeline_gpu_busy_time_ratio", 0.01,
                          "Share of time a kernel was running (NVML utilization.gpu; not a use fraction)"),
    "gpm_dram_bw_util_pct": ("ridgeline_gpu_dram_bandwidth_utilization_ratio", 0.01,
                             "DRAM bandwidth used / peak (NVML GPM)"),
    "gpm_sm_occupancy_pct": ("ridgeline_gpu_sm_occupancy_ratio", 0.01, "SM warp occupancy (NVML GPM)"),
    "gpm_any_tensor_util_pct": ("ridgeline_gpu_tensor_utilization_ratio", 0.01,
                                "Tensor-core activity, any precision (NVML GPM)"),
    "sm_clock_mhz": ("ridgeline_gpu_sm_clock_hertz", 1e6, "SM clock (NVML)"),
    "power_w": ("ridgeline_gpu_power_watts", 1.0, "Board power draw (NVML)"),
    "energy_j": ("ridgeline_gpu_window_energy_joules", 1.0, "Energy used over the window (NVML energy counter delta)"),
    # A counter (name ends _total): rate() gives watts over any interval, as dcgm-exporter's
    # DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION; the window gauge above covers one window only.
    "energy_total_j": ("ridgeline_gpu_energy_joules_total", 1.0,
                       "Energy the GPU used since its driver loaded (NVML total energy counter)"),
    "temperature_c": ("ridgeline_gpu_temperature_celsius", 1.0, "GPU temperature (NVML)"),
    "pcie_tx_bytes_per_s": ("ridgeline_gpu_pcie_tx_bytes_per_second", 1.0, "PCIe transmit rate (NVML)"),
    "pcie_rx_bytes_per_s": ("ridgeline_gpu_pcie_rx_bytes_per_second", 1.0, "PCIe receive rate (NVML)"),
    "nvlink_tx_bytes_per_s": ("ridgeline_gpu_nvlink_tx_bytes_per_second", 1.0, "NVLink transmit rate (NVML)"),
    "nvlink_rx_bytes_per_s": ("ridgeline_gpu_nvlink_rx_bytes_per_second", 1.0, "NVLink receive rate (NVML)"),
    "clock_slowdown_ratio": ("ridgeline_gpu_clock_slowdown_ratio", 1.0,
                             "Share of the window with a clock slowdown reason active"),
    # Memory and error health, as nvidia-smi -q and dcgm-exporter show it (NVML).
    "ecc_corrected_volatile_errors_total": ("ridgeline_gpu_ecc_corrected_volatile_errors_total", 1.0,
                                            "Corrected ECC errors since the driver loaded (NVML volatile counter)"),
    "ecc_uncorrected_volatile_errors_total": ("ridgeline_gpu_ecc_uncorrected_volatile_errors_total", 1.0,
                                              "Uncorrected ECC errors since the driver loaded (NVML volatile counter)"),
    "ecc_corrected_aggregate_errors_total": ("ridgeline_gpu_ecc_corrected_aggregate_errors_total", 1.0,
                                             "Corrected ECC errors over the device's life (NVML aggregate counter)"),
    "ecc_uncorrected_aggregate_errors_total": ("ridgeline_gpu_ecc_uncorrected_aggregate_errors_total", 1.0,
                                               "Uncorrected ECC errors over the device's life (NVML aggregate "
                                               "counter)"),
    "retired_pages_single_bit_count": ("ridgeline_gpu_retired_pages_single_bit", 1.0,
                                       "Pages retired for multiple single-bit ECC errors (NVML, pre-Ampere)"),
    "retired_pages_double_bit_count": ("ridgeline_gpu_retired_pages_double_bit", 1.0,
                                       "Pages retired for a double-bit ECC error (NVML, pre-Ampere)"),
    "retired_pages_pending": ("ridgeline_gpu_retired_pages_pending", 1.0,
                              "1 while a page retirement waits for the next driver load (NVML)"),
    "remapped_rows_correctable_count": ("ridgeline_gpu_remapped_rows_correctable", 1.0,
                                        "Rows remapped for correctable errors (NVML, Ampere and later)"),
    "remapped_rows_uncorrectable_count": ("ridgeline_gpu_remapped_rows_uncorrectable", 1.0,
                                          "Rows remapped for uncorrectable errors (NVML, Ampere and later)"),
    "remapped_rows_pending": ("ridgeline_gpu_remapped_rows_pending", 1.0,
                              "1 while a row remapping waits for a GPU reset (NVML)"),
    "remapped_rows_failed": ("ridgeline_gpu_remapped_rows_failed", 1.0,
                             "1 when a row remapping failed: the GPU needs service (NVML)"),
    "xid_errors_count": ("ridgeline_gpu_window_xid_errors", 1.0, "Xid critical errors in the window (NVML events)"),
    "xid_last": ("ridgeline_gpu_last_xid", 1.0,
                 "Code of the latest Xid critical error in the window (as dcgm-exporter's DCGM_FI_DEV_XID_ERRORS)"),
}
_PROM_EXTRA_HELP = {
    "ridgeline_gpu_process_memory_used_bytes": "GPU memory used by one process (NVML)",
    "ridgeline_gpu_clock_event_reason": "1 for each clock event reason active in the window (NVML)",
}


def prometheus_help(name: str) -> str:
    """HELP text of a metric :func:`prometheus_samples` emits (a counter by its name with or
    without ``_total``)."""
    for metric, _, doc in _PROM.values():
        if name in (metric, metric.removesuffix("_total")):
            return doc
    return _PROM_EXTRA_HELP.get(name, name)


def prometheus_samples(fig: dict, labels: dict | None = None) -> list[tuple[str, dict, float]]:
    """``(name, labels, value)`` per known figure (a name ending ``_total`` is a counter,
    the others gauges); per-process memory as its own series."""
    base = {"gpu": str(fig.get("gpu_index")), "gpu_name": str(fig.get("gpu_name"))}
    base.update(labels or {})
    out = [(name, dict(base), float(fig[k]) * factor) for k, (name, factor, _) in _PROM.items()
           if fig.get(k) is not None]
    for p in fig.get("processes") or []:
        if p.get("gpu_memory_used_bytes") is not None:
            out.append(("ridgeline_gpu_process_memory_used_bytes", dict(base, pid=str(p["pid"])),
                        float(p["gpu_memory_used_bytes"])))
    for name in fig.get("clock_event_reasons") or []:
        out.append(("ridgeline_gpu_clock_event_reason", dict(base, reason=name), 1.0))
    return out
