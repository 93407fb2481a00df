"""What the ``top`` operator chose and has seen: the keys, the selection, the sort, and a
short history of each GPU's binding face (pure; tested with literal windows and keys).

Keys, as in htop and nvtop: ``q`` quits; ``s`` cycles the order of the GPU/process list
(:data:`SORTS`); ``g`` steps through the GPUs (all, then each device) and ``p`` through
the served processes (all, then each pid) of the latest window. The history keeps, per
(GPU, process), the binding face and the figure that places it (the % the face is at, see
:func:`pressure_pct`), :data:`HISTORY` windows long, for the sparkline.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import msgspec

from ridgeline.aggregator.answer import verdict_records
from ridgeline.probes.records import GpuProcess, VerdictRecord, Window, window_of

HISTORY = 24
#: GPU/process orders ``s`` cycles through.
SORTS = ("device", "busy", "pressure", "pid")


def typed_verdicts(v) -> list[tuple[dict, VerdictRecord]]:
    """The window's verdict records (``aggregator.answer.verdict_records``), each with what
    the views read of it typed; a record of the wrong shape is left out (the answer lines
    of it could not be read either)."""
    out = []
    for rec in verdict_records(v):
        try:
            out.append((rec, msgspec.convert(rec, VerdictRecord)))
        except msgspec.ValidationError:
            continue
    return out


def pressure_pct(rec: VerdictRecord) -> float | None:
    """How far the binding face is pressed, in % of what binds it: the dominant phase's %
    of peak bytes/s (bandwidth) or FLOP/s (compute), KV usage (memory capacity), the GPU's
    idle share (host, launch). None for queueing and undetermined (no % to draw)."""
    face = rec.face
    if face == "bandwidth":
        return rec.phase_pct_of_peak_bytes
    if face == "compute":
        return rec.phase_pct_of_peak_flops
    if face == "memory-capacity":
        return None if rec.kv_usage_ratio is None else 100.0 * rec.kv_usage_ratio
    if face in ("host", "launch"):
        return None if rec.gpu_idle_ratio is None else 100.0 * rec.gpu_idle_ratio
    return None


def _cycle(options: list, current):
    """The option after ``current`` in [None, *options] (None = all)."""
    seq = [None, *options]
    i = seq.index(current) if current in seq else 0
    return seq[(i + 1) % len(seq)]


@dataclass
class ViewState:
    gpu: int | None = None          # the GPU shown (None: all)
    pid: int | None = None          # the served process shown (None: all)
    sort: str = SORTS[0]
    quit: bool = False
    history: dict = field(default_factory=dict)   # (device, pid) -> deque[(face, pct)]
    _devices: list = field(default_factory=list)
    _pids: list = field(default_factory=list)

    def observe(self, window: dict | Window) -> None:
        """Take a window (a :class:`probes.records.Window`, or the decoded record, read with
        ``window_of``: ``msgspec.ValidationError`` when it is not one): remember its GPUs and
        processes (for ``g``/``p``) and each verdict's face and pressure (for the sparkline)."""
        window = window_of(window)
        self._devices = sorted({g.device for g in window.gpus if g.device is not None})
        self._pids = sorted({g.pid for g in window.gpus if isinstance(g.pid, int) and g.pid >= 0})
        for _, rec in typed_verdicts(window.verdict):
            h = self.history.setdefault((rec.device, rec.pid), collections.deque(maxlen=HISTORY))
            h.append((rec.face, pressure_pct(rec)))
        if len(self.history) > 4 * 64:       # bounded: pairs long gone are forgotten first
            for key in list(self.history)[: len(self.history) - 4 * 64]:
                del self.history[key]

    def key(self, ch: str) -> bool:
        """Apply one key; True when it changed what is shown (or quits)."""
        if ch in ("q", "Q", "\x03"):
            self.quit = True
        elif ch == "s":
            self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]
        elif ch == "g":
            self.gpu = _cycle(self._devices, self.gpu)
        elif ch == "p":
            self.pid = _cycle(self._pids, self.pid)
        else:
            return False
        return True

    def pick(self, gpus: list[GpuProcess], verdicts: dict[tuple, VerdictRecord]) -> list[GpuProcess]:
        """The GPU/process pairs to show, selected and in the chosen order."""
        rows = [g for g in gpus if (self.gpu is None or g.device == self.gpu)
                and (self.pid is None or g.pid == self.pid)]

        def busy(g: GpuProcess):
            return -(g.busy_ns / g.span_ns) if g.span_ns else 0.0

        def pressure(g: GpuProcess):
            rec = verdicts.get((g.device, g.pid))
            p = pressure_pct(rec) if rec else None
            return -(p or 0.0)
        key = {"device": lambda g: (g.device or 0, g.pid or 0), "busy": busy,
               "pressure": pressure, "pid": lambda g: (g.pid or 0, g.device or 0)}[self.sort]
        return sorted(rows, key=key)

    def describe(self) -> str:
        """The selection in words, for the frame's key line."""
        gpu = "all" if self.gpu is None else str(self.gpu)
        pid = "all" if self.pid is None else str(self.pid)
        return f"sort {self.sort}, GPU {gpu}, pid {pid}"
