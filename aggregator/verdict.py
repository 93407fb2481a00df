"""The window verdict: which cost face binds this GPU and served process now (pure).

One verdict per window, per (GPU, served process), naming the binding face and the
numbers behind it. The candidate verdicts, checked in this order (the first that holds
wins; every other condition that also held is listed under ``also``):

1. ``kv-capacity-bound`` (face ``memory-capacity``): KV usage at or above the watermark
   (85% of the pool), or preemptions in the window (SGLang versions with only a gauge:
   retractions at the last log tick), or waiting requests growing while KV
   usage is at or above ``kv_full_ratio``. Capacity first: once the pool is full the
   engine stops admitting or starts evicting, whatever the GPU's speed.
2. ``host-bound`` (face ``host``): the GPU idles (idle share of its busy span at least
   ``gpu_idle_min_ratio``) while the launch thread is off-CPU: waiting in the run queue or
   blocked for at least ``host_wait_min_ratio`` of the window, and longer than it ran.
3. ``launch-bound`` (face ``launch``): the GPU idles while the launch thread is on-CPU for
   at least ``launch_busy_min_ratio`` of the window: it cannot issue work fast enough
   (Python overhead, many tiny kernels, no CUDA graphs).
   Without the launch thread's scheduling figures, an idle GPU is judged host- or
   launch-bound when the dominant phase's roofline verdict says so (it weighs how much of
   the idle time the host spent in launch calls). The GPU idle share is the window's
   (busy/idle ns) or, failing that, the phase's ``idle_ratio``.
4. ``queue-bound`` (face ``queue``): requests wait (``num_waiting >= 1`` and mean queue
   time at least ``queue_time_min_s``) while KV has room and the dominant phase is below
   both ceilings: the scheduler's batch limits, not the GPU, hold requests back.
Rules 5 and 6 apply only while the GPU idles less than ``gpu_idle_bound_ratio`` (an idle
GPU is not held back by its ceilings), and a % of peak above ``implausible_pct`` is
reported under ``figures["implausible"]`` and never used (a work-model overcount).

5. ``memory-bandwidth-bound`` (face ``bandwidth``, usually decode): the dominant phase
   (most kernel time among prefill, decode, mixed) reaches ``bandwidth_bound_min_pct`` of
   peak HBM bytes/s (or, when that fraction is unknown, its roofline verdict says
   memory-bound).
6. ``compute-bound`` (face ``compute``, usually prefill): the dominant phase reaches
   ``compute_bound_min_pct`` of peak FLOP/s (or its roofline verdict says compute-bound).
7. When no rule held but the dominant phase has a roofline verdict, that verdict is
   mapped (memory -> bandwidth, compute, launch/latency, host) and its reason says it was
   below the thresholds.
8. ``undetermined``: not enough evidence (says which inputs were missing).

Rules 1-6 are the functions of :data:`RULES`, each ``(Evidence, Thresholds) -> (verdict,
reasons) | None`` over the figures :func:`evidence` reduces the inputs to once; 7 and 8
are :func:`_choose`'s when none holds.

"GPU utilisation" (NVML's busy-time fraction) is never evidence of headroom: a GPU "100%
busy" can use a few percent of its bandwidth. It appears in ``figures`` only beside
GPM's DRAM-bandwidth utilisation, and no rule reads it.

Inputs are read typed (one conversion each: :func:`phase_figures_of`, ``_typed``): per-phase
figures (:class:`probes.records.PhaseFigures`, or analyze's phases converted to them),
engine figures (:class:`EngineFigures`, from :func:`aggregator.engine_metrics.engine_record`), device figures
(:mod:`aggregator.device_metrics`), the launch thread's scheduling figures
(``on_cpu_ns``, ``runq_wait_ns``, ``blocked_ns``) and the GPU's busy/idle time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

import msgspec

from ridgeline.probes.records import (
    DeviceSamples,
    EngineFigures,
    EngineSource,
    PhaseFigures,
    SchedThread,
    Window,
    window_of,
)

KV_CAPACITY = "kv-capacity-bound"
HOST = "host-bound"
LAUNCH = "launch-bound"
QUEUE = "queue-bound"
BANDWIDTH = "memory-bandwidth-bound"
COMPUTE = "compute-bound"
UNDETERMINED = "undetermined"

FACES = {KV_CAPACITY: "memory-capacity", HOST: "host", LAUNCH: "launch", QUEUE: "queue",
         BANDWIDTH: "bandwidth", COMPUTE: "compute", UNDETERMINED: None}
VERDICTS = tuple(FACES)


@dataclass(frozen=True)
class Thresholds:
    """Verdict thresholds; every one can be overridden (agent config ``[verdict]``).

    kv_watermark_ratio: KV usage (0..1) at or above which the window is KV-capacity-bound.
    kv_full_ratio: KV usage above which growing waiting requests mean the pool cannot
        admit them (vLLM reserves blocks per admitted request, so "full" comes before 100%).
    preemptions_min: preemptions in one window that count as "preemptions rising".
    waiting_growth_min: increase of waiting requests over the window that counts as growing.
    gpu_idle_min_ratio: GPU idle time / (busy + idle) above which idle gaps matter.
    host_wait_min_ratio: (run-queue wait + blocked) / window for the launch thread to be
        held back by the host.
    launch_busy_min_ratio: on-CPU / window for the launch thread to count as saturated.
    queue_time_min_s: mean queue time (s) that counts as queueing.
    waiting_min: waiting requests that count as a queue.
    bandwidth_bound_min_pct / compute_bound_min_pct: % of the peak HBM bytes/s or FLOP/s
        that marks a phase as at its ceiling.
    gpu_idle_bound_ratio: GPU idle share at or above which no GPU ceiling can be what binds
        (the bandwidth and compute rules then do not apply).
    implausible_pct: a % of peak above this is a work-model overcount, not a measurement;
        it is reported and not used as evidence.
    near_ratio: a figure within this fraction of its threshold (or an intensity within it
        of the ridge point) is reported as a caveat: the call could go either way.
    max_num_seqs: the engine's batch cap (vLLM ``--max-num-seqs``, which vLLM does not
        export); SGLang's exported ``max_running_requests`` wins where present. With it,
        a running batch at the cap is named as the limit that binds.
    """
    kv_watermark_ratio: float = 0.85
    kv_full_ratio: float = 0.75
    preemptions_min: float = 1.0
    waiting_growth_min: float = 1.0
    gpu_idle_min_ratio: float = 0.20
    host_wait_min_ratio: float = 0.20
    launch_busy_min_ratio: float = 0.50
    queue_time_min_s: float = 0.5
    waiting_min: float = 1.0
    bandwidth_bound_min_pct: float = 50.0
    compute_bound_min_pct: float = 50.0
    gpu_idle_bound_ratio: float = 0.50
    implausible_pct: float = 110.0
    near_ratio: float = 0.10
    max_num_seqs: float | None = None


DEFAULT_THRESHOLDS = Thresholds()


@lru_cache(maxsize=16)
def _thresholds_record(th: Thresholds) -> tuple[tuple[str, object], ...]:
    """``asdict(th)``'s items, made once per thresholds (frozen, so hashable): every
    judgement carries them. Its fields are plain numbers, so the instance's own ``vars``
    are asdict's answer without its recursive copy."""
    return tuple(vars(th).items())


@dataclass
class VerdictInputs:
    """What one (GPU, served process) window offers to judge; any part may be missing."""
    window_ns: int
    device: int | None = None
    pid: int | None = None
    # phase name -> PhaseFigures (a window's), or analyze's document phases (PhaseAnalysis
    # or its decoded map): read as PhaseFigures by :func:`phase_figures_of`, the one conversion.
    phases: dict[str, Any] = field(default_factory=dict)
    gpu_busy_ns: int | None = None
    gpu_idle_ns: int | None = None
    engine: EngineFigures | dict | None = None      # engine_metrics.engine_record, read as EngineFigures
    device_figures: dict | None = None  # device_metrics window figures for this GPU
    launch_thread: SchedThread | dict | None = None  # on_cpu_ns, runq_wait_ns, blocked_ns (+ tid, comm)


def phase_figures_of(p: Any) -> PhaseFigures:
    """One phase as the rules read it: a window's :class:`PhaseFigures` as it is, an
    analyze document's phase (its decoded map, or the typed ``analysis.PhaseAnalysis``
    through its builtins) converted; ``msgspec.ValidationError`` on a wrong type."""
    if isinstance(p, PhaseFigures):
        return p
    return msgspec.convert(p if isinstance(p, dict) else msgspec.to_builtins(p), PhaseFigures)


def _typed(obj: Any, cls: type) -> Any:
    """An engine record or launch-thread row as ``cls`` (None stays None)."""
    return obj if obj is None or isinstance(obj, cls) else msgspec.convert(obj, cls)


def _dominant_phase(phases: dict[str, PhaseFigures]) -> tuple[str | None, PhaseFigures | None]:
    best, best_t = None, -1
    for name, p in phases.items():
        if name not in ("prefill", "decode", "mixed"):
            continue
        t = p.kernel_time_ns or 0
        if t > best_t:
            best, best_t = name, t
    return (best, phases[best]) if best else (None, None)


def _verdict_text(p: PhaseFigures | None) -> str:
    return str((p.verdict if p is not None else None) or "").lower()


def _at_ceiling(p: PhaseFigures | None, pct: float | None, min_pct: float, verdict_word: str, th: Thresholds) -> bool:
    """At a ceiling: by the achieved fraction ``pct`` when known (an implausible one counts
    as no), else by the roofline verdict's wording."""
    if p is None:
        return False
    if pct is not None and pct > th.implausible_pct:
        return False
    return pct >= min_pct if pct is not None else verdict_word in _verdict_text(p)


def _at_bandwidth(p: PhaseFigures | None, th: Thresholds) -> bool:
    """At the HBM ceiling."""
    return _at_ceiling(p, p.pct_of_peak_bytes if p is not None else None, th.bandwidth_bound_min_pct, "memory", th)


def _at_compute(p: PhaseFigures | None, th: Thresholds) -> bool:
    """At the compute ceiling."""
    return _at_ceiling(p, p.pct_of_peak_flops if p is not None else None, th.compute_bound_min_pct, "compute", th)


def _roofline_fallback(p: PhaseFigures) -> str | None:
    """The dominant phase's own roofline verdict, when no rule reached a threshold."""
    v = _verdict_text(p)
    if "memory" in v:
        return BANDWIDTH
    if "compute" in v:
        return COMPUTE
    if "launch" in v or "latency" in v:
        return LAUNCH
    if "host" in v:
        return HOST
    return None


@dataclass
class Evidence:
    """What the rules read: one window's inputs reduced once to the figures the rules
    compare (KV, preemptions, waiting, queue time; the dominant phase and whether it is at
    a ceiling; the GPU's idle share and its source; the launch thread). Built by
    :func:`evidence`, never changed by a rule."""
    window_ns: int
    engine: EngineFigures | None
    phase_name: str | None
    phase: PhaseFigures | None
    kv: float | None
    pre: float | None
    wchg: float | None
    waiting: float | None
    qmean: float | None
    idle_ratio: float | None
    idle_src: str | None
    lt: SchedThread | None
    gpu_idles: bool
    ceilings_apply: bool
    at_bw: bool
    at_cp: bool

    def __post_init__(self):
        # Built from plain maps too (each rule is tested alone): read as typed here.
        self.engine = _typed(self.engine, EngineFigures)
        self.phase = None if self.phase is None else phase_figures_of(self.phase)
        self.lt = _typed(self.lt, SchedThread)


#: A rule: (evidence, thresholds) -> (verdict name, its reasons) when it holds, else None.
Rule = Callable[[Evidence, Thresholds], "tuple[str, list[str]] | None"]


def _idle(inp: VerdictInputs, phase_name: str | None, phase: PhaseFigures | None) -> tuple[float | None, str | None]:
    """The GPU's idle share and where it comes from: the window's busy/idle time, else the
    dominant phase's ``idle_ratio``."""
    if inp.gpu_idle_ns is not None and inp.gpu_busy_ns is not None and inp.gpu_busy_ns + inp.gpu_idle_ns > 0:
        return inp.gpu_idle_ns / (inp.gpu_busy_ns + inp.gpu_idle_ns), "its span"
    if phase is not None and phase.idle_ratio is not None:
        return float(phase.idle_ratio), f"the {phase_name} phase's time"
    return None, None


def evidence(inp: VerdictInputs, th: Thresholds) -> Evidence:
    """The figures every rule reads, from one window's inputs."""
    e = _typed(inp.engine, EngineFigures)
    f = e if e is not None else EngineFigures()    # no engine: every figure None
    phase_name, phase = _dominant_phase({n: phase_figures_of(p) for n, p in inp.phases.items()})
    kv = f.kv_usage_max_ratio
    kv = f.kv_usage_ratio if kv is None else kv
    idle_ratio, idle_src = _idle(inp, phase_name, phase)
    ceilings_apply = idle_ratio is None or idle_ratio < th.gpu_idle_bound_ratio
    return Evidence(
        window_ns=inp.window_ns, engine=e, phase_name=phase_name, phase=phase, kv=kv,
        pre=f.preemptions, wchg=f.num_waiting_change, waiting=f.num_waiting_requests,
        qmean=f.queue_time_mean_s, idle_ratio=idle_ratio, idle_src=idle_src, lt=_typed(inp.launch_thread, SchedThread),
        gpu_idles=idle_ratio is not None and idle_ratio >= th.gpu_idle_min_ratio,
        ceilings_apply=ceilings_apply,
        at_bw=ceilings_apply and _at_bandwidth(phase, th), at_cp=ceilings_apply and _at_compute(phase, th))


# --------------------------------------------------------------------------- the rules

def kv_capacity_rule(ev: Evidence, th: Thresholds) -> tuple[str, list[str]] | None:
    """KV at the watermark, preemptions (or retractions) in the window, or waiting requests
    growing while the pool is nearly full."""
    why: list[str] = []
    kv, pre, wchg = ev.kv, ev.pre, ev.wchg
    if kv is not None and kv >= th.kv_watermark_ratio:
        why.append(f"KV usage {kv:.1%} >= watermark {th.kv_watermark_ratio:.0%}")
    if pre is not None and pre >= th.preemptions_min:
        rate = ev.engine.preemption_rate_per_s if ev.engine is not None else None
        why.append(f"{pre:.0f} preemptions in the window" + (f" ({rate:.2f}/s)" if rate is not None else ""))
    retracted = ev.engine.retracted_requests_last_tick if ev.engine is not None else None
    if pre is None and retracted:
        why.append(f"{retracted:.0f} requests retracted at the engine's last log tick")
    if wchg is not None and wchg >= th.waiting_growth_min and kv is not None and kv >= th.kv_full_ratio:
        why.append(f"waiting requests +{wchg:.0f} (now {ev.waiting:.0f}) while KV usage {kv:.1%} "
                   f">= {th.kv_full_ratio:.0%}")
    return (KV_CAPACITY, why) if why else None


def _launch_thread_shares(ev: Evidence) -> tuple[int, int, int] | None:
    """(on-CPU, run-queue, blocked) ns of the launch thread while the GPU idles, or None
    when the GPU does not idle or the thread's figures are missing."""
    if not ev.gpu_idles or ev.lt is None or ev.window_ns <= 0:
        return None
    return (ev.lt.on_cpu_ns or 0, ev.lt.runq_wait_ns or 0, ev.lt.blocked_ns or 0)


def host_wait_rule(ev: Evidence, th: Thresholds) -> tuple[str, list[str]] | None:
    """The GPU idles while the launch thread waits off-CPU (run queue, blocked) longer than it runs."""
    shares = _launch_thread_shares(ev)
    if shares is None:
        return None
    on, rq, bl = shares
    off, w = rq + bl, ev.window_ns
    if not (off / w >= th.host_wait_min_ratio and off > on):
        return None
    return HOST, [f"GPU idle {ev.idle_ratio:.0%} of {ev.idle_src}",
                  f"launch thread off-CPU {off / w:.0%} of the window "
                  f"(run queue {rq / w:.0%}, blocked {bl / w:.0%}) vs on-CPU {on / w:.0%}"]


def launch_busy_rule(ev: Evidence, th: Thresholds) -> tuple[str, list[str]] | None:
    """The GPU idles while the launch thread is on-CPU most of the window: it cannot issue
    work fast enough."""
    shares = _launch_thread_shares(ev)
    if shares is None:
        return None
    on, rq, bl = shares
    w = ev.window_ns
    if on / w < th.launch_busy_min_ratio:
        return None
    return LAUNCH, [f"GPU idle {ev.idle_ratio:.0%} of {ev.idle_src}",
                    f"launch thread on-CPU {on / w:.0%} of the window (run queue {rq / w:.0%}, "
                    f"blocked {bl / w:.0%})"]


def idle_roofline_rule(ev: Evidence, th: Thresholds) -> tuple[str, list[str]] | None:
    """Without the scheduler's view, an idle GPU is host- or launch-bound when the dominant
    phase's roofline says so (its API-call coverage of the idle gaps, kernel and gap
    lengths are the evidence)."""
    if not ev.gpu_idles or ev.phase is None or (ev.lt is not None and ev.window_ns > 0):
        return None
    fb = _roofline_fallback(ev.phase)
    if fb not in (HOST, LAUNCH):
        return None
    return fb, [f"GPU idle {ev.idle_ratio:.0%} of {ev.idle_src}",
                f"roofline verdict {ev.phase.verdict}: "
                + "; ".join(str(x) for x in (ev.phase.evidence or [])[:3])]


def queue_rule(ev: Evidence, th: Thresholds) -> tuple[str, list[str]] | None:
    """Requests wait while KV has room and the dominant phase is at neither ceiling: the
    scheduler's batch limits hold them back (naming the batch cap when it is full)."""
    waiting, qmean, kv, phase = ev.waiting, ev.qmean, ev.kv, ev.phase
    if not (waiting is not None and waiting >= th.waiting_min and qmean is not None and qmean >= th.queue_time_min_s
            and (kv is None or kv < th.kv_watermark_ratio) and not ev.at_bw and not ev.at_cp):
        return None
    ceil = ""
    if phase is not None:
        ceil = (f"; {ev.phase_name} at {phase.pct_of_peak_bytes or 0:.0f}% of peak bytes/s and "
                f"{phase.pct_of_peak_flops or 0:.0f}% of peak FLOP/s")
    why = [f"{waiting:.0f} requests waiting, mean queue time {qmean:.2f} s"]
    cap_line = _batch_cap_line(ev.engine, th)
    if cap_line is not None and cap_line[1]:
        why.append(cap_line[0])
    why.append((f"KV usage {kv:.1%} below watermark" if kv is not None else "KV usage unknown") + ceil)
    return QUEUE, why


def bandwidth_rule(ev: Evidence, th: Thresholds) -> tuple[str, list[str]] | None:
    """The dominant phase at ``bandwidth_bound_min_pct`` of peak HBM bytes/s (or, without
    the fraction, its roofline verdict says memory-bound)."""
    p = ev.phase
    if p is None or not ev.at_bw:
        return None
    return BANDWIDTH, [f"{ev.phase_name}: {p.pct_of_peak_bytes or 0:.0f}% of peak HBM bytes/s "
                       f"({(p.achieved_bytes_per_s or 0) / 1e12:.2f} TB/s), intensity "
                       f"{p.arithmetic_intensity or 0:.1f} FLOP/B, roofline verdict {p.verdict}"]


def compute_rule(ev: Evidence, th: Thresholds) -> tuple[str, list[str]] | None:
    """The dominant phase at ``compute_bound_min_pct`` of peak FLOP/s (or its roofline
    verdict says compute-bound)."""
    p = ev.phase
    if p is None or not ev.at_cp:
        return None
    return COMPUTE, [f"{ev.phase_name}: {p.pct_of_peak_flops or 0:.0f}% of peak FLOP/s "
                     f"({(p.achieved_flops_per_s or 0) / 1e12:.1f} TFLOP/s), intensity "
                     f"{p.arithmetic_intensity or 0:.1f} FLOP/B, roofline verdict {p.verdict}"]


#: Every rule, in the order of the module docstring; each is named here and nowhere
#: guessed. The first verdict (in ``VERDICTS`` order) among those that hold binds.
RULES: tuple[Rule, ...] = (kv_capacity_rule, host_wait_rule, launch_busy_rule, idle_roofline_rule,
                           queue_rule, bandwidth_rule, compute_rule)


# --------------------------------------------------------------------------- figures

def _figures(inp: VerdictInputs, ev: Evidence, th: Thresholds) -> tuple[dict[str, Any], list[str]]:
    """The numbers behind the verdict (shown, and for /metrics) and the inputs that were missing."""
    e, p, d, lt = ev.engine, ev.phase, inp.device_figures, ev.lt
    f = e if e is not None else EngineFigures()
    figures: dict[str, Any] = {"window_ns": inp.window_ns}
    missing: list[str] = []
    if e is None:
        missing.append("engine metrics")
    figures.update({"kv_usage_ratio": ev.kv, "kv_pool_tokens": f.kv_pool_tokens, "preemptions": ev.pre,
                    "preemption_rate_per_s": f.preemption_rate_per_s,
                    "num_waiting_requests": ev.waiting, "num_waiting_change": ev.wchg,
                    "queue_time_mean_s": ev.qmean, "prefix_cache_hit_ratio": f.prefix_cache_hit_ratio})
    if p is None:
        missing.append("per-phase roofline")
    else:
        figures["phase"] = {k: getattr(p, k) for k in (
            "kernel_time_ns", "achieved_flops_per_s", "achieved_bytes_per_s", "arithmetic_intensity",
            "pct_of_peak_flops", "pct_of_peak_bytes", "idle_ratio", "verdict")}
        for k in ("pct_of_peak_bytes", "pct_of_peak_flops"):
            if (getattr(p, k) or 0) > th.implausible_pct:
                figures.setdefault("implausible", []).append(
                    f"{ev.phase_name} {k} = {getattr(p, k):.0f}% exceeds the ceiling: work model overcounts; not used")
    if ev.idle_ratio is None:
        missing.append("GPU busy/idle time")
    figures.update({"gpu_busy_ns": inp.gpu_busy_ns, "gpu_idle_ns": inp.gpu_idle_ns, "gpu_idle_ratio": ev.idle_ratio})
    if lt is None:
        missing.append("launch-thread scheduling")
    else:
        figures["launch_thread"] = {k: getattr(lt, k) for k in ("tid", "comm", "on_cpu_ns", "runq_wait_ns", "blocked_ns")}
    # Busy-time beside bandwidth use: shown, never judged on.
    if d is not None:
        figures["gpu_busy_time_pct"] = d.get("gpu_busy_time_pct")
        figures["dram_bw_util_pct"] = d.get("gpm_dram_bw_util_pct")
        figures["sm_occupancy_pct"] = d.get("gpm_sm_occupancy_pct")
        figures["tensor_util_pct"] = d.get("gpm_any_tensor_util_pct")
        figures["clock_event_reasons"] = d.get("clock_event_reasons")
    else:
        missing.append("device metrics")
    return figures, missing


def _choose(held: list[tuple[str, list[str]]], ev: Evidence,
            missing: list[str]) -> tuple[str, list[str], bool]:
    """(verdict, reasons, from the roofline fallback): the first rule that held, else the
    dominant phase's own roofline call (a ceiling only while the GPU does not idle), else
    undetermined."""
    if held:
        return held[0][0], held[0][1], False
    p = ev.phase
    fallback = _roofline_fallback(p) if p is not None else None
    if fallback in (BANDWIDTH, COMPUTE) and not ev.ceilings_apply:
        fallback = None
    if fallback is not None:
        return fallback, [f"{ev.phase_name}: roofline verdict {p.verdict} (below the thresholds: "
                          f"{p.pct_of_peak_bytes or 0:.0f}% of peak bytes/s, "
                          f"{p.pct_of_peak_flops or 0:.0f}% of peak FLOP/s)"], True
    return UNDETERMINED, ["no rule held" + (f"; missing: {', '.join(missing)}" if missing else "")], False


def judge(inp: VerdictInputs, th: Thresholds = DEFAULT_THRESHOLDS, rules: tuple[Rule, ...] = RULES) -> dict:
    """The verdict of one window (see the module docstring for the rules and their order).

    Returns ``{"device", "pid", "verdict", "face", "phase", "reasons": [str],
    "also": [verdict names that also held], "figures": {...}, "missing": [str]}``.
    """
    ev = evidence(inp, th)
    figures, missing = _figures(inp, ev, th)
    order = {v: i for i, v in enumerate(VERDICTS)}
    held = sorted((h for h in (rule(ev, th) for rule in rules) if h is not None), key=lambda h: order[h[0]])
    name, reasons, fallback = _choose(held, ev, missing)
    phase_of = ev.phase_name if (name in (BANDWIDTH, COMPUTE, QUEUE) or fallback) else None
    ctx = _FaceContext(name=name, held=dict(held), phase_name=ev.phase_name, phase=ev.phase, kv=ev.kv, pre=ev.pre,
                       waiting=ev.waiting, qmean=ev.qmean, idle_ratio=ev.idle_ratio, idle_src=ev.idle_src,
                       lt=ev.lt, window_ns=inp.window_ns, ceilings_apply=ev.ceilings_apply, engine=ev.engine,
                       device=inp.device_figures, fallback=fallback)
    return {"device": inp.device, "pid": inp.pid, "verdict": name, "face": FACES[name], "phase": phase_of,
            "reasons": reasons, "also": [h[0] for h in held[1:]], "figures": figures, "missing": missing,
            "faces": _faces(ctx, th), "caveats": _caveats(ctx, th), "limits": _limits(ctx, th),
            "thresholds": dict(_thresholds_record(th))}


# --------------------------------------------------------------------------- the other faces

# Faces in the order an operator reads them: GPU memory, the two roofline ceilings,
# queueing, the host. host and launch share one line (both: the GPU waits for the CPU).
FACE_ORDER = ("memory-capacity", "bandwidth", "compute", "queue", "host")
_FACE_VERDICTS = {"memory-capacity": (KV_CAPACITY,), "bandwidth": (BANDWIDTH,), "compute": (COMPUTE,),
                  "queue": (QUEUE,), "host": (HOST, LAUNCH)}


_NO_INPUT = {"memory-capacity": "no engine metrics", "bandwidth": "no per-phase roofline",
             "compute": "no per-phase roofline", "queue": "no engine metrics", "host": "no GPU busy/idle time"}


@dataclass
class _FaceContext:
    name: str
    held: dict
    phase_name: str | None
    phase: PhaseFigures | None
    kv: float | None
    pre: float | None
    waiting: float | None
    qmean: float | None
    idle_ratio: float | None
    idle_src: str | None
    lt: SchedThread | None
    window_ns: int
    ceilings_apply: bool
    engine: EngineFigures | None
    device: dict | None
    fallback: bool


def _pct(p: PhaseFigures | None, k: str) -> float | None:
    v = None if p is None else getattr(p, k)
    return None if v is None else float(v)


def _memory_figure(c: _FaceContext, th: Thresholds) -> str | None:
    if c.kv is None and c.pre is None:
        return None
    parts = []
    if c.kv is not None:
        parts.append(f"KV {c.kv:.1%} of the pool (watermark {th.kv_watermark_ratio:.0%})")
    if c.pre is not None:
        parts.append(f"{c.pre:.0f} preemptions")
    if c.waiting is not None:
        parts.append(f"{c.waiting:.0f} waiting")
    return ", ".join(parts)


def _ceiling_figure(c: _FaceContext, th: Thresholds, key: str, word: str, need: float) -> str | None:
    """The dominant phase's % of one ceiling (``key``), and why no ceiling binds an idle GPU."""
    if c.phase is None:
        return None
    pct = _pct(c.phase, key)
    txt = (f"{c.phase_name} {pct:.0f}% of {word} (binds at {need:.0f}%)" if pct is not None
           else f"{c.phase_name} % of {word} unknown")
    if not c.ceilings_apply and c.idle_ratio is not None:
        txt += f"; GPU idle {c.idle_ratio:.0%} >= {th.gpu_idle_bound_ratio:.0%}: no ceiling binds an idle GPU"
    return txt


def _bandwidth_figure(c: _FaceContext, th: Thresholds) -> str | None:
    return _ceiling_figure(c, th, "pct_of_peak_bytes", "peak HBM bytes/s", th.bandwidth_bound_min_pct)


def _compute_figure(c: _FaceContext, th: Thresholds) -> str | None:
    return _ceiling_figure(c, th, "pct_of_peak_flops", "peak FLOP/s", th.compute_bound_min_pct)


def _queue_figure(c: _FaceContext, th: Thresholds) -> str | None:
    if c.waiting is None and c.qmean is None:
        return None
    w = "-" if c.waiting is None else f"{c.waiting:.0f}"
    q = "-" if c.qmean is None else f"{c.qmean:.2f} s"
    return (f"{w} waiting, mean queue time {q} (binds at >= {th.waiting_min:.0f} waiting and "
            f">= {th.queue_time_min_s:g} s)")


def _host_figure(c: _FaceContext, th: Thresholds) -> str | None:
    if c.idle_ratio is None:
        return None
    txt = f"GPU idle {c.idle_ratio:.0%} of {c.idle_src} (binds at >= {th.gpu_idle_min_ratio:.0%})"
    if c.lt is not None and c.window_ns > 0:
        on = (c.lt.on_cpu_ns or 0) / c.window_ns
        off = ((c.lt.runq_wait_ns or 0) + (c.lt.blocked_ns or 0)) / c.window_ns
        txt += f"; launch thread on-CPU {on:.0%}, off-CPU {off:.0%} of the window"
    return txt


#: The figure of each face, in :data:`FACE_ORDER`'s names.
_FACE_FIGURES: dict[str, Callable[[_FaceContext, Thresholds], "str | None"]] = {
    "memory-capacity": _memory_figure, "bandwidth": _bandwidth_figure, "compute": _compute_figure,
    "queue": _queue_figure, "host": _host_figure}


def _face_figure(face: str, c: _FaceContext, th: Thresholds) -> str | None:
    """The number that places this face (rules it out, or says how far it is): None when
    the inputs for it are missing."""
    figure = _FACE_FIGURES.get(face)
    return figure(c, th) if figure is not None else None


def _faces(c: _FaceContext, th: Thresholds) -> list[dict]:
    """Every face with its state (binds / also holds / ruled out / below the thresholds /
    unknown) and the figure behind it."""
    out = []
    for face in FACE_ORDER:
        names = _FACE_VERDICTS[face]
        fig = _face_figure(face, c, th)
        if c.name in names:
            state = "binds (below the thresholds)" if c.fallback else "binds"
            reasons = list(c.held.get(c.name) or [])
        elif any(n in c.held for n in names):
            state, reasons = "also holds", list(next(c.held[n] for n in names if n in c.held))
        elif fig is None:
            state, reasons = "unknown", []
        else:
            state, reasons = "ruled out", []
        out.append({"face": face, "state": state, "figure": fig or _NO_INPUT[face], "reasons": reasons})
    return out


def _near(value: float, threshold: float, th: Thresholds) -> bool:
    return threshold > 0 and abs(value - threshold) <= th.near_ratio * threshold


def _roofline_caveats(c: _FaceContext, th: Thresholds) -> list[str]:
    """A roofline call near its edge: intensity near the ridge point, both ceilings about
    as near, a ceiling's % near its threshold."""
    p = c.phase
    out = []
    ai, ridge = _pct(p, "arithmetic_intensity"), _pct(p, "ridge_point")
    pf, pb = _pct(p, "pct_of_peak_flops"), _pct(p, "pct_of_peak_bytes")
    if ai is not None and ridge and _near(ai, ridge, th):
        out.append(f"{c.phase_name} intensity {ai:.0f} FLOP/B is within {abs(ai - ridge) / ridge:.0%} of the "
                   f"ridge point {ridge:.0f}: compute- vs memory-bound is a coin toss")
    if pf is not None and pb is not None and abs(pf - pb) <= 100 * th.near_ratio:
        out.append(f"{c.phase_name} at {pf:.0f}% of peak FLOP/s and {pb:.0f}% of peak bytes/s: "
                   "both ceilings about equally near")
    for v, need, word in ((pb, th.bandwidth_bound_min_pct, "HBM bytes/s"),
                          (pf, th.compute_bound_min_pct, "FLOP/s")):
        if v is not None and _near(v, need, th):
            out.append(f"{c.phase_name} at {v:.0f}% of peak {word}, within {abs(v - need):.0f} points of "
                       f"the {need:.0f}% threshold")
    return out


def _threshold_caveats(c: _FaceContext, th: Thresholds) -> list[str]:
    """KV usage near its watermark, GPU idle near the share at which the host binds (for a
    verdict that is not already that face)."""
    out = []
    if c.kv is not None and c.name != KV_CAPACITY and _near(c.kv, th.kv_watermark_ratio, th):
        out.append(f"KV {c.kv:.1%} is within {abs(c.kv - th.kv_watermark_ratio) * 100:.0f} points of the "
                   f"{th.kv_watermark_ratio:.0%} watermark")
    if c.idle_ratio is not None and c.name not in (HOST, LAUNCH) and _near(c.idle_ratio, th.gpu_idle_min_ratio, th):
        out.append(f"GPU idle {c.idle_ratio:.0%} is near the {th.gpu_idle_min_ratio:.0%} at which the host binds")
    return out


def _caveats(c: _FaceContext, th: Thresholds) -> list[str]:
    """Where the call could go the other way: a figure within ``near_ratio`` of its
    threshold, an intensity within it of the ridge point, both ceilings about as close."""
    out = []
    if c.fallback:
        out.append(f"no face reached its threshold: {c.name} is the roofline's call for {c.phase_name}, "
                   "not a ceiling the server is pressed against")
    if c.phase is not None and (c.name in (BANDWIDTH, COMPUTE) or c.fallback):
        out += _roofline_caveats(c, th)
    return out + _threshold_caveats(c, th)


def _batch_cap_line(e: EngineFigures | None, th: Thresholds) -> tuple[str, bool] | None:
    """(text, at the cap) for the running batch against the engine's batch cap, or None
    when the cap is unknown."""
    cap = e.max_running_requests if e is not None else None
    src = "the engine's max_running_requests"
    if cap is None and th.max_num_seqs is not None:
        cap, src = th.max_num_seqs, "max_num_seqs (configured)"
    running = e.num_running_requests if e is not None else None
    if not cap or running is None:
        return None
    at = running >= cap * (1 - th.near_ratio / 2)
    return (f"batch cap: running {running:.0f} of {cap:.0f} ({src})" + (": the batch is full" if at else ""), at)


def _limits(c: _FaceContext, th: Thresholds) -> list[str]:
    """The configured or physical limits that bind now: the batch cap, the KV pool, clock
    throttling."""
    out = []
    cap = _batch_cap_line(c.engine, th)
    if cap is not None and cap[1]:
        out.append(cap[0])
    if c.kv is not None and c.kv >= th.kv_watermark_ratio:
        pool = c.engine.kv_pool_tokens if c.engine is not None else None
        out.append(f"KV pool: {c.kv:.1%} used" + (f" of {pool:,.0f} tokens" if pool else ""))
    # gpu_idle, application clocks and the display clock do not cost throughput (the
    # same split as probes.nvml's clock_slowdown); the others are limits that bind.
    reasons = [r for r in ((c.device or {}).get("clock_event_reasons") or [])
               if r not in ("gpu_idle", "applications_clocks_setting", "display_clock_setting")]
    if reasons:
        out.append(f"clocks held back: {', '.join(str(r) for r in reasons)}")
    return out


# --------------------------------------------------------------------------- window glue

def _rows(obj: Any) -> list[dict]:
    """Per-thread rows from any shape the scheduling probes' data takes on its way: a
    numpy structured array, its ``plain()`` form (a dict of equal-length columns), a list
    of dicts, or a probe's poll dict holding one of these under ``threads``."""
    if obj is None:
        return []
    names = getattr(getattr(obj, "dtype", None), "names", None)
    if names:
        return [{n: (r[n].item() if hasattr(r[n], "item") and getattr(r[n], "ndim", 0) == 0 else r[n])
                 for n in names} for r in obj]
    if isinstance(obj, list):
        return [r for r in obj if isinstance(r, dict)]
    if isinstance(obj, dict):
        if "threads" in obj:
            return _rows(obj["threads"])
        if "tid" in obj and isinstance(obj["tid"], list):
            cols = {k: v for k, v in obj.items() if isinstance(v, list) and len(v) == len(obj["tid"])}
            return [{k: cols[k][i] for k in cols} for i in range(len(obj["tid"]))]
    return []


def _comm(v: Any) -> Any:
    return v.decode(errors="replace").rstrip("\x00") if isinstance(v, (bytes, bytearray)) else v


def _sched_sources(sched: Any) -> list:
    """The probe data in ``sched``: the window's section (source -> data) or one probe's."""
    if isinstance(sched, dict) and not ("threads" in sched or "tid" in sched):
        return list(sched.values())
    return [sched]


def _thread_rows(sched: Any, pid: int | None) -> tuple[dict[int, dict], dict[int, int]]:
    """(tid -> its scheduler row, tid -> its kernel launches) of ``pid``'s threads."""
    timing: dict[int, dict] = {}
    launches: dict[int, int] = {}
    for src in _sched_sources(sched):
        for r in _rows(src):
            owner = r.get("pid", r.get("tgid"))
            if pid is not None and owner not in (None, pid):
                continue
            tid = r.get("tid")
            if "on_cpu_ns" in r:
                timing[tid] = dict(r, comm=_comm(r.get("comm")))
            if r.get("launches") is not None:
                launches[tid] = launches.get(tid, 0) + int(r["launches"]) + int(r.get("graph_launches") or 0)
    return timing, launches


def _launch_thread(timing: dict[int, dict], launches: dict[int, int], launch_tid: int | None) -> int:
    """The launch thread: ``launch_tid`` when it has a row, else the one with the most
    kernel launches, else the one longest on-CPU."""
    if launch_tid is not None and launch_tid in timing:
        return launch_tid
    if launches and max(launches.values()) > 0:
        cand = [t for t in launches if t in timing]
        if cand:
            return max(cand, key=lambda t: launches[t])
        return max(timing, key=lambda t: timing[t]["on_cpu_ns"] or 0)
    return max(timing, key=lambda t: timing[t].get("launches") or timing[t]["on_cpu_ns"] or 0)


def launch_thread_figures(sched: Any, pid: int | None, launch_tid: int | None = None) -> dict | None:
    """The launch thread of ``pid`` with its ``on_cpu_ns``, ``runq_wait_ns``, ``blocked_ns``.

    ``sched`` is the window's ``sched`` section (source -> probe data) or one probe's data:
    rows with ``on_cpu_ns`` come from the scheduler probe, rows with ``launches`` from the
    CUDA uprobes (joined by tid). The launch thread is ``launch_tid`` when given, else the
    thread with the most kernel launches, else the one longest on-CPU. Rows name the process
    ``pid`` or ``tgid``.
    """
    timing, launches = _thread_rows(sched, pid)
    if not timing:
        return None
    chosen = _launch_thread(timing, launches, launch_tid)
    out = dict(timing[chosen])
    if chosen in launches:
        out["launches"] = launches[chosen]
    return out


def _device_for(window: Window, device: int) -> dict | None:
    """The NVML figures of GPU ``device`` (:func:`aggregator.device_metrics.window_figures`)
    from the window's device section: each source's samples (``{"devices": [...]}``, or the
    list itself), or a source's record keyed by the device index."""
    from ridgeline.aggregator import device_metrics
    for data in window.device.values():
        if isinstance(data, list):
            recs = data
        else:
            try:
                recs = msgspec.convert(data, DeviceSamples).devices
            except msgspec.ValidationError:
                recs = None
        fig = device_metrics.window_figures(recs).get(device) if recs else None
        if fig is not None:
            return fig
        if not recs and isinstance(data, dict) and device in data:
            return data[device]
    return None


def _engine_records(window: Window) -> list[tuple[dict, EngineFigures]]:
    """Every endpoint's engine record of the window (``aggregator.engine_metrics.engine_record``,
    what :func:`judge` reads) with what choosing among them reads, typed; a record of
    another shape is skipped."""
    out = []
    for data in window.engine.values():
        try:
            src = msgspec.convert(data, EngineSource)
        except msgspec.ValidationError:
            continue
        recs = list(src.endpoints.values()) if src.endpoints is not None else [data]
        for r in recs:
            try:
                e = msgspec.convert(r, EngineFigures)
            except msgspec.ValidationError:
                continue
            if src.endpoints is not None or e.engine is not None:
                out.append((r, e))
    return out


def _engine_for(window: Window, pid: int | None = None) -> EngineFigures | None:
    """The engine record for ``pid``: the endpoint discovered from that process when there is
    one, else the binding one of the window (highest KV usage)."""
    recs = _engine_records(window)
    if not recs:
        return None
    mine = [r for r in recs if pid is not None and r[1].pid == pid]
    return max(mine or recs, key=lambda r: (r[1].kv_usage_max_ratio or r[1].kv_usage_ratio or 0))[1]


def window_verdict(window: dict | Window, th: Thresholds = DEFAULT_THRESHOLDS) -> list[dict]:
    """Verdicts for every (GPU, process) of a window (a :class:`probes.records.Window`, or
    the decoded record, read with ``window_of``)."""
    w = window_of(window)
    out = []
    for g in w.gpus:
        inp = VerdictInputs(
            window_ns=int(w.duration_ns or g.span_ns or 0),
            device=g.device, pid=g.pid, phases=dict(g.phases),
            gpu_busy_ns=g.busy_ns, gpu_idle_ns=g.idle_ns,
            engine=_engine_for(w, g.pid), device_figures=_device_for(w, g.device) if g.device is not None else None,
            launch_thread=launch_thread_figures(w.sched or None, g.pid),
        )
        out.append(judge(inp, th))
    if not out:
        engine = _engine_for(w)
        if engine is not None:
            out.append(judge(VerdictInputs(window_ns=int(w.duration_ns), engine=engine), th))
    return out


def verdict_record(v: dict) -> dict:
    """Flat record of one verdict for the wire and /metrics (numbers with units, sources)."""
    f = v["figures"]
    rec = {"device": v["device"], "pid": v["pid"], "verdict": v["verdict"], "face": v["face"],
           "phase": v["phase"], "reasons": list(v["reasons"]), "also": list(v["also"]),
           "missing": list(v["missing"]), "faces": [dict(x) for x in v.get("faces") or []],
           "caveats": list(v.get("caveats") or []), "limits": list(v.get("limits") or [])}
    for k in ("kv_usage_ratio", "preemptions", "num_waiting_requests", "queue_time_mean_s", "gpu_idle_ratio",
              "gpu_busy_time_pct", "dram_bw_util_pct"):
        rec[k] = f.get(k)
    p = f.get("phase") or {}
    rec["phase_pct_of_peak_bytes"] = p.get("pct_of_peak_bytes")
    rec["phase_pct_of_peak_flops"] = p.get("pct_of_peak_flops")
    lt = f.get("launch_thread") or {}
    for k in ("on_cpu_ns", "runq_wait_ns", "blocked_ns"):
        rec[f"launch_thread_{k}"] = lt.get(k)
    rec["source"] = {"engine": "engine" if f.get("kv_usage_ratio") is not None else None,
                     "device": "nvml" if "gpu_busy_time_pct" in f else None,
                     "sched": "sched" if lt else None,
                     "roofline": "roofline" if p else None}
    return rec


def prometheus_samples(v: dict, labels: dict | None = None) -> list[tuple[str, dict, float]]:
    """One-hot ``ridgeline_verdict_state{verdict=...}`` per known verdict (1 for the current)."""
    base = {"gpu": str(v.get("device")), "pid": str(v.get("pid"))}
    base.update(labels or {})
    # gpu = device index (joins dcgm-exporter's gpu label); face "" when the verdict has none.
    return [("ridgeline_verdict_state", dict(base, verdict=name, face=FACES[name] or ""),
             1.0 if v["verdict"] == name else 0.0) for name in VERDICTS]
