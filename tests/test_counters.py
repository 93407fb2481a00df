"""aggregator.counters: measured counters attributed to phases by overlap, with literals."""
from __future__ import annotations

import numpy as np
import pytest

from ridgeline.aggregator.counters import EXTENSIVE, INTENSIVE, CounterSamples, attribute, busy_ns, from_gpm_records

PREFILL, DECODE = 1, 2


def test_busy_ns_sums_overlaps():
    # kernels [0,10) [5,15) [20,30); queries [0,10) [8,22) [30,40) [-5,100)
    got = busy_ns([0, 5, 20], [10, 15, 30], [0, 8, 30, -5], [10, 22, 40, 100])
    assert got.tolist() == [15.0, 2 + 7 + 2, 0.0, 30.0]


def test_busy_ns_epoch_timestamps_do_not_overflow():
    t0 = 1_700_000_000_000_000_000
    s = t0 + np.arange(0, 1_000_000, 10, dtype=np.int64)
    got = busy_ns(s, s + 5, [t0], [t0 + 1_000_000])
    assert got[0] == 500_000.0


def test_dram_bytes_split_by_kernel_time_share():
    # sample 1 [0,100): prefill kernels 60+20 ns, decode 20 ns -> 1200 bytes split 960/240
    # sample 2 [100,200): decode only -> all 500 bytes to decode
    # sample 3 [200,300): no kernel -> idle
    k_start = np.array([0, 60, 80, 120])
    k_end = np.array([60, 80, 100, 180])
    phase = np.array([PREFILL, DECODE, PREFILL, DECODE])
    s = CounterSamples("cupti_pm_sampling", [0, 100, 200], [100, 200, 300],
                       {"dram__bytes_read.sum": np.array([1200.0, 500.0, 70.0])},
                       {"dram__bytes_read.sum": EXTENSIVE}, {"dram__bytes_read.sum": "bytes"})
    out = attribute(s, k_start, k_end, phase)
    assert out["prefill"]["dram__bytes_read.sum"]["value"] == pytest.approx(960.0)
    assert out["decode"]["dram__bytes_read.sum"]["value"] == pytest.approx(240.0 + 500.0)
    assert out["idle"]["dram__bytes_read.sum"]["value"] == 70.0
    d = out["decode"]["dram__bytes_read.sum"]
    assert d["work_source"] == "measured" and d["source"] == "cupti_pm_sampling" and d["unit"] == "bytes"
    assert d["coverage_ratio"] == 1.0
    # decode: 740 bytes over 80 ns of sampled kernel time
    assert out["decode"]["dram__bytes_read.sum_per_s"]["value"] == pytest.approx(740 / 80e-9)
    assert out["decode"]["kernel_time_ns"] == 80


def test_gpm_utilisation_is_an_overlap_weighted_mean_and_bytes_per_s_uses_the_ceiling():
    k_start, k_end, phase = np.array([0, 100]), np.array([100, 150]), np.array([DECODE, DECODE])
    s = from_gpm_records([0, 100, 200], [100, 200, 300], dram_bw_util_pct=[80.0, 40.0, float("nan")],
                         tensor_util_pct=[10.0, None, 0.0])
    out = attribute(s, k_start, k_end, phase, hbm_bytes_per_s=4.8e12)
    # weights: sample 1 -> 100 ns, sample 2 -> 50 ns
    assert out["decode"]["dram_bw_util_ratio"]["value"] == pytest.approx((0.8 * 100 + 0.4 * 50) / 150)
    assert out["decode"]["dram_bytes_per_s"]["value"] == pytest.approx((0.8 * 100 + 0.4 * 50) / 150 * 4.8e12)
    # a missing tensor sample carries no weight
    assert out["decode"]["tensor_util_ratio"]["value"] == pytest.approx(0.10)
    assert out["decode"]["dram_bw_util_ratio"]["source"] == "nvml_gpm"
    assert "idle" not in out       # intensive metrics have no idle share


def test_partial_coverage_is_reported():
    s = CounterSamples("cupti_pm_sampling", [0], [50], {"x": np.array([10.0])}, {"x": EXTENSIVE})
    out = attribute(s, [0, 100], [100, 200], [PREFILL, PREFILL])
    assert out["prefill"]["x"]["coverage_ratio"] == pytest.approx(0.25)


def test_bad_samples_are_rejected():
    with pytest.raises(ValueError, match="kind"):
        CounterSamples("x", [0], [1], {"m": [1.0]}, {"m": "sum"})
    with pytest.raises(ValueError, match="values"):
        CounterSamples("x", [0, 1], [1, 2], {"m": [1.0]}, {"m": INTENSIVE})
