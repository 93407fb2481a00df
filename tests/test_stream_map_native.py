"""The native passes of the stream phaser's batch mapping (``rl_map_runs`` and
``rl_map_phases`` in aggregator/native/ridgeline_map.c, called by
aggregator.stream_phases.StreamPhaser.map_batch) and its steady-case continuity history
(``StreamPhaser._continuity``) against their references, selected with
``fold_native.REFERENCE``: map_batch's numpy path (``_map_reference``) and
aggregator.phases.mixed_by_continuity step by step.

Checked: the runs and hashes on adversarial records (steps and starts out of order by 1 ns,
skipped steps, starts 2**40 ns apart, where map_batch's sort key caps them); the whole
BatchPhases (phase and step per kernel, order, every StreamStep field, shape hits and
misses) and the phaser's continuity history, batch after batch, on the simulator's streams
(one GPU and four, in time order and shuffled, with and without held steps: batches with
prefills relabelled mixed and decode-only ones, so both continuity paths) and on the
shared third-party traces replayed as kernel streams; and the wire-encoded live windows of
those streams."""

import numpy as np
import pytest
from support.kineto_traces import TRACES
from support.window_replay import fold_windows

from ridgeline.aggregator import fold_native, stream_phases
from ridgeline.aggregator.phases import MIXED, mixed_by_continuity
from ridgeline.aggregator.stream_phases import _HASH_CONSTS, StreamPhaser
from ridgeline.probes.events import KERNEL_DTYPE, Trace, empty


def _runs_reference(k, step, order, skip):
    """rl_map_runs by its definition, in numpy: the kernels in (step, start) order (None
    when ``order`` is None and they are not in it), the kept ones, their runs and hashes."""
    n = len(k)
    st = k["start_ns"]
    s64 = step.astype(np.int64)
    if order is None:
        key = (s64 << 40) | np.minimum(st - st.min(), (1 << 40) - 1)
        if n > 1 and not bool((key[1:] >= key[:-1]).all()):
            return None
        order = np.arange(n)
    ss = s64[order]
    on = ss >= 0
    if skip is not None:
        on &= ~skip[np.maximum(ss, 0)]
    order, ss = order[on], ss[on]
    if not len(order):
        return order, order, order, np.empty(0, np.uint64)
    first = np.flatnonzero(np.r_[True, ss[1:] != ss[:-1]])
    lens = np.diff(np.r_[first, len(ss)])
    pos = np.arange(len(ss)) - np.repeat(first, lens)
    h = StreamPhaser([])._hashes_reference(k, order, False, first, lens, pos)
    return order, first, ss[first], h


@pytest.mark.parametrize("seed", range(24))
def test_runs_equal_reference_on_adversarial_records(seed):
    """Seed bits: 1 in (step, start) order, 2 one pair 1 ns out of order, 4 steps skipped,
    8 the starts 2**40 ns apart (the sort key caps them: in key order though not in start
    order), 16 an explicit order (a permutation)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 600))
    k = empty(KERNEL_DTYPE, n)
    for f in ("name_id", "grid_x", "grid_y", "block_x", "grid_z", "block_y"):
        k[f] = rng.integers(-2, 3000, n)
    step = rng.integers(-1, 12, n).astype(np.int32)
    st = rng.integers(0, 50 * n, n) * 1000 + 10**12
    if seed & 1:
        o = np.lexsort((st, step))
        step, st = step[o], st[o]
        if seed & 2 and n > 2:
            same = np.flatnonzero(step[1:] == step[:-1])
            if len(same):
                i = int(same[0])
                st[i] = st[i + 1] + 1
    if seed & 8 and n > 2:
        # the sort key caps starts 2**40 ns after the earliest: two late kernels of one
        # step out of start order are equal in key, in order by it
        st[-2:] = st.min() + (1 << 40) + np.array([5, 3])
        step[-2:] = step[-3] if n > 2 else step[-2:]
    k["start_ns"] = st
    k["end_ns"] = st + 700
    skip = rng.random(13) < 0.3 if seed & 4 else None
    order = rng.permutation(n).astype(np.int64) if seed & 16 else None
    got = fold_native.map_runs(k, step, order, skip, _HASH_CONSTS)
    want = _runs_reference(k, step, order, skip)
    if want is None:
        assert got is None
        return
    assert got is not None
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    # each kept kernel's phase: the run's shape phases laid out at its position
    order_k, first, _, _ = got
    if len(first):
        lens = np.diff(np.r_[first, len(order_k)])
        flat = rng.integers(0, 5, int(lens.sum()) + 7).astype(np.uint8)
        at = rng.integers(0, 8, len(first))
        phase = np.full(n, 9, np.uint8)
        fold_native.map_phases(order_k, first, at, flat, phase)
        pos = np.arange(len(order_k)) - np.repeat(first, lens)
        want_phase = np.full(n, 9, np.uint8)
        want_phase[order_k] = flat[np.repeat(at, lens) + pos]
        np.testing.assert_array_equal(phase, want_phase)


def _step_fields(bp):
    return [(s.device, s.start_ns, s.end_ns, s.phase, s.prefill_tokens, s.decode_tokens, s.evidence, s.mixed_slots,
             s.source, s.tokens) for s in bp.steps]


def _map_all(batches, names, hold: bool, reference: bool, monkeypatch, stepwise: list | None = None):
    """Every batch through one phaser (each device's last step skipped when ``hold``, as
    SourceFold holds it): the BatchPhases and the phaser's history after each batch.
    ``stepwise``: appended one item per step-by-step continuity pass."""
    out = []
    with monkeypatch.context() as m:
        if reference:
            m.setattr(fold_native, "REFERENCE", True)
        if stepwise is not None:
            def counted(*a, **kw):
                stepwise.append(1)
                return mixed_by_continuity(*a, **kw)
            m.setattr(stream_phases, "mixed_by_continuity", counted)
        ph = StreamPhaser(names)
        for kb in batches:
            t = Trace(kernels=kb, names=names)
            seg = ph.segment(t)
            skip = None
            if hold:
                skip = np.zeros(len(seg[1].segments) + 1, dtype=bool)
                last = {}
                for i, s in enumerate(seg[1].segments):
                    last[s.device] = i
                skip[list(last.values())] = True
            bp = ph.map_batch(t, seg=seg, skip=skip)
            out.append((bp, {d: list(v) for d, v in ph.previous_step.items()}, dict(ph.first_step_ns)))
    return out


def _same_mapping(native, ref) -> int:
    """Asserts the two runs equal; returns how many steps were relabelled mixed."""
    assert len(native) == len(ref)
    mixed = 0
    for (a, ha, fa), (b, hb, fb) in zip(native, ref):
        np.testing.assert_array_equal(a.kernel_phase, b.kernel_phase)
        np.testing.assert_array_equal(a.kernel_step, b.kernel_step)
        assert a.kernel_phase.dtype == b.kernel_phase.dtype and a.kernel_step.dtype == b.kernel_step.dtype
        np.testing.assert_array_equal(a.order, b.order)
        assert _step_fields(a) == _step_fields(b)
        assert (a.shape_hits, a.shape_misses) == (b.shape_hits, b.shape_misses)
        assert ha == hb and fa == fb
        mixed += sum(s.phase == MIXED for s in a.steps)
    return mixed


def _simulated(gpus: int):
    from support.phase_traces import simulated_gpu_streams
    parts = simulated_gpu_streams(gpus)
    k = np.concatenate([p.kernels for p in parts])
    return k[np.argsort(k["start_ns"], kind="stable")], parts[0].names


@pytest.mark.parametrize("gpus", [1, 4])
@pytest.mark.parametrize("hold", [False, True], ids=["all-steps", "held-steps"])
@pytest.mark.parametrize("shuffled", [False, True], ids=["time-order", "shuffled"])
def test_batch_phases_equal_reference_on_simulated_streams(gpus, hold, shuffled, monkeypatch):
    """The simulator's stream in 17 batches: each BatchPhases and the continuity history
    equal the reference's; the stream holds prefills relabelled mixed (the step-by-step
    path) and decode-only batches (the steady path), so both are compared."""
    k, names = _simulated(gpus)
    rng = np.random.default_rng(gpus)
    cuts = np.linspace(0, len(k), 18).astype(int)
    batches = [k[lo:hi][rng.permutation(hi - lo)] if shuffled else k[lo:hi] for lo, hi in zip(cuts[:-1], cuts[1:])]
    stepwise: list = []
    native = _map_all(batches, names, hold, False, monkeypatch, stepwise)
    mixed = _same_mapping(native, _map_all(batches, names, hold, True, monkeypatch))
    assert mixed > 0 and sum(bp.shape_hits for bp, _, _ in native) > 0
    assert 0 < len(stepwise) < len(batches)      # both continuity paths ran


@pytest.mark.parametrize("name", TRACES, ids=[t.split("/")[-1].split(".")[0] for t in TRACES])
def test_batch_phases_equal_reference_on_shared_traces(name, trace_path, monkeypatch):
    """Third-party traces replayed as kernel streams (kernels in start order, nine batches):
    the A100 training trace makes its device a training loop (steps "other"), the B200
    vLLM trace interleaves eight GPUs."""
    from ridgeline.probes.kineto import load_trace
    t = load_trace(trace_path(name))
    if not len(t.kernels):
        pytest.skip(f"{name}: no kernels")
    k = t.kernels[np.argsort(t.kernels["start_ns"], kind="stable")]
    cuts = np.linspace(0, len(k), 10).astype(int)
    batches = [k[lo:hi] for lo, hi in zip(cuts[:-1], cuts[1:])]
    for hold in (False, True):
        _same_mapping(_map_all(batches, t.names, hold, False, monkeypatch),
                      _map_all(batches, t.names, hold, True, monkeypatch))


def _encoded_windows(batches, names, reference: bool, monkeypatch) -> list[bytes]:
    """The live windows of a kernel stream (with its launch records), wire-encoded."""
    return fold_windows(batches, names, reference=reference, monkeypatch=monkeypatch)


@pytest.mark.parametrize("gpus", [1, 4])
def test_encoded_windows_equal_reference_on_simulated_streams(gpus, monkeypatch):
    from support.phase_traces import simulated_gpu_streams
    parts = simulated_gpu_streams(gpus)
    k = np.concatenate([p.kernels for p in parts])
    a = np.concatenate([p.api for p in parts])
    k = k[np.argsort(k["start_ns"], kind="stable")]
    a = a[np.argsort(a["start_ns"], kind="stable")]
    cuts = np.linspace(int(k["start_ns"].min()), int(k["end_ns"].max()) + 1, 24).astype(np.int64)
    batches = [(k[(k["start_ns"] >= lo) & (k["start_ns"] < hi)], a[(a["start_ns"] >= lo) & (a["start_ns"] < hi)])
               for lo, hi in zip(cuts[:-1], cuts[1:])]
    native = _encoded_windows(batches, parts[0].names, False, monkeypatch)
    assert len(native) > 3 and all(len(w) for w in native)
    assert native == _encoded_windows(batches, parts[0].names, True, monkeypatch)


def test_a_library_without_the_map_passes_is_refused_in_one_line(monkeypatch, tmp_path):
    """A library built from ridgeline_fold.c alone (the layout right, rl_map_runs missing)
    is refused as built from another version, in one line saying what to build."""
    import subprocess
    from pathlib import Path

    from ridgeline.probes.errors import RuntimeFailure
    src = Path(fold_native.__file__).parent / "native" / "ridgeline_fold.c"
    lib = tmp_path / "libridgeline_fold.so"
    subprocess.run(["cc", "-O1", "-std=c11", "-fPIC", "-shared", "-o", str(lib), str(src)], check=True)
    monkeypatch.setenv("RIDGELINE_FOLD_LIB", str(lib))
    fold_native.library.cache_clear()
    fold_native._map_library.cache_clear()
    try:
        k = empty(KERNEL_DTYPE, 3)
        with pytest.raises(RuntimeFailure) as e:
            fold_native.map_runs(k, np.zeros(3, np.int32), None, None, _HASH_CONSTS)
        assert "another version" in str(e.value) and "rl_map_runs" in str(e.value) and "\n" not in str(e.value)
    finally:
        fold_native.library.cache_clear()
        fold_native._map_library.cache_clear()


def test_end_and_devices_reads_the_records():
    """rl_end_and_devices on a strided view of records (every third, negative devices)."""
    rng = np.random.default_rng(3)
    k = empty(KERNEL_DTYPE, 301)
    k["end_ns"] = rng.integers(-10**12, 10**15, len(k))
    k["device"] = rng.integers(-2, 9, len(k))
    v = k[1::3]
    end, lo, hi = fold_native.end_and_devices(v)
    np.testing.assert_array_equal(end, v["end_ns"])
    assert (lo, hi) == (int(v["device"].min()), int(v["device"].max()))


@pytest.mark.parametrize("seed", range(8))
def test_argmax_ranges_equal_reference(seed, monkeypatch):
    """rl_argmax_ranges against steps._argmax_in_ranges' numpy (fold_native.REFERENCE): ties
    (the first position wins), overlapping ranges, ranges long enough for its slice path;
    an empty or out-of-bounds range is left to the numpy path."""
    from ridgeline.aggregator import steps
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 300))
    values = rng.integers(0, 4, n).astype(np.int64)        # many ties
    m = int(rng.integers(1, 40)) * (20 if seed % 4 == 3 else 1)
    lo = rng.integers(0, n - 1, m)
    hi = np.minimum(lo + rng.integers(1, n, m), n)
    got = steps._argmax_in_ranges(values, lo, hi)
    assert fold_native.argmax_ranges(values, lo, hi) is not None
    with monkeypatch.context() as mp:
        mp.setattr(fold_native, "REFERENCE", True)
        want = steps._argmax_in_ranges(values, lo, hi)
    np.testing.assert_array_equal(got, want)
    assert fold_native.argmax_ranges(values, np.array([3]), np.array([3])) is None
    assert fold_native.argmax_ranges(values, np.array([0]), np.array([n + 1])) is None


def _merge_across_lengths(h: np.ndarray, lens: np.ndarray, merged: list) -> np.ndarray:
    """Each hash paired with the next distinct hash of another length, one value for both
    (``merged`` gets the pairs): what a peer choosing grid fields could approach, the hash
    being linear in them."""
    seen: dict[int, int] = {}
    for x, n in zip(h.tolist(), lens.tolist()):
        seen.setdefault(x, n)
    new, open_ = {}, None
    for x in seen:
        if open_ is not None and seen[open_] != seen[x]:
            new[x] = new[open_]
            merged.append((open_, x))
            open_ = None
        else:
            new[x] = x
            open_ = x
    return np.array([new[x] for x in h.tolist()], np.uint64)


def _colliding_hashes(monkeypatch, merged: list) -> None:
    """Both hash paths of map_batch (fold_native.map_runs and the reference's
    StreamPhaser._hashes_reference) answer with :func:`_merge_across_lengths`' hashes."""
    real_runs, real_ref = fold_native.map_runs, StreamPhaser._hashes_reference

    def runs(*a, **kw):
        r = real_runs(*a, **kw)
        if r is None:
            return None
        order, first, step_ids, h = r
        return order, first, step_ids, _merge_across_lengths(h, np.diff(np.r_[first, len(order)]), merged)

    def ref(self, k, order, identity, first, lens, pos):
        return _merge_across_lengths(real_ref(self, k, order, identity, first, lens, pos), lens, merged)

    monkeypatch.setattr(fold_native, "map_runs", runs)
    monkeypatch.setattr(StreamPhaser, "_hashes_reference", ref)


def _simulated_batch(kernels: int = 6000):
    from support.phase_traces import simulated_gpu_streams
    part = simulated_gpu_streams(1)[0]
    k = part.kernels[np.argsort(part.kernels["start_ns"], kind="stable")][:kernels]
    return Trace(kernels=k, names=part.names)


def test_runs_whose_hashes_collide_across_lengths_are_decided_on_their_own(monkeypatch):
    """Runs of different lengths given one hash (pairs of the stream's shapes merged): only
    the first run of a hash was checked against the remembered shape's length, so a longer
    run with the same hash had the native copy read past the shapes' phases, or took the
    next shape's (found by review). Each run must get the phases of its own kernels: the
    same BatchPhases as with the real hashes."""
    batch = _simulated_batch()
    want = StreamPhaser(batch.names).map_batch(batch)
    merged: list = []
    _colliding_hashes(monkeypatch, merged)
    got = StreamPhaser(batch.names).map_batch(batch)
    assert merged, "no two shapes of different lengths to merge"
    np.testing.assert_array_equal(got.kernel_phase, want.kernel_phase)
    assert [(s_.start_ns, s_.phase) for s_ in got.steps] == [(s_.start_ns, s_.phase) for s_ in want.steps]


@pytest.mark.parametrize("reference", [False, True], ids=["native", "reference"])
def test_runs_whose_hashes_collide_across_lengths_are_remembered(reference, monkeypatch):
    """Shapes are remembered by (hash, length): a run whose hash another length's shape has
    is decided once, like any new shape, and found again in the next batch. They were
    decided on their own and not remembered (found by review): a peer's colliding shapes
    cost a full phase mapping per run per batch. The same batch twice through one phaser:
    the second decides nothing and maps every kernel as the first did; the first decides
    as many shapes as there are distinct (hash, length) pairs."""
    batch = _simulated_batch()
    shapes = len(np.unique(fold_native.map_runs(batch.kernels, StreamPhaser(batch.names).segment(batch)[1]
                                                .kernel_step, None, None, _HASH_CONSTS)[3]))
    merged: list = []
    _colliding_hashes(monkeypatch, merged)
    monkeypatch.setattr(fold_native, "REFERENCE", reference)
    ph = StreamPhaser(batch.names)
    first = ph.map_batch(batch)
    assert merged, "no two shapes of different lengths to merge"
    # one decision per distinct shape of the batch, each remembered
    assert first.shape_misses == ph.map_phases_calls == len(ph._shapes) == shapes
    second = ph.map_batch(batch)
    assert ph.map_phases_calls == shapes, "a colliding run was decided again"
    assert (second.shape_hits, second.shape_misses) == (len(second.steps), 0)
    np.testing.assert_array_equal(second.kernel_phase, first.kernel_phase)
    assert _step_fields(second) == _step_fields(first)
