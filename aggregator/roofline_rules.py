"""The roofline's rules on plain numbers: which roof a phase's figures put it under (the
verdict and its evidence) and which work figures to trust (shapes, the model, or none).

Shared by the per-phase figure function (:mod:`aggregator.phase_figures`) and the roofline
module (:mod:`aggregator.roofline`, which re-exports these names); thresholds are
documented in docs/analyze.md.
"""
from __future__ import annotations

from .ceilings import Ceilings
from .work import NO_SOURCE, SOURCE_MODEL, SOURCE_SHAPES

MEMORY_BOUND = "memory-bound"
COMPUTE_BOUND = "compute-bound"
LAUNCH_BOUND = "latency/launch-bound"
HOST_BOUND = "host-bound"
UNDETERMINED = "undetermined"

# Thresholds of the verdict rule (documented in docs/analyze.md).
IDLE_BOUND_RATIO = 0.5          # GPU idle for at least half of the phase's windows
LAUNCH_COVER_RATIO = 0.5        # host inside launch calls for at least half of that idle
LOW_FRACTION = 0.10             # achieved < 10% of the roof that applies
SHORT_KERNEL_NS = 20_000        # median kernel shorter than 20 us
SHORT_GAP_NS = 20_000           # median idle gap shorter than 20 us
MIN_WORK_COVERAGE = 0.5         # figures must cover half of the phase's kernel time
SHAPES_PREFERRED_COVERAGE = 0.8  # shapes win over the model when they cover this much
IMPLAUSIBLE_RATIO = 1.5         # figures implying > 1.5x a ceiling are not this work

# ---------------------------------------------------------------------------------
# Verdict
# ---------------------------------------------------------------------------------

def decide_verdict(*, idle_ratio: float | None, launch_cover_ratio: float | None,
                   sync_cover_ratio: float | None, median_gap_ns: float | None,
                   median_kernel_ns: float | None, arithmetic_intensity: float | None,
                   ridge_point: float | None, pct_of_peak_flops: float | None,
                   pct_of_peak_bytes: float | None, work_coverage_ratio: float) -> tuple[str, list[str]]:
    """The verdict of one phase from plain numbers, and the evidence that decided it.

    1. GPU idle >= IDLE_BOUND_RATIO of the phase's windows: the GPU waits for the host.
       Host inside launch calls for >= LAUNCH_COVER_RATIO of the idle, or short gaps
       between short kernels -> latency/launch-bound; otherwise host-bound (the thread is
       busy elsewhere or blocked in a synchronisation).
    2. Otherwise, with FLOP/byte figures covering >= MIN_WORK_COVERAGE of kernel time:
       both achieved fractions below LOW_FRACTION with short kernels ->
       latency/launch-bound; else intensity >= ridge point -> compute-bound, below ->
       memory-bound.
    3. Otherwise undetermined.
    """
    ev: list[str] = []
    pct = lambda x: f"{100 * x:.0f}%"   # noqa: E731
    if idle_ratio is not None and idle_ratio >= IDLE_BOUND_RATIO:
        ev.append(f"GPU idle {pct(idle_ratio)} of the phase's time")
        if launch_cover_ratio is not None:
            ev.append(f"host in launch calls during {pct(launch_cover_ratio)} of the idle")
        if sync_cover_ratio:
            ev.append(f"host blocked in synchronisation during {pct(sync_cover_ratio)} of the idle")
        short = (median_gap_ns is not None and median_gap_ns < SHORT_GAP_NS
                 and median_kernel_ns is not None and median_kernel_ns < SHORT_KERNEL_NS)
        if median_gap_ns is not None:
            ev.append(f"median idle gap {median_gap_ns / 1e3:.1f} us, median kernel "
                      f"{(median_kernel_ns or 0) / 1e3:.1f} us")
        if (launch_cover_ratio or 0) >= LAUNCH_COVER_RATIO or short:
            return LAUNCH_BOUND, ev
        return HOST_BOUND, ev
    if idle_ratio is not None:
        ev.append(f"GPU busy {pct(1 - idle_ratio)} of the phase's time")
    known = (arithmetic_intensity is not None and ridge_point is not None
             and work_coverage_ratio >= MIN_WORK_COVERAGE)
    if not known:
        ev.append("no FLOP/byte figures for most of the kernel time" if work_coverage_ratio
                  < MIN_WORK_COVERAGE else "no ceilings for this GPU")
        return UNDETERMINED, ev
    pf, pb = pct_of_peak_flops or 0.0, pct_of_peak_bytes or 0.0
    ev.append(f"intensity {arithmetic_intensity:.1f} FLOP/B vs ridge {ridge_point:.0f}")
    ev.append(f"{pf:.0f}% of peak FLOP/s, {pb:.0f}% of peak bytes/s")
    if max(pf, pb) < 100 * LOW_FRACTION and median_kernel_ns is not None \
            and median_kernel_ns < SHORT_KERNEL_NS:
        ev.append(f"median kernel {median_kernel_ns / 1e3:.1f} us: neither roof approached")
        return LAUNCH_BOUND, ev
    if arithmetic_intensity >= ridge_point:
        return COMPUTE_BOUND, ev
    return MEMORY_BOUND, ev


def choose_work(by_source: dict[str, dict], shapes_cov: float, model_cov: float,
                ceilings: Ceilings | None, model_dtype: str | None) -> dict:
    """Pick the FLOP/byte source of one phase and derive its roofline figures.

    ``by_source``: source name -> ``{"flops", "bytes", "busy_ns", optional "dtype"}``
    (sources whose figures exceed the ceilings get ``exceeds_ceilings_ratio`` set in
    place). Returns ``implausible`` (source names), ``work_source``, ``chosen`` (the
    chosen source's dict or None), ``flops``, ``bytes``, ``work_coverage_ratio``,
    ``work_busy_ns``, ``achieved_flops_per_s``, ``achieved_bytes_per_s``,
    ``arithmetic_intensity``, ``ridge_point``, ``peak_flops_per_s``, ``ceiling_dtype``,
    ``pct_of_peak_flops``, ``pct_of_peak_bytes`` (None where unknown).
    """
    # A figure implying more than IMPLAUSIBLE_RATIO x a ceiling over the traced
    # kernel time cannot be the work those kernels did: for the model it means the
    # trace holds only part of the step (e.g. unexpanded CUDA-graph replays).
    implausible: list[str] = []
    if ceilings is not None:
        for name_, w in by_source.items():
            if w["busy_ns"] <= 0:
                continue
            sec = w["busy_ns"] * 1e-9
            pk = ceilings.peak_flops_per_s(w.get("dtype") or model_dtype)[0]
            r = max(w["flops"] / sec / pk, w["bytes"] / sec / ceilings.hbm_bytes_per_s)
            if r > IMPLAUSIBLE_RATIO:
                w["exceeds_ceilings_ratio"] = r
                implausible.append(name_)
    usable_model = SOURCE_MODEL in by_source and SOURCE_MODEL not in implausible
    if SOURCE_SHAPES in by_source and (shapes_cov >= SHAPES_PREFERRED_COVERAGE
                                       or model_cov <= shapes_cov or not usable_model):
        src = SOURCE_SHAPES
    elif usable_model:
        src = SOURCE_MODEL
    else:
        src = NO_SOURCE
    chosen = by_source.get(src)
    flops = chosen["flops"] if chosen else None
    bytes_ = chosen["bytes"] if chosen else None
    wbusy = chosen["busy_ns"] if chosen else 0
    afl = (flops / (wbusy * 1e-9)) if chosen and wbusy > 0 else None
    aby = (bytes_ / (wbusy * 1e-9)) if chosen and wbusy > 0 else None
    dtype = (chosen or {}).get("dtype") or model_dtype
    ridge = peak_f = pct_f = pct_b = None
    used_dtype = None
    if ceilings is not None:
        peak_f, used_dtype = ceilings.peak_flops_per_s(dtype)
        ridge = peak_f / ceilings.hbm_bytes_per_s
        if afl is not None:
            pct_f = 100.0 * afl / peak_f
            pct_b = 100.0 * aby / ceilings.hbm_bytes_per_s
    return {"implausible": implausible, "work_source": src, "chosen": chosen,
            "flops": flops, "bytes": bytes_,
            "work_coverage_ratio": chosen["coverage_ratio"] if chosen else 0.0,
            "work_busy_ns": wbusy, "achieved_flops_per_s": afl, "achieved_bytes_per_s": aby,
            "arithmetic_intensity": (flops / bytes_) if chosen and bytes_ else None,
            "ridge_point": ridge, "peak_flops_per_s": peak_f, "ceiling_dtype": used_dtype,
            "pct_of_peak_flops": pct_f, "pct_of_peak_bytes": pct_b}
