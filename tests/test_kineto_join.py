"""The kernel -> CPU operator join of probes.trace_joins, read a block at a time: the same
links whatever the block size, checked against plain per-record definitions on generated
operator trees and against the real shared traces."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ridgeline.probes import events as ev
from ridgeline.probes import trace_joins
from ridgeline.probes.kineto import load_trace
from ridgeline.probes.trace_joins import kernel_cpu_op_index

A100 = "nvidia-training/hta_a100_rank0_training.json.gz"     # links by containment
H100 = "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz"


def _tree(rng, lo, hi, depth, out):
    """Properly nested operators in [lo, hi]: children may start with their parent, end
    with it, or repeat it exactly (all seen in Kineto files)."""
    t = lo
    while t < hi and depth < 6:
        s = int(t + rng.integers(0, 3))
        e = int(min(hi, s + rng.integers(0, max(1, (hi - lo) // 2) + 1)))
        if s > hi:
            break
        out.append((s, e))
        if rng.random() < 0.15:
            out.append((s, e))                       # an exact repeat: the later row is inner
        if e > s:
            _tree(rng, s, e, depth + 1, out)
        t = e + int(rng.integers(0, 3))


def _ops(rng, order):
    rows = []
    for pid, tid in ((1, 1), (1, 2), (2, -7)):
        iv = []
        _tree(rng, 0, 400, 0, iv)
        rows += [(s, e, pid, tid) for s, e in iv]
    ops = ev.empty(ev.CPU_OP_DTYPE, len(rows))
    for f, col in zip(("start_ns", "end_ns", "pid", "tid"), zip(*rows)):
        ops[f] = col
    if order == "file":                              # start order, ties not longer-first
        o = np.lexsort((rng.random(len(ops)), ops["start_ns"]))
    elif order == "stack":
        o = np.lexsort((-ops["end_ns"], ops["start_ns"]))
    else:
        o = rng.permutation(len(ops))
    return ops[o]


def _innermost(ops, pid, tid, t):
    """Definition: of the operators on the thread containing t, the latest-starting, then
    the shortest, then the later row (an exact repeat is nested in the earlier one)."""
    best, key = -1, None
    for i, (s, e, p, q) in enumerate(zip(ops["start_ns"].tolist(), ops["end_ns"].tolist(),
                                         ops["pid"].tolist(), ops["tid"].tolist())):
        if p == pid and q == tid and s <= t <= e and (key is None or (s, -e, i) > key):
            best, key = i, (s, -e, i)
    return best


@pytest.mark.parametrize("order", ["file", "stack", "shuffled"])
@pytest.mark.parametrize("rows", [1, 3, 16, 1 << 18])
def test_enclosing_in_blocks_is_the_innermost_operator(monkeypatch, order, rows):
    monkeypatch.setattr(trace_joins, "JOIN_ROWS", rows)
    rng = np.random.default_rng(rows * 7 + len(order))
    for _ in range(4):
        ops = _ops(rng, order)
        n = 300
        pid = np.array([1, 1, 2, 3])[rng.integers(0, 4, n)].astype(np.int32)
        tid = np.where(pid == 2, -7, rng.integers(1, 3, n)).astype(np.int32)
        t = rng.integers(-5, 420, n).astype(np.int64)
        got = trace_joins._enclosing(ops, pid, tid, t)
        want = [_innermost(ops, p, q, x) for p, q, x in zip(pid.tolist(), tid.tolist(), t.tolist())]
        assert got.tolist() == want


@pytest.mark.parametrize("rows", [1, 4, 1 << 18])
def test_first_row_and_last_starting_in_blocks(monkeypatch, rows):
    monkeypatch.setattr(trace_joins, "JOIN_ROWS", rows)
    values = np.array([5, 3, 5, 9, -1, 3, 5, 7, 3], dtype=np.int64)
    start = np.array([10, 4, 30, 1, 0, 4, 30, 2, 1], dtype=np.int64)
    keys = np.array([-1, 3, 4, 5, 9], dtype=np.int64)
    assert trace_joins._first_row(keys, values).tolist() == [4, 1, -1, 0, 3]
    # 3: rows 1 and 5 both start at 4, the later wins; 5: rows 2 and 6 start at 30
    assert trace_joins._last_starting(keys, values, start).tolist() == [4, 5, -1, 6, 3]
    assert trace_joins._first_row(keys[:0], values).tolist() == []


@pytest.mark.parametrize("rows", [2, 1 << 18])
def test_api_for_is_the_first_record_with_the_correlation(monkeypatch, rows):
    monkeypatch.setattr(trace_joins, "JOIN_ROWS", rows)
    api = ev.empty(ev.API_DTYPE, 6)
    api["correlation_id"] = [8, 3, -1, 8, 5, 3]
    pos, hit = trace_joins._api_for(np.array([3, 8, 8, 4, -1, 5], dtype=np.int64), api)
    assert hit.tolist() == [True, True, True, False, False, True]
    assert pos[hit].tolist() == [1, 0, 0, 4]


@pytest.mark.parametrize("name", [A100, H100])
def test_real_trace_links_do_not_depend_on_the_block(monkeypatch, name, trace_path):
    trace = load_trace(trace_path(name))
    whole = kernel_cpu_op_index(trace)
    assert (whole >= 0).sum() > 1000
    monkeypatch.setattr(trace_joins, "JOIN_ROWS", 97)
    fresh = dataclasses.replace(trace)          # the same arrays without the memo: computed again
    assert fresh.cpu_op_join is None
    assert kernel_cpu_op_index(fresh).tolist() == whole.tolist()
