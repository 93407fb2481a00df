"""aggregator.steps joins, and the memoised kernel -> CPU operator index they use (probes.trace_joins)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ridgeline.probes import trace_joins
from ridgeline.probes.events import API_DTYPE, API_LAUNCH, CPU_OP_DTYPE, KERNEL_DTYPE, NameTable, Trace, empty
from ridgeline.probes.trace_joins import kernel_cpu_op_index


def _trace() -> Trace:
    """Three kernels: two linked by External id to ops 1 and 0, one to no op (its launch
    has no External id and no operator on its thread encloses it)."""
    names = NameTable()
    k = empty(KERNEL_DTYPE, 3)
    k["start_ns"] = [100, 200, 300]
    k["end_ns"] = k["start_ns"] + 10
    k["correlation_id"] = [1, 2, 3]
    k["external_id"] = [11, 10, 99]
    k["name_id"] = names.intern("k")
    a = empty(API_DTYPE, 3)
    a["start_ns"] = [90, 190, 290]
    a["end_ns"] = a["start_ns"] + 5
    a["correlation_id"] = [1, 2, 3]
    a["category"] = API_LAUNCH
    a["tid"] = [0, 0, 7]                   # the third launch: on a thread without operators
    ops = empty(CPU_OP_DTYPE, 2)
    ops["start_ns"] = [0, 50]
    ops["end_ns"] = [1000, 250]
    ops["external_id"] = [10, 11]
    ops["name_id"] = [names.intern("aten::mm"), names.intern("aten::addmm")]
    return Trace(kernels=k, api=a, cpu_ops=ops, names=names)


def test_cpu_op_index_is_the_importer_join():
    tr = _trace()
    assert kernel_cpu_op_index(tr).tolist() == trace_joins._computed(tr).tolist() == [1, 0, -1]


def test_cpu_op_index_is_computed_once_and_read_only():
    tr = _trace()
    first = kernel_cpu_op_index(tr)
    assert kernel_cpu_op_index(tr) is first
    assert tr.cpu_op_join.index is first
    with pytest.raises(ValueError):
        first[0] = 5


def test_cpu_op_index_recomputed_when_an_array_is_replaced():
    tr = _trace()
    before = kernel_cpu_op_index(tr)
    ops = tr.cpu_ops.copy()
    ops["external_id"] = [11, 10]          # swap the operators' ids
    tr.cpu_ops = ops
    after = kernel_cpu_op_index(tr)
    assert after is not before
    assert after.tolist() == [0, 1, -1]
    # A derived trace (new object) never sees the original's cache.
    k = tr.kernels.copy()
    k["external_id"] = [-1, -1, -1]
    derived = dataclasses.replace(tr, kernels=k)
    assert derived.cpu_op_join is None
    assert kernel_cpu_op_index(derived).tolist() == trace_joins._computed(derived).tolist()
    assert np.array_equal(kernel_cpu_op_index(tr), after)


def test_argmax_in_ranges_is_the_first_maximum_of_each_slice():
    from ridgeline.aggregator.steps import _argmax_in_ranges
    rng = np.random.default_rng(3)
    values = rng.integers(0, 5, 300)                    # many ties: the first maximum wins
    lo = rng.integers(0, 290, 80)
    hi = lo + rng.integers(1, 10, 80)                   # overlapping and nested ranges
    want = [a + int(np.argmax(values[a:b])) for a, b in zip(lo.tolist(), hi.tolist())]
    assert _argmax_in_ranges(values, lo, hi).tolist() == want
    # Ranges laid end to end far longer than the values: the per-slice path, same answer.
    lo2, hi2 = np.zeros(20, dtype=np.int64), np.full(20, 300)
    assert _argmax_in_ranges(values, lo2, hi2).tolist() == [int(np.argmax(values))] * 20
    assert _argmax_in_ranges(values, lo[:0], hi[:0]).tolist() == []


def test_launch_index_with_correlation_ids_in_and_out_of_order():
    from ridgeline.aggregator.steps import launch_index
    tr = _trace()
    assert launch_index(tr).tolist() == [0, 1, 2]
    a = tr.api[[2, 0, 1]]                     # two threads interleave: ids out of order
    tr2 = dataclasses.replace(tr, api=a)
    assert launch_index(tr2).tolist() == [1, 2, 0]
    k = tr.kernels.copy()
    k["correlation_id"] = [3, 42, -1]         # no launch record / no id
    assert launch_index(dataclasses.replace(tr2, kernels=k)).tolist() == [0, -1, -1]


def test_analysis_computes_the_cpu_op_join_once(monkeypatch):
    """map_phases and the shape-based work model share one kernel -> CPU op join."""
    from ridgeline.aggregator.analysis import analyze_trace
    calls = []
    original = trace_joins._computed

    def counting(trace):
        calls.append(1)
        return original(trace)

    # The join itself is counted: it has one caller, the memoising kernel_cpu_op_index.
    monkeypatch.setattr(trace_joins, "_computed", counting)
    tr = _trace()
    tr.cpu_ops["input_dims_id"] = tr.names.intern("[[16, 1024], [1024, 1024]]")   # GEMM rows need the join
    analyze_trace(tr, gpu="H100 SXM")
    assert len(calls) == 1



def test_optimizer_run_ends_are_the_last_kernel_of_each_run_of_a_loop():
    from ridgeline.aggregator.steps import OPTIMIZER_RUN_GAP, optimizer_run_ends

    flags = np.zeros(40, dtype=bool)
    flags[[3, 5, 6]] = True                                 # one run (other streams interleave)
    assert optimizer_run_ends(flags).tolist() == []         # one optimizer.step() is no loop
    flags[[20, 20 + OPTIMIZER_RUN_GAP, 39]] = True          # 20 and 20 + GAP: one run; 39: a third
    assert optimizer_run_ends(flags).tolist() == [6, 20 + OPTIMIZER_RUN_GAP, 39]
    assert optimizer_run_ends(np.zeros(5, dtype=bool)).tolist() == []
