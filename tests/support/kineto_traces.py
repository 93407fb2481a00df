"""The shared Kineto traces the readers are checked on, and how two readings are compared
(tests/test_kineto.py, tests/test_kineto_typed.py, tests/test_analysis.py).
"""
from __future__ import annotations

import numpy as np

TRACES = [
    "nvidia-inference/nanovllm_rtx4080laptop_decode_step0_fragment.json.gz",
    "nvidia-inference/nanovllm_rtx4080laptop_decode_step100_fragment.json.gz",
    "nvidia-inference/tracelens_b200_vllm_gptoss_tp8_prefill888.json.gz",
    "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz",
    "nvidia-training/hta_a100_alexnet_benchmark.json.gz",
    "nvidia-training/hta_a100_rank0_training.json.gz",
]


_NAME_FIELDS = ("name_id", "input_dims_id", "input_types_id")


def same_events(a, b):
    """Two traces hold the same events (names compared as strings, not ids)."""
    for kind in ("kernels", "copies", "api", "ranges", "cpu_ops"):
        x, y = getattr(a, kind), getattr(b, kind)
        assert len(x) == len(y), kind
        for f in x.dtype.names:
            if f in _NAME_FIELDS:
                assert a.names.names_of(x[f]) == b.names.names_of(y[f]), f"{kind}.{f}"
            else:
                assert np.array_equal(x[f], y[f]), f"{kind}.{f}"
    drop = ("source_path",)
    assert {k: v for k, v in a.meta.items() if k not in drop} == \
        {k: v for k, v in b.meta.items() if k not in drop}
