"""Work (FLOPs, bytes) from operator shapes and from the analytic model."""
import numpy as np
import orjson
import pytest

from ridgeline.aggregator import model_config, work
from ridgeline.probes.events import CPU_OP_DTYPE, KERNEL_DTYPE, NameTable, Trace, empty

BF16 = "c10::BFloat16"


def test_mm_is_2mnk():
    f, b, dt, cat, _ = work.op_work("aten::mm", [[8944, 1024], [1024, 2816]], [BF16, BF16])
    assert f == 2 * 8944 * 1024 * 2816
    assert b == 2 * (8944 * 1024 + 1024 * 2816 + 8944 * 2816)
    assert (dt, cat) == ("bf16", work.CAT_GEMM)


def test_addmm_linear_bmm_baddbmm_matmul():
    f, b, *_ = work.op_work("aten::addmm", [[1024], [8944, 1024], [1024, 1024], [], []],
                            [BF16, BF16, BF16, "Scalar", "Scalar"])
    assert f == 2 * 8944 * 1024 * 1024
    assert b == 2 * (8944 * 1024 + 1024 * 1024 + 8944 * 1024 + 1024)
    f, *_ = work.op_work("aten::linear", [[16, 559, 1024], [2816, 1024], []], [BF16, BF16, ""])
    assert f == 2 * 16 * 559 * 1024 * 2816
    f, *_ = work.op_work("aten::bmm", [[4, 32, 64], [4, 64, 16]], ["float", "float"])
    assert f == 2 * 4 * 32 * 64 * 16
    f, b, dt, _, _ = work.op_work("aten::baddbmm", [[4, 32, 16], [4, 32, 64], [4, 64, 16], [], []],
                                  ["float", "float", "float", "Scalar", "Scalar"])
    assert f == 2 * 4 * 32 * 64 * 16 and dt == "fp32"
    f, *_ = work.op_work("aten::matmul", [[2, 3, 5], [5, 7]], [BF16, BF16])
    assert f == 2 * 2 * 3 * 5 * 7
    # Mismatched inner dimensions: no figure rather than a wrong one.
    assert work.op_work("aten::mm", [[4, 5], [6, 7]], [BF16, BF16]) is None


def test_attention_flash_layout_causal():
    q = [16, 559, 16, 64]            # _flash_attention_forward: [batch, seq, heads, dim]
    f, b, dt, cat, note = work.op_work("aten::_flash_attention_forward", [q, q, q, [], []],
                                       [BF16, BF16, BF16, "", ""])
    pairs = 559 * 560 / 2
    assert f == pytest.approx(2 * 16 * 16 * pairs * (64 + 64))
    assert b == 2 * 4 * 16 * 559 * 16 * 64
    assert cat == work.CAT_ATTENTION and "causal" in note
    # SDPA decode: [b, h, 1, d] against [b, h, 1000, d]: full, not causal.
    f, *_ = work.op_work("aten::scaled_dot_product_attention",
                         [[2, 8, 1, 128], [2, 8, 1000, 128], [2, 8, 1000, 128]], [BF16] * 3)
    assert f == 2 * 2 * 8 * 1000 * 256
    # Packed variable-length inputs need sequence lengths the trace lacks.
    assert work.op_work("aten::_flash_attention_forward", [[100, 8, 64]] * 3, [BF16] * 3) is None


def test_elementwise_copy_reduction_bytes():
    f, b, *_ = work.op_work("aten::mul", [[16, 559, 1024], [16, 559, 1024]], [BF16, BF16])
    n = 16 * 559 * 1024
    assert (f, b) == (n, 3 * 2 * n)             # two reads and one write
    _, b, *_ = work.op_work("aten::mul", [[16, 559, 1024], []], [BF16, "Scalar"])
    assert b == 2 * 2 * n                       # scalar operand costs nothing
    _, b, *_ = work.op_work("aten::copy_", [[10, 10], [10, 10], []], ["float", BF16, "Scalar"])
    assert b == 10 * 10 * 4 + 10 * 10 * 2
    f, b, *_ = work.op_work("aten::mean", [[16, 559, 1024], [], [], []], ["float", "ScalarList", "Scalar", ""])
    assert (f, b) == (n, 4 * n)
    f, b, *_ = work.op_work("aten::silu", [[8, 2816]], [BF16])
    assert b == 2 * 2 * 8 * 2816


def test_unmodelled_or_shapeless_ops_have_no_figure():
    assert work.op_work("vllm::moe_forward", [[888, 2880], [888, 128], []], [BF16, BF16, ""]) is None
    assert work.op_work("aten::cat", [[[1, 559, 32], [1, 559, 32]], []], ["TensorList", "Scalar"]) is None
    assert work.op_work("aten::mm", [[], []], ["", ""]) is None


def _trace_with_ops(ops, kernels):
    names = NameTable()
    k = empty(KERNEL_DTYPE, len(kernels))
    for i, (start, end, ext) in enumerate(kernels):
        k[i]["start_ns"], k[i]["end_ns"], k[i]["external_id"] = start, end, ext
        k[i]["name_id"] = names.intern(f"kernel{i}")
        k[i]["device"] = 0
    c = empty(CPU_OP_DTYPE, len(ops))
    for i, (name, ext, dims, types) in enumerate(ops):
        c[i]["name_id"] = names.intern(name)
        c[i]["external_id"] = ext
        c[i]["start_ns"], c[i]["end_ns"] = 0, 1
        c[i]["input_dims_id"] = names.intern(orjson.dumps(dims).decode())
        c[i]["input_types_id"] = names.intern(orjson.dumps(types).decode())
    return Trace(kernels=k, cpu_ops=c, names=names)


def test_kernel_work_split_over_an_ops_kernels_by_duration():
    mm = ("aten::mm", 7, [[64, 128], [128, 256]], [BF16, BF16])
    unk = ("my::custom", 8, [[4]], [BF16])
    t = _trace_with_ops([mm, unk], [(0, 300, 7), (300, 400, 7), (400, 500, 8), (500, 600, -1)])
    w = work.kernel_work_from_shapes(t)
    total = 2 * 64 * 128 * 256
    assert w.flops[0] == pytest.approx(0.75 * total)
    assert w.flops[1] == pytest.approx(0.25 * total)
    assert np.isnan(w.flops[2]) and np.isnan(w.flops[3])        # unmodelled op, no op
    assert w.known.tolist() == [True, True, False, False]
    assert work.DTYPE_KEYS[w.dtype_code[0]] == "bf16"


def test_kernel_work_without_shapes_is_all_unknown():
    t = _trace_with_ops([], [(0, 10, 1)])
    w = work.kernel_work_from_shapes(t)
    assert np.isnan(w.flops).all() and w.notes


def test_decode_step_from_model_is_weights_plus_kv():
    m = model_config.builtin("llama-3-8b")
    batch, ctx = 32, 1000
    w = work.step_work_from_model(m, 0, batch, context_len=ctx)
    assert w.source == "model"
    assert w.parts["weight_bytes"] == pytest.approx(m.weight_bytes_read(batch))
    # Dense model: every weight but the embedding table is read once per step.
    assert w.parts["weight_bytes"] == pytest.approx(
        m.weight_bytes - m.embedding_params * 2 + batch * m.hidden_size * 2)
    assert w.parts["kv_read_bytes"] == batch * ctx * m.kv_bytes_per_token
    assert w.parts["kv_write_bytes"] == batch * m.kv_bytes_per_token
    assert w.bytes == pytest.approx(w.parts["weight_bytes"] + w.parts["kv_read_bytes"]
                                    + w.parts["kv_write_bytes"] + w.parts["activation_bytes"])
    assert w.parts["linear_flops"] == batch * m.linear_flops_per_token()
    assert w.parts["attention_flops"] == 4 * 32 * 32 * 128 * batch * ctx
    assert w.parts["lm_head_flops"] == batch * 2 * m.vocab_size * m.hidden_size
    # Decode intensity is low: memory-bound territory on any GPU (ridge > 100).
    assert w.flops / w.bytes < 100


def test_model_step_without_lengths_says_what_is_left_out():
    m = model_config.builtin("qwen1.5-0.5b")
    w = work.step_work_from_model(m, 8944, None)
    assert w.parts["attention_flops"] == 0
    assert any("attention" in n for n in w.notes)
    assert work.step_work_from_model(m, None, None) is None
    assert work.step_work_from_model(m, 0, 0) is None


def test_triton_fused_counts_arguments_and_caps_lookup_tables():
    # Real nano-vllm kernel: q [3,16,128], positions [3], cos/sin cache [40960,1,128], out.
    f, b, _, cat, _ = work.op_work("triton_poi_fused__to_copy_cat_0",
                                   [[3, 16, 128], [3], [40960, 1, 128], [3, 16, 128], [], [], []],
                                   [BF16, "long int", "float", BF16, "", "", ""])
    n = 3 * 16 * 128
    assert cat == work.CAT_FUSED and f == n
    assert b == 2 * n + 8 * 3 + 4 * n + 2 * n     # the cache counts as one output's worth
    _, b, *_ = work.op_work("triton_poi_fused_mul_silu_0", [[3, 6144], [3, 3072]], [BF16, BF16])
    assert b == 2 * (3 * 6144 + 3 * 3072)
