"""CUPTI activity buffers laid out exactly as CUPTI lays them out, for tests and bench.

Records are built with cupti-python's numpy dtypes (``activity_kernel13_dtype`` ...,
the byte layout of the C structs), concatenated in CUPTI's order (mixed kinds, back
to back), with ``name`` fields pointing at real NUL-terminated strings in this process
(ctypes buffers kept alive by :class:`CuptiBuffer`), as CUPTI's name pointers do.
Used by tests/test_native_cupti.py, tests/test_cupti_*.py and bench/bench_cupti_decode.py.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
from cupti import cupti as C

KERNEL = C.activity_kernel13_dtype
MEMCPY = C.activity_memcpy7_dtype
MEMSET = C.activity_memset5_dtype
API = C.activity_api_dtype
MARKER = C.activity_marker2_dtype
EXTCORR = C.activity_external_correlation_dtype

KIND_MEMCPY, KIND_MEMSET, KIND_DRIVER, KIND_RUNTIME = 1, 2, 4, 5
KIND_CONCURRENT_KERNEL, KIND_MARKER, KIND_EXTCORR = 10, 12, 39
CBID_CUDA_LAUNCH_KERNEL = 211     # CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000
CBID_CUDA_GRAPH_LAUNCH = 311      # cudaGraphLaunch_v10000
CBID_CUDA_STREAM_SYNC = 131       # cudaStreamSynchronize_v3020

KERNEL_NAMES = [
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>(Params)",
    "void vllm::rms_norm_kernel<c10::BFloat16>(c10::BFloat16*, c10::BFloat16 const*, float, int, int)",
    "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>, true>(Flash_fwd_params)",
    "void at::native::elementwise_kernel<128, 2>(int, at::native::gpu_kernel_impl_nocast)",
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn",
]


@dataclass
class CuptiBuffer:
    """One activity buffer and the records it was made from (the expected values)."""
    data: bytes
    kernels: np.ndarray
    copies: np.ndarray          # memcpy records
    memsets: np.ndarray
    api: np.ndarray
    markers: np.ndarray
    extcorr: np.ndarray
    names: dict[int, str]       # pointer -> string, for every pointer used
    keepalive: list = field(default_factory=list)


def _strings(names: list[str]) -> tuple[list, list[int]]:
    bufs = [ctypes.create_string_buffer(s.encode()) for s in names]
    return bufs, [ctypes.addressof(b) for b in bufs]


def make_buffer(n_kernels: int = 200, seed: int = 0, t0_ns: int = 1_700_000_000_000_000_000,
                with_markers: bool = True, interleave: bool = True, corr0: int = 1) -> CuptiBuffer:
    """A buffer with ``n_kernels`` kernels, each launched by one runtime API record,
    plus memcpys, memsets, external correlations and NVTX markers."""
    rng = np.random.default_rng(seed)
    keep, ptrs = _strings(KERNEL_NAMES)
    mkeep, mptrs = _strings(["step[DECODE bs=8]", "layer"])
    dkeep, dptrs = _strings(["vllm"])
    names = {p: s for p, s in zip(ptrs, KERNEL_NAMES)}
    names.update({mptrs[0]: "step[DECODE bs=8]", mptrs[1]: "layer", dptrs[0]: "vllm"})

    n = n_kernels
    corr = np.arange(corr0, corr0 + n, dtype=np.uint32)
    launch = t0_ns + np.cumsum(rng.integers(2_000, 9_000, n)).astype(np.uint64)
    k = np.zeros(n, KERNEL)
    k["kind"] = KIND_CONCURRENT_KERNEL
    k["start"] = launch + rng.integers(3_000, 40_000, n).astype(np.uint64)
    k["end"] = k["start"] + rng.integers(1_000, 500_000, n).astype(np.uint64)
    k["completed"] = k["end"]
    k["device_id"] = rng.integers(0, 2, n)
    k["context_id"] = 1
    k["stream_id"] = rng.choice([7, 13, 21], n)
    for f, hi in (("grid_x", 4096), ("grid_y", 8), ("grid_z", 2), ("block_x", 1024), ("block_y", 4), ("block_z", 2)):
        k[f] = rng.integers(1, hi, n)
    k["registers_per_thread"] = rng.integers(16, 255, n)
    k["static_shared_memory"] = rng.integers(0, 48 << 10, n)
    k["dynamic_shared_memory"] = rng.integers(0, 160 << 10, n)
    k["correlation_id"] = corr
    k["name"] = np.array(ptrs, dtype=np.int64)[rng.integers(0, len(ptrs), n)]
    in_graph = rng.random(n) < 0.5
    k["graph_id"] = np.where(in_graph, rng.integers(1, 5, n), 0)
    k["graph_node_id"] = np.where(in_graph, rng.integers(1, 10_000, n), 0)

    a = np.zeros(n, API)
    a["kind"] = KIND_RUNTIME
    a["cbid"] = np.where(in_graph, CBID_CUDA_GRAPH_LAUNCH, CBID_CUDA_LAUNCH_KERNEL)
    a["start"] = launch
    a["end"] = launch + rng.integers(1_000, 5_000, n).astype(np.uint64)
    a["process_id"] = 4242
    a["thread_id"] = rng.choice([1001, 1002, 1003], n)
    a["correlation_id"] = corr

    nc = max(1, n // 10)
    cc = np.arange(corr0 + n, corr0 + n + nc, dtype=np.uint32)
    c = np.zeros(nc, MEMCPY)
    c["kind"] = KIND_MEMCPY
    c["copy_kind"] = rng.choice([1, 2, 8], nc)
    c["bytes"] = rng.integers(1, 1 << 30, nc)
    c["start"] = t0_ns + rng.integers(0, 10**9, nc).astype(np.uint64)
    c["end"] = c["start"] + rng.integers(1_000, 100_000, nc).astype(np.uint64)
    c["device_id"] = rng.integers(0, 2, nc)
    c["stream_id"] = 7
    c["correlation_id"] = cc
    c["graph_id"] = 0

    ms = np.zeros(nc, MEMSET)
    ms["kind"] = KIND_MEMSET
    ms["bytes"] = rng.integers(1, 1 << 20, nc)
    ms["start"] = t0_ns + rng.integers(0, 10**9, nc).astype(np.uint64)
    ms["end"] = ms["start"] + 2_000
    ms["device_id"] = 0
    ms["stream_id"] = 13
    ms["correlation_id"] = cc + nc
    ms["graph_id"] = rng.integers(0, 3, nc)

    ex = np.zeros(n, EXTCORR)
    ex["kind"] = KIND_EXTCORR
    ex["external_kind"] = 5          # CUSTOM2
    ex["external_id"] = 900_000 + np.arange(n)
    ex["correlation_id"] = corr

    if with_markers:
        m = np.zeros(4, MARKER)
        m["kind"] = KIND_MARKER
        m["flags_"] = [2, 2, 4, 4]          # START, START, END, END
        m["id"] = [seed * 10 + 1, seed * 10 + 2, seed * 10 + 2, seed * 10 + 1]
        m["timestamp"] = [t0_ns + 10, t0_ns + 20, t0_ns + 500, t0_ns + 900]
        m["object_kind"] = 1                # thread
        m["object_id"]["pt"]["process_id"] = 4242
        m["object_id"]["pt"]["thread_id"] = [1001, 1001, 1001, 1001]
        m["name"] = [mptrs[0], mptrs[1], 0, 0]
        m["domain"] = [dptrs[0], dptrs[0], 0, 0]
    else:
        m = np.zeros(0, MARKER)

    # CUPTI's order: records of different kinds interleaved, back to back
    pieces: list[bytes] = []
    if interleave:
        for i in range(n):
            pieces.append(a[i].tobytes())
            pieces.append(ex[i].tobytes())
            pieces.append(k[i].tobytes())
            if i < nc:
                pieces.append(c[i].tobytes())
                pieces.append(ms[i].tobytes())
            if i < len(m):
                pieces.append(m[i].tobytes())
        data = b"".join(pieces)
    else:
        data = b"".join(x.tobytes() for x in (k, a, ex, c, ms, m))
    return CuptiBuffer(data, k, c, ms, a, m, ex, names, [keep, mkeep, dkeep])


def split_by_pid(out: dict) -> list[dict]:
    """CuptiProbe.poll() output -> one ``{"pid", "trace", "launch_latency_ns"}`` per process
    (the trace's meta is that process's entry of ``meta["processes"]``)."""
    from ridgeline.probes.events import Trace
    if "trace" not in out:
        return []
    t, lat = out["trace"], out["launch_latency_ns"]
    res = []
    for pid, meta in t.meta["processes"].items():
        sel = lambda a: a[a["pid"] == pid]  # noqa: E731
        km = t.kernels["pid"] == pid
        res.append({"pid": pid, "launch_latency_ns": lat[km],
                    "trace": Trace(t.kernels[km], sel(t.copies), sel(t.api), sel(t.ranges), names=t.names,
                                   meta=meta)})
    return res
