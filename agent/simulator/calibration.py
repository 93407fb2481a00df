"""Calibration of the simulator against a real trace: step time and per-kernel-class time.

:func:`kernel_class` puts a kernel name in one of four classes (GEMM, attention,
elementwise/norm, other) by name alone, the same rule for the real and the simulated
trace so the comparison does not depend on the simulator's own labels.
:func:`compare` returns the table rows (real, simulated, relative error) for one step.
"""
from __future__ import annotations

import re

import numpy as np

from ridgeline.probes.events import Trace

CLASSES = ("gemm", "attention", "elementwise_norm", "other")
_RULES = (
    ("attention", re.compile(r"flash|fmha|attention|attn", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|gemv|matmul", re.I)),
    ("elementwise_norm", re.compile(r"elementwise|reduce_kernel|CatArray|norm|rotary|act_and_mul|"
                                    r"reshape_and_cache|copy|index", re.I)),
)


def kernel_class(name: str) -> str:
    for cls, rx in _RULES:
        if rx.search(name):
            return cls
    return "other"


def step_kernels(trace: Trace, annotation: str | None = None) -> np.ndarray:
    """Kernels inside the GPU projection of the step annotation ``annotation`` (e.g.
    ``ProfilerStep#6``), or all kernels when it is None."""
    k = trace.kernels
    if annotation is None:
        return k
    r = trace.ranges
    ids = [i for i, n in enumerate(trace.names) if n == annotation]
    # The GPU-side projection: a range on a device (the importer may label it as a
    # profiler step or as a GPU annotation).
    sel = r[(r["device"] >= 0) & np.isin(r["name_id"], ids)]
    if not len(sel):
        raise ValueError(f"no GPU annotation {annotation!r} in the trace")
    lo, hi = int(sel["start_ns"][0]), int(sel["end_ns"][0])
    return k[(k["start_ns"] >= lo) & (k["start_ns"] < hi)]


def class_times_ns(trace: Trace, kernels: np.ndarray) -> dict[str, int]:
    dur = (kernels["end_ns"] - kernels["start_ns"]).astype(np.int64)
    cls = np.array([CLASSES.index(kernel_class(trace.names[i])) for i in kernels["name_id"].tolist()], dtype=np.int64)
    sums = np.bincount(cls, weights=dur, minlength=len(CLASSES)) if len(cls) else np.zeros(len(CLASSES))
    return {c: int(sums[i]) for i, c in enumerate(CLASSES)}


def compare(real: Trace, real_kernels: np.ndarray, sim: Trace, sim_kernels: np.ndarray) -> list[dict]:
    """Rows: step time (first kernel start to last kernel end), kernel count, then the
    time per class; each with real and simulated values and the relative error."""
    def span(k):
        return int(k["end_ns"].max() - k["start_ns"].min())
    rows = [("step_time_ns", span(real_kernels), span(sim_kernels)),
            ("kernel_time_ns", int((real_kernels["end_ns"] - real_kernels["start_ns"]).sum()),
             int((sim_kernels["end_ns"] - sim_kernels["start_ns"]).sum())),
            ("kernels", len(real_kernels), len(sim_kernels))]
    rc, sc = class_times_ns(real, real_kernels), class_times_ns(sim, sim_kernels)
    rows += [(f"{c}_time_ns", rc[c], sc[c]) for c in CLASSES]
    return [{"quantity": q, "real": r, "simulated": s, "error_ratio": (s - r) / r if r else None}
            for q, r, s in rows]


def simulate_hf_qwen_forward(batch: int = 16, seq: int = 559) -> Trace:
    """The simulated counterpart of the shared H100 HF Qwen1.5-0.5B forward trace: same
    engine conventions (HF eager), same model, same shape, H100 SXM ceilings."""
    from .engine import SimConfig, SimEngine
    e = SimEngine(SimConfig(gpu="h100", model="qwen1.5-0.5b", engine="hf"), seed=0, metrics=False)
    e.forward([seq] * batch)
    return e.drain()


def markdown(rows: list[dict]) -> str:
    out = ["| quantity | real | simulated | error |", "|---|---:|---:|---:|"]
    for r in rows:
        q = r["quantity"]
        unit = 1e6 if q.endswith("_ns") else 1
        name = q.replace("_time_ns", " time (ms)").replace("_ns", " (ms)")
        fmt = "{:.2f}" if unit != 1 else "{:.0f}"
        err = "n/a" if r["error_ratio"] is None else f"{100 * r['error_ratio']:+.1f}%"
        out.append(f"| {name} | {fmt.format(r['real'] / unit)} | {fmt.format(r['simulated'] / unit)} | {err} |")
    return "\n".join(out)


if __name__ == "__main__":   # python -m ridgeline.agent.simulator.calibration TRACE [ANNOTATION]
    import sys

    from ridgeline.probes.kineto import load_trace
    real = load_trace(sys.argv[1])
    rk = step_kernels(real, sys.argv[2] if len(sys.argv) > 2 else "ProfilerStep#6")
    sim = simulate_hf_qwen_forward()
    print(markdown(compare(real, rk, sim, sim.kernels)))
