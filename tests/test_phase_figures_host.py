"""phase_figures.host_intervals on host calls NOT in start order: the native pass
(fold_native.host_unions: rl_host_unions, then one stable sort and rl_union_sorted for a kind
out of order) against a plain-Python union of the literals and against the numpy reference
(``fold_native.REFERENCE``) on random records of several threads and on the shared A100
training trace, whose launch and sync records each step back once (two launching threads:
ranks' main thread and the autograd thread), and on copies of it overlapping in time, as
the shared scale tool's traces (../shared/tools/scale_kineto_trace.py) lay them out."""

import numpy as np
import pytest

from ridgeline.aggregator import fold_native
from ridgeline.aggregator.phase_figures import _LAUNCHING, _SYNCING, host_intervals
from ridgeline.probes.events import API_DTYPE, API_GRAPH_LAUNCH, API_LAUNCH, API_MEMCPY, API_MEMSET, API_SYNC, empty


def _records(rows) -> np.ndarray:
    """API records from (category, start_ns, end_ns) literals, in the order given."""
    a = empty(API_DTYPE, len(rows))
    for i, (cat, s, e) in enumerate(rows):
        a[i]["category"], a[i]["start_ns"], a[i]["end_ns"] = cat, s, e
    return a


def _python_union(pairs) -> tuple[list[int], list[int]]:
    """Closed intervals [s, max(e, s)] merged where they overlap or touch, sorted: the
    definition, one interval at a time."""
    out: list[list[int]] = []
    for s, e in sorted((s, max(e, s)) for s, e in pairs):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [s for s, _ in out], [e for _, e in out]


def _by_kind(a: np.ndarray):
    rows = list(zip(a["category"].tolist(), a["start_ns"].tolist(), a["end_ns"].tolist()))
    return (_python_union([(s, e) for c, s, e in rows if _LAUNCHING[c]]),
            _python_union([(s, e) for c, s, e in rows if _SYNCING[c]]))


def _reference(a: np.ndarray, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(fold_native, "REFERENCE", True)
        return host_intervals(a)


def _same(x, y) -> None:
    for (xs, xe), (ys, ye) in zip(x, y):
        np.testing.assert_array_equal(np.asarray(xs, np.int64), np.asarray(ys, np.int64))
        np.testing.assert_array_equal(np.asarray(xe, np.int64), np.asarray(ye, np.int64))


def test_literals_out_of_order_merge_as_the_definition_says(monkeypatch):
    # Launches stepping back twice: a later call first, one nested in an earlier merge,
    # one touching (end == next start), a negative duration (end before start: a point),
    # and a point inside an interval; sync calls out of order, merging across the step back.
    a = _records([
        (API_LAUNCH, 100, 110), (API_SYNC, 500, 520), (API_LAUNCH, 120, 130),
        (API_LAUNCH, 50, 60),                         # steps back: before everything so far
        (API_MEMCPY, 60, 70),                         # touches [50, 60]
        (API_SYNC, 400, 505),                         # steps back, overlaps [500, 520]
        (API_GRAPH_LAUNCH, 125, 200),                 # overlaps [120, 130]
        (0, 0, 10**9),                                # another call: neither kind
        (API_MEMSET, 300, 250),                       # end before start: the point [300, 300]
        (API_LAUNCH, 140, 150),                       # inside [125, 200]
        (API_LAUNCH, 10, 20), (API_SYNC, 10, 20),
    ])
    (ls, le), (ss, se) = host_intervals(a)
    assert ls.tolist() == [10, 50, 100, 120, 300] and le.tolist() == [20, 70, 110, 200, 300]
    assert ss.tolist() == [10, 400] and se.tolist() == [20, 520]
    _same(((ls, le), (ss, se)), _by_kind(a))
    _same(((ls, le), (ss, se)), _reference(a, monkeypatch))


def test_literals_in_order_keep_one_pass_answer():
    a = _records([(API_LAUNCH, 1, 5), (API_LAUNCH, 5, 6), (API_SYNC, 7, 9), (API_LAUNCH, 8, 8), (API_LAUNCH, 20, 30)])
    (ls, le), (ss, se) = host_intervals(a)
    assert ls.tolist() == [1, 8, 20] and le.tolist() == [6, 8, 30]
    assert ss.tolist() == [7] and se.tolist() == [9]


@pytest.mark.parametrize("seed", range(12))
def test_random_threads_interleaved_equal_reference_and_definition(seed, monkeypatch):
    """Calls of up to four threads, each in start order, interleaved at random (or the whole
    set shuffled, seed % 3 == 0), durations that nest, touch and go negative."""
    rng = np.random.default_rng(seed)
    rows, thread = [], []
    for th in range(int(rng.integers(1, 5))):
        t = int(rng.integers(0, 1000))
        for _ in range(int(rng.integers(1, 300))):
            t += int(rng.choice([0, 1, 3, 10, 50]))
            cat = int(rng.choice([API_LAUNCH, API_GRAPH_LAUNCH, API_MEMCPY, API_MEMSET, API_SYNC, 0]))
            rows.append((cat, t, t + int(rng.choice([-2, 0, 1, 4, 30]))))
            thread.append(th)
    if seed % 3 == 0:
        order = rng.permutation(len(rows))
    else:                        # threads interleaved at random, each thread's calls in order
        pick = rng.permutation(np.asarray(thread))
        order = np.empty(len(rows), np.int64)
        for th in set(thread):
            order[pick == th] = np.flatnonzero(np.asarray(thread) == th)
    a = _records([rows[i] for i in order])
    got = host_intervals(a)
    _same(got, _by_kind(a))
    _same(got, _reference(a, monkeypatch))


def test_shared_a100_trace_and_overlapping_copies_equal_reference(trace_path, monkeypatch):
    from ridgeline.probes.kineto import load_trace
    a = load_trace(trace_path("nvidia-training/hta_a100_rank0_training.json.gz")).api
    cat = a["category"]
    for m in (_LAUNCHING[cat], _SYNCING[cat]):       # the case this covers is really there
        assert (np.diff(a["start_ns"][m]) < 0).any()
    _same(host_intervals(a), _reference(a, monkeypatch))
    # Three copies, each shifted by a third of the trace's span: their calls overlap in time
    # but come one copy after another, as in a trace the scale tool wrote.
    span = int(a["end_ns"].max() - a["start_ns"].min())
    copies = []
    for c in range(3):
        b = a.copy()
        b["start_ns"] += c * span // 3
        b["end_ns"] += c * span // 3
        copies.append(b)
    big = np.concatenate(copies)
    got = host_intervals(big)
    _same(got, _reference(big, monkeypatch))
    assert len(got[0][0]) < 3 * len(host_intervals(a)[0][0])   # the copies' calls really merge
