"""A tensor-parallel group built kernel by kernel (collectives and GEMMs per rank, one rank
slowed at will), for the straggler tests (tests/test_stragglers.py, tests/test_straggler_window.py).
"""
from __future__ import annotations

import numpy as np

from ridgeline.probes.events import COPY_DTYPE, KERNEL_DTYPE, NameTable, Trace, empty

ALLREDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"


US = 1_000


class Builder:
    def __init__(self):
        self.names = NameTable()
        self.k: list[tuple] = []
        self.c: list[tuple] = []

    def kernel(self, pid, dev, name, start, end):
        self.k.append((pid, dev, self.names.intern(name), start, end))

    def copy(self, pid, dev, start, end):
        self.c.append((pid, dev, start, end))

    def trace(self) -> Trace:
        k = empty(KERNEL_DTYPE, len(self.k))
        for i, (pid, dev, nid, s, e) in enumerate(self.k):
            k[i]["pid"], k[i]["device"], k[i]["name_id"], k[i]["start_ns"], k[i]["end_ns"] = pid, dev, nid, s, e
        c = empty(COPY_DTYPE, len(self.c))
        for i, (pid, dev, s, e) in enumerate(self.c):
            c[i]["pid"], c[i]["device"], c[i]["start_ns"], c[i]["end_ns"] = pid, dev, s, e
        return Trace(kernels=k[np.argsort(k["start_ns"], kind="stable")], copies=c, names=self.names)


def tp_group(b: Builder, ranks, steps=50, t0=1_000_000, compute_us=400, slow: dict | None = None,
             idle_before: dict | None = None, copy_before: dict | None = None, transfer_us=30, seed=0):
    """``steps`` of (compute, all-reduce) on ``ranks`` [(pid, device)]; ``slow``: rank index ->
    extra compute (us); ``idle_before``: rank -> a gap (us) before its compute (the launch came
    late); ``copy_before``: rank -> a copy (us) between its compute and its collective."""
    rng = np.random.default_rng(seed)
    slow, idle_before, copy_before = slow or {}, idle_before or {}, copy_before or {}
    t = t0
    for _ in range(steps):
        arrive = []
        for i, (pid, dev) in enumerate(ranks):
            s = t + idle_before.get(i, 0) * US
            e = s + (compute_us + slow.get(i, 0) + rng.uniform(0, 5)) * US
            b.kernel(pid, dev, GEMM, s, e)
            if i in copy_before:
                b.copy(pid, dev, e, e + copy_before[i] * US)
                e += copy_before[i] * US
            arrive.append(e + 2 * US)
        end = max(arrive) + transfer_us * US
        for (pid, dev), a in zip(ranks, arrive):
            b.kernel(pid, dev, ALLREDUCE, int(a), int(end + rng.uniform(0, 3) * US))
        t = int(end) + 20 * US
    return b


TP4 = [(101, 0), (102, 1), (103, 2), (104, 3)]
