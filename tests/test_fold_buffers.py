"""The window fold's reused concatenation buffers (aggregator/windows.py ``RecordBuffer``) and
its native per-fold passes, against the reference path (``fold_native.REFERENCE``: a fresh
concatenation per fold, phase_figures.py's numpy passes): the wire-encoded windows of the
simulator's stream and of the shared third-party traces, replayed in small batches so that
many batches wait and are folded together with a held open step in front, are the same
bytes; and a buffer whose last result is still alive anywhere is never overwritten."""

import numpy as np
import pytest
from support.kineto_traces import TRACES
from support.window_replay import fold_windows

from ridgeline.aggregator import windows, wire
from ridgeline.aggregator.windows import RecordBuffer, concat_records
from ridgeline.probes.events import KERNEL_DTYPE, Device, empty


def _cuts(lo: int, hi: int, n: int) -> list[int]:
    return [lo + (hi - lo) * i // n for i in range(n + 1)]


def _wire_windows(batches, names, devices, reference: bool, monkeypatch, **kw) -> list[bytes]:
    """The encoded windows (a close every 5 batches) with the fold's batching threshold low,
    so that several batches wait and are concatenated with the held step's records."""
    return fold_windows(batches, names, devices, reference=reference, monkeypatch=monkeypatch,
                        tick_ns=10**9, fold_min_events=1_500, **kw)


def _batches(k: np.ndarray, a: np.ndarray, n: int):
    """A kernel stream as CUPTI sends it: kernels and their API records in start order, in
    n batches cut by time."""
    k = k[np.argsort(k["start_ns"], kind="stable")]
    a = a[np.argsort(a["start_ns"], kind="stable")] if len(a) else a
    cuts = _cuts(int(k["start_ns"].min()), int(k["end_ns"].max()) + 1, n)
    return [(k[(k["start_ns"] >= lo) & (k["start_ns"] < hi)],
             a[(a["start_ns"] >= lo) & (a["start_ns"] < hi)] if len(a) else a) for lo, hi in zip(cuts[:-1], cuts[1:])]


@pytest.mark.parametrize("gpus,model", [(1, None), (2, None), (1, "llama-3-8b")])
def test_wire_windows_equal_reference_on_simulated_stream(gpus, model, monkeypatch):
    from support.phase_traces import simulated_gpu_streams

    from ridgeline.aggregator import model_config
    parts = simulated_gpu_streams(gpus)
    k = np.concatenate([p.kernels for p in parts])
    a = np.concatenate([p.api for p in parts])
    batches = _batches(k, a, 60)
    devices = [Device(d, "NVIDIA H100 80GB HBM3") for d in range(gpus)]
    reused: list = []
    shape = model_config.load(model) if model else None
    new = _wire_windows(batches, parts[0].names, devices, False, monkeypatch, reused=reused, model=shape)
    ref = _wire_windows(batches, parts[0].names, devices, True, monkeypatch, model=shape)
    if shape is not None:            # the model's work was folded (per step, from the vectorised sums)
        phases = [ph for w in new for g in wire.decode_window(w).get("gpus", ()) for ph in g["phases"].values()]
        assert any(ph["work_by_source"].get("model", {}).get("steps") for ph in phases)
    # the buffers were reused (the path under test ran), and every kernel was published
    assert sum(reused) > 10
    got = sum(g["kernels"] for w in new for g in wire.decode_window(w).get("gpus", ()))
    assert got == len(k)
    assert new == ref


@pytest.mark.parametrize("reference", [False, True], ids=["native", "reference"])
def test_held_steps_over_the_carry_bound_are_folded_not_lost(reference, monkeypatch):
    """A held step whose kernels and launch records together pass MAX_CARRY_KERNELS is cut:
    map_batch had skipped it (it was to be mapped whole later), so it must be mapped and
    folded now; before, its kernels were in no order and vanished (found by review: 14,223 of
    16,556 kernels published with the bound at 400; at the real bound, a held step of 100k to
    200k kernels with one launch each)."""
    from support.phase_traces import simulated_gpu_streams
    parts = simulated_gpu_streams(1)
    k = np.concatenate([p.kernels for p in parts])
    a = np.concatenate([p.api for p in parts])
    batches = _batches(k, a, 60)
    monkeypatch.setattr(windows, "MAX_CARRY_KERNELS", 400)
    assert max(len(kb) for kb, _ in batches) < 400 < max(len(kb) + len(ab) for kb, ab in batches)
    out = fold_windows(batches, parts[0].names, [Device(0, "NVIDIA H100 80GB HBM3")], reference=reference,
                       monkeypatch=monkeypatch, tick_ns=10**9)
    assert sum(g["kernels"] for w in out for g in wire.decode_window(w).get("gpus", ())) == len(k)
    assert sum(wire.decode_window(w)["agent"]["window_open_steps_cut"] for w in out) > 0


@pytest.mark.parametrize("name", TRACES, ids=[t.split("/")[-1].split(".")[0] for t in TRACES])
def test_wire_windows_equal_reference_on_shared_traces(name, trace_path, monkeypatch):
    from ridgeline.probes.kineto import load_trace
    t = load_trace(trace_path(name))
    if not len(t.kernels):
        pytest.skip(f"{name}: no kernels")
    batches = _batches(t.kernels, t.api, 40)
    new = _wire_windows(batches, t.names, t.devices, False, monkeypatch)
    assert sum(g["kernels"] for w in new for g in wire.decode_window(w).get("gpus", ())) == len(t.kernels)
    assert new == _wire_windows(batches, t.names, t.devices, True, monkeypatch)


def _records(n: int, t0: int) -> np.ndarray:
    r = empty(KERNEL_DTYPE, n)
    r["start_ns"] = t0 + np.arange(n) * 10
    r["end_ns"] = r["start_ns"] + 5
    r["correlation_id"] = np.arange(n) + t0
    return r


def test_buffer_reused_only_when_nothing_holds_its_last_result():
    buf = RecordBuffer()
    a, b = _records(300, 0), _records(200, 10_000)
    first = buf.concat([a, b])
    np.testing.assert_array_equal(first, concat_records([a, b]))
    held = first[250:]["start_ns"]                 # a field view of a slice: holds the buffer
    want = held.copy()
    second = buf.concat([b, a])
    # the held view is intact: the second result went to a new buffer
    np.testing.assert_array_equal(held, want)
    assert second.base is not first.base
    np.testing.assert_array_equal(second, concat_records([b, a]))
    del first, held
    owner = second.base.ctypes.data                # its address (a reference would hold it)
    del second
    third = buf.concat([a, a])
    assert third.base.ctypes.data == owner and buf.reuses == 1   # nothing held it: the same memory
    np.testing.assert_array_equal(third, concat_records([a, a]))
    # records that do not fit: a bigger buffer, the same records
    big = buf.concat([a, b, a, b])
    np.testing.assert_array_equal(big, concat_records([a, b, a, b]))
    # one part (or one non-empty one) is returned as it is, no copy
    assert buf.concat([a[:0], b]) is b


class _Work:
    def __init__(self, j: int):
        self.flops, self.bytes = 1e9 * (j + 0.1), 3e7 / (j + 1)
        self.estimate = bool(j & 1)
        self.notes = [f"note {j % 3}"] if j % 2 else []


@pytest.mark.parametrize("seed", range(8))
def test_step_sums_equal_reference_with_model_work(seed):
    """fold_kernels' per-step sums (steps, windows, evidence, model work, the step log),
    vectorised over the units, against the reference that takes one step at a time; steps
    of two phases interleaved (several units per step), kernels in no step, several groups,
    some steps without work, more evidence lines than a row keeps."""
    from ridgeline.aggregator import phase_figures
    from ridgeline.aggregator.phase_figures import PhaseSums, fold_kernels, group_key
    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 3000))
    nsteps = int(rng.integers(1, 60))
    step = np.sort(rng.integers(-1, nsteps, n))
    start = np.cumsum(rng.choice([0, 3, 700, 40_000], n)) + 10**9
    end = start + rng.choice([-2, 0, 500, 9_000], n)
    phase = rng.integers(0, 4, n)
    steps = []
    for j in range(nsteps):
        st = type("S", (), {})()
        st.phase, st.start_ns, st.end_ns = int(rng.integers(0, 4)), 10**9 + 7 * j, 10**9 + 7 * j + int(rng.integers(1, 10**7))
        st.evidence = [f"line {j % 11}"]
        steps.append(st)
    # each step's kernels mostly of its own phase, some of another (interleaved units)
    own = np.array([steps[i].phase for i in step.clip(0)])
    phase = np.where((step >= 0) & (rng.random(n) < 0.8), own, phase)
    gkey = group_key(np.sort(rng.integers(0, 1 + seed % 3, n)), 77) if seed % 2 else int(group_key(0, 77))
    works = {id(st): (_Work(j) if j % 4 else None) for j, st in enumerate(steps)}
    out = []
    for ref in (False, True):
        sums, log = PhaseSums(), []
        fold_kernels(sums, start_ns=start, end_ns=end, phase=phase, step=step, gkey=gkey, steps=steps,
                     latency_ns=np.full(n, 100), step_work=lambda st: works[id(st)],
                     on_steps=lambda sts, gks: log.extend(zip([id(x) for x in sts], gks.tolist())), reference=ref)
        out.append((sums, log))
    (a, la), (b, lb) = out
    for f in ("keys", "ints", "floats", "hists", "dtype_flops"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    assert a.notes == b.notes and a.evidence == b.evidence
    assert [list(v) for v in a.evidence.values()] == [list(v) for v in b.evidence.values()]   # same order
    assert la == lb and len(la) == a.ints[:, phase_figures.I["steps"]].sum()
    assert a.ints[:, phase_figures.I["model_steps"]].sum() > 0 or nsteps < 2
