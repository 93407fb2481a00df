"""trace_joins.join_launch_threads moves pid and tid as one 8-byte value where the layouts
put them side by side: the same pid/tid as the field-by-field join (``_pid_tid`` None) on
literals (a repeated correlation id: the first record wins; a negative id and a missing one:
both MISSING; a negative tid and an int32-wide pid: the halves do not mix) and on the kernels
and copies of the shared A100 training trace, whose API records are not in correlation order."""

import numpy as np

from ridgeline.probes import trace_joins
from ridgeline.probes.events import API_DTYPE, COPY_DTYPE, KERNEL_DTYPE, MISSING, empty


def _joined(api, *targets, pairs: bool, monkeypatch):
    out = [t.copy() for t in targets]
    with monkeypatch.context() as m:
        if not pairs:
            m.setattr(trace_joins, "_pid_tid", lambda a: None)
        trace_joins.join_launch_threads(api, *out)
    return out


def test_literals_pairs_and_fields_agree(monkeypatch):
    api = empty(API_DTYPE, 5)
    api["correlation_id"] = [30, 10, 20, 10, -4]
    api["pid"] = [7, 2**31 - 1, 9, 5, 6]
    api["tid"] = [-3, 11, 2**31 - 2, 12, 13]
    k = empty(KERNEL_DTYPE, 6)
    k["correlation_id"] = [10, 20, 30, 99, -4, 10]
    c = empty(COPY_DTYPE, 2)
    c["correlation_id"] = [20, 5]
    got = _joined(api, k, c, pairs=True, monkeypatch=monkeypatch)
    ref = _joined(api, k, c, pairs=False, monkeypatch=monkeypatch)
    assert list(zip(got[0]["pid"].tolist(), got[0]["tid"].tolist())) == [
        (2**31 - 1, 11), (9, 2**31 - 2), (7, -3), (MISSING, MISSING), (MISSING, MISSING), (2**31 - 1, 11)]
    assert list(zip(got[1]["pid"].tolist(), got[1]["tid"].tolist())) == [(9, 2**31 - 2), (MISSING, MISSING)]
    for g, r in zip(got, ref):
        assert np.array_equal(g, r)       # every field, not only pid/tid


def test_shared_a100_trace_pairs_and_fields_agree(trace_path, monkeypatch):
    from ridgeline.probes.kineto import load_trace
    t = load_trace(trace_path("nvidia-training/hta_a100_rank0_training.json.gz"))
    corr = t.api["correlation_id"]
    assert (np.diff(corr) < 0).any()                # the sorted branch is the one taken
    k, c = t.kernels.copy(), t.copies.copy()
    for x in (k, c):
        x["pid"], x["tid"] = 123, 456               # overwritten by both joins
    got = _joined(t.api, k, c, pairs=True, monkeypatch=monkeypatch)
    ref = _joined(t.api, k, c, pairs=False, monkeypatch=monkeypatch)
    for g, r in zip(got, ref):
        assert np.array_equal(g, r)
    assert np.array_equal(got[0]["tid"], t.kernels["tid"])     # and the loader's own join
    assert (got[0]["tid"] >= 0).any() and (got[0]["tid"] == MISSING).any()
