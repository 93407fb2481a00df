"""The window fold's reused concatenation buffers (aggregator/windows.py ``RecordBuffer``) and
its native per-fold passes, against the reference path (``fold_native.REFERENCE``: a fresh
concatenation per fold, phase_figures.py's numpy passes): the wire-encoded windows of the
simulator's stream and of the shared third-party traces, replayed in small batches so that
many batches wait and are folded together with a held open step in front, are the same
bytes; and a buffer whose last result is still alive anywhere is never overwritten."""

import numpy as np
import pytest
from support.kineto_traces import TRACES

from ridgeline.aggregator import fold_native, windows, wire
from ridgeline.aggregator.windows import RecordBuffer, WindowBuilder, concat_records
from ridgeline.probes.events import KERNEL_DTYPE, Device, Trace, empty


def _cuts(lo: int, hi: int, n: int) -> list[int]:
    return [lo + (hi - lo) * i // n for i in range(n + 1)]


def _batches(k: np.ndarray, a: np.ndarray, n: int):
    """A kernel stream as CUPTI sends it: kernels and their API records in start order, in
    n batches cut by time."""
    k = k[np.argsort(k["start_ns"], kind="stable")]
    a = a[np.argsort(a["start_ns"], kind="stable")] if len(a) else a
    cuts = _cuts(int(k["start_ns"].min()), int(k["end_ns"].max()) + 1, n)
    return [(k[(k["start_ns"] >= lo) & (k["start_ns"] < hi)],
             a[(a["start_ns"] >= lo) & (a["start_ns"] < hi)] if len(a) else a) for lo, hi in zip(cuts[:-1], cuts[1:])]


def _wire_windows(batches, names, devices, reference: bool, monkeypatch, reused: list | None = None) -> list[bytes]:
    """The encoded windows (a close every 5 batches) with the fold's batching threshold low,
    so that several batches wait and are concatenated with the held step's records."""
    with monkeypatch.context() as m:
        m.setattr(windows, "FOLD_MIN_EVENTS", 1_500)
        if reference:
            m.setattr(fold_native, "REFERENCE", True)
        b = WindowBuilder(host="test")
        out = []
        for i, (k, a) in enumerate(batches):
            b.add_events(Trace(kernels=k, api=a, names=names, devices=devices, meta={"source": "simulated"}))
            if i % 5 == 4:
                out.append(wire.encode_window(b.close(i * 10**9, (i + 1) * 10**9, {})))
        if reused is not None:
            # the concatenations that wrote into a buffer a previous fold had used
            reused.extend(buf.reuses for fold in b._folds.values() for buf in fold._buf.values())
        out.append(wire.encode_window(b.close(len(batches) * 10**9, (len(batches) + 1) * 10**9, {}, final=True)))
    return out


@pytest.mark.parametrize("gpus", [1, 2])
def test_wire_windows_equal_reference_on_simulated_stream(gpus, monkeypatch):
    from support.phase_traces import simulated_gpu_streams
    parts = simulated_gpu_streams(gpus)
    k = np.concatenate([p.kernels for p in parts])
    a = np.concatenate([p.api for p in parts])
    batches = _batches(k, a, 60)
    devices = [Device(d, "NVIDIA H100 80GB HBM3") for d in range(gpus)]
    reused: list = []
    new = _wire_windows(batches, parts[0].names, devices, False, monkeypatch, reused)
    ref = _wire_windows(batches, parts[0].names, devices, True, monkeypatch)
    # the buffers were reused (the path under test ran), and every kernel was published
    assert sum(reused) > 10
    got = sum(g["kernels"] for w in new for g in wire.decode_window(w).get("gpus", ()))
    assert got == len(k)
    assert new == ref


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
