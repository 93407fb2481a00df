"""One fixed window as the agent publishes it, for the view tests (tests/test_top_frame.py,
tests/test_view_consistency.py): two GPUs of an H100 host serving Llama-3-8B, decode at
its bandwidth ceiling on GPU 0 (the figures of tests/test_verdict.py: 2.60 TB/s, 77.6% of
the 3.35 TB/s peak), an engine with KV at 52% (55% at the window's highest) and 3 requests
waiting, NVML figures with one Xid 79 and remapped rows on GPU 0. The verdict is computed
by the verdict module, as aggregator.windows does, so the views read what the agent sends.
"""
from __future__ import annotations

import copy

H100 = {"gpu": "NVIDIA H100 80GB HBM3", "hbm_bytes_per_s": 3.35e12,
        "flops_per_s": {"bf16": 989.4e12, "fp8": 1978.9e12}}
DECODE = {"kernels": 52_000, "kernel_time_ns": 780_000_000, "time_share_pct": 86.7, "flops": 8.4e13,
          "bytes": 2.03e12, "achieved_flops_per_s": 1.08e14, "achieved_bytes_per_s": 2.60e12,
          "arithmetic_intensity": 41.4, "pct_of_peak_flops": 10.9, "pct_of_peak_bytes": 77.6,
          "ridge_point": 295.3, "verdict": "memory-bound", "work_source": "model"}
PREFILL = {"kernels": 9_100, "kernel_time_ns": 120_000_000, "time_share_pct": 13.3, "flops": 8.2e13,
           "bytes": 7.5e10, "achieved_flops_per_s": 6.80e14, "achieved_bytes_per_s": 6.2e11,
           "arithmetic_intensity": 1094.0, "pct_of_peak_flops": 68.8, "pct_of_peak_bytes": 18.5,
           "ridge_point": 295.3, "verdict": "compute-bound", "work_source": "model"}
ENDPOINT = "http://127.0.0.1:8000/metrics"
ENGINE = {"engine": "vllm", "pid": 4242, "kv_usage_ratio": 0.52, "kv_usage_max_ratio": 0.55, "kv_pool_tokens": 39232,
          "num_running_requests": 61.0, "num_waiting_requests": 3.0, "num_waiting_change": 0.0,
          "num_swapped_requests": None, "preemptions": 0.0, "preemption_rate_per_s": 0.0,
          "queue_time_mean_s": 0.12, "queue_time_p50_s": None, "queue_time_p50_kind": "first_bucket",
          "queue_time_p50_upper_s": 0.3, "queue_time_p99_s": 0.41, "queue_time_p99_kind": "interpolated",
          "ttft_p50_s": 0.0183, "ttft_p99_s": 0.0395, "itl_p50_s": 0.0121, "itl_p99_s": 0.024,
          "prefix_cache_hit_ratio": 0.4}


def _device(index: int, ts_ns: int, xids: list[int]) -> dict:
    return {"gpu_index": index, "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_uuid": f"GPU-{index:08d}", "ts_ns": ts_ns,
            "memory_total_bytes": 85_520_809_984, "memory_used_bytes": 76_900_000_000, "power_w": 612.0,
            "power_limit_w": 700.0, "sm_clock_mhz": 1755, "sm_clock_max_mhz": 1980, "temperature_c": 61,
            "clock_event_reasons": ["sw_power_cap"], "clock_slowdown": True, "gpu_busy_time_pct": 100.0,
            "ecc_corrected_volatile_errors_total": 12, "ecc_uncorrected_volatile_errors_total": 0,
            "ecc_corrected_aggregate_errors_total": 340, "ecc_uncorrected_aggregate_errors_total": 0,
            "retired_pages_single_bit_count": None, "retired_pages_double_bit_count": None,
            "retired_pages_pending": None, "remapped_rows_correctable_count": 3 if index == 0 else 0,
            "remapped_rows_uncorrectable_count": 0, "remapped_rows_pending": False, "remapped_rows_failed": False,
            "xid_errors_count": len(xids), "xid_errors": xids, "source": "nvml"}


def view_window() -> dict:
    """The window (a fresh copy), with its ``verdict`` as the window builder attaches it."""
    from ridgeline.aggregator import verdict
    gpus = []
    for dev, pid in ((0, 4242), (1, 4243)):
        gpus.append({"device": dev, "pid": pid, "gpu": H100["gpu"], "source": "cupti", "kernels": 61_100,
                     "kernel_time_ns": 900_000_000, "busy_ns": 960_000_000, "idle_ns": 40_000_000,
                     "span_ns": 1_000_000_000, "launch": {"count": 61_100, "p50_ns": 3200, "p99_ns": 18000},
                     "ceilings": copy.deepcopy(H100),
                     "phases": {"decode": dict(DECODE), "prefill": dict(PREFILL)}})
    w = {"start_ns": 1_700_000_000_000_000_000, "end_ns": 1_700_000_001_000_000_000, "duration_ns": 1_000_000_000,
         "host": "gpu-host-1", "sources": ["cupti"], "gpus": gpus,
         "device": {"nvml": {"devices": [_device(0, 1_700_000_000_500_000_000, [79]),
                                         _device(1, 1_700_000_000_500_000_000, [])]}},
         "engine": {"engine": {"endpoints": {ENDPOINT: dict(ENGINE)}}},
         "agent": {"cpu_pct": 0.8, "rss_bytes": 83_000_000, "probes": {"cupti": {"drops": 0}}}}
    w["verdict"] = [verdict.verdict_record(v) for v in verdict.window_verdict(w)]
    return w
