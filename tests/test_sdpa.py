"""The causal flag of PyTorch's SDPA operators (probes.sdpa) and its column in the readers.

The literals are the ``Concrete Inputs`` and ``Input type`` lists Kineto recorded on real
traces (third-party, not in the project: tests/THIRD_PARTY.md): the MI300X BERT encoder
(is_causal False, no mask), the MI300X xDiT SD3.5 pipeline (CLIP text towers: True; MMDiT
joint attention, compiled, calling aten::_scaled_dot_product_flash_attention directly: False)
and the H100 HF Qwen1.5 forward (True). Positions are those of the schemas in PyTorch's
native_functions.yaml.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import third_party

from ridgeline.probes import kineto_scan, kineto_typed
from ridgeline.probes.kineto_dicts import load_trace_via_dicts
from ridgeline.probes.sdpa import CAUSAL_FLAG_NO, CAUSAL_FLAG_UNKNOWN, CAUSAL_FLAG_YES, causal_flag

BF16 = "c10::BFloat16"


def test_bert_encoder_flags_are_false_without_a_mask():
    assert causal_flag("aten::scaled_dot_product_attention", ["", "", "", "", "0.", "False", "", "False"],
                       [BF16, BF16, BF16, "", "Scalar", "Scalar", "", "Scalar"]) == CAUSAL_FLAG_NO
    assert causal_flag("aten::_scaled_dot_product_flash_attention", ["", "", "", "0.", "False", "False", "0.125"],
                       [BF16, BF16, BF16, "Scalar", "Scalar", "Scalar", "Scalar"]) == CAUSAL_FLAG_NO
    assert causal_flag("aten::_flash_attention_forward",
                       ["", "", "", "", "", "141", "141", "0.", "False", "False", "0.125", "", "", "", ""],
                       [BF16, BF16, BF16, "", "", "Scalar", "Scalar", "Scalar", "Scalar", "Scalar", "Scalar",
                        "", "", "", ""]) == CAUSAL_FLAG_NO


def test_causal_flags_are_true():
    assert causal_flag("aten::scaled_dot_product_attention", ["", "", "", "", "0.", "True", "0.125", "False"],
                       [BF16, BF16, BF16, "", "Scalar", "Scalar", "Scalar", "Scalar"]) == CAUSAL_FLAG_YES
    assert causal_flag("aten::_flash_attention_forward",
                       ["", "", "", "", "", "559", "559", "0.", "True", "False", "0.125", "", "", "", ""],
                       None) == CAUSAL_FLAG_YES
    # _efficient_attention_forward: custom_mask_type 1 / 2 is causal (top left / bottom right)
    ci = ["", "", "", "", "", "", "", "", "0.", "2", "False", ""]
    assert causal_flag("aten::_efficient_attention_forward", ci, None) == CAUSAL_FLAG_YES


def test_false_with_a_mask_is_unknown():
    """HF decoders pass is_causal=False with an explicit 4-D causal mask: no evidence of
    non-causal attention. A tensor input is recorded with its dtype, None with ""."""
    ci = ["", "", "", "", "0.", "False", "", "False"]
    assert causal_flag("aten::scaled_dot_product_attention", ci,
                       [BF16, BF16, BF16, BF16, "Scalar", "Scalar", "", "Scalar"]) == CAUSAL_FLAG_UNKNOWN
    assert causal_flag("aten::scaled_dot_product_attention", ci, None) == CAUSAL_FLAG_UNKNOWN
    assert causal_flag("aten::_scaled_dot_product_efficient_attention", ["", "", "", "", "True", "0.", "False", ""],
                       [BF16, BF16, BF16, "bool", "Scalar", "Scalar", "Scalar", ""]) == CAUSAL_FLAG_UNKNOWN
    assert causal_flag("aten::_efficient_attention_forward", ["", "", "", "", "", "", "", "", "0.", "0", "False", ""],
                       [BF16, BF16, BF16, BF16, "", "", "", "", "Scalar", "Scalar", "Scalar", ""]) == CAUSAL_FLAG_UNKNOWN


def test_other_ops_and_malformed_inputs_are_unknown():
    assert causal_flag("aten::linear", ["", "", "", "True", "False", "False"], None) == CAUSAL_FLAG_UNKNOWN
    assert causal_flag("aten::_scaled_dot_product_flash_attention", ["", "", ""], None) == CAUSAL_FLAG_UNKNOWN
    assert causal_flag("aten::_scaled_dot_product_flash_attention", "nope", None) == CAUSAL_FLAG_UNKNOWN
    assert causal_flag("aten::_scaled_dot_product_flash_attention", ["", "", "", "0.", "1", "False"],
                       None) == CAUSAL_FLAG_UNKNOWN


@pytest.mark.parametrize("name, counts", [
    ("tracelens_mi300_bert_small_fill_mask.json.gz", {0: 12}),
    ("tracelens_mi300_xdit_sd35_diffusion_transformer.json.gz", {0: 307, 1: 264}),
])
def test_three_readers_give_the_same_column(name, counts):
    p = third_party("traces/" + name)
    ref = load_trace_via_dicts(p)
    scanned = kineto_scan.load(Path(p), 1 << 20, False)
    typed = kineto_typed.load(p)
    for t in (scanned, typed):
        assert np.array_equal(t.cpu_ops["is_causal"], ref.cpu_ops["is_causal"])
    flags, n = np.unique(ref.cpu_ops["is_causal"], return_counts=True)
    got = dict(zip(flags.tolist(), n.tolist()))
    got.pop(CAUSAL_FLAG_UNKNOWN)
    assert got == counts
    # only SDPA operators carry a flag
    named = set(ref.names.names_of(ref.cpu_ops["name_id"][ref.cpu_ops["is_causal"] >= 0]))
    assert named <= {"aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
                     "aten::_flash_attention_forward"}
