"""Kernel signature table (aggregator/data/kernel_signatures.toml) and name classification."""
from __future__ import annotations

import re

import numpy as np
import pytest

from ridgeline.aggregator.signatures import (
    CAUSAL_LOCAL,
    CAUSAL_NO,
    CAUSAL_UNKNOWN,
    CAUSAL_YES,
    DATA_FILE,
    GRID_TOKENS,
    ROLE_ATTENTION,
    ROLE_GEMM,
    ROLE_NONE,
    ROLE_PER_TOKEN,
    classify_kernels,
    load_signatures,
    match_name_ids,
    parse_causal,
    parse_tile,
    short_name,
    template_bools,
)
from ridgeline.probes.errors import InputError
from ridgeline.probes.events import KERNEL_DTYPE, NameTable, Trace, empty

# Kernel names as they appear in real traces (reference/traces.md, kernel-signatures.md),
# with the signature id that must claim each.
REAL_NAMES = [
    ("fmhaSm100aKernel_QkvE4m3OBfloat16H64PagedKvCausalP16VarSeqQ128Kv128PersistentContext", "trtllm_gen_fmha_context"),
    ("fmhaSm100aKernel_QkvE4m3OBfloat16H64PagedKvSlidingOrChunkedCausalP16VarSeqQ128Kv128PersistentContext",
     "trtllm_gen_fmha_context"),
    ("fmhaSm100aKernel_QkvBfloat16OBfloat16H128PagedKvP64VarSeqQ8Kv128PersistentSwapsAbForGen",
     "trtllm_gen_fmha_generation"),
    ("void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
     "cutlass::bfloat16_t>, false, true>(pytorch_flash::Flash_fwd_params)", "fa2_fwd"),
    ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
     "cutlass::bfloat16_t>, true>(flash::Flash_fwd_params)", "fa2_splitkv"),
    ("void flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
     "cutlass::bfloat16_t>, 4, 1, true>(flash::Flash_fwd_params)", "fa2_splitkv_combine"),
    ("void flash::FlashAttnBwd<cute::tuple<int>>(x)", "attention_backward"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, unsigned char, (vllm::Fp8KVCacheDataType)1>(x)",
     "kv_cache_write"),
    ("store_kvcache_kernel", "kv_cache_write"),
    ("std::enable_if<(((8)>(0)))&&vllm::_typeConvert<c10::BFloat16>::exists, void>::type "
     "vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, c10::BFloat16*)", "vllm_norm_rotary"),
    ("void vllm::paged_attention_v2_kernel<__nv_bfloat16, __nv_bfloat16, 128, 16, 128>(x)", "vllm_paged_attention"),
    ("paged_attention_ll4mi_QKV_mfma16_kernel", "rocm_paged_attention"),
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<true, 2u>(x)", "flashinfer_decode"),
    ("void flashinfer::BatchPrefillWithRaggedKVCacheKernel<KernelTraits>(x)", "flashinfer_prefill_ragged"),
    ("void flashinfer::PODWithKVCacheTensorKernel<KTraits>(x)", "flashinfer_pod"),
    ("_fwd_kernel_stage1", "triton_decode_attention"),
    ("_fwd_kernel", "triton_prefill_attention"),
    ("kernel_unified_attention_3d", "vllm_unified_attention_3d"),
    ("void tensorrt_llm::kernels::mmha::masked_multihead_attention_kernel<unsigned short, 128>(x)", "trtllm_mmha"),
    ("fmha_v2_flash_attention_bf16_64_32_S_q_paged_kv_128_causal_sm86_kernel_nl", "trtllm_fmha_v2"),
    ("std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, __nv_bfloat16>(x)", "cublas_gemv"),
    ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>(x)", "cublas_gemv"),
    ("void mul_mat_vec_q<(ggml_type)12, 1>(x)", "cublas_gemv"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "gemm"),
    ("nvjet_tst_144x128_64x6_2x1_v_bz_bias_TNN", "gemm"),
    ("bmm_MxE4m3_MxE2m1MxE4m3_Fp32_t128x16x256u2_s3_et128x16_m128x16x32_cga1x1x1_16dp256b_rM_TN_transOut", "gemm"),
    ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>, float>(x)", "optimizer"),
    ("void split_embedding_backward_codegen_rowwise_adagrad_unweighted_kernel_cta_per_row_1<float>(x)", "backward"),
    ("cudnn_ampere_scudnn_128x64_relu_xregs_large_nn_v1", "convolution"),
    ("sm80_xmma_fprop_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16_stage4", "convolution"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
     "unsigned int, long, 4> >(x)", "argmax"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collective"),
    # ROCm (TraceLens MI300X traces, third-party: tests/THIRD_PARTY.md; CK names from public profiler tables).
    ("attn_fwd", "triton_attn_fwd"),
    ("void ck_tile::kentry<256, 2, ck_tile::FmhaFwdKernel<ck_tile::BlockFmhaPipelineQRKSVSAsync<x> > >(x)",
     "ck_fmha_fwd"),
    ("fmha_fwd_d128_bf16_batch_b128x128x32x128x32x128_r4x1x1_r4x1x1_w32x32x16_w32x32x16_qr_async_vr_psddv_nlogits_"
     "nbias_mask_nlse_ndropout_nskip_nqscale_ntrload_nsink", "ck_fmha_fwd"),     # CK Tile instance (benchmark scripts)
    ("void ck_tile::kentry<256, 1, ck_tile::FmhaFwdSplitKVKernel<x> >(x)", "ck_fmha_fwd_splitkv"),
    ("void ck_tile::kentry<256, 1, ck_tile::FmhaBwdDQDKDVKernel<x> >(x)", "attention_backward"),
    ("bwd_kernel_dk_dv", "attention_backward"),
    ("Cijk_Alik_Bljk_B_BS_BH_Bias_HA_S_SAV_UserArgs_MT16x16x128_MI16x16x1_SN_LDSB0_AFC1", "gemm"),
    ("igemm_fwd_gtcx3_nhwc_bf16_bx0_ex1_bt64x64x16_wt16x16x4_ws1x1_wr2x2_ta1x1x4x1_1x16x1x16", "convolution"),
    # Not claimed: generic PyTorch kernels and fbgemm embedding kernels.
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16> >(x)", None),
    ("void fbgemm_gpu::permute_2D_data_kernel<false, int, int, decltype(nullptr)>(int)", "embedding_bag"),
    ("void split_embedding_codegen_forward_unweighted_kernel<float, float, float, false, long, 1ul, 16ul>(x)",
     "embedding_bag"),
    ("triton_poi_fused_mul_silu_0", None),
    ("decoder_layer_convert_unary", None),
]


def test_table_loads_and_every_entry_cites_a_source():
    sigs = load_signatures()
    assert len(sigs) >= 30
    assert len({s.id for s in sigs}) == len(sigs)
    for s in sigs:
        assert s.source and s.label
        re.compile(s.pattern)
    by_id = {s.id: s for s in sigs}
    assert by_id["kv_cache_write"].grid_rule == "tokens" and by_id["fa2_fwd"].grid_rule == "query_blocks"
    assert by_id["trtllm_gen_fmha_context"].inference_only and not by_id["fa2_fwd"].inference_only


@pytest.mark.parametrize("name, sig_id", REAL_NAMES)
def test_real_kernel_names_are_claimed_by_the_right_signature(name, sig_id):
    sigs = load_signatures()
    names = NameTable([name])
    got = match_name_ids(names, np.array([0]), sigs)[0]
    assert (sigs[got].id if got >= 0 else None) == sig_id


def test_classify_kernels_is_aligned_and_shares_per_name_results():
    names = NameTable([n for n, _ in REAL_NAMES])
    k = empty(KERNEL_DTYPE, 3 * len(REAL_NAMES))
    k["name_id"] = np.tile(np.arange(len(REAL_NAMES)), 3)
    kc = classify_kernels(Trace(kernels=k, names=names))
    assert len(kc.sig) == len(kc.role) == len(kc.hint) == len(kc.tile_min) == len(k)
    n = len(REAL_NAMES)
    assert np.array_equal(kc.sig[:n], kc.sig[n:2 * n]) and np.array_equal(kc.sig[:n], kc.sig[2 * n:])
    ids = [kc.signatures[s].id if s >= 0 else None for s in kc.sig[:n]]
    assert ids == [sid for _, sid in REAL_NAMES]
    i = [sid for _, sid in REAL_NAMES].index("kv_cache_write")
    assert kc.role[i] == ROLE_PER_TOKEN and kc.grid_rule[i] == GRID_TOKENS
    assert kc.role[[sid for _, sid in REAL_NAMES].index("fa2_fwd")] == ROLE_ATTENTION
    assert kc.role[-1] == ROLE_NONE
    g = [sid for _, sid in REAL_NAMES].index("gemm")
    assert kc.role[g] == ROLE_GEMM and kc.tile_min[g] == 128
    assert classify_kernels(Trace()).sig.shape == (0,)


@pytest.mark.parametrize("name, tile", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", (128, 128)),
    ("nvjet_tst_64x16_64x16_2x4_2cta_h_bz_bias_TNT", (64, 16)),
    ("nvjet_sm100_tst_192x8_64x8_4x1_v_bz_splitK_TNN", (192, 8)),
    ("Cijk_Alik_Bljk_BBS_BH_MT256x32x64_MI16x16x16x1_SN", (256, 32)),
    ("bmm_Bfloat16_MxE2m1MxE4m3_Fp32_t128x16x256u2_s3", (128, 16)),
    ("cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", (16, 16)),
    ("cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x64_16x4_tn_align1>", (256, 64)),
    ("ampere_sgemm_32x32_sliced1x4_tn", (32, 32)),
    ("internal::gemvx::kernel<int>", None),
])
def test_parse_tile(name, tile):
    assert parse_tile(name) == tile


@pytest.mark.parametrize("name, short", [
    ("void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<64> >(x)", "flash_fwd_kernel"),
    ("std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int>(x)", "gemvx::kernel"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(p)",
     "cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_t"),
    ("void at::native::(anonymous namespace)::max_pool_forward_nchw<float, float>(int)", "max_pool_forward_nchw"),
    ("store_kvcache_kernel", "store_kvcache_kernel"),
])
def test_short_name(name, short):
    assert short_name(name) == short


@pytest.mark.parametrize("body, message", [
    ('[[signature]]\nid = "x"\npattern = "a"\nrole = "attention"\nphase = "prefill"\nstrength = "strong"\n'
     'label = "x"\n', "missing or empty 'source'"),
    ('[[signature]]\nid = "x"\npattern = "a("\nrole = "attention"\nphase = "prefill"\nstrength = "strong"\n'
     'label = "x"\nsource = "s"\n', "bad pattern"),
    ('[[signature]]\nid = "x"\npattern = "a"\nrole = "flux"\nphase = "prefill"\nstrength = "strong"\n'
     'label = "x"\nsource = "s"\n', "unknown role 'flux'"),
    ('[[signature]]\nid = "x"\npattern = "a"\nrole = "gemm"\nphase = "soon"\nstrength = "strong"\n'
     'label = "x"\nsource = "s"\n', "unknown phase 'soon'"),
    ("not toml [", "cannot read kernel signatures"),
    ("", "no [[signature]] entries"),
])
def test_bad_table_is_one_clear_error(tmp_path, body, message):
    p = tmp_path / "sigs.toml"
    p.write_text(body)
    with pytest.raises(InputError) as e:
        load_signatures(p)
    assert message in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)


def test_missing_table_file(tmp_path):
    with pytest.raises(InputError, match="cannot read kernel signatures"):
        load_signatures(tmp_path / "absent.toml")


def test_default_data_file_is_package_data():
    assert DATA_FILE.name == "kernel_signatures.toml" and DATA_FILE.parent.name == "data"


# flash-attention csrc/flash_attn/src/flash_fwd_launch_template.h (01afd16d):
#   flash_fwd_kernel<Kernel_traits, Is_dropout, Is_causal, Is_local, Has_alibi, Is_even_MN, Is_even_K, Is_softcap,
#                    Return_softmax>
#   flash_fwd_splitkv_kernel<Kernel_traits, Is_causal, Is_local, Has_alibi, Is_even_MN, Is_even_K, Is_softcap, Split,
#                            Append_KV>
_TRAITS = ("pytorch_flash::Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t, "
           "pytorch_flash::Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >")


@pytest.mark.parametrize("name, sig_id, causal", [
    # TraceLens H100 BERT-small (encoder) and H100 HF Qwen1.5 (decoder), as recorded.
    (f"void pytorch_flash::flash_fwd_kernel<{_TRAITS}, false, false, false, false, true, true, false, false>"
     "(pytorch_flash::Flash_fwd_params)", "fa2_fwd", CAUSAL_NO),
    (f"void pytorch_flash::flash_fwd_kernel<{_TRAITS}, false, true, false, false, true, true, false, false>"
     "(pytorch_flash::Flash_fwd_params)", "fa2_fwd", CAUSAL_YES),
    # Sliding window (Mistral-style): Is_causal false, Is_local true.
    (f"void flash::flash_fwd_kernel<{_TRAITS}, false, false, true, false, false, true, false, false>(p)", "fa2_fwd",
     CAUSAL_LOCAL),
    # Split-KV: Is_causal is the first boolean (decode calls it with false: seqlen_q == 1).
    ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 4, cutlass::bfloat16_t> >, true, false, false, "
     "false, true, true, false, false>(flash::Flash_fwd_params)", "fa2_splitkv", CAUSAL_YES),
    # flash-attention < 2.3 (no Is_local): the third boolean is Is_even_MN, not a window.
    (f"void flash::flash_fwd_kernel<{_TRAITS}, false, false, true, true, false>(p)", "fa2_fwd", CAUSAL_NO),
    ("attn_fwd", "triton_attn_fwd", CAUSAL_UNKNOWN),
    ("aiter::fmha_fwd_hd128_bf16_causal_rtne", "aiter_fmha_fwd_asm", CAUSAL_YES),
])
def test_causal_flag_from_the_name(name, sig_id, causal):
    sigs = {s.id: s for s in load_signatures()}
    got = match_name_ids(NameTable([name]), np.array([0]), list(sigs.values()))[0]
    assert list(sigs)[got] == sig_id
    assert parse_causal(name, sigs[sig_id]) == causal


def test_template_bools_skip_nested_lists():
    assert template_bools("k<T<1, true>, false, true>(x)") == [False, True]
    assert template_bools("kernel_without_templates") == []


def test_tile_sides_block_m_and_work_item_grids():
    names = NameTable(["nvjet_tst_64x16_64x16_2x4_2cta_h_bz_bias_TNT",
                       "Cijk_Alik_Bljk_B_BS_BH_Bias_HA_S_SAV_UserArgs_MT128x144x64_MI16x16x1_SN",
                       f"void pytorch_flash::flash_fwd_kernel<{_TRAITS}, false, true>(p)"])
    k = empty(KERNEL_DTYPE, 3)
    k["name_id"] = [0, 1, 2]
    kc = classify_kernels(Trace(kernels=k, names=names))
    assert kc.tile_out.tolist()[:2] == [64, 128] and kc.tile_tok.tolist()[:2] == [16, 144]
    assert kc.grid_in_work_items.tolist() == [False, True, False]
    assert kc.block_m.tolist() == [-1, -1, 128] and kc.causal.tolist() == [CAUSAL_UNKNOWN, CAUSAL_UNKNOWN, CAUSAL_YES]
