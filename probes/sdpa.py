"""The causal flag of PyTorch's scaled-dot-product-attention operators, from their arguments.

Kineto records a CPU operator's scalar arguments in ``args["Concrete Inputs"]`` (one string per
input, "" for tensors and None) and each input's type in ``args["Input type"]`` ("" for None).
Which input is ``is_causal``, and which is the attention mask, is fixed by each operator's
schema in PyTorch's ``aten/src/ATen/native/native_functions.yaml``; the positions below are
those of the schemas there (and of real MI300X and H100 traces: see tests/test_sdpa.py).

A flag is only as good as what it excludes: ``is_causal=False`` says "not causal" only when no
mask is passed. Hugging Face decoders pass ``is_causal=False`` with an explicit 4-D causal
mask (transformers' ``sdpa_attention_forward`` sets ``is_causal`` only when the mask is None),
so a False flag next to a mask is unknown, not non-causal.
"""
from __future__ import annotations

CAUSAL_FLAG_UNKNOWN, CAUSAL_FLAG_NO, CAUSAL_FLAG_YES = -1, 0, 1

# operator -> (position of is_causal, position of the mask / bias input or -1 when the
# schema takes none, True when the flag is _efficient_attention_forward's int
# custom_mask_type: 0 none, 1 causal from the top left, 2 causal from the bottom right).
_SCHEMA: dict[str, tuple[int, int, bool]] = {
    # scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p, is_causal, *, scale, enable_gqa)
    "aten::scaled_dot_product_attention": (5, 3, False),
    # _scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, return_debug_mask, *, scale)
    "aten::_scaled_dot_product_flash_attention": (4, -1, False),
    # _scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, *, attn_mask, scale)
    "aten::_scaled_dot_product_flash_attention_for_cpu": (4, 5, False),
    # _scaled_dot_product_efficient_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale)
    "aten::_scaled_dot_product_efficient_attention": (6, 3, False),
    # _scaled_dot_product_cudnn_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, ...)
    "aten::_scaled_dot_product_cudnn_attention": (6, 3, False),
    # _scaled_dot_product_fused_attention_overrideable(query, key, value, attn_bias, dropout_p, is_causal, ...)
    "aten::_scaled_dot_product_fused_attention_overrideable": (5, 3, False),
    # _flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, ...)
    "aten::_flash_attention_forward": (8, -1, False),
    # _efficient_attention_forward(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    #                              max_seqlen_k, dropout_p, custom_mask_type, ...)
    "aten::_efficient_attention_forward": (9, 3, True),
    # _cudnn_attention_forward(query, key, value, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
    #                          compute_log_sumexp, dropout_p, is_causal, ...)
    "aten::_cudnn_attention_forward": (10, 3, False),
}
SDPA_OPS = frozenset(_SCHEMA)


def causal_flag(op_name: str, concrete_inputs, input_types) -> int:
    """CAUSAL_FLAG_YES / _NO / _UNKNOWN of one CPU operator from its recorded arguments.

    ``concrete_inputs`` and ``input_types``: the decoded ``Concrete Inputs`` and ``Input
    type`` lists (anything else, e.g. None when absent, counts as not recorded). Unknown
    for operators outside :data:`SDPA_OPS`, for a list too short or a value that is not a
    boolean (an int for custom_mask_type), and for a False flag with a mask passed (or a
    mask whose presence was not recorded).
    """
    schema = _SCHEMA.get(op_name)
    if schema is None or not isinstance(concrete_inputs, list):
        return CAUSAL_FLAG_UNKNOWN
    at, mask_at, mask_type = schema
    if len(concrete_inputs) <= at:
        return CAUSAL_FLAG_UNKNOWN
    v = concrete_inputs[at]
    if mask_type:
        causal = {"0": False, "1": True, "2": True}.get(v)
    else:
        causal = {"True": True, "False": False}.get(v)
    if causal is None:
        return CAUSAL_FLAG_UNKNOWN
    if causal:
        return CAUSAL_FLAG_YES
    if mask_at < 0:
        return CAUSAL_FLAG_NO
    # None is recorded with an empty type; a tensor with its dtype.
    if not isinstance(input_types, list) or len(input_types) <= mask_at or input_types[mask_at] != "":
        return CAUSAL_FLAG_UNKNOWN
    return CAUSAL_FLAG_NO
