"""The step time a batch would take by the roofline model: the request join's baseline when
a window has no measured steps without culprits (``request_join.join``'s
``estimate_step_ns``; its stories then say ``roofline_estimate``).

:func:`step_time_estimator(shape, ceilings)` returns ``f(decode_members, context_tokens,
prefill_tokens) -> ns`` (numpy arrays in, array out): the larger of the step's bytes over
the GPU's HBM bandwidth and its FLOPs over the dense peak of the model's dtype. Bytes: the
weights once per step (batched tokens share one read), the KV cache read of every decoding
sequence's context, the KV written for every new token. FLOPs: every token through the
linear layers (:meth:`ModelShape.linear_flops_per_token`), the attention scores of the
decode contexts and of the prefill chunks (causal: T(T+1)/2 pairs for a chunk of T, the
step's prefill tokens taken as one chunk). A model and a ceiling, nothing measured: the
join scales it to the measured step time and uses only the ratio with and without the
culprits.
"""
from __future__ import annotations

import numpy as np


def step_time_estimator(shape, ceil):
    bw = float(ceil.hbm_bytes_per_s)
    peak, _dtype = ceil.peak_flops_per_s(shape.ceiling_dtype)
    w_bytes = float(shape.weight_bytes)
    kv_tok = float(shape.kv_bytes_per_token)
    lin = float(shape.linear_flops_per_token())

    def estimate(decode_members, context_tokens, prefill_tokens):
        n = np.asarray(decode_members, dtype=np.float64)
        ctx = np.asarray(context_tokens, dtype=np.float64)
        pf = np.asarray(prefill_tokens, dtype=np.float64)
        tokens = n + pf
        bytes_ = np.where(tokens > 0, w_bytes, 0.0) + kv_tok * (ctx + tokens)
        flops = tokens * lin + shape.attention_flops(ctx + pf * (pf + 1) / 2.0)
        return np.maximum(bytes_ / bw, flops / peak) * 1e9

    return estimate
