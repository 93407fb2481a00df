"""A judgement's ``thresholds`` record is made once per thresholds (aggregator.verdict
``_thresholds_record``; asdict's recursive copy was redone for every GPU every window):
it is still asdict's record of the thresholds judged with, and each judgement gets its
own dict (a consumer that edits one does not change the next)."""
from __future__ import annotations

from dataclasses import asdict, replace

from ridgeline.aggregator import verdict as v


def test_thresholds_record_is_asdicts_and_each_judgement_owns_its_copy():
    inp = v.VerdictInputs(window_ns=1_000_000_000)
    first = v.judge(inp)
    assert first["thresholds"] == asdict(v.DEFAULT_THRESHOLDS)
    first["thresholds"]["kv_watermark_ratio"] = -1.0
    assert v.judge(inp)["thresholds"] == asdict(v.DEFAULT_THRESHOLDS)
    other = replace(v.DEFAULT_THRESHOLDS, kv_watermark_ratio=0.5, max_num_seqs=64)
    got = v.judge(inp, other)["thresholds"]
    assert got == asdict(other) and got["kv_watermark_ratio"] == 0.5 and got["max_num_seqs"] == 64
