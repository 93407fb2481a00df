"""aggregator.windows: interval union, per-GPU/process figures, window assembly."""
import numpy as np

from aggregator.windows import WindowBuilder, busy_ns, gpu_figures, plain
from probes.events import (API_DTYPE, API_LAUNCH, API_SYNC, COPY_DTOH, COPY_DTYPE, COPY_HTOD,
                           KERNEL_DTYPE, Device, NameTable, Trace, empty)


def test_busy_ns_unions_overlaps():
    s = np.array([0, 5, 20, 22, 40], dtype=np.int64)
    e = np.array([10, 12, 25, 23, 41], dtype=np.int64)
    assert busy_ns(s, e) == 12 + 5 + 1
    assert busy_ns(s[:0], e[:0]) == 0


def _trace():
    names = NameTable(["ampere_bf16_gemm", "flash_fwd_kernel", "cudaLaunchKernel"])
    k = empty(KERNEL_DTYPE, 4)
    k["start_ns"] = [1000, 1600, 3000, 1000]
    k["end_ns"] = [1500, 2600, 3500, 1200]
    k["device"] = [0, 0, 0, 1]
    k["pid"] = [42, 42, 42, 42]
    k["name_id"] = [0, 1, 0, 0]
    c = empty(COPY_DTYPE, 2)
    c["start_ns"], c["end_ns"] = [100, 3600], [200, 3700]
    c["device"], c["pid"] = [0, 0], [42, 42]
    c["direction"], c["bytes"] = [COPY_HTOD, COPY_DTOH], [4096, 128]
    a = empty(API_DTYPE, 3)
    a["start_ns"], a["end_ns"] = [900, 1550, 2700], [905, 1560, 3600]
    a["pid"], a["category"], a["name_id"] = [42, 42, 42], [API_LAUNCH, API_LAUNCH, API_SYNC], [2, 2, 2]
    return Trace(kernels=k, copies=c, api=a, names=names,
                 devices=[Device(0, "NVIDIA H100 80GB HBM3"), Device(1, "NVIDIA H100 80GB HBM3")],
                 meta={"source": "replay"})


def test_gpu_figures_per_device_and_process():
    figs = {(g["device"], g["pid"]): g for g in gpu_figures(_trace())}
    g0 = figs[(0, 42)]
    assert g0["kernels"] == 3
    assert g0["kernel_time_ns"] == 500 + 1000 + 500
    assert g0["busy_ns"] == 2000                     # no overlap on GPU 0
    assert g0["span_ns"] == 3700 - 100               # copies included in the span
    assert g0["idle_ns"] == 3600 - 2000
    assert g0["copy_bytes"] == {"HtoD": 4096, "DtoH": 128}
    assert g0["launch"]["count"] == 2 and g0["launch"]["p50_ns"] in (7, 8)
    assert g0["sync"]["count"] == 1 and g0["sync"]["p50_ns"] == 900
    shares = sum(p["time_share_pct"] for p in g0["phases"].values())
    assert abs(shares - 100.0) < 1e-6
    assert sum(p["kernels"] for p in g0["phases"].values()) == 3
    assert g0["ceilings"] is None or g0["ceilings"]["hbm_bytes_per_s"] > 1e12
    assert figs[(1, 42)]["kernels"] == 1


def test_builder_closes_and_starts_empty():
    b = WindowBuilder(host="h")
    t = _trace()
    b.add_events(t)
    b.add_device({"devices": [{"gpu_index": 0, "memory_used_bytes": 5}]}, "nvml")
    b.add_sched({"threads": [{"pid": 42, "tid": 43, "on_cpu_ns": 10}]}, "sched")
    w = b.close(0, 1_000_000_000, {"cpu_pct": 1.0})
    assert w["duration_ns"] == 1_000_000_000 and w["host"] == "h"
    assert w["sources"] == ["replay"]
    assert sum(g["kernels"] for g in w["gpus"]) == 4
    assert w["device"]["nvml"]["devices"][0]["memory_used_bytes"] == 5
    assert w["agent"]["cpu_pct"] == 1.0
    w2 = b.close(1_000_000_000, 2_000_000_000)
    assert w2["gpus"] == []
    # The latest device and sched samples carry over: a slow probe still shows its last value.
    assert w2["device"]["nvml"]["devices"][0]["memory_used_bytes"] == 5


def test_engine_scrapes_become_figures_from_deltas(tmp_path):
    from probes import prom_text
    text = ("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 3\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.9\n"
            "# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total {n}\n")
    b = WindowBuilder()
    for i, n in enumerate((10, 14)):
        b.add_engine({"scrapes": [{"endpoint": "http://127.0.0.1:8000/metrics", "ts_ns": i * 1_000_000_000,
                                   "exposition": prom_text.parse(text.format(n=n))}]})
    w = b.close(0, 2_000_000_000)
    e = w["engine"]["engine"]["endpoints"]["http://127.0.0.1:8000/metrics"]
    assert e["kv_usage_ratio"] == 0.9
    assert e["num_waiting_requests"] == 3
    assert e["preemption_rate_per_s"] == 4.0


def test_plain_makes_numpy_msgpack_ready():
    out = plain({"a": np.int64(3), "b": np.array([1.5, 2.5]), 1: float("nan")})
    assert out == {"a": 3, "b": [1.5, 2.5], "1": None}
    assert type(out["a"]) is int


def test_window_on_real_trace(shared_traces):
    from probes.kineto import load_trace
    t = load_trace(shared_traces / "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz")
    b = WindowBuilder()
    b.add_events(t, "replay")
    w = b.close(0, 1)
    assert sum(g["kernels"] for g in w["gpus"]) == len(t.kernels)
    for g in w["gpus"]:
        assert g["busy_ns"] <= g["span_ns"]
        assert g["gpu"].startswith("NVIDIA H100")


def test_full_window_drops_and_counts_batches():
    b = WindowBuilder(max_events=8)
    b.add_events(_trace())           # 4 kernels + 2 copies + 3 API calls = 9 > 8
    assert b.drops == 9 and b.close(0, 1)["gpus"] == []
    b.max_events = 20
    b.add_events(_trace())
    b.add_events(_trace())           # 18 held
    b.add_events(_trace())           # would be 27: dropped
    assert b.drops == 18
    assert sum(g["kernels"] for g in b.close(1, 2)["gpus"]) == 8
