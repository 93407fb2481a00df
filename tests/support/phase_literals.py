"""Hand-built phase maps for the tests of phase consumers (roofline, analysis, perfetto).

Those tests give literal steps and per-kernel labels instead of running
:func:`aggregator.phases.map_phases`, so that a failure there is the consumer's, not
the phase mapper's. They use the real :class:`aggregator.phases.Step` and
:class:`aggregator.phases.PhaseMap`.
"""
import numpy as np

from ridgeline.aggregator.phases import PHASE_NAMES, PhaseMap, Step
from ridgeline.probes.events import (
    API_DTYPE,
    API_LAUNCH,
    COPY_DTYPE,
    COPY_HTOD,
    KERNEL_DTYPE,
    RANGE_DTYPE,
    RANGE_GPU_ANNOTATION,
    Device,
    NameTable,
    Trace,
    empty,
)

NAMES = PHASE_NAMES
__all__ = ["NAMES", "Step", "phase_map"]


def phase_map(steps: list[Step], kernel_phase: np.ndarray, kernel_step: np.ndarray) -> PhaseMap:
    """A PhaseMap of literal ``steps`` and labels; every kernel's evidence is "literal"."""
    return PhaseMap(steps, kernel_phase, kernel_step,
                    np.zeros(len(kernel_phase), np.int32), ["literal"])


def annotated_literal_trace():
    """Two kernels and a copy on stream 7 (the copy overlaps the first kernel, the second
    kernel partially overlaps the first), launched by three API calls; a GPU annotation
    spanning them."""
    names = NameTable(["gemm", "cudaLaunchKernel", "cudaMemcpyAsync", "fwd"])
    k = empty(KERNEL_DTYPE, 3)
    k["start_ns"] = [1_000_000, 1_001_500, 9_000_000]
    k["end_ns"] = [1_002_000, 1_004_000, 9_000_100]
    k["device"], k["stream"], k["name_id"] = 0, 7, 0
    k["correlation_id"] = [11, 12, 13]
    c = empty(COPY_DTYPE, 1)
    c["start_ns"], c["end_ns"], c["device"], c["stream"] = 1_000_500, 1_001_000, 0, 7
    c["direction"], c["bytes"], c["correlation_id"] = COPY_HTOD, 4096, 14
    api = empty(API_DTYPE, 4)
    api["start_ns"] = [999_000, 999_600, 8_999_000, 999_800]
    api["end_ns"] = [999_500, 999_700, 8_999_500, 999_900]
    api["pid"], api["tid"] = 10, 11
    api["category"], api["name_id"] = API_LAUNCH, 1
    api["name_id"][3] = 2
    api["correlation_id"] = [11, 12, 13, 14]
    r = empty(RANGE_DTYPE, 1)
    r["start_ns"], r["end_ns"], r["device"], r["tid"] = 999_000, 9_000_200, 0, 7
    r["kind"], r["name_id"] = RANGE_GPU_ANNOTATION, 3
    return Trace(kernels=k, copies=c, api=api, ranges=r, names=names)


def decode_literal_trace():
    # Four decode steps of 40 kernels of 250 us each, back to back, on an H200.
    n = 160
    k = empty(KERNEL_DTYPE, n)
    k["start_ns"] = np.arange(n) * 250_000
    k["end_ns"] = k["start_ns"] + 250_000
    k["device"] = 0
    k["name_id"] = 0
    t = Trace(kernels=k, names=NameTable(["gemv"]),
              devices=[Device(0, "NVIDIA H200", 132, 150_000_000_000)])
    steps = [Step(i, i * 10_000_000, (i + 1) * 10_000_000, 0, 2, 0, 64, ["literal"]) for i in range(4)]
    pm = phase_map(steps, np.full(n, 2, np.uint8), np.repeat(np.arange(4), 40).astype(np.int32))
    return t, pm
