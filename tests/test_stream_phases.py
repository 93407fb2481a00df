"""aggregator.stream_phases: per-batch phase mapping with step shapes decided once."""
import numpy as np

from ridgeline.aggregator.phases import PHASE_NAMES, map_phases
from ridgeline.aggregator.stream_phases import StreamPhaser
from ridgeline.probes.events import RANGE_DTYPE, Trace, empty


def _simulated_decode():
    from ridgeline.agent.simulator.engine import SimConfig, SimEngine
    e = SimEngine(SimConfig(model="llama-3-8b", gpu="h100", annotations=False), seed=0, metrics=False)
    for _ in range(6):
        e.forward([1] * 16, [500] * 16)       # six identical decode steps
    t = e.drain()
    order = np.argsort(t.kernels["start_ns"], kind="stable")
    return Trace(kernels=t.kernels[order], api=t.api, names=t.names, devices=t.devices)


def test_identical_steps_are_decided_once_and_agree_with_the_whole_trace_mapper():
    t = _simulated_decode()
    sp = StreamPhaser(t.names)
    bp = sp.map_batch(t)
    whole = map_phases(t, use_annotations=False)
    assert np.array_equal(bp.kernel_phase, whole.kernel_phase)
    assert PHASE_NAMES[int(np.bincount(bp.kernel_phase).argmax())] == "decode"
    assert len(bp.steps) == len(whole.steps) == 6
    assert bp.shape_misses == 1 and bp.shape_hits == 5 and sp.map_phases_calls == 1
    # The same shapes in a later batch cost no further map_phases call.
    bp2 = sp.map_batch(t)
    assert sp.map_phases_calls == 1 and bp2.shape_hits == 6
    assert all(s.decode_tokens == 16 for s in bp2.steps), [s.decode_tokens for s in bp2.steps]


def test_remembered_shapes_are_bounded():
    t = _simulated_decode()
    sp = StreamPhaser(t.names, max_shapes=1)
    k = t.kernels.copy()
    sp.map_batch(Trace(kernels=k, names=t.names, devices=t.devices))
    k["grid_x"] += 1                         # a different shape
    sp.map_batch(Trace(kernels=k, names=t.names, devices=t.devices))
    assert len(sp._shapes) == 1 and sp.map_phases_calls == 2


def test_annotated_batch_uses_the_full_layered_method():
    t = _simulated_decode()
    r = empty(RANGE_DTYPE, 1)
    r["start_ns"], r["end_ns"] = t.kernels["start_ns"].min(), t.kernels["end_ns"].max()
    r["device"], r["name_id"] = 0, t.names.intern("execute_context_0(0)_generation_16(16)")
    r["external_id"] = 1
    from ridgeline.probes.events import RANGE_GPU_ANNOTATION
    r["kind"] = RANGE_GPU_ANNOTATION
    ann = Trace(kernels=t.kernels, ranges=r, names=t.names, devices=t.devices)
    bp = StreamPhaser(t.names).map_batch(ann)
    assert bp.order is None
    assert np.array_equal(bp.kernel_phase, map_phases(ann).kernel_phase)
    assert "generation" in bp.steps[0].evidence or "decode" in bp.steps[0].evidence


def test_eager_decoder_shapes_agree_with_the_whole_trace_mapper():
    """The eager GPT-2-style literal of tests/test_phases.py (kernels only, host stalls): the
    streaming mapper gives the whole-trace labels (prefill, decode, decode); shapes that differ
    only in grid.z or block.y are distinct shapes (both carry evidence)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from support.phase_traces import TraceBuilder, eager_forward
    b = TraceBuilder()
    t = eager_forward(b, 0, tokens=50, context=50)
    t = eager_forward(b, t + 30_000, tokens=1, context=51)
    eager_forward(b, t + 30_000, tokens=1, context=52)
    for k in b.kernels:
        k["block_y"] = 4
    tr = b.build()
    bp = StreamPhaser(tr.names).map_batch(tr)
    whole = map_phases(tr)
    assert [s.phase for s in bp.steps] == [s.phase for s in whole.steps] == [1, 2, 2]
    assert np.array_equal(bp.kernel_phase, whole.kernel_phase)
    k = tr.kernels.copy()
    k["grid_z"] += 1
    sp = StreamPhaser(tr.names)
    sp.map_batch(tr)
    calls = sp.map_phases_calls
    sp.map_batch(Trace(kernels=k, names=tr.names, devices=tr.devices))
    assert sp.map_phases_calls > calls
