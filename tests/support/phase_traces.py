"""Literal traces for the phase-mapping tests: real kernel names (from the shared traces
or the engines' sources, see reference/kernel-signatures.md), a builder of events, and
whole forwards built from them (tests/test_phases*.py, tests/test_stream_phases.py).
"""
from __future__ import annotations

import json

import numpy as np

from ridgeline.probes.events import (
    API_DTYPE,
    API_LAUNCH,
    CPU_OP_DTYPE,
    KERNEL_DTYPE,
    RANGE_DTYPE,
    RANGE_GPU_ANNOTATION,
    NameTable,
    Trace,
    empty,
)

US = 1000  # ns per microsecond


RESHAPE_AND_CACHE = ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, unsigned char, "
                     "(vllm::Fp8KVCacheDataType)1>(__nv_bfloat16 const*, __nv_bfloat16 const*)")


GEMVX = ("std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, __nv_bfloat16, __nv_bfloat16, "
         "__nv_bfloat16, float, false, true, true, false, 6, false, cublasGemvParamsEx<int, "
         "cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, "
         "cublasGemvTensorStridedBatched<__nv_bfloat16>, float> >(cublasGemvParamsEx<int, int, int, int>)")


GEMM_LARGE = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"


ELEMENTWISE = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
               "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)")


ARGMAX = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
          "unsigned int, long, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4>)")


class TraceBuilder:
    """Accumulates literal events; ``build()`` returns a sorted :class:`Trace`."""

    def __init__(self):
        self.names = NameTable()
        self.kernels: list[dict] = []
        self.ranges: list[dict] = []
        self.api: list[dict] = []
        self.ops: list[dict] = []
        self._corr = 1000

    def kernel(self, name: str, start_us: float, dur_us: float = 2.0, grid=(1, 1, 1), device: int = 0,
               stream: int = 7, corr: int | None = None, ext: int = -1, graph: int = -1) -> int:
        if corr is None:
            self._corr += 1
            corr = self._corr
        self.kernels.append(dict(start_ns=int(start_us * US), end_ns=int((start_us + dur_us) * US), device=device,
                                 stream=stream, correlation_id=corr, external_id=ext, grid_x=grid[0],
                                 grid_y=grid[1], grid_z=grid[2], block_x=128, block_y=1, block_z=1,
                                 name_id=self.names.intern(name), graph_id=graph))
        return corr

    def launch(self, corr: int, start_us: float, dur_us: float = 3.0, pid: int = 100, tid: int = 100,
               name: str = "cudaLaunchKernel", ext: int = -1, category: int = API_LAUNCH) -> None:
        self.api.append(dict(start_ns=int(start_us * US), end_ns=int((start_us + dur_us) * US), pid=pid, tid=tid,
                             correlation_id=corr, external_id=ext, cbid=211, domain=1, category=category,
                             name_id=self.names.intern(name)))

    def range(self, name: str, start_us: float, end_us: float, kind: int = RANGE_GPU_ANNOTATION,
              device: int = 0, pid: int = 100, tid: int = 100, ext: int = -1) -> None:
        self.ranges.append(dict(start_ns=int(start_us * US), end_ns=int(end_us * US), pid=pid, tid=tid,
                                device=device, kind=kind, name_id=self.names.intern(name), external_id=ext))

    def op(self, name: str, start_us: float, end_us: float, ext: int = -1, dims=None, pid: int = 100,
           tid: int = 100) -> None:
        self.ops.append(dict(start_ns=int(start_us * US), end_ns=int(end_us * US), pid=pid, tid=tid,
                             name_id=self.names.intern(name), external_id=ext,
                             input_dims_id=self.names.intern(json.dumps(dims, separators=(",", ":")))
                             if dims is not None else -1, input_types_id=-1))

    @staticmethod
    def _array(rows: list[dict], dtype) -> np.ndarray:
        out = empty(dtype, len(rows))
        for i, r in enumerate(rows):
            for key, v in r.items():
                out[key][i] = v
        return out

    def build(self) -> Trace:
        return Trace(kernels=self._array(self.kernels, KERNEL_DTYPE), api=self._array(self.api, API_DTYPE),
                     ranges=self._array(self.ranges, RANGE_DTYPE), cpu_ops=self._array(self.ops, CPU_OP_DTYPE),
                     names=self.names).sorted()


def layers(b: TraceBuilder, t0_us: float, n_layers: int, attention: str, tokens: int, attention_grid=(1, 1, 1),
           per_token: str = RESHAPE_AND_CACHE, gemm: str = GEMM_LARGE, step_us: float = 10.0,
           device: int = 0) -> float:
    """Append ``n_layers`` transformer layers (per-token kernel, GEMM, attention, GEMM,
    elementwise) starting at ``t0_us``; returns the time after the last kernel."""
    t = t0_us
    for _ in range(n_layers):
        b.kernel(per_token, t, grid=(tokens, 1, 1), device=device)
        b.kernel(gemm, t + 2, grid=(8, 8, 1), device=device)
        b.kernel(attention, t + 4, grid=attention_grid, device=device)
        b.kernel(gemm, t + 6, grid=(8, 8, 1), device=device)
        b.kernel(ELEMENTWISE, t + 8, grid=(64, 1, 1), device=device)
        t += step_us
    return t


# An eager GPT-2-style decoder (attention = batched GEMM + softmax + batched GEMM, no fused
# attention, no KV-cache kernel), kernels only, with real kernel names (TraceLens H100 OWLv2 /
# TimeSformer traces and the nano-vllm decode fragment) and host stalls inside the forward.
LAYER_NORM = ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(int, float, "
              "c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, c10::BFloat16*)")


LINEAR = ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x6_tn_align8>"
          "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x6_tn_align8::Params)")


BMM_QK = ("void cutlass::Kernel2<cutlass_75_wmma_tensorop_bf16_s161616gemm_bf16_32x32_32x1_tn_align1>"
          "(cutlass_75_wmma_tensorop_bf16_s161616gemm_bf16_32x32_32x1_tn_align1::Params)")


BMM_PV = ("void cutlass::Kernel2<cutlass_75_wmma_tensorop_bf16_s161616gemm_bf16_32x32_32x1_nn_align1>"
          "(cutlass_75_wmma_tensorop_bf16_s161616gemm_bf16_32x32_32x1_nn_align1::Params)")


EMBEDDING = ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, "
             "-2, true>(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>, at::cuda::detail::TensorInfo"
             "<c10::BFloat16 const, unsigned int>, at::cuda::detail::TensorInfo<long const, unsigned int>, int, int, "
             "unsigned int, unsigned int, long)")


LM_HEAD = ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_256x128_64x3_tn_align2>"
           "(cutlass_80_tensorop_bf16_s16816gemm_bf16_256x128_64x3_tn_align2::Params)")


def softmax_warp(log2: int) -> str:
    return (f"void (anonymous namespace)::softmax_warp_forward<c10::BFloat16, c10::BFloat16, float, {log2}, false, "
            f"false>(c10::BFloat16*, c10::BFloat16 const*, int, int, int, bool const*, int, bool)")


def eager_forward(b: "TraceBuilder", t: float, tokens: int, context: int, heads: int = 12, n_layers: int = 12,
                  stall_after=(2, 5, 9), stall_us: float = 8000.0) -> float:
    """One forward of a GPT-2-style eager decoder over ``tokens`` new tokens of one sequence
    (``context`` keys): per layer LN, QKV GEMM, Q.K bmm (grid.z = heads), scale and mask,
    softmax over heads x tokens rows, P.V bmm, out-projection, LN, MLP; then the LM head
    (50257 columns). The host stalls ``stall_us`` after the layers in ``stall_after``."""
    log2 = max(context - 1, 1).bit_length()
    rows_per_block = (128 // min(1 << log2, 32)) * (2 if (1 << log2) <= 128 else 1)
    decode = tokens == 1
    for _ in range(2):                                       # token and position embeddings, added
        b.kernel(EMBEDDING, t, grid=(tokens, 1, 1))
        t += 20.0
    b.kernel(ELEMENTWISE, t, grid=(8, 1, 1))
    t += 20.0
    lin = GEMVX if decode else LINEAR
    lin_grid = (192, 1, 1) if decode else (12, -(-tokens // 64), 1)
    for layer in range(n_layers):
        for name, grid in ((LAYER_NORM, (tokens, 1, 1)), (lin, lin_grid), (BMM_QK, (2, 1, heads)),
                           (ELEMENTWISE, (8, 1, 1)), (ELEMENTWISE, (8, 1, 1)),
                           (softmax_warp(log2), (-(-heads * tokens // rows_per_block), 1, 1)),
                           (BMM_PV, (2, 1, heads)), (lin, lin_grid), (ELEMENTWISE, (8, 1, 1)), (LAYER_NORM, (tokens, 1, 1)),
                           (lin, lin_grid), (ELEMENTWISE, (8, 1, 1)), (lin, lin_grid), (ELEMENTWISE, (8, 1, 1))):
            b.kernel(name, t, dur_us=3.0, grid=grid)
            t += 20.0
        if layer in stall_after:
            t += stall_us
    b.kernel(LAYER_NORM, t, grid=(tokens, 1, 1))
    if decode:
        b.kernel(GEMVX, t + 20, grid=(12565, 1, 1))          # 50257 columns / 4 rows per block
    else:
        b.kernel(LM_HEAD, t + 20, grid=(197, -(-tokens // 128), 1))
    b.kernel(ARGMAX, t + 40)                                  # greedy sampling
    return t + 60


# Real kernel names (from the shared traces, see reference/traces.md).
TRTLLM_CONTEXT = "fmhaSm100aKernel_QkvE4m3OBfloat16H64PagedKvCausalP16VarSeqQ128Kv128PersistentContext"


TRTLLM_GEN = "fmhaSm100aKernel_QkvE4m3OBfloat16H64PagedKvCausalP16VarSeqQ128Kv128PersistentSwapsAbForGen"


FLASH_FWD = ("void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<64, 128, 128, 4, false, "
             "false, cutlass::bfloat16_t, pytorch_flash::Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, "
             "false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)")


SPLITKV = ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
           "cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 4, cutlass::bfloat16_t> >, true, false, false, "
           "false, true, true, false, false>(flash::Flash_fwd_params)")


SPLITKV_COMBINE = ("void flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, "
                   "false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 4, cutlass::bfloat16_t> >, 4, 1, "
                   "true>(flash::Flash_fwd_params)")


GEMM_SMALL = ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>"
              "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)")


ADAM = ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>, float, float, float, float, float, "
        "float, float, float, adamMode_t, float, int>(long, int volatile*, TensorListMetadata<4>, AdamFunctor<float>)")


CONV = "cudnn_ampere_scudnn_128x64_relu_xregs_large_nn_v1"


def lm_head(b: "TraceBuilder", t: float, rows: int, vocab: int = 151936, ext: int = 990) -> None:
    """A decoder's LM head (decoder-LLM evidence): aten::mm [rows, 1024] x [1024, vocab], once."""
    b.op("aten::mm", t, t + 8, ext=ext, dims=[[rows, 1024], [1024, vocab]])
    b.kernel(GEMM_SMALL if rows <= 16 else GEMM_LARGE, t + 1, ext=ext)


#: The three ways the real-trace tests map phases: annotations kept, ignored, and every range
#: and CPU operator removed (kernels only).
MODES = ["annotations", "no_annotations", "no_cpu_ops"]


def phases_in_mode(tr: Trace, mode: str):
    from ridgeline.aggregator.phases import map_phases
    if mode == "annotations":
        return map_phases(tr)
    if mode == "no_annotations":
        return map_phases(tr, use_annotations=False)
    bare = Trace(kernels=tr.kernels, copies=tr.copies, api=tr.api, ranges=empty(RANGE_DTYPE),
                 cpu_ops=empty(CPU_OP_DTYPE), names=tr.names, devices=tr.devices, meta=tr.meta)
    return map_phases(bare)


def simulated_gpu_streams(gpus: int) -> list[Trace]:
    """0.4 s of the simulator's llama-3-8b stream per GPU (no annotations), one Trace each."""
    from ridgeline.agent.simulator.engine import SimConfig, SimEngine
    from ridgeline.agent.simulator.workload import Workload
    parts = []
    for dev in range(gpus):
        w = Workload(rate_per_s=30, duration_s=1, prompt_mean=300, prompt_max=900, output_mean=60, output_max=200)
        e = SimEngine(SimConfig(model="llama-3-8b", workload=w, annotations=False, device=dev, pid=100 + dev,
                                tid=100 + dev), seed=dev, metrics=False)
        e.run_until(int(0.4e9))
        parts.append(e.drain())
    return parts
