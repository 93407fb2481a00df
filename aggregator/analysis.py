"""A whole analysis of one :class:`probes.events.Trace`: ceilings, phases, work, roofline.

:func:`analyze_trace` returns an :class:`Analysis`, the typed ``ridgeline analyze --json``
document (keys are listed in docs/analyze.md; :func:`document` gives the JSON-ready
dict). It chooses the GPU's ceilings from the trace's device properties unless a GPU is
named, maps kernels to phases (:func:`aggregator.phases.map_phases`), derives work from
operator shapes and, with a model, from the analytic model per step, and assembles the
per-phase roofline, idle gaps, launch latency and copy traffic.

The Structs below say what the document holds, in its key order (the JSON keeps the order
of the dicts it was built from before it was typed: ``tests/test_analyze_golden.py`` pins
the bytes). A key that only some documents carry (a recording's ``recording``, a rank's
``rank``, a phase's ``percentiles_from_segment`` after segments were combined) is
``msgspec.UNSET`` where absent, and left out of the JSON; every other key is always written,
None where its figure is unknown. Figures keep the type their producer gave
(:data:`probes.records.Num`: an int stays an int in the JSON).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

from ridgeline.probes.errors import InputError
from ridgeline.probes.events import Trace
from ridgeline.probes.records import PHASE_NAMES, Num
from ridgeline.probes.trace_joins import kernel_cpu_op_index

from . import ceilings as ceilings_mod
from . import roofline, stragglers
from .model_config import ModelShape
from .phases import MIXED, map_phases
from .stragglers import GroupFigures
from .work import StepWork, kernel_work_from_shapes, step_work_of

SCHEMA = "ridgeline.analyze/1"


class LaunchLatency(msgspec.Struct):
    """API launch call start to kernel start over the kernels with a launch record
    (:func:`roofline.launch_latency`; a phase's from the figure builder)."""
    kernels: int = 0
    p50_ns: Num | None = None
    p90_ns: Num | None = None
    p99_ns: Num | None = None
    mean_ns: Num | None = None
    negative_skipped: int | UnsetType = UNSET     # launch after its kernel: host/device clocks disagree


class TopKernel(msgspec.Struct):
    """One kernel name of a phase's most time (:func:`roofline.top_kernels`)."""
    name: str = ""
    count: int = 0
    time_ns: Num = 0
    flops: Num | None = None
    bytes: Num | None = None
    achieved_flops_per_s: Num | None = None
    achieved_bytes_per_s: Num | None = None
    category: str | None = None
    shapes_coverage_ratio: Num | UnsetType = UNSET   # where operator shapes gave figures


class WorkSource(msgspec.Struct):
    """A phase's work from one source (operator shapes or the model) and the kernel time it
    covers (:func:`aggregator.phase_figures.phase_figures`)."""
    flops: Num = 0.0
    bytes: Num = 0.0
    busy_ns: Num = 0
    coverage_ratio: Num = 0.0
    dtype: str | None = None
    kernels: int | UnsetType = UNSET          # shapes: kernels with shapes
    steps: int | UnsetType = UNSET            # model: steps with token counts
    estimated_steps: int | UnsetType = UNSET  # model: of them, token counts read from kernel grids
    notes: list[str] | UnsetType = UNSET      # model: the model's notes
    exceeds_ceilings_ratio: Num | UnsetType = UNSET   # where its figures exceed the GPU's ceilings


class PhaseAnalysis(msgspec.Struct):
    """One phase's figures over the whole trace (:func:`aggregator.phase_figures.phase_figures`,
    where each is defined) and its top kernels."""
    kernels: int = 0
    kernel_time_ns: Num = 0
    busy_ns: Num = 0
    time_share_pct: Num = 0.0
    share_of_gpu_time_ratio: Num | None = None
    steps: int = 0
    window_ns: Num = 0
    idle_ns: Num = 0
    idle_ratio: Num | None = None
    gaps: int = 0
    median_gap_ns: Num | None = None
    median_kernel_ns: Num | None = None
    idle_in_launch_calls_ratio: Num | None = None
    idle_in_sync_calls_ratio: Num | None = None
    flops: Num | None = None
    bytes: Num | None = None
    work_source: str | None = None
    work_estimated: bool = False      # model work over token counts read from kernel grids
    work_coverage_ratio: Num | None = None
    work_busy_ns: Num | None = None
    work_by_source: dict[str, WorkSource] = {}
    achieved_flops_per_s: Num | None = None
    achieved_bytes_per_s: Num | None = None
    arithmetic_intensity: Num | None = None
    ridge_point: Num | None = None
    ceiling_dtype: str | None = None
    peak_flops_per_s: Num | None = None
    peak_bytes_per_s: Num | None = None
    pct_of_peak_flops: Num | None = None
    pct_of_peak_bytes: Num | None = None
    launch_latency: LaunchLatency = msgspec.field(default_factory=LaunchLatency)
    verdict: str | None = None
    evidence: list[str] = []
    top_kernels: list[TopKernel] = []
    percentiles_from_segment: int | UnsetType = UNSET   # a recording's: the segment its percentiles are


class IdleGaps(msgspec.Struct):
    """GPU idle between kernels on one device (:func:`roofline.idle_gaps`)."""
    span_ns: Num = 0
    busy_ns: Num = 0
    idle_ns: Num = 0
    idle_ratio: Num | None = None
    gaps: int = 0
    gap_p50_ns: Num | None = None
    gap_p90_ns: Num | None = None
    gap_p99_ns: Num | None = None
    gap_max_ns: Num | None = None
    gap_histogram: dict[str, int] = {}
    percentiles_from_segment: str | UnsetType = UNSET   # a recording's: "longest"


class Copies(msgspec.Struct):
    """Memcpy or memset traffic of one kind and direction (:func:`roofline.copy_traffic`)."""
    kind: str = ""
    direction: str = ""
    count: int = 0
    bytes: Num = 0
    time_ns: Num = 0
    achieved_bytes_per_s: Num | None = None


class StepTokens(msgspec.Struct):
    """A step's token counts, both written (None: the step's record does not say)."""
    prefill: int | None = None
    decode: int | None = None
    total: int | UnsetType = UNSET    # kernels gave only the step's total (a mixed step)


class ModelWork(msgspec.Struct):
    """A step's work from the analytic model (:class:`aggregator.work.StepWork`)."""
    flops: Num = 0.0
    bytes: Num = 0.0
    source: str = ""
    estimate: bool = False            # over token counts read from kernel grids
    parts: dict[str, Num] = {}
    notes: list[str] = []


class AnalysisStep(msgspec.Struct):
    """One step of the phase map with its kernel count and busy time."""
    index: int = 0
    start_ns: int = 0
    end_ns: int = 0
    device: int | None = None
    phase: str = "unknown"
    evidence: list[str] = []
    kernels: int = 0
    busy_ns: int = 0
    tokens: StepTokens | UnsetType = UNSET        # where the step's record gave token counts
    model_work: ModelWork | UnsetType = UNSET     # with a model and token counts


class GpuCeilings(msgspec.Struct):
    """The trace's GPU and the ceilings chosen for it. With ceilings, their table entry
    (:meth:`aggregator.ceilings.Ceilings.to_dict`) and the ridge point per dtype; without,
    only ``name`` (the device's) beside how none were found."""
    device_index: int | None = None
    device_name: str | None = None
    ceilings_from: str = ""
    key: str | UnsetType = UNSET
    name: str | None = None
    hbm_bytes_per_s: Num | UnsetType = UNSET
    flops_per_s: dict[str, Num] | UnsetType = UNSET
    memory_bytes: Num | None | UnsetType = UNSET
    sm_count: int | None | UnsetType = UNSET
    source: dict[str, Any] | UnsetType = UNSET
    note: str | UnsetType = UNSET
    origin: str | UnsetType = UNSET
    ridge_point: dict[str, Num] | UnsetType = UNSET

    @property
    def has_ceilings(self) -> bool:
        return bool(self.key)


class WorkSources(msgspec.Struct):
    """Where the work figures could come from: operator shapes, and the model given."""
    shapes_kernels: int = 0
    shapes_notes: list[str] = []
    model: dict[str, Any] | None = None
    context_len: int | None = None
    # where the attention and KV-read terms took sequence lengths from: "--context-len N",
    # "the step annotations' key lengths (N of M steps)", or None (left out)
    context_from: str | None = None
    tensor_parallel: int = 1


class RecordingSegment(msgspec.Struct):
    """One segment of a recording (``agent.recording.iter_segments``)."""
    index: int = 0
    started_by: str = ""        # start | restart | gap | size
    batches: int = 0
    kernels: int = 0
    start_ns: int | None = None
    end_ns: int | None = None


class RecordingFacts(msgspec.Struct):
    """What a recording says of itself: segments, agent restarts, lost messages, and the
    agent's downtime kept out of every span and idle figure (``agent.recording_analysis``)."""
    segments: int = 0
    restarts: int = 0
    gaps: dict[str, int] = {}
    messages: dict[str, int] = {}
    truncated: bool = False
    hosts: list[str] = []
    downtime_ns: int = 0
    segment_list: list[RecordingSegment] = []


class RecordingRequests(msgspec.Struct):
    """The served requests the agent's request join told in a recording: how many, and the
    slowest as their story records (``agent.request_view.stories_of`` reads them)."""
    told: int = 0
    slowest: list[dict[str, Any]] = []


class Analysis(msgspec.Struct):
    """The ``ridgeline analyze`` document of one trace or recording (see the module docs)."""
    schema: str = SCHEMA
    trace: str = ""
    simulated: bool = False
    gpu: GpuCeilings = msgspec.field(default_factory=GpuCeilings)
    kernels: int = 0
    kernel_time_ns: int = 0
    span_ns: int = 0
    phases: dict[str, PhaseAnalysis] = {}
    steps: list[AnalysisStep] = []
    idle_gaps: dict[str, IdleGaps] = {}           # by device index (a string: a JSON key)
    launch_latency: LaunchLatency = msgspec.field(default_factory=LaunchLatency)
    copies: list[Copies] = []
    work: WorkSources = msgspec.field(default_factory=WorkSources)
    annotations_used: bool = True
    stragglers: list[GroupFigures] = []           # ranks of one TP/PP group in this trace
    answer: list[dict[str, Any]] = []             # verdict records (aggregator.answer reads them)
    rejected_events: dict[str, dict[str, int]] | UnsetType = UNSET   # by kind and reason
    rank: Any = UNSET                             # the trace's declared rank and world size
    world_size: Any = UNSET
    steps_total: int | UnsetType = UNSET          # a recording's: steps before MAX_STEPS_KEPT
    recording: RecordingFacts | UnsetType = UNSET
    requests: RecordingRequests | UnsetType = UNSET
    answer_title: str | UnsetType = UNSET         # whose verdict ``answer`` is, when not the trace's
    perfetto: str | UnsetType = UNSET             # files written by --perfetto and --plot
    plot: str | UnsetType = UNSET


def _builtin(obj):
    """numpy scalars as Python numbers (the figures are computed with numpy)."""
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"{type(obj).__name__} in an analysis document")


def document(value) -> Any:
    """The JSON-ready builtins of an :class:`Analysis` (or anything holding them: a list,
    the per-rank document), keys in field order, absent keys left out."""
    return msgspec.to_builtins(value, enc_hook=_builtin)


def trace_device(trace: Trace):
    """The device most kernels ran on (a rank's trace lists every GPU of the node), as
    ``(index, Device or None)``."""
    k = trace.kernels
    if len(k):
        devs, counts = np.unique(k["device"], return_counts=True)
        idx = int(devs[np.argmax(counts)])
    else:
        idx = trace.devices[0].index if trace.devices else 0
    for d in trace.devices:
        if d.index == idx:
            return idx, d
    return idx, (trace.devices[0] if trace.devices else None)


def choose_ceilings(trace: Trace, gpu: str | None, table: dict) -> tuple[ceilings_mod.Ceilings | None, str]:
    """Ceilings and a sentence saying how they were chosen."""
    if gpu:
        c = ceilings_mod.lookup(gpu, table)
        return c, f"--gpu {gpu}"
    _, dev = trace_device(trace)
    if dev is None or not dev.name:
        return None, "the trace names no device; pass --gpu NAME"
    mem = dev.memory_total_bytes if dev.memory_total_bytes and dev.memory_total_bytes > 0 else None
    sms = dev.sm_count if dev.sm_count and dev.sm_count > 0 else None
    c = ceilings_mod.from_device_name(dev.name, mem, sms, table)
    if c is None:
        return None, f"device {dev.name!r} is not in the ceilings table; pass --gpu NAME or --ceilings FILE"
    return c, f"device name {dev.name!r}"


def model_step_work(s, model: ModelShape, context_len: int | None, tensor_parallel: int) -> StepWork | None:
    """The analytic work of step ``s`` (a :class:`aggregator.phases.Step`): tokens read from
    the kernels (every step not from an engine annotation) make it an estimate; a mixed
    step from kernels counts its total (:func:`aggregator.work.step_work_of`)."""
    return step_work_of(model, s.prefill_tokens, s.decode_tokens,
                        mixed_tokens=s.tokens if s.phase == MIXED else None, estimate=s.source != "annotation",
                        context_len=context_len, tensor_parallel=tensor_parallel, sequences=s.sequences)


def _step(s, names: dict, work: StepWork | None, kernels: int, busy: int) -> AnalysisStep:
    st = AnalysisStep(index=int(s.index), start_ns=int(s.start_ns), end_ns=int(s.end_ns), device=int(s.device),
                      phase=names.get(int(s.phase), str(s.phase)), evidence=list(s.evidence), kernels=kernels,
                      busy_ns=busy)
    if s.prefill_tokens is not None or s.decode_tokens is not None:
        st.tokens = StepTokens(prefill=s.prefill_tokens, decode=s.decode_tokens)
    elif s.tokens is not None:
        st.tokens = StepTokens(total=int(s.tokens))
    if work is not None:
        st.model_work = ModelWork(flops=work.flops, bytes=work.bytes, source=work.source, estimate=work.estimate, parts=work.parts,
                                  notes=work.notes)
    return st


def _gpu(idx: int, dev, ceil: ceilings_mod.Ceilings | None, how: str) -> GpuCeilings:
    """The trace's GPU (index, Device or None) with its ceilings' table entry, or without."""
    name = dev.name if dev else None
    if ceil is None:
        return GpuCeilings(device_index=idx, device_name=name, ceilings_from=how, name=name)
    return GpuCeilings(device_index=idx, device_name=name, ceilings_from=how, **ceil.to_dict(),
                       ridge_point={d: v / ceil.hbm_bytes_per_s for d, v in ceil.flops_per_s.items()})


def _phase(f: dict) -> PhaseAnalysis:
    """A phase's figure dict (:func:`roofline.phase_summary`) as its Struct: every key is a
    field (TypeError on one that is not), values as computed."""
    return PhaseAnalysis(**{**f, "launch_latency": LaunchLatency(**f["launch_latency"]),
                            "work_by_source": {k: WorkSource(**w) for k, w in f["work_by_source"].items()},
                            "top_kernels": [TopKernel(**t) for t in f["top_kernels"]]})


def analyze_trace(trace: Trace, *, gpu: str | None = None, model: ModelShape | None = None,
                  context_len: int | None = None, tensor_parallel: int = 1, use_annotations: bool = True,
                  ceilings_path: str | Path | None = None, phase_map=None) -> Analysis:
    """Full analysis of one trace (see module docs). ``phase_map`` may be given (tests,
    or a caller that already mapped phases); otherwise :func:`map_phases` is called."""
    table = ceilings_mod.load_table(ceilings_path)
    ceil, how = choose_ceilings(trace, gpu, table)
    if phase_map is None:
        phase_map = map_phases(trace, use_annotations=use_annotations)
    kp = np.asarray(phase_map.kernel_phase)
    ks = np.asarray(phase_map.kernel_step)
    if len(kp) != len(trace.kernels):
        raise InputError("phase map does not match the trace's kernels")
    steps = list(phase_map.steps)
    op_index = kernel_cpu_op_index(trace)
    kw = kernel_work_from_shapes(trace, op_index)
    step_work: dict[int, StepWork] = {}
    if model is not None:
        for s in steps:
            w = model_step_work(s, model, context_len, tensor_parallel)
            if w is not None:
                step_work[int(s.index)] = w
    gaps = roofline._device_gaps(trace)
    join = roofline.launch_join(trace)
    phases = roofline.phase_summary(
        trace, kp, steps, PHASE_NAMES, ceil, kernel_work=kw, step_work=step_work,
        kernel_step=ks, model_dtype=model.ceiling_dtype if model else None, gaps=gaps, join=join)

    # Per-step kernel count and busy time, vectorised: shifting each step's kernels by
    # step * (span + 1) keeps their union from merging across steps.
    k = trace.kernels
    step_stats: dict[int, tuple[int, int]] = {}
    sel = np.flatnonzero(ks >= 0) if len(ks) else np.empty(0, np.int64)
    if len(sel):
        t0 = int(k["start_ns"][sel].min())
        width = int(k["end_ns"][sel].max()) - t0 + 1
        off = ks[sel].astype(np.int64) * width - t0
        ms, me = roofline.union_intervals(k["start_ns"][sel] + off, k["end_ns"][sel] + off)
        run_step = ms // width
        busy = np.bincount(run_step, weights=(me - ms), minlength=int(ks.max()) + 1)
        cnt = np.bincount(ks[sel], minlength=int(ks.max()) + 1)
        step_stats = {i: (int(cnt[i]), int(busy[i])) for i in np.flatnonzero(cnt).tolist()}
    idx, dev = trace_device(trace)
    span = (int(k["end_ns"].max() - k["start_ns"].min())) if len(k) else 0
    idle_gaps = roofline.idle_gaps(trace, gaps)
    return Analysis(
        schema=SCHEMA,
        trace=str(trace.meta.get("path") or trace.meta.get("source_path") or ""),
        # Traces from the workload generator say so (recording meta, or the device
        # properties it writes); their figures are never measurements.
        simulated=bool(trace.meta.get("simulated") or any(d.properties.get("simulated") for d in trace.devices)),
        gpu=_gpu(idx, dev, ceil, how),
        kernels=int(len(k)),
        kernel_time_ns=int(np.maximum(k["end_ns"] - k["start_ns"], 0).sum()) if len(k) else 0,
        span_ns=span,
        phases={name: _phase(f) for name, f in phases.items()},
        steps=[_step(s, PHASE_NAMES, step_work.get(int(s.index)), *step_stats.get(int(s.index), (0, 0)))
               for s in steps],
        idle_gaps={dev_: IdleGaps(**g) for dev_, g in idle_gaps.items()},
        launch_latency=LaunchLatency(**roofline.launch_latency(trace, join=join)),
        copies=[Copies(**c) for c in roofline.copy_traffic(trace)],
        work=WorkSources(shapes_kernels=int(kw.known.sum()), shapes_notes=kw.notes,
                         model=model.to_dict() if model else None, context_len=context_len,
                         context_from=_context_from(model, context_len, steps),
                         tensor_parallel=tensor_parallel),
        annotations_used=bool(use_annotations),
        # ranks of one TP/PP group in this trace (a host's CUPTI recording holds them all)
        stragglers=list(stragglers.analyse(trace)[0].groups),
        answer=[trace_answer(phases, idle_gaps, span, idx)],
    )


def _context_from(model: ModelShape | None, context_len: int | None, steps: list) -> str | None:
    """Where the model's attention and KV-read terms took the sequence lengths from."""
    if model is None:
        return None
    if context_len is not None:
        return f"--context-len {context_len}"
    n = sum(1 for s in steps if s.sequences is not None)
    if n:
        return f"the step annotations' key lengths ({n} of {len(steps)} steps)"
    return None


def trace_answer(phases: dict, idle_gaps: dict, span_ns: int, device: int | None) -> dict:
    """The window verdict (:func:`verdict.judge`) of the whole trace: the roofline and the
    GPU's idle share; a trace carries no engine or scheduler figures, and the answer says
    those faces are unknown."""
    from . import verdict
    d = idle_gaps.get(str(device)) if device is not None else None
    if d is None and len(idle_gaps) == 1:
        d = next(iter(idle_gaps.values()))
    idle = int(d["idle_ns"]) if d else None
    busy = int(d["span_ns"]) - idle if d else None
    v = verdict.judge(verdict.VerdictInputs(window_ns=int(span_ns), device=device, phases=phases,
                                            gpu_busy_ns=busy, gpu_idle_ns=idle))
    return verdict.verdict_record(v)
