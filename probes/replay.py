"""A recorded trace played back as if it were live: the GPU-side source without a GPU.

Contract: :class:`ReplayProbe` follows :mod:`probes.probe`. ``start()`` loads the trace
(a Kineto JSON file through :func:`probes.kineto.load_trace`, or a ready
:class:`~probes.events.Trace`). Each ``poll()`` returns ``{"kind": "events", "trace":
Trace}`` holding the events whose (rebased) start time has passed since the previous
poll, or ``None`` when nothing is due. Times are rebased onto the wall clock
(``time.time_ns()`` at start) and advance at ``speed`` times real time; with ``loop`` the
trace starts over, each lap shifted by the trace's span plus a gap so timestamps keep
increasing. Durations are kept as recorded (a replay at speed 10 covers 10 s of GPU time
per wall-second). ``trace.meta["source"]`` is ``"replay"`` and ``meta["replay_of"]`` the
file, so every record derived from it can say where it came from.

Slices are numpy views of the loaded arrays (copied only when shifted), so a poll costs
two binary searches per event kind. A poll returns at most ``max_batch_s`` seconds (of
wall time, times ``speed``) from where the previous one ended, the rest at the next
polls; and when the caller fell more than ``max_catchup_s`` behind (a stalled agent), the
older part is skipped and its events counted in ``drops``. So a slow consumer can make
neither the replay's batches nor its own work grow without bound: without the batch
bound a starved agent (30% of a core, 3x replay of an annotated trace) took a whole
second's catch-up in one poll, 24 MiB of records, and folded its CPU operators unsliced
(annotated batches are not cut: ``aggregator.windows``), which kept its heap 100 MiB
over what it needed.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .events import Trace
from .probe import Availability, Probe

_KINDS = ("kernels", "copies", "api", "ranges", "cpu_ops")


class ReplayProbe(Probe):
    name = "replay"
    optional = True

    def __init__(self, path: str | Path | None = None, speed: float = 1.0, loop: bool = True,
                 trace: Trace | None = None, name: str = "replay", clock=time.monotonic_ns,
                 wall_clock=time.time_ns, max_catchup_s: float = 1.0, max_batch_s: float = 0.1):
        super().__init__(name=name)
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.path = Path(path) if path else None
        self.speed = float(speed)
        self.loop = loop
        self._given = trace
        self._clock = clock
        self._wall = wall_clock
        self._trace: Trace | None = None
        self._sorted: dict[str, np.ndarray] = {}
        self.laps = 0
        self.finished = False
        self._running = False
        self.max_catchup_ns = int(max_catchup_s * 1e9 * self.speed)
        # twice the agent's 50 ms poll: a consumer that keeps up catches up at twice real time
        self.max_batch_ns = max(1, int(max_batch_s * 1e9 * self.speed))

    def check(self) -> Availability:
        if self._given is not None:
            return Availability(True)
        if self.path is None:
            return Availability(False, "no trace to replay", "set probes.replay.path to a Kineto trace (.json or .json.gz)")
        if not self.path.is_file():
            return Availability(False, f"replay trace not found: {self.path}", "check probes.replay.path")
        return Availability(True)

    def start(self) -> None:
        if self._given is not None:
            trace = self._given
        else:
            from .kineto import load_trace
            trace = load_trace(self.path)
        self._trace = trace
        self._sorted = {}
        starts = []
        ends = []
        for k in _KINDS:
            a = getattr(trace, k)
            if len(a):
                a = a[np.argsort(a["start_ns"], kind="stable")]
                starts.append(int(a["start_ns"][0]))
                ends.append(int(a["end_ns"].max()))
            self._sorted[k] = a
        if not starts:
            raise ValueError(f"replay trace {self.path or ''} holds no events")
        self._t0_trace = min(starts)
        span = max(ends) - self._t0_trace
        # A gap of 10% (at least 1 ms) between laps, like the pause between profiler steps.
        self._lap_ns = span + max(span // 10, 1_000_000)
        self._per_lap = sum(len(a) for a in self._sorted.values())
        self._t0_clock = self._clock()
        self._wall_base = self._wall()
        self._cursor_ns = 0          # replay time already emitted, from trace start
        self.laps = 0
        self.finished = False
        self._running = True

    def _slice(self, lo_ns: int, hi_ns: int, lap: int) -> Trace:
        out = {}
        shift = self._wall_base - self._t0_trace + lap * self._lap_ns
        for k, a in self._sorted.items():
            if not len(a):
                out[k] = a[:0]
                continue
            rel = a["start_ns"]
            i = int(np.searchsorted(rel, self._t0_trace + lo_ns, side="left"))
            j = int(np.searchsorted(rel, self._t0_trace + hi_ns, side="left"))
            part = a[i:j].copy()
            part["start_ns"] += shift
            part["end_ns"] += shift
            out[k] = part
        meta = dict(self._trace.meta)
        meta.update(source="replay", replay_of=str(self.path) if self.path else meta.get("path", ""), lap=lap)
        return Trace(out["kernels"], out["copies"], out["api"], out["ranges"], out["cpu_ops"],
                     self._trace.names, self._trace.devices, meta)

    def poll(self):
        if not self._running or self.finished:
            return None
        now = int((self._clock() - self._t0_clock) * self.speed)
        if now <= self._cursor_ns:
            return None
        if now - self._cursor_ns > self.max_catchup_ns:
            skip_to = now - self.max_catchup_ns
            self.drops += self._events_between(self._cursor_ns, skip_to)
            self._cursor_ns = skip_to
        now = min(now, self._cursor_ns + self.max_batch_ns)
        parts = []
        lo = self._cursor_ns
        while lo < now:
            lap, lo_in = divmod(lo, self._lap_ns)
            if lap > 0 and not self.loop:
                self.finished = True
                break
            hi_in = min(self._lap_ns, lo_in + (now - lo))
            parts.append(self._slice(lo_in, hi_in, lap))
            self.laps = lap
            lo += hi_in - lo_in
        self._cursor_ns = now
        if not parts:
            return None
        trace = parts[0] if len(parts) == 1 else _concat(parts)
        n = len(trace.kernels) + len(trace.copies) + len(trace.api) + len(trace.ranges) + len(trace.cpu_ops)
        if n == 0:
            return None
        self.records += n
        return {"kind": "events", "trace": trace}

    def _events_between(self, lo: int, hi: int) -> int:
        """Events whose replay start lies in [lo, hi) (for counting skipped ones)."""
        def upto(t: int) -> int:
            lap, off = divmod(t, self._lap_ns)
            if lap > 0 and not self.loop:
                return self._per_lap
            n = 0
            for a in self._sorted.values():
                if len(a):
                    n += int(np.searchsorted(a["start_ns"], self._t0_trace + off, side="left"))
            return lap * self._per_lap + n
        return max(0, upto(hi) - upto(lo))

    def stop(self) -> None:
        self._running = False

    def counters(self) -> dict:
        c = super().counters()
        c["laps"] = self.laps
        return c


def _concat(parts: list[Trace]) -> Trace:
    first = parts[0]
    arrays = {k: np.concatenate([getattr(p, k) for p in parts]) for k in _KINDS}
    return Trace(arrays["kernels"], arrays["copies"], arrays["api"], arrays["ranges"], arrays["cpu_ops"],
                 first.names, first.devices, dict(parts[-1].meta))
