"""A trace streamed through the window builder as the agent does (batches, window closes)
next to the whole-trace mapper, for the tests that hold the two to each other
(tests/test_windows_open_step.py, tests/test_phases_serving_traces.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ridgeline.aggregator.phases import PHASE_NAMES, map_phases
from ridgeline.aggregator.windows import WindowBuilder
from ridgeline.probes.events import Trace
from ridgeline.probes.kineto import load_trace

_cache: dict[str, Trace] = {}


def kernel_stream(t: Trace) -> Trace:
    o = np.argsort(t.kernels["start_ns"], kind="stable")
    return Trace(kernels=t.kernels[o], copies=t.copies, api=t.api, names=t.names, devices=t.devices, meta=t.meta)


def load_kernels(path: Path) -> Trace:
    key = str(path)
    if key not in _cache:
        _cache[key] = kernel_stream(load_trace(path))
    return _cache[key]


def whole_phases(t: Trace, annotations: bool = False) -> dict:
    """Kernels and kernel time per phase from the whole-trace mapper."""
    pm = map_phases(t, use_annotations=annotations)
    dur = (t.kernels["end_ns"] - t.kernels["start_ns"]).astype(np.int64)
    out = {}
    for code, name in PHASE_NAMES.items():
        m = pm.kernel_phase == code
        if m.any():
            out[name] = (int(m.sum()), int(dur[m].sum()))
    return out


def replay_batches(t: Trace, per_window: int):
    """What the replay probe streams: kernels in time order with their launch records, and
    the CPU operators and ranges that started since the previous batch's last launch."""
    k = t.kernels[np.argsort(t.kernels["start_ns"], kind="stable")]
    a, r, o = t.api, t.ranges, t.cpu_ops
    parts = np.array_split(np.arange(len(k)), max(1, -(-len(k) // per_window)))
    lo = np.iinfo(np.int64).min
    for i, part in enumerate(parts):
        kp = k[part]
        ap = a[np.isin(a["correlation_id"], kp["correlation_id"])]
        hi = np.iinfo(np.int64).max if i == len(parts) - 1 else int((ap if len(ap) else kp)["start_ns"].max())
        yield Trace(kernels=kp, api=ap, ranges=r[(r["start_ns"] >= lo) & (r["start_ns"] <= hi)],
                    cpu_ops=o[(o["start_ns"] >= lo) & (o["start_ns"] <= hi)], names=t.names, devices=t.devices)
        lo = hi + 1


def windowed_phases(t: Trace, per_window: int, trailing_empty: int = 0, final: bool = True, replay: bool = False):
    """Stream ``t`` through a WindowBuilder, closing a window every ``per_window`` kernels
    (launch records with their kernels), then ``trailing_empty`` windows with no events and,
    with ``final``, the agent's last window. Returns per-phase (kernels, kernel time) summed
    over windows, and the windows."""
    wb = WindowBuilder(host="test")
    k, a = t.kernels, t.api
    wins = []
    if replay:
        batches = replay_batches(t, per_window)
    else:
        batches = (Trace(kernels=k[part], api=a[np.isin(a["correlation_id"], k["correlation_id"][part])],
                         names=t.names, devices=t.devices)
                   for part in np.array_split(np.arange(len(k)), max(1, -(-len(k) // per_window))))
    # Windows of one second (the agent's default) on the agent's clock: a step shorter than
    # half a window in its own clock is held whole however many windows it spans (a step
    # still open one close later and longer than that is decided then, test_windows_rates).
    s = 1_000_000_000
    for i, b in enumerate(batches):
        wb.add_events(b, source="replay" if replay else "cupti")
        wins.append(wb.close(i * s, (i + 1) * s, {}))
    for _ in range(trailing_empty):
        wins.append(wb.close(len(wins) * s, (len(wins) + 1) * s, {}))
    if final:
        wins.append(wb.close(len(wins) * s, (len(wins) + 1) * s, {}, final=True))
    out: dict = {}
    for w in wins:
        for g in w.gpus:
            for ph, v in g.phases.items():
                x = out.setdefault(ph, [0, 0])
                x[0] += v.kernels
                x[1] += v.kernel_time_ns
    return {ph: tuple(v) for ph, v in out.items()}, wins


def fold_windows(batches, names, devices=None, *, reference: bool, monkeypatch, every: int = 5,
                 tick_ns: int = 1, encode: bool = True, fold_min_events: int | None = None, model=None,
                 reused: list | None = None) -> list:
    """The live windows of ``batches`` ((kernels, api) pairs) through one WindowBuilder, a
    close every ``every`` batches at ticks of ``tick_ns`` and a final close, on the native
    fold or its numpy reference (``fold_native.REFERENCE``): wire-encoded bytes (``encode``)
    or builtins. The tests of the native passes hold the two paths to each other
    (tests/test_fold_native.py, tests/test_fold_buffers.py, tests/test_stream_map_native.py).
    ``fold_min_events`` lowers the fold's batching threshold, so that several batches wait
    and are concatenated with the held step's records; ``reused`` gets each buffer's reuse
    count (the concatenations that wrote into a buffer a previous fold had used)."""
    import msgspec

    from ridgeline.aggregator import fold_native, windows, wire
    with monkeypatch.context() as m:
        if fold_min_events is not None:
            m.setattr(windows, "FOLD_MIN_EVENTS", fold_min_events)
        if reference:
            m.setattr(fold_native, "REFERENCE", True)
        b = WindowBuilder(host="test", model=model, gpu="h100-sxm" if model is not None else "")
        out = []
        for i, (k, a) in enumerate(batches):
            b.add_events(Trace(kernels=k, api=a, names=names, devices=devices if devices is not None else [], meta={"source": "simulated"}))
            if i % every == every - 1:
                out.append(b.close(i * tick_ns, (i + 1) * tick_ns, {}))
        if reused is not None:
            reused.extend(buf.reuses for fold in b._folds.values() for buf in fold._buf.values())
        out.append(b.close(len(batches) * tick_ns, (len(batches) + 1) * tick_ns, {}, final=True))
    return [wire.encode_window(w) if encode else msgspec.to_builtins(w) for w in out]


def steps_in_order(t: Trace, kernel_step: np.ndarray, order: list[int], gap_ns: int = 1_000_000_000) -> Trace:
    """The kernels (and their launch records) of ``t``'s steps ``order`` (indices into
    ``kernel_step``'s steps, repeats allowed) one after another, ``gap_ns`` of idle between
    them, each copy with its own correlation ids: real steps in an order the recording did
    not have (the layer-continuity tests, tests/test_phases_sdpa.py)."""
    ks, aps = [], []
    t0 = int(t.kernels["start_ns"].min())
    for n, j in enumerate(order):
        x = t.kernels[kernel_step == j].copy()
        a = t.api[np.isin(t.api["correlation_id"], x["correlation_id"])].copy()
        shift = t0 - int(x["start_ns"].min())
        for r in (x, a):
            r["start_ns"] += shift
            r["end_ns"] += shift
            r["correlation_id"] += n * 10_000_000
        ks.append(x)
        aps.append(a)
        t0 = int(x["end_ns"].max()) + gap_ns
    k = np.concatenate(ks)
    return Trace(kernels=k[np.argsort(k["start_ns"], kind="stable")], api=np.concatenate(aps), names=t.names,
                 devices=t.devices, meta=t.meta)
