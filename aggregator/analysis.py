"""A whole analysis of one :class:`probes.events.Trace`: ceilings, phases, work, roofline.

:func:`analyze_trace` returns a plain, JSON-ready dict (the ``ridgeline analyze --json``
document; keys are listed in docs/analyze.md). It chooses the GPU's ceilings from the
trace's device properties unless a GPU is named, maps kernels to phases
(:func:`aggregator.phases.map_phases`), derives work from operator shapes and, with a
model, from the analytic model per step, and assembles the per-phase roofline, idle gaps,
launch latency and copy traffic.
"""
from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from ridgeline.probes.errors import InputError
from ridgeline.probes.events import Trace
from ridgeline.probes.records import PHASE_NAMES
from ridgeline.probes.trace_joins import kernel_cpu_op_index

from . import ceilings as ceilings_mod
from . import roofline, stragglers
from .model_config import ModelShape
from .phases import MIXED, map_phases
from .work import StepWork, kernel_work_from_shapes, step_work_of

SCHEMA = "ridgeline.analyze/1"


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
                        context_len=context_len, tensor_parallel=tensor_parallel)


def _step_dict(s, names: dict, work: StepWork | None, kernels: int, busy: int) -> dict:
    d = {"index": int(s.index), "start_ns": int(s.start_ns), "end_ns": int(s.end_ns),
         "device": int(s.device), "phase": names.get(int(s.phase), str(s.phase)),
         "evidence": list(s.evidence), "kernels": kernels, "busy_ns": busy}
    if s.prefill_tokens is not None or s.decode_tokens is not None:
        d["tokens"] = {"prefill": s.prefill_tokens, "decode": s.decode_tokens}
    elif s.tokens is not None:
        d["tokens"] = {"prefill": None, "decode": None, "total": int(s.tokens)}
    if work is not None:
        d["model_work"] = {"flops": work.flops, "bytes": work.bytes, "source": work.source,
                           "estimate": work.estimate, "parts": work.parts, "notes": work.notes}
    return d


def analyze_trace(trace: Trace, *, gpu: str | None = None, model: ModelShape | None = None,
                  context_len: int | None = None, tensor_parallel: int = 1, use_annotations: bool = True,
                  ceilings_path: str | Path | None = None, phase_map=None) -> dict:
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
    gpu_doc = {"device_index": idx, "device_name": dev.name if dev else None, "ceilings_from": how}
    if ceil is not None:
        gpu_doc.update(ceil.to_dict())
        gpu_doc["ridge_point"] = {d: v / ceil.hbm_bytes_per_s for d, v in ceil.flops_per_s.items()}
    else:
        gpu_doc["name"] = dev.name if dev else None
    span = (int(k["end_ns"].max() - k["start_ns"].min())) if len(k) else 0
    idle_gaps = roofline.idle_gaps(trace, gaps)
    doc = {
        "schema": SCHEMA,
        "trace": str(trace.meta.get("path") or trace.meta.get("source_path") or ""),
        # Traces from the workload generator say so (recording meta, or the device
        # properties it writes); their figures are never measurements.
        "simulated": bool(trace.meta.get("simulated")
                          or any(d.properties.get("simulated") for d in trace.devices)),
        "gpu": gpu_doc,
        "kernels": int(len(k)),
        "kernel_time_ns": int(np.maximum(k["end_ns"] - k["start_ns"], 0).sum()) if len(k) else 0,
        "span_ns": span,
        "phases": phases,
        "steps": [_step_dict(s, PHASE_NAMES, step_work.get(int(s.index)),
                             *step_stats.get(int(s.index), (0, 0))) for s in steps],
        "idle_gaps": idle_gaps,
        "launch_latency": roofline.launch_latency(trace, join=join),
        "copies": roofline.copy_traffic(trace),
        "work": {"shapes_kernels": int(kw.known.sum()), "shapes_notes": kw.notes,
                 "model": model.to_dict() if model else None, "context_len": context_len,
                 "tensor_parallel": tensor_parallel},
        "annotations_used": bool(use_annotations),
        # ranks of one TP/PP group in this trace (a host's CUPTI recording holds them all)
        "stragglers": msgspec.to_builtins(stragglers.analyse(trace)[0].groups),
    }
    doc["answer"] = [trace_answer(phases, idle_gaps, span, idx)]
    return doc


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
