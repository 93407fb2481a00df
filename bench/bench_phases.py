"""Phase-mapping cost at scale: map_phases on a large columnar kernel timeline.

Builds (with numpy, no Python object per event) a synthetic timeline of alternating
vLLM-style prefill and decode steps (names from the real B200 and nano-vllm traces;
per-token kernels carry the step's token count in grid.x) and times ``map_phases`` with
and without a GPU-side step annotation per step. Prints one table. This is a cost
measurement only: phase-mapping accuracy is proven on real traces (tests/test_phases_traces.py).

    .venv/bin/python bench/bench_phases.py [--steps 2000] [--layers 24]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from aggregator.phases import DECODE, PREFILL, map_phases
from probes.events import KERNEL_DTYPE, RANGE_DTYPE, RANGE_GPU_ANNOTATION, NameTable, Trace, empty

LAYER = [
    "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, unsigned char, (vllm::Fp8KVCacheDataType)1>(x)",
    "nvjet_tst_144x128_64x6_2x1_v_bz_bias_TNN",
    None,   # attention: per phase
    "nvjet_tst_64x64_64x16_2x1_2cta_v_bz_bias_TNT",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16> >(x)",
]
ATTN = {PREFILL: "fmhaSm100aKernel_QkvE4m3OBfloat16H64PagedKvCausalP16VarSeqQ128Kv128PersistentContext",
        DECODE: "fmhaSm100aKernel_QkvE4m3OBfloat16H64PagedKvCausalP16VarSeqQ128Kv128PersistentSwapsAbForGen"}
ARGMAX = "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float> > >(x)"


def build(steps: int, layers: int) -> tuple[Trace, np.ndarray]:
    names = NameTable()
    ids = [names.intern(n) if n else -1 for n in LAYER]
    att = {p: names.intern(n) for p, n in ATTN.items()}
    argmax = names.intern(ARGMAX)
    per_step = layers * len(LAYER) + 1
    n = steps * per_step
    k = empty(KERNEL_DTYPE, n)
    phase = np.where(np.arange(steps) % 4 == 0, PREFILL, DECODE)          # 1 prefill : 3 decodes
    tokens = np.where(phase == PREFILL, 2048, 64)
    step_of = np.repeat(np.arange(steps), per_step)
    pos = np.tile(np.arange(per_step), steps)
    name = np.tile(np.array(ids * layers + [argmax]), steps)
    slot = pos % len(LAYER)
    is_att = (slot == 2) & (pos < per_step - 1)
    name[is_att] = np.where(phase[step_of[is_att]] == PREFILL, att[PREFILL], att[DECODE])
    t0 = step_of.astype(np.int64) * 20_000_000 + pos.astype(np.int64) * 5_000    # 5 us per kernel, 20 ms per step
    k["start_ns"], k["end_ns"] = t0, t0 + 4_000
    k["device"], k["stream"], k["name_id"] = 0, 7, name
    k["grid_x"], k["grid_y"], k["grid_z"] = 1, 1, 1
    k["grid_x"][(slot == 0) & (pos < per_step - 1)] = tokens[step_of[(slot == 0) & (pos < per_step - 1)]]
    k["correlation_id"] = np.arange(n)
    r = empty(RANGE_DTYPE, steps)
    r["start_ns"] = np.arange(steps, dtype=np.int64) * 20_000_000 - 1_000
    r["end_ns"] = r["start_ns"] + per_step * 5_000 + 2_000
    r["device"], r["kind"], r["external_id"] = 0, RANGE_GPU_ANNOTATION, np.arange(steps)
    r["name_id"] = [names.intern(f"execute_context_1({t}_{t * t})_generation_0(0)" if p == PREFILL
                                 else f"execute_context_0(0)_generation_{t}({t})") for p, t in zip(phase, tokens)]
    return Trace(kernels=k, ranges=r, names=names), phase


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    tr, truth = build(args.steps, args.layers)
    rows = []
    for label, use in (("with annotations", True), ("kernels only", False)):
        t = time.perf_counter()
        pm = map_phases(tr, use_annotations=use)
        dt = time.perf_counter() - t
        got = np.array([s.phase for s in pm.steps])
        ok = len(got) == len(truth) and bool((got == truth).all())
        rows.append((label, len(tr.kernels), len(pm.steps), dt, len(tr.kernels) / dt, ok))
    print(f"{'mode':<18} {'kernels':>9} {'steps':>6} {'seconds':>8} {'kernels/s':>11} {'labels match':>13}")
    for label, nk, ns, dt, rate, ok in rows:
        print(f"{label:<18} {nk:>9} {ns:>6} {dt:>8.2f} {rate:>11.0f} {str(ok):>13}")


if __name__ == "__main__":
    main()
