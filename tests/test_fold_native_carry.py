"""The native passes of the poll-time fold added for issue 21.1's sixth step, against the
numpy they replace (``fold_native.REFERENCE`` selects that numpy in the fold itself):

* ``rl_carry_api_mask`` (fold_native.carry_api_mask, SourceFold._carry_records): the API
  records held with a kernel stream's open steps, ``(end_ns >= t0) | np.isin(correlation_id,
  held)``;
* ``rl_device_groups`` (fold_native.device_groups, steps.segment_kernels): the devices of a
  batch and each one's record indices, ``np.unique`` and ``np.flatnonzero(device == d)``;

on literal records, adversarial random ones, and through the live windows of a multi-GPU
stream and the shared third-party traces replayed (the windows must be equal, builtins and
wire bytes, with and without the native passes)."""

import numpy as np
import pytest
from support.kineto_traces import TRACES
from support.window_replay import fold_windows

from ridgeline.aggregator import fold_native
from ridgeline.probes.events import API_DTYPE, KERNEL_DTYPE, Device, NameTable, empty


def _reference_mask(a, t0, held):
    return (a["end_ns"] >= t0) | np.isin(a["correlation_id"], held)


def test_carry_mask_on_literal_records():
    a = empty(API_DTYPE, 6)
    a["end_ns"] = [10, 20, 30, 40, 50, 60]
    a["correlation_id"] = [5, -1, 7, 7, 2, 9]
    # t0 = 45 keeps the last two by their ends; ids 7 (twice) and -1 by the held ids; 5 and 2 not
    got = fold_native.carry_api_mask(a, 45, np.array([7, -1, 8]))
    assert got.tolist() == [False, True, True, True, True, True]
    # no held id: the ends alone; a held id below and above every record's: nothing more
    assert fold_native.carry_api_mask(a, 45, np.array([], np.int64)).tolist() == [False] * 4 + [True] * 2
    assert fold_native.carry_api_mask(a, 61, np.array([1, 10])).tolist() == [False] * 6
    # the first and the last held id (the search's two ends)
    assert fold_native.carry_api_mask(a, 61, np.array([9, 2])).tolist() == [False] * 4 + [True] * 2
    assert fold_native.carry_api_mask(a[:0], 0, np.array([1])).tolist() == []


@pytest.mark.parametrize("seed", range(24))
def test_carry_mask_equals_reference_on_random_records(seed):
    """Ids repeated, negative, unsorted; held ids repeated, unsorted, outside the records'
    range; t0 before, inside and after the records; records as a strided view."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 500))
    a = empty(API_DTYPE, n)
    a["end_ns"] = rng.integers(-50, 1000, n)
    a["correlation_id"] = rng.integers(-3, 60, n) if seed % 2 else np.sort(rng.integers(-3, 2000, n))
    held = rng.integers(-5, 70 if seed % 2 else 2100, int(rng.integers(0, 40)))
    t0 = int(rng.integers(-100, 1100))
    if seed % 5 == 0:
        a = a[::2]
    got = fold_native.carry_api_mask(a, t0, held)
    np.testing.assert_array_equal(got, _reference_mask(a, t0, held))


def _reference_groups(k):
    devs = np.unique(k["device"])
    return devs.tolist(), [np.flatnonzero(k["device"] == d) for d in devs]


@pytest.mark.parametrize("seed", range(16))
def test_device_groups_equal_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    k = empty(KERNEL_DTYPE, n)
    k["device"] = rng.choice([-2, 0, 3, 7], n) if seed % 3 else rng.integers(0, 9, n)
    if seed % 4 == 0:
        k = k[::3]
    lo, hi = int(k["device"].min()), int(k["device"].max())
    devs, groups = fold_native.device_groups(k, lo, hi)
    want_devs, want = _reference_groups(k)
    assert devs == want_devs
    assert fold_native.distinct_devices(k, lo, hi) == want_devs
    assert len(groups) == len(want)
    for g, w in zip(groups, want):
        np.testing.assert_array_equal(g, w)


def test_device_groups_refuse_what_they_cannot_hold():
    k = empty(KERNEL_DTYPE, 3)
    k["device"] = [0, 5, 2]
    assert fold_native.device_groups(k, 0, 4) is None          # a device outside the range
    assert fold_native.distinct_devices(k, 0, 4) is None
    assert fold_native.distinct_devices(k, 0, 5) == [0, 2, 5]
    assert fold_native.device_groups(k, 0, fold_native.MAX_DEVICE_SPAN) is None   # too wide
    devs, groups = fold_native.device_groups(k, 0, 5)
    assert devs == [0, 2, 5] and [g.tolist() for g in groups] == [[0], [2], [1]]


def _segmentation(k, names, reference, monkeypatch):
    from ridgeline.aggregator.stream_phases import StreamPhaser
    from ridgeline.probes.events import Trace
    with monkeypatch.context() as m:
        m.setattr(fold_native, "REFERENCE", reference)
        t = Trace(kernels=k, names=names)
        kc, seg = StreamPhaser(names).segment(t)
    return seg.kernel_step.tolist(), [(s.device, s.start_ns, s.end_ns, s.reasons) for s in seg.segments]


def _multi_gpu_stream(gpus: int, rate: int):
    """bench/bench_scale.py's simulated decode stream on several GPUs, in 50 ms batches."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    try:
        from bench_scale import StepStream
    finally:
        sys.path.pop(0)
    stream = StepStream(gpus, rate)
    names = NameTable(stream.names)
    return [stream.batch(i) for i in range(12)], names, [Device(g, stream.gpu_name) for g in range(gpus)]


def test_segment_kernels_of_several_devices_equal_reference(monkeypatch):
    batches, names, _ = _multi_gpu_stream(4, 20_000)
    k = np.concatenate([b[0] for b in batches[:3]])
    assert len(np.unique(k["device"])) == 4
    assert _segmentation(k, names, False, monkeypatch) == _segmentation(k, names, True, monkeypatch)


@pytest.mark.parametrize("gpus", [1, 4])
def test_live_windows_of_a_multi_gpu_stream_equal_reference(gpus, monkeypatch):
    """The bench's stream through the live windows (held steps of every device carried with
    their launch records from fold to fold): equal windows, native passes or numpy."""
    batches, names, devices = _multi_gpu_stream(gpus, 20_000)
    native = fold_windows(batches, names, devices, reference=False, monkeypatch=monkeypatch, every=5, encode=True)
    ref = fold_windows(batches, names, devices, reference=True, monkeypatch=monkeypatch, every=5, encode=True)
    assert native == ref
    plain = fold_windows(batches, names, devices, reference=False, monkeypatch=monkeypatch, every=5, encode=False)
    assert sum(g["kernels"] for w in plain for g in w.get("gpus", ())) == sum(len(b[0]) for b in batches)
    assert {g["device"] for w in plain for g in w.get("gpus", ())} == set(range(gpus))


@pytest.mark.parametrize("name", TRACES, ids=[t.split("/")[-1].split(".")[0] for t in TRACES])
def test_carry_records_of_shared_traces_equal_reference(name, trace_path, monkeypatch):
    """Each shared trace replayed as a kernel stream in small batches (so that open steps
    are carried with their launch records many times): the same wire-encoded windows."""
    from ridgeline.probes.kineto import load_trace
    t = load_trace(trace_path(name))
    if not len(t.kernels) or not len(t.api):
        pytest.skip(f"{name}: no kernels with launch records")
    k = t.kernels[np.argsort(t.kernels["start_ns"], kind="stable")]
    a = t.api[np.argsort(t.api["start_ns"], kind="stable")]
    parts = np.array_split(np.arange(len(k)), max(2, len(k) // 700))
    batches = []
    for p in parts:
        kp = k[p]
        lo, hi = int(kp["start_ns"].min()), int(kp["start_ns"].max())
        batches.append((kp, a[(a["start_ns"] >= lo) & (a["start_ns"] <= hi)]))
    calls = []
    real = fold_native.carry_api_mask

    def counted(*args):
        calls.append(1)
        return real(*args)
    monkeypatch.setattr(fold_native, "carry_api_mask", counted)
    native = fold_windows(batches, t.names, t.devices, reference=False, monkeypatch=monkeypatch, every=3, encode=True)
    assert calls, "the native carry pass did not run"
    assert native == fold_windows(batches, t.names, t.devices, reference=True, monkeypatch=monkeypatch, every=3,
                                  encode=True)


