"""Roofline figures, verdict rule, idle gaps, launch latency and copy traffic on literals."""
import numpy as np
import pytest
from support.phase_literals import NAMES, Step

from ridgeline.aggregator import ceilings, roofline, work
from ridgeline.probes.events import (
    API_DTYPE,
    API_LAUNCH,
    API_SYNC,
    COPY_DTOH,
    COPY_DTYPE,
    COPY_HTOD,
    COPY_KIND_MEMCPY,
    COPY_KIND_MEMSET,
    KERNEL_DTYPE,
    NameTable,
    Trace,
    empty,
)


def kernels(intervals, device=0, corr0=1):
    k = empty(KERNEL_DTYPE, len(intervals))
    k["start_ns"] = [a for a, _ in intervals]
    k["end_ns"] = [b for _, b in intervals]
    k["device"] = device
    k["name_id"] = 0
    k["correlation_id"] = np.arange(corr0, corr0 + len(intervals))
    return k


def test_union_busy_and_covered():
    s, e = roofline.union_intervals(np.array([0, 5, 20, 25]), np.array([10, 12, 30, 26]))
    assert s.tolist() == [0, 20] and e.tolist() == [12, 30]
    assert roofline.busy_ns(np.array([0, 5, 20]), np.array([10, 12, 30])) == 22
    cov = roofline.covered_ns(np.array([0, 11, 15, 0]), np.array([5, 21, 19, 100]), s, e)
    assert cov.tolist() == [5, 2, 0, 22]


def test_idle_gaps_distribution():
    t = Trace(kernels=kernels([(0, 10_000), (15_000, 20_000), (220_000, 230_000), (2_230_000, 2_240_000)]),
              names=NameTable(["k"]))
    g = roofline.idle_gaps(t)["0"]
    assert g["busy_ns"] == 35_000 and g["idle_ns"] == 5_000 + 200_000 + 2_000_000
    assert g["gaps"] == 3 and g["gap_max_ns"] == 2_000_000
    assert g["gap_histogram"] == {"<10us": 1, "10-100us": 0, "100us-1ms": 1, "1-10ms": 1, ">=10ms": 0}
    assert g["gap_p50_ns"] == 200_000


def test_launch_latency_percentiles_by_correlation():
    k = kernels([(1000 + 100 * i, 1050 + 100 * i) for i in range(100)])
    api = empty(API_DTYPE, 100)
    api["category"] = API_LAUNCH
    api["correlation_id"] = np.arange(1, 101)[::-1]          # order must not matter
    lat = np.arange(100) * 10                               # 0..990 ns
    api["start_ns"] = k["start_ns"][::-1] - lat[::-1]
    api["end_ns"] = api["start_ns"] + 5
    t = Trace(kernels=k, api=api, names=NameTable(["k"]))
    r = roofline.launch_latency(t)
    assert r["kernels"] == 100
    # read from the 8-bins-per-octave histogram every phase and live window uses: within
    # one bin (a bin is 2**(1/8) wide, 9%) of the exact percentile
    assert r["p50_ns"] == pytest.approx(np.percentile(lat, 50), rel=0.09)
    assert r["p99_ns"] == pytest.approx(np.percentile(lat, 99), rel=0.09)


def test_launch_latency_is_the_phase_figure_on_a_real_trace(trace_path):
    """Issue 24.2: the report's launch line and the phase's evidence named two numbers
    (10.1 us and 9.7 us) for the same 768 kernels of the shared B200 vLLM trace (one
    prefill step: every kernel is the phase's)."""
    from ridgeline.aggregator.analysis import analyze_trace
    from ridgeline.probes.kineto import load_trace
    path = trace_path("nvidia-inference/tracelens_b200_vllm_gptoss_tp8_prefill888.json.gz")
    doc = analyze_trace(load_trace(str(path)))
    whole, phase = doc.launch_latency, doc.phases["prefill"].launch_latency
    assert whole.kernels == phase.kernels == doc.kernels == 768
    assert whole == phase


def test_copy_traffic_by_direction():
    c = empty(COPY_DTYPE, 3)
    c["kind"] = [COPY_KIND_MEMCPY, COPY_KIND_MEMCPY, COPY_KIND_MEMSET]
    c["direction"] = [COPY_HTOD, COPY_DTOH, 0]
    c["bytes"] = [1_000_000, 500, 64]
    c["start_ns"], c["end_ns"] = [0, 10, 20], [1000, 20, 21]
    rows = roofline.copy_traffic(Trace(copies=c))
    h2d = next(r for r in rows if r["direction"] == "HtoD")
    assert h2d["bytes"] == 1_000_000 and h2d["achieved_bytes_per_s"] == pytest.approx(1e12)
    assert {r["kind"] for r in rows} == {"memcpy", "memset"}


BASE = dict(idle_ratio=0.05, launch_cover_ratio=0.0, sync_cover_ratio=0.0, median_gap_ns=2000.0,
            median_kernel_ns=200_000.0, arithmetic_intensity=10.0, ridge_point=295.0,
            pct_of_peak_flops=3.0, pct_of_peak_bytes=70.0, work_coverage_ratio=1.0)


@pytest.mark.parametrize("changes,verdict", [
    ({}, roofline.MEMORY_BOUND),
    ({"arithmetic_intensity": 600.0, "pct_of_peak_flops": 60.0, "pct_of_peak_bytes": 20.0}, roofline.COMPUTE_BOUND),
    # Both fractions low with short kernels: neither roof is the limit.
    ({"pct_of_peak_bytes": 5.0, "median_kernel_ns": 4000.0}, roofline.LAUNCH_BOUND),
    # Low fractions with long kernels stays on the roofline side.
    ({"pct_of_peak_bytes": 5.0}, roofline.MEMORY_BOUND),
    # GPU idle most of the time, host in launch calls -> launch-bound.
    ({"idle_ratio": 0.8, "launch_cover_ratio": 0.7, "median_gap_ns": 50_000.0}, roofline.LAUNCH_BOUND),
    # ... short gaps between short kernels -> launch-bound too.
    ({"idle_ratio": 0.6, "median_gap_ns": 8000.0, "median_kernel_ns": 3000.0}, roofline.LAUNCH_BOUND),
    # GPU idle, host elsewhere (long gaps, not launching) -> host-bound.
    ({"idle_ratio": 0.9, "launch_cover_ratio": 0.05, "median_gap_ns": 500_000.0}, roofline.HOST_BOUND),
    ({"idle_ratio": 0.9, "sync_cover_ratio": 0.8, "median_gap_ns": 500_000.0}, roofline.HOST_BOUND),
    # Busy GPU but figures cover too little kernel time -> no verdict invented.
    ({"work_coverage_ratio": 0.3}, roofline.UNDETERMINED),
    ({"arithmetic_intensity": None, "work_coverage_ratio": 0.0}, roofline.UNDETERMINED),
])
def test_verdict_thresholds(changes, verdict):
    v, ev = roofline.decide_verdict(**{**BASE, **changes})
    assert v == verdict
    assert ev and all(isinstance(e, str) for e in ev)


def test_verdict_boundary_at_ridge_and_idle_threshold():
    v, _ = roofline.decide_verdict(**{**BASE, "arithmetic_intensity": 295.0, "pct_of_peak_flops": 50.0})
    assert v == roofline.COMPUTE_BOUND
    v, _ = roofline.decide_verdict(**{**BASE, "arithmetic_intensity": 294.9, "pct_of_peak_flops": 50.0})
    assert v == roofline.MEMORY_BOUND
    v, _ = roofline.decide_verdict(**{**BASE, "idle_ratio": roofline.IDLE_BOUND_RATIO - 0.01})
    assert v == roofline.MEMORY_BOUND


def test_phase_summary_gemm_prefill_and_decode_idle():
    h100 = ceilings.lookup("h100-sxm")
    # Prefill: two 1 ms kernels back to back, a GEMM of known size split over them.
    # Decode: ten 5 us kernels separated by 100 us gaps while the host is in launch calls.
    pre = [(0, 1_000_000), (1_000_000, 2_000_000)]
    dec = [(3_000_000 + i * 105_000, 3_000_000 + i * 105_000 + 5_000) for i in range(10)]
    k = kernels(pre + dec)
    kw = work.KernelWork.empty(len(k))
    m_, n_, k_ = 8192, 8192, 8192
    kw.flops[:2] = 2.0 * m_ * n_ * k_ / 2
    kw.bytes[:2] = 2.0 * (m_ * k_ + k_ * n_ + m_ * n_) / 2
    kw.dtype_code[:2] = work.DTYPE_KEYS.index("bf16")
    api = empty(API_DTYPE, 9)
    api["category"] = API_LAUNCH
    api["start_ns"] = [d[1] + 1_000 for d in dec[:-1]]
    api["end_ns"] = [d[1] + 99_000 for d in dec[:-1]]
    t = Trace(kernels=k, api=api, names=NameTable(["k"]))
    kp = np.array([1, 1] + [2] * 10, np.uint8)
    steps = [Step(0, 0, 2_000_000, 0, 1, 8192), Step(1, dec[0][0], dec[-1][1], 0, 2, None, 8)]
    ks = np.array([0, 0] + [1] * 10, np.int32)
    out = roofline.phase_summary(t, kp, steps, NAMES, h100, kernel_work=kw, kernel_step=ks)
    p = out["prefill"]
    assert p["kernels"] == 2 and p["busy_ns"] == 2_000_000
    assert p["flops"] == pytest.approx(2.0 * m_ * n_ * k_) and p["work_source"] == "shapes"
    assert p["achieved_flops_per_s"] == pytest.approx(2.0 * m_ * n_ * k_ / 2e-3)
    assert p["arithmetic_intensity"] == pytest.approx(2.0 * m_ * n_ * k_ / (2.0 * 3 * m_ * k_))
    assert p["pct_of_peak_flops"] == pytest.approx(100 * p["achieved_flops_per_s"] / 989.4e12)
    assert p["verdict"] == roofline.COMPUTE_BOUND and p["ceiling_dtype"] == "bf16"
    d = out["decode"]
    assert d["flops"] is None and d["work_source"] == work.NO_SOURCE
    assert d["idle_ratio"] == pytest.approx(900_000 / 950_000)
    assert d["idle_in_launch_calls_ratio"] == pytest.approx(9 * 98_000 / 900_000)
    assert d["verdict"] == roofline.LAUNCH_BOUND
    assert d["share_of_gpu_time_ratio"] == pytest.approx(50_000 / 2_050_000)


def test_phase_summary_host_bound_when_host_is_elsewhere():
    dec = [(i * 1_000_000, i * 1_000_000 + 50_000) for i in range(5)]
    k = kernels(dec)
    api = empty(API_DTYPE, 1)
    api["category"] = API_SYNC
    api["start_ns"], api["end_ns"] = 50_000, 200_000
    t = Trace(kernels=k, api=api, names=NameTable(["k"]))
    out = roofline.phase_summary(t, np.full(5, 2, np.uint8), [Step(0, 0, 4_050_000, 0, 2)], NAMES, None)
    d = out["decode"]
    assert d["verdict"] == roofline.HOST_BOUND
    assert d["idle_in_sync_calls_ratio"] == pytest.approx(150_000 / 3_800_000)
    assert d["ridge_point"] is None


def test_model_source_used_when_shapes_are_missing():
    k = kernels([(0, 1_000_000)])
    sw = {0: work.StepWork(flops=1e9, bytes=1e9, parts={}, notes=["n"])}
    out = roofline.phase_summary(Trace(kernels=k, names=NameTable(["k"])), np.array([2], np.uint8),
                                 [Step(0, 0, 1_000_000, 0, 2, None, 4)], NAMES, ceilings.lookup("h200-sxm"),
                                 kernel_work=work.KernelWork.empty(1), step_work=sw,
                                 kernel_step=np.array([0], np.int32), model_dtype="bf16")
    d = out["decode"]
    assert d["work_source"] == "model" and d["flops"] == 1e9
    assert d["achieved_bytes_per_s"] == pytest.approx(1e12)
    assert d["verdict"] == roofline.MEMORY_BOUND


def test_top_kernels_grouped_by_name_with_rates():
    k = kernels([(0, 1000), (1000, 4000), (4000, 5000), (5000, 5500)])
    k["name_id"] = [0, 1, 0, 2]
    kw = work.KernelWork.empty(4)
    kw.flops[[0, 2]] = [1e6, 1e6]
    kw.bytes[[0, 2]] = [1e3, 1e3]
    kw.category[[0, 2]] = work.CAT_GEMM
    t = Trace(kernels=k, names=NameTable(["gemm", "copy", "norm"]))
    rows = roofline.top_kernels(t, np.array([True, True, True, False]), kw)
    assert [r["name"] for r in rows] == ["copy", "gemm"]
    assert rows[0]["time_ns"] == 3000 and rows[0]["flops"] is None
    g = rows[1]
    assert g["count"] == 2 and g["category"] == "gemm"
    assert g["achieved_flops_per_s"] == pytest.approx(2e6 / 2e-6)


def test_model_figures_beyond_the_ceilings_are_not_used():
    # A fragment: one 10 us kernel of a decode step whose model work is 1.2 GB of weights.
    k = kernels([(0, 10_000)])
    sw = {0: work.StepWork(flops=1.2e9, bytes=1.2e9, parts={}, notes=[])}
    out = roofline.phase_summary(Trace(kernels=k, names=NameTable(["k"])), np.array([2], np.uint8),
                                 [Step(0, 0, 10_000, 0, 2, 0, 1)], NAMES, ceilings.lookup("rtx-4080-laptop"),
                                 kernel_work=work.KernelWork.empty(1), step_work=sw,
                                 kernel_step=np.array([0], np.int32), model_dtype="bf16")
    d = out["decode"]
    assert d["work_source"] == work.NO_SOURCE and d["flops"] is None
    assert d["work_by_source"]["model"]["exceeds_ceilings_ratio"] > 100
    assert any("only part of the step" in e for e in d["evidence"])
