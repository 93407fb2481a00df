"""aggregator.phase_figures: analyze and the live windows fill one accumulator and read one
figure function, so the same kernels give the same per-phase figures through both."""
import msgspec
import numpy as np
import pytest

from ridgeline.aggregator import analysis, model_config
from ridgeline.aggregator.phase_figures import FINE_BINS, SUB_BINS, PhaseSums, fine_bins, fine_percentile_ns
from ridgeline.aggregator.windows import WindowBuilder
from ridgeline.probes.events import Trace
from ridgeline.probes.records import PhaseFigures


def _kernel_stream(t: Trace) -> Trace:
    """What CUPTI streams: kernels in start order with their launch records, no ranges or
    CPU operators (the streaming mapper then labels kernels as the whole-trace one does)."""
    order = np.argsort(t.kernels["start_ns"], kind="stable")
    return Trace(kernels=t.kernels[order], api=t.api, names=t.names, devices=t.devices, meta=t.meta)


def _simulated(prompt_mean, output_mean, rate, max_tokens=None):
    from ridgeline.agent.simulator.engine import SimConfig, SimEngine
    from ridgeline.agent.simulator.scheduler import SchedulerConfig
    from ridgeline.agent.simulator.workload import Workload
    w = Workload(rate_per_s=rate, duration_s=1, prompt_mean=prompt_mean, prompt_max=2 * prompt_mean,
                 output_mean=output_mean, output_max=2 * output_mean)
    kw = {"scheduler": SchedulerConfig(max_num_batched_tokens=max_tokens)} if max_tokens else {}
    e = SimEngine(SimConfig(model="llama-3-8b", workload=w, annotations=False, **kw), seed=1, metrics=False)
    e.run_until(int(0.3e9))
    return _kernel_stream(e.drain())


def _window_phases(t: Trace, batches: int, model, gpu: str) -> dict:
    """Per-phase figures of the live window: ``t`` in ``batches`` consecutive slices, each
    with its kernels' launch records."""
    b = WindowBuilder(model=model, gpu=gpu)
    k, a = t.kernels, t.api
    for part in np.array_split(np.arange(len(k)), batches):
        kp = k[part]
        b.add_events(Trace(kernels=kp, api=a[np.isin(a["correlation_id"], kp["correlation_id"])],
                           names=t.names, devices=t.devices, meta={"source": "simulated"}))
    (g,) = b.close(0, 1, final=True).gpus
    return g.phases


def _analyze_phases(t: Trace, model, gpu: str) -> dict[str, PhaseFigures]:
    """analyze's phases as the window's typed records: every figure analyze gives is one
    the window record declares (none is lost in the conversion)."""
    doc = analysis.document(analysis.analyze_trace(t, gpu=gpu, model=model, use_annotations=False))
    for f in doc["phases"].values():
        del f["top_kernels"]          # a listing of the trace's names, not a window figure
        assert set(f) <= set(PhaseFigures.__struct_fields__), set(f) - set(PhaseFigures.__struct_fields__)
    return msgspec.convert(doc["phases"], dict[str, PhaseFigures])


@pytest.mark.parametrize("args", [(128, 400, 40), (4000, 1, 4, 8192)], ids=["decode-heavy", "prefill-heavy"])
def test_analyze_and_live_window_give_equal_figures(args):
    model = model_config.builtin("llama-3-8b")
    t = _simulated(*args)
    whole = _analyze_phases(t, model, "h100-sxm")
    assert whole and sum(f.kernels for f in whole.values()) == len(t.kernels)
    assert any(f.flops for f in whole.values())             # the model's work was attributed
    assert _window_phases(t, 1, model, "h100-sxm") == whole
    # Batches cut anywhere: each step is folded whole (the window holds the open one), so
    # the sums, and every figure read from them, are those of one fold.
    for n in (3, 11):
        assert _window_phases(t, n, model, "h100-sxm") == whole, n


@pytest.mark.parametrize("name", [
    "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz",
    "nvidia-inference/nanovllm_rtx4080laptop_decode_step100_fragment.json.gz",
])
def test_analyze_and_live_window_agree_on_real_traces(trace_path, name):
    from ridgeline.probes.kineto import load_trace
    t = _kernel_stream(load_trace(trace_path(name)))
    # One GPU and process (a window reports each pair; analyze sums a trace's pairs).
    k = t.kernels
    key = (k["device"].astype(np.int64) << 32) | k["pid"].astype(np.int64)
    u, c = np.unique(key, return_counts=True)
    m = key == u[np.argmax(c)]
    a = t.api[np.isin(t.api["correlation_id"], k["correlation_id"][m])]
    t = Trace(kernels=k[m], api=a, names=t.names, devices=t.devices, meta=t.meta)
    model = model_config.builtin("qwen1.5-0.5b")
    whole = _analyze_phases(t, model, "h100-sxm")
    assert whole and sum(f.kernels for f in whole.values()) == int(m.sum())
    assert _window_phases(t, 1, model, "h100-sxm") == whole


def test_fine_bins_and_percentiles():
    v = np.array([0, 1, 2, 3, 5, 1000, 1024, 10**9])
    b = fine_bins(v)
    assert b[0] == 0 and b[1] == SUB_BINS and b[2] == 2 * SUB_BINS
    assert b[3] == 2 * SUB_BINS + SUB_BINS // 2          # 3 = 1.5 x 2
    assert (np.diff(b) > 0).all() and b.max() < FINE_BINS
    for x in (7, 5000, 123_456, 10**8):
        h = np.bincount(fine_bins(np.full(9, x)), minlength=FINE_BINS)
        assert abs(fine_percentile_ns(h, 50) / x - 1) < 2 ** (1 / SUB_BINS) - 1
    assert fine_percentile_ns(np.zeros(FINE_BINS, np.int64), 50) is None


def test_sums_add_and_by_phase_are_row_sums():
    a, b = PhaseSums(), PhaseSums()
    ra = a.rows(np.array([(0 << 35) | 2, (1 << 35) | 2, 1]))
    a.ints[ra, 0] = [3, 4, 5]
    rb = b.rows(np.array([(1 << 35) | 2]))
    b.ints[rb, 0] = 10
    a.add(b)
    assert a.ints[:, 0].sum() == 22 and len(a) == 3
    p = a.by_phase()
    assert p.keys.tolist() == [1, 2] and p.ints[:, 0].tolist() == [5, 17]


def test_a_whole_trace_folded_in_slices_gives_the_figures_of_one_fold(monkeypatch):
    from ridgeline.aggregator import roofline
    model = model_config.builtin("llama-3-8b")
    t = _simulated(128, 400, 40)
    once = _analyze_phases(t, model, "h100-sxm")
    monkeypatch.setattr(roofline, "FOLD_SLICE_KERNELS", 500)
    assert _analyze_phases(t, model, "h100-sxm") == once
