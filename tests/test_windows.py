"""aggregator.windows: interval union, per-GPU/process figures, window assembly."""
import numpy as np
import pytest

from ridgeline.aggregator.windows import WindowBuilder, busy_ns, plain
from ridgeline.probes.events import (
    API_DTYPE,
    API_LAUNCH,
    API_SYNC,
    COPY_DTOH,
    COPY_DTYPE,
    COPY_HTOD,
    KERNEL_DTYPE,
    Device,
    NameTable,
    Trace,
    empty,
)


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
    b = WindowBuilder()
    b.add_events(_trace())
    figs = {(g.device, g.pid): g for g in b.close(0, 1, final=True).gpus}
    g0 = figs[(0, 42)]
    assert g0.kernels == 3
    assert g0.kernel_time_ns == 500 + 1000 + 500
    assert g0.busy_ns == 2000                     # no overlap on GPU 0
    assert g0.span_ns == 3700 - 100               # copies included in the span
    assert g0.idle_ns == 3600 - 2000
    assert g0.copy_bytes == {"HtoD": 4096, "DtoH": 128}
    # Log2 histograms: the middle of the bin holding the percentile (5 ns and 10 ns calls; 900 ns).
    assert g0.launch.count == 2 and 4 <= g0.launch.p50_ns < 8
    assert g0.sync.count == 1 and 512 <= g0.sync.p50_ns < 1024
    shares = sum(p.time_share_pct for p in g0.phases.values())
    assert abs(shares - 100.0) < 1e-6
    assert sum(p.kernels for p in g0.phases.values()) == 3
    assert g0.ceilings is None or g0.ceilings.hbm_bytes_per_s > 1e12
    assert figs[(1, 42)].kernels == 1


def test_builder_closes_and_starts_empty():
    b = WindowBuilder(host="h")
    t = _trace()
    b.add_events(t)
    b.add_device({"devices": [{"gpu_index": 0, "memory_used_bytes": 5}]}, "nvml")
    b.add_sched({"threads": [{"pid": 42, "tid": 43, "on_cpu_ns": 10}]}, "sched")
    w = b.close(0, 1_000_000_000, {"cpu_pct": 1.0})
    assert w.duration_ns == 1_000_000_000 and w.host == "h"
    assert w.sources == ["replay"]
    # Each device's only step may still be running at close: held, not mapped in pieces.
    assert sum(g.kernels for g in w.gpus) == 0
    assert "3 kernels of the open step held for the window where it ends" in w.gpus[0].phase_source
    assert w.gpus[0].copy_bytes == {"HtoD": 4096, "DtoH": 128}
    assert w.device["nvml"]["devices"][0]["memory_used_bytes"] == 5
    assert w.agent.cpu_pct == 1.0 and w.agent.window_open_steps_cut == 0
    # Nothing more came for a whole window: the held steps are over, mapped and counted now.
    w2 = b.close(1_000_000_000, 2_000_000_000)
    assert sum(g.kernels for g in w2.gpus) == 4
    assert b.close(2_000_000_000, 3_000_000_000).gpus == []
    # The latest device and sched samples carry over: a slow probe still shows its last value.
    assert w2.device["nvml"]["devices"][0]["memory_used_bytes"] == 5


def test_engine_scrapes_become_figures_from_deltas(tmp_path):
    from ridgeline.probes import prom_text
    text = ("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 3\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.9\n"
            "# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total {n}\n")
    b = WindowBuilder()
    for i, n in enumerate((10, 14)):
        b.add_engine({"scrapes": [{"endpoint": "http://127.0.0.1:8000/metrics", "ts_ns": i * 1_000_000_000,
                                   "exposition": prom_text.parse(text.format(n=n))}]})
    w = b.close(0, 2_000_000_000)
    e = w.engine["engine"]["endpoints"]["http://127.0.0.1:8000/metrics"]
    assert e["kv_usage_ratio"] == 0.9
    assert e["num_waiting_requests"] == 3
    assert e["preemption_rate_per_s"] == 4.0


def test_plain_makes_numpy_msgpack_ready():
    out = plain({"a": np.int64(3), "b": np.array([1.5, 2.5]), 1: float("nan")})
    assert out == {"a": 3, "b": [1.5, 2.5], "1": None}
    assert type(out["a"]) is int


def test_window_on_real_trace(shared_traces):
    from ridgeline.probes.kineto import load_trace
    t = load_trace(shared_traces / "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz")
    b = WindowBuilder()
    b.add_events(t, "replay")
    w = b.close(0, 1, final=True)         # the agent's last window: the open step too
    assert sum(g.kernels for g in w.gpus) == len(t.kernels)
    for g in w.gpus:
        assert g.busy_ns <= g.span_ns
        assert g.gpu.startswith("NVIDIA H100")


def test_full_window_drops_and_counts_batches():
    b = WindowBuilder(max_events=8)
    b.add_events(_trace())           # 4 kernels + 2 copies + 3 API calls = 9 > 8
    assert b.drops == 9 and b.close(0, 1).gpus == []
    b.max_events = 20
    b.add_events(_trace())
    b.add_events(_trace())           # 18 held
    b.add_events(_trace())           # would be 27: dropped
    assert b.drops == 18
    assert sum(g.kernels for g in b.close(1, 2, final=True).gpus) == 8


# ------------------------------------------------------------------ incremental fold

from ridgeline.aggregator import model_config  # noqa: E402
from ridgeline.aggregator.phases import PHASE_NAMES, map_phases  # noqa: E402
from ridgeline.aggregator.windows import HIST_BINS, SourceFold, hist_percentile_ns, log2_bins  # noqa: E402


def _kernel_stream(t: Trace) -> Trace:
    """What CUPTI streams: kernels, copies and API calls, no ranges or CPU operators."""
    order = np.argsort(t.kernels["start_ns"], kind="stable")
    return Trace(kernels=t.kernels[order], copies=t.copies, api=t.api, names=t.names, devices=t.devices,
                 meta=t.meta)


def _fold_in(t: Trace, batches: int, model=None, gpu: str = "") -> dict:
    """Per phase (summed over GPU/process pairs) kernels, kernel time, FLOPs, bytes of
    ``t`` folded in ``batches`` consecutive time slices (API records with their kernels'
    slice, copies with the first)."""
    f = SourceFold(t.names, t.devices, model=model, gpu=gpu)
    k, a = t.kernels, t.api
    a_sorted = a[np.argsort(a["correlation_id"], kind="stable")]
    for i, part in enumerate(np.array_split(np.arange(len(k)), batches)):
        kp = k[part]
        ap = a_sorted[np.isin(a_sorted["correlation_id"], kp["correlation_id"])]
        f.add(Trace(kernels=kp, api=ap, copies=t.copies if i == 0 else t.copies[:0], names=t.names,
                    devices=t.devices))
        # Bounded: nothing but the open step of each device and small pending batches stays.
        held = (len(f._carry[0]) if f._carry else 0) + f._pending_n
        assert held <= len(kp) + (f._pending_n if f._pending_n < 32_768 else 0) + 200_000
    out: dict = {}
    f.flush()                        # the open step too: the stream ends here
    for g in f.figures():
        for ph, v in g.phases.items():
            x = out.setdefault(ph, [0, 0, 0.0, 0.0])
            x[0] += v.kernels
            x[1] += v.kernel_time_ns
            x[2] += v.flops or 0.0
            x[3] += v.bytes or 0.0
    return out


def _whole_trace_counts(t: Trace) -> dict:
    pm = map_phases(_kernel_stream(t), use_annotations=False)
    c = np.bincount(pm.kernel_phase, minlength=5)
    return {PHASE_NAMES[i]: int(n) for i, n in enumerate(c) if n}


@pytest.mark.parametrize("name", [
    "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz",
    "nvidia-inference/tracelens_b200_vllm_gptoss_tp8_prefill888.json.gz",
    "nvidia-inference/nanovllm_rtx4080laptop_decode_step100_fragment.json.gz",
    "nvidia-training/hta_a100_rank0_training.json.gz",
])
def test_fold_in_batches_equals_fold_at_once_on_real_traces(trace_path, name):
    from ridgeline.probes.kineto import load_trace
    t = _kernel_stream(load_trace(trace_path(name)))
    model = model_config.builtin("gpt-oss-120b")
    once = _fold_in(t, 1, model)
    for n in (3, 7):
        assert _fold_in(t, n, model) == once, n
    # The streaming mapper labels kernels as the whole-trace mapper does (kernels only).
    assert {ph: v[0] for ph, v in once.items()} == _whole_trace_counts(t)
    assert sum(v[1] for v in once.values()) == int((t.kernels["end_ns"] - t.kernels["start_ns"]).sum())


def _simulated(prompt_mean, output_mean, rate, max_tokens=None):
    from ridgeline.agent.simulator.engine import SimConfig, SimEngine
    from ridgeline.agent.simulator.scheduler import SchedulerConfig
    from ridgeline.agent.simulator.workload import Workload
    w = Workload(rate_per_s=rate, duration_s=1, prompt_mean=prompt_mean, prompt_max=2 * prompt_mean,
                 output_mean=output_mean, output_max=2 * output_mean)
    kw = {"scheduler": SchedulerConfig(max_num_batched_tokens=max_tokens)} if max_tokens else {}
    e = SimEngine(SimConfig(model="llama-3-8b", workload=w, annotations=False, **kw), seed=1, metrics=False)
    e.run_until(int(0.5e9))
    return _kernel_stream(e.drain())


def test_fold_in_batches_equals_fold_at_once_on_simulated_runs():
    model = model_config.builtin("llama-3-8b")
    for t in (_simulated(128, 400, 40), _simulated(4000, 1, 4, 8192)):
        once = _fold_in(t, 1, model, "h100-sxm")
        assert once and sum(v[2] for v in once.values()) > 0          # model FLOPs were attributed
        for n in (4, 16):
            assert _fold_in(t, n, model, "h100-sxm") == once, n
        assert {ph: v[0] for ph, v in once.items()} == _whole_trace_counts(t)


def test_window_verdicts_from_the_fold_on_simulated_regimes():
    """The streamed window says what the whole-trace analysis says (tests/test_simulator_regimes.py)."""
    model = model_config.builtin("llama-3-8b")
    for t, phase, verdict in ((_simulated(128, 400, 40), "decode", "memory-bound"),
                              (_simulated(4000, 1, 4, 8192), "prefill", "compute-bound")):
        b = WindowBuilder(model=model, gpu="h100-sxm")
        k = t.kernels
        for part in np.array_split(np.arange(len(k)), 10):
            kp = k[part]
            b.add_events(Trace(kernels=kp, api=t.api[np.isin(t.api["correlation_id"], kp["correlation_id"])],
                               names=t.names, devices=t.devices, meta={"source": "simulated"}))
        w = b.close(0, 1, final=True)
        (g,) = w.gpus
        p = g.phases[phase]
        assert p.verdict == verdict, p.evidence
        from ridgeline.aggregator import analysis
        whole = analysis.document(analysis.analyze_trace(t, gpu="h100-sxm", model=model,
                                                         use_annotations=False))["phases"][phase]
        assert p.kernel_time_ns == whole["kernel_time_ns"] and p.kernels == whole["kernels"]
        assert whole["verdict"] == verdict
        # Same model work per step: FLOPs and bytes agree with the whole-trace roofline.
        assert p.flops == pytest.approx(whole["flops"], rel=1e-9)
        assert p.bytes == pytest.approx(whole["bytes"], rel=1e-9)
        assert g.busy_ns <= g.span_ns and g.launch.count > 0


def test_log2_histogram_percentiles():
    v = np.array([0, 1, 2, 3, 1000, 1023, 1024, 10**9])
    assert log2_bins(v).tolist() == [0, 1, 2, 2, 10, 10, 11, 30]
    h = np.bincount(log2_bins(np.full(99, 5000)), minlength=HIST_BINS)
    p = hist_percentile_ns(h, 50)
    assert 4096 <= p < 8192                 # within the bin that holds 5000
    assert hist_percentile_ns(np.zeros(HIST_BINS, np.int64), 50) is None


def test_window_close_does_not_reparse_tables():
    from ridgeline.aggregator import ceilings
    b = WindowBuilder()
    b.add_events(_trace())
    b.close(0, 1)
    before = ceilings._parsed_file.cache_info()
    for _ in range(3):
        b.add_events(_trace())
        b.close(0, 1)
    after = ceilings._parsed_file.cache_info()
    assert after.misses == before.misses


def test_big_batch_is_folded_in_slices_with_the_same_figures(monkeypatch):
    import ridgeline.aggregator.windows as windows_mod
    model = model_config.builtin("llama-3-8b")
    t = _simulated(128, 400, 40)
    once = _fold_in(t, 1, model, "h100-sxm")
    monkeypatch.setattr(windows_mod, "FOLD_MAX_KERNELS", 1000)
    assert len(t.kernels) > 5000
    assert _fold_in(t, 1, model, "h100-sxm") == once


def test_decode_kv_read_filled_from_the_engine_estimate():
    from ridgeline.aggregator.windows import fill_decode_kv_read
    from ridgeline.probes.records import window_of
    w = {"duration_ns": 2_000_000_000,
         "gpus": [{"pid": 7, "phases": {"decode": {"bytes": 3.0e12, "work_source": "model",
                                                   "achieved_bytes_per_s": 2.0e12},
                                        "prefill": {"bytes": 1.0e12, "work_source": "model"}}},
                  {"pid": 8, "phases": {"decode": {"bytes": 1.0e12, "work_source": "shapes"}}}],
         "engine": {"engine": {"endpoints": {"u": {"pid": 7, "estimated_bytes_per_gpu_per_s": 2.5e12},
                                             "v": {"pid": 8, "estimated_bytes_per_gpu_per_s": 9e12}}}}}
    w = window_of(w)
    fill_decode_kv_read(w)
    dec = w.gpus[0].phases["decode"]
    # 2.5 TB/s estimated by the engine - (3 + 1) TB / 2 s from the model = 0.5 TB/s of KV reads.
    assert dec.kv_read_bytes_per_s == pytest.approx(0.5e12) and dec.kv_read_source == "engine_estimate"
    assert dec.achieved_bytes_with_kv_per_s == pytest.approx(2.5e12)
    assert w.gpus[1].phases["decode"].kv_read_bytes_per_s is None     # shapes already count KV reads


def test_engine_endpoints_kept_until_stale_and_merged_across_windows():
    """Each endpoint keeps its last figures between its scrapes (two endpoints scraped in
    different windows are both in the window); one whose server died leaves the window
    after ENGINE_STALE_S, so /metrics and alerts do not show a dead server's KV usage."""
    from ridgeline.aggregator import windows
    from ridgeline.probes import prom_text
    text = "vllm:num_requests_waiting 3\nvllm:kv_cache_usage_perc 0.9\n"
    a, b = "http://127.0.0.1:8000/metrics", "http://127.0.0.1:8001/metrics"
    S = 1_000_000_000
    bld = WindowBuilder()

    def scrape(ep, t):
        return {"endpoint": ep, "ts_ns": t, "exposition": prom_text.parse(text)}
    bld.add_engine({"scrapes": [scrape(a, 0)]})
    w = bld.close(0, S)
    assert set(w.engine["engine"]["endpoints"]) == {a}
    bld.add_engine({"scrapes": [scrape(b, S)]})
    w = bld.close(S, 2 * S)
    assert set(w.engine["engine"]["endpoints"]) == {a, b}
    # a's server is gone: only errors for it from now on, b goes on.
    last = None
    for i in range(2, 40):
        bld.add_engine({"scrapes": [scrape(b, i * S)], "errors": [{"endpoint": a, "error": "refused"}]})
        w = bld.close(i * S, (i + 1) * S)
        if a in w.engine["engine"]["endpoints"]:
            last = i
    assert last == int(windows.ENGINE_STALE_S)          # still there 30 s after its last scrape, then gone
    assert set(w.engine["engine"]["endpoints"]) == {b}
    assert w.engine["engine"]["errors"][0]["endpoint"] == a
    # Nothing at all from the probe (back-off): stale endpoints still go.
    for i in range(40, 80):
        w = bld.close(i * S, (i + 1) * S)
    assert w.engine["engine"]["endpoints"] == {}
