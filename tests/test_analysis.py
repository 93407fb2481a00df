"""Whole-trace analysis on literal traces and on every shared trace."""
import numpy as np
import pytest
from support.kineto_traces import TRACES as SHARED
from support.phase_literals import decode_literal_trace

from ridgeline.aggregator import model_config
from ridgeline.aggregator.analysis import analyze_trace as analyze_typed
from ridgeline.aggregator.analysis import choose_ceilings, document
from ridgeline.aggregator.ceilings import load_table
from ridgeline.aggregator.work import CAT_GEMM, kernel_work_from_shapes
from ridgeline.probes.events import Device

H100_QWEN = SHARED[3]
PHASE_KEYS = {"kernel_time_ns", "kernels", "flops", "bytes", "achieved_flops_per_s", "achieved_bytes_per_s",
              "arithmetic_intensity", "verdict", "evidence", "pct_of_peak_flops", "pct_of_peak_bytes",
              "work_source", "busy_ns", "share_of_gpu_time_ratio", "idle_ratio"}
VERDICTS = {"memory-bound", "compute-bound", "latency/launch-bound", "host-bound", "undetermined"}


def analyze_trace(*a, **kw) -> dict:
    """The ``ridgeline analyze --json`` document (these tests check its keys and figures)."""
    return document(analyze_typed(*a, **kw))


def test_literal_decode_with_model_is_memory_bound():
    t, pm = decode_literal_trace()
    m = model_config.builtin("llama-3-8b")
    doc = analyze_trace(t, model=m, context_len=2048, phase_map=pm)
    assert doc["gpu"]["key"] == "h200-sxm" and doc["gpu"]["ceilings_from"].startswith("device name")
    d = doc["phases"]["decode"]
    assert d["work_source"] == "model" and d["kernels"] == 160 and d["steps"] == 4
    # Each step reads the weights once and 64 sequences' KV of 2048 tokens.
    per_step = m.weight_bytes_read(64) + 64 * 2048 * m.kv_bytes_per_token
    assert d["bytes"] > 4 * per_step
    assert d["achieved_bytes_per_s"] == pytest.approx(d["bytes"] / 40e-3)
    assert 50 < d["pct_of_peak_bytes"] < 100
    assert d["verdict"] == "memory-bound"
    assert doc["steps"][0]["tokens"] == {"prefill": 0, "decode": 64}
    assert doc["steps"][0]["kernels"] == 40 and doc["steps"][0]["busy_ns"] == 10_000_000


def test_literal_without_model_or_shapes_reports_no_source():
    t, pm = decode_literal_trace()
    d = analyze_trace(t, phase_map=pm)["phases"]["decode"]
    assert d["flops"] is None and d["bytes"] is None and d["work_source"] == "no source"
    assert d["verdict"] == "undetermined"
    assert any("no FLOP/byte source" in e for e in d["evidence"])


def test_gpu_option_and_unknown_device():
    t, pm = decode_literal_trace()
    doc = analyze_trace(t, gpu="l4", phase_map=pm)
    assert doc["gpu"]["key"] == "l4"
    t.devices = [Device(0, "NVIDIA Tesla K80")]
    c, how = choose_ceilings(t, None, load_table())
    assert c is None and "--gpu" in how
    doc = analyze_trace(t, phase_map=pm)
    assert doc["gpu"]["name"] == "NVIDIA Tesla K80" and doc["phases"]["decode"]["ridge_point"] is None


@pytest.mark.parametrize("name", SHARED)
def test_every_shared_trace(trace_path, name):
    from ridgeline.probes.kineto import load_trace
    doc = analyze_trace(load_trace(trace_path(name)))
    assert {"gpu", "phases", "steps", "idle_gaps", "launch_latency", "copies"} <= set(doc)
    assert doc["gpu"]["key"], "every shared trace's GPU is in the table"
    assert doc["phases"]
    for p in doc["phases"].values():
        assert PHASE_KEYS <= set(p)
        assert p["verdict"] in VERDICTS and p["evidence"]
        if p["flops"] is None:
            assert p["work_source"] == "no source"
    assert sum(p["kernels"] for p in doc["phases"].values()) == doc["kernels"]
    for s in doc["steps"]:
        assert {"start_ns", "end_ns", "phase", "evidence"} <= set(s) and s["end_ns"] >= s["start_ns"]


def test_h100_qwen_prefill_shape_flops_match_the_model(trace_path):
    """Qwen1.5-0.5B, 16 x 559 = 8944 tokens: projections and MLP are 2 x 0.31 G non-embedding
    parameters x 8944 tokens = 5.5 TFLOP, causal attention 2 x 16 x 16 x (559 x 560 / 2) x 128
    x 24 layers = 0.25 TFLOP: about 5.8e12 FLOPs for the profiled forward pass."""
    from ridgeline.probes.kineto import load_trace
    t = load_trace(trace_path(H100_QWEN))
    m = model_config.builtin("qwen1.5-0.5b")
    kw = kernel_work_from_shapes(t)
    gemm = float(np.nansum(kw.flops[kw.category == CAT_GEMM]))
    # The profiled forward's 168 projections (24 layers x 7) against the model's count.
    assert gemm == pytest.approx(8944 * m.linear_flops_per_token(), rel=0.01)
    doc = analyze_trace(t)
    p = doc["phases"]["prefill"]
    shapes = p["work_by_source"]["shapes"]
    assert 4e12 < shapes["flops"] < 8e12
    assert shapes["dtype"] == "bf16" and p["ceiling_dtype"] == "bf16"
    # Achieved FLOP/s must lie under the H100's bf16 peak, and be a real fraction of it.
    assert 0.05 < p["pct_of_peak_flops"] / 100 < 1.0
    assert p["pct_of_peak_bytes"] < 100


def test_b200_prefill_tokens_and_model_share(trace_path):
    from ridgeline.probes.kineto import load_trace
    t = load_trace(trace_path(SHARED[2]))
    m = model_config.builtin("gpt-oss-120b")
    doc = analyze_trace(t, model=m, context_len=888, tensor_parallel=8)
    step = next(s for s in doc["steps"] if s.get("tokens"))
    assert step["tokens"]["prefill"] == 888
    mw = step["model_work"]
    # 888 tokens touch nearly all 128 experts: about 1/8 of ~63 GB of weights per GPU.
    assert 6e9 < mw["parts"]["weight_bytes"] < 9e9
    assert doc["phases"]["prefill"]["work_source"] == "model"


def test_simulated_traces_are_labelled():
    t, pm = decode_literal_trace()
    assert analyze_trace(t, phase_map=pm)["simulated"] is False
    t.devices[0].properties["simulated"] = True
    assert analyze_trace(t, phase_map=pm)["simulated"] is True
