"""roofline.phase_sums reads its kernels' launch latencies from the analysis' launch join
(roofline.launch_join) instead of joining again: the same latencies as
phase_figures.launch_latency_ns (the live fold's join) on literals that tell the two joins
apart (a correlation id repeated, with and without one launch record per kernel; records
out of correlation order; kernels without a record) and on the six shared traces, and the
same folded sums with and without the join."""

import numpy as np
import pytest
from support.kineto_traces import TRACES

from ridgeline.aggregator import roofline
from ridgeline.aggregator.phase_figures import launch_latency_ns
from ridgeline.probes.events import API_DTYPE, API_GRAPH_LAUNCH, API_LAUNCH, API_SYNC, KERNEL_DTYPE, empty


class _Trace:
    def __init__(self, kernels, api):
        self.kernels, self.api = kernels, api


def _kernels(rows):
    k = empty(KERNEL_DTYPE, len(rows))
    for i, (corr, start) in enumerate(rows):
        k[i]["correlation_id"], k[i]["start_ns"], k[i]["end_ns"] = corr, start, start + 5
    return k


def _api(rows):
    a = empty(API_DTYPE, len(rows))
    for i, (cat, corr, start) in enumerate(rows):
        a[i]["category"], a[i]["correlation_id"], a[i]["start_ns"], a[i]["end_ns"] = cat, corr, start, start + 3
    return a


def _both(k, a):
    t = _Trace(k, a)
    return roofline._kernel_launch_latency_ns(t, roofline.launch_join(t)), launch_latency_ns(k, a)


def test_repeated_correlation_with_one_record_per_kernel_pairs_as_the_live_fold():
    # Two launch records share correlation id 7 and there is one per kernel: the live fold
    # pairs kernel i with record i (latencies 10 and 10); the analysis' join would give the
    # second kernel the first record (20): the fold's answer must win.
    k = _kernels([(7, 110), (7, 130)])
    a = _api([(API_LAUNCH, 7, 100), (API_LAUNCH, 7, 120), (API_SYNC, 9, 0)])
    got, ref = _both(k, a)
    assert ref.tolist() == [10, 10]
    np.testing.assert_array_equal(got, ref)


def test_join_path_on_records_out_of_order_and_missing():
    # More kernels than launch records (a graph launch's kernels share its id), records out
    # of correlation order, a kernel with no record (-1), one with a negative id (-1), one
    # starting before its call (0), a repeated id with fewer records than kernels.
    k = _kernels([(3, 50), (1, 20), (5, 70), (5, 90), (2, 5), (8, 99), (-1, 1), (4, 60), (4, 61)])
    a = _api([(API_LAUNCH, 4, 55), (API_GRAPH_LAUNCH, 5, 65), (API_LAUNCH, 1, 10), (API_SYNC, 3, 0),
              (API_LAUNCH, 3, 40), (API_LAUNCH, 2, 8), (API_LAUNCH, 4, 58)])
    got, ref = _both(k, a)
    assert ref.tolist() == [10, 10, 5, 25, 0, -1, -1, 5, 6]
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("name", TRACES)
def test_shared_traces_same_latencies_and_sums(name, trace_path):
    from ridgeline.aggregator.phases import map_phases
    from ridgeline.aggregator.work import kernel_work_from_shapes
    from ridgeline.probes.kineto import load_trace
    t = load_trace(trace_path(name))
    if not len(t.kernels):
        pytest.skip("no kernels")
    join = roofline.launch_join(t)
    np.testing.assert_array_equal(roofline._kernel_launch_latency_ns(t, join), launch_latency_ns(t.kernels, t.api))
    pm = map_phases(t)
    args = (t, np.asarray(pm.kernel_phase), list(pm.steps), kernel_work_from_shapes(t))
    a = roofline.phase_sums(*args, kernel_step=np.asarray(pm.kernel_step), join=join)
    b = roofline.phase_sums(*args, kernel_step=np.asarray(pm.kernel_step))
    assert len(a)
    for f in ("keys", "ints", "floats", "hists", "dtype_flops"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
