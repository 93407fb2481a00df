"""The steps found from kernels are the model calls a trace holds, not its ProfilerStep count
(issue 20: "step boundaries must equal the engine's steps").

docs/phases.md's table once listed these traces as disagreeing with their engine: one
ProfilerStep each, yet 2 steps (Hugging Face Qwen1.5-0.5B on H100 and MI300X), 5 (OWLv2)
and 9 (xDiT SD3.5). What the traces' own CPU side says (written by the PyTorch profiler for
the TraceLens authors, nobody here) is that each of those steps is one model call:

* **Qwen**: the first step is exactly the kernels with no launch record in the trace: the
  end of the previous forward, launched before the recording began (the GPU runs behind the
  CPU; Kineto records launches from the step it starts in). The second is the profiled
  forward: 24 causal attention launches, one per layer (Qwen1.5-0.5B's config.json on the
  Hugging Face hub: ``"num_hidden_layers": 24``).
* **OWLv2**: the one ProfilerStep holds five pipeline calls. Each ends by copying its
  outputs to the host (an ``aten::to`` of about 70 ms that waits for the GPU), and the next
  call launches only after that copy, past a GPU idle gap of over 100 ms; the five steps
  have the same kernels (866 each).
* **xDiT SD3.5**: the denoising transformer runs as ``Torch-Compiled Region: 0/0`` four
  times; each region launches (nearly all of) exactly one step's kernels, the rest being the
  scheduler's update of the latents in the same iteration. The steps launched before the first
  region are the text encoders', and the one after the last is the VAE decode.

Checked in every mode (annotations kept, stripped, and CPU operators removed too): the CPU
side only checks the boundaries here, the kernels alone draw them. Traces: tests/THIRD_PARTY.md
(the MI300X and OWLv2 files under ../shared/third-party, the H100 Qwen file under ../shared/traces);
absent, these tests skip.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import shared_trace, third_party
from support.phase_traces import MODES, phases_in_mode

from ridgeline.aggregator.phases import PREFILL
from ridgeline.probes.events import Trace
from ridgeline.probes.kineto import load_trace

_cache: dict[str, Trace] = {}


def _load(path) -> Trace:
    key = str(path)
    if key not in _cache:
        _cache[key] = load_trace(path)
    return _cache[key]


def _launches(tr: Trace, mask: np.ndarray) -> np.ndarray:
    """Start times of the launch records of the kernels in ``mask``."""
    a = tr.api
    return a["start_ns"][np.isin(a["correlation_id"], tr.kernels["correlation_id"][mask])]


def _cpu_ops(tr: Trace, name: str) -> list[tuple[int, int]]:
    c = tr.cpu_ops
    ids = [i for i in range(len(tr.names)) if tr.names[i] == name]
    m = np.isin(c["name_id"], ids)
    return sorted(zip(c["start_ns"][m].tolist(), c["end_ns"][m].tolist()))


QWEN = [("shared", "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz"),
        ("third_party", "traces/tracelens_mi300_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where, rel", QWEN, ids=["h100", "mi300x"])
def test_qwen_the_first_step_is_the_previous_forwards_tail(where, rel, mode):
    tr = _load(shared_trace(rel) if where == "shared" else third_party(rel))
    pm = phases_in_mode(tr, mode)
    assert len(pm.steps) == 2
    launched = np.isin(tr.kernels["correlation_id"], tr.api["correlation_id"])
    tail = pm.kernel_step == 0
    assert tail.any() and not launched[tail].any()           # no kernel of it was launched in the trace
    assert launched[pm.kernel_step == 1].all()               # every kernel of the profiled forward was
    assert pm.steps[1].phase == PREFILL
    names = np.array([tr.names[int(i)] for i in tr.kernels["name_id"]])
    attention = (np.char.find(names, "flash_fwd_kernel") >= 0) | (names == "attn_fwd")   # FA2 (H100), aotriton (MI300X)
    assert int(attention[pm.kernel_step == 1].sum()) == 24   # num_hidden_layers of Qwen1.5-0.5B


@pytest.mark.parametrize("mode", MODES)
def test_owlv2_one_step_per_pipeline_call(mode):
    tr = _load(third_party("traces/tracelens_h100_owlv2_zero_shot_detection.json.gz"))
    pm = phases_in_mode(tr, mode)
    assert len(pm.steps) == 5 and {s.kernels for s in pm.steps} == {866}
    # each call ends by copying its outputs to the host: an aten::to that waits for the GPU
    copies = [(a, b) for a, b in _cpu_ops(tr, "aten::to") if b - a > 50_000_000]
    assert len(copies) == 5
    for s, (_, copy_end) in zip(pm.steps, copies):
        assert abs(copy_end - s.end_ns) < 2_000_000          # the copy is done when the step's kernels are
    for s, (_, copy_end) in zip(pm.steps[1:], copies):
        assert _launches(tr, pm.kernel_step == s.index).min() > copy_end   # the next call starts after it
    gaps = [b.start_ns - a.end_ns for a, b in zip(pm.steps, pm.steps[1:])]
    assert min(gaps) > 100_000_000


@pytest.mark.parametrize("mode", MODES)
def test_sd35_one_step_per_compiled_transformer_call(mode):
    tr = _load(third_party("traces/tracelens_mi300_xdit_sd35_diffusion_transformer.json.gz"))
    pm = phases_in_mode(tr, mode)
    regions = _cpu_ops(tr, "Torch-Compiled Region: 0/0")
    assert len(regions) == 4
    inside = []
    for s in pm.steps:
        t = _launches(tr, pm.kernel_step == s.index)
        # most of a denoising step's launches are the compiled transformer's; the few after
        # it are the scheduler's update of the latents, in the same iteration
        held = [j for j, (a, b) in enumerate(regions) if ((t >= a) & (t <= b)).mean() >= 0.9]
        inside.append(held[0] if held else None)
        if not held:            # launched wholly outside every region: before the first or after the last
            assert t.max() < regions[0][0] or t.min() > regions[-1][1]
    assert [j for j in inside if j is not None] == [0, 1, 2, 3]    # each region: exactly one step
    first = inside.index(0)
    assert all(j is None for j in inside[:first]) and inside[first:first + 4] == [0, 1, 2, 3]
    assert len(inside) - (first + 4) == 1                           # the VAE decode after them
