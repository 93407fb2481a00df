"""Recordings of several simulated hosts, with the agent's own windows, for fleet queries.

Each host's recording is what ``ridgeline record`` saves from an agent serving the
simulator's run (``ridgeline simulate``: vLLM-style kernels, copies, launch calls and
step annotations): one ``events`` batch per window of 1 s of the simulated GPU's events,
and the ``window`` the agent's real :class:`aggregator.windows.WindowBuilder` folds
from it (phases, roofline with the model's analytic work, verdict), encoded with the real
wire codec. A window is as long as the GPU took for its batch (``events_s``, times the
slow factor) and one starts every ``window_s`` of the agent's clock from ``t0_ns`` (a
sampled recording: a few windows span hours of wall clock at the cost of seconds of
events). A host may be
``slowed`` from a window on: its GPU takes ``slow_factor`` times as long for the same
work (every event time of the slice stretched), as a throttled or degraded GPU does.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ridgeline.agent.recording import RecordingWriter
from ridgeline.aggregator import model_config, wire
from ridgeline.aggregator.windows import WindowBuilder
from ridgeline.probes.events import Trace
from support.recording_synth import _KINDS, _slices

T0_NS = 1_796_119_200 * 1_000_000_000      # 2026-12-01 10:00:00 UTC


def write_host(out: Path, source: Trace, host: str, model: str, windows: int = 18, window_s: float = 300.0,
               t0_ns: int = T0_NS, slowed_from: int | None = None, slow_factor: float = 3.0,
               events_s: float = 1.0) -> dict:
    """Write ``host``'s recording; returns per window what was written. ``events_s``: the
    seconds of the source's events each window carries (at most 1; less is quicker)."""
    t0 = min(int(getattr(source, k)["start_ns"].min()) for k in _KINDS if len(getattr(source, k)))
    sl = _slices(source, t0)
    wb = WindowBuilder(host=host, model=model_config.builtin(model))
    enc = wire.EventBatchEncoder()
    gpu_clock = t0
    written = []
    with RecordingWriter(out) as w:
        for i in range(windows):
            off, parts = sl[i % len(sl)]
            f = slow_factor if slowed_from is not None and i >= slowed_from else 1.0
            arrays = {}
            for k, a in parts.items():
                s0 = t0 + off
                a = a[a["start_ns"] < s0 + int(events_s * 1e9)]
                a["start_ns"] = gpu_clock + ((a["start_ns"] - s0) * f).astype(np.int64)
                a["end_ns"] = gpu_clock + ((a["end_ns"] - s0) * f).astype(np.int64)
                if "correlation_id" in a.dtype.names:     # fresh ids per window, as a live run has
                    a["correlation_id"] = np.where(a["correlation_id"] >= 0,
                                                   a["correlation_id"] + i * 10_000_000, -1)
                arrays[k] = a
            gpu_clock += int(events_s * f * 1e9)      # the next batch follows on (no idle GPU between)
            tr = Trace(names=source.names, devices=source.devices,
                       meta={"source": "simulated", "model": model}, **arrays)
            # the agent's window holds the batch: as long as the GPU took for it, one
            # every window_s (a sampled recording: hours of wall clock, seconds of events)
            start = t0_ns + int(i * window_s * 1e9)
            end = start + int(events_s * f * 1e9)
            w.write(wire.encode_envelope("events", i, enc.encode(tr), host, end - 1000), end - 1000)
            wb.add_events(tr)
            win = wb.close(start, end, final=(i == windows - 1))
            w.write(wire.encode_envelope("window", i, wire.encode_window(win), host, end), end)
            written.append(win)
    return {"windows": written, "bytes": out.stat().st_size}
