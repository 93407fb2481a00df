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

from ridgeline.aggregator.answer import verdict_records

HISTORY = 24
#: GPU/process orders ``s`` cycles through.
SORTS = ("device", "busy", "pressure", "pid")


def pressure_pct(rec: dict) -> float | None:
    """How far the binding face is pressed, in % of what binds it: the dominant phase's %
    of peak bytes/s (bandwidth) or FLOP/s (compute), KV usage (memory capacity), the GPU's
    idle share (host, launch). None for queueing and undetermined (no % to draw)."""
    face = rec.get("face")
    if face == "bandwidth":
        return rec.get("phase_pct_of_peak_bytes")
    if face == "compute":
        return rec.get("phase_pct_of_peak_flops")
    if face == "memory-capacity":
        kv = rec.get("kv_usage_ratio")
        return None if kv is None else 100.0 * kv
    if face in ("host", "launch"):
        idle = rec.get("gpu_idle_ratio")
        return None if idle is None else 100.0 * idle
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

    def observe(self, window: dict) -> None:
        """Take a window: remember its GPUs and processes (for ``g``/``p``) and each
        verdict's face and pressure (for the sparkline)."""
        gpus = [g for g in window.get("gpus") or [] if isinstance(g, dict)]
        self._devices = sorted({g.get("device") for g in gpus if g.get("device") is not None})
        self._pids = sorted({g.get("pid") for g in gpus if isinstance(g.get("pid"), int) and g.get("pid") >= 0})
        for rec in verdict_records(window.get("verdict")):
            key = (rec.get("device"), rec.get("pid"))
            h = self.history.setdefault(key, collections.deque(maxlen=HISTORY))
            h.append((rec.get("face"), pressure_pct(rec)))
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

    def pick(self, gpus: list[dict], verdicts: dict) -> list[dict]:
        """The GPU/process pairs to show, selected and in the chosen order."""
        rows = [g for g in gpus if isinstance(g, dict)
                and (self.gpu is None or g.get("device") == self.gpu)
                and (self.pid is None or g.get("pid") == self.pid)]

        def busy(g):
            span = g.get("span_ns") or 0
            return -(g.get("busy_ns", 0) / span) if span else 0.0

        def pressure(g):
            rec = verdicts.get((g.get("device"), g.get("pid")))
            p = pressure_pct(rec) if rec else None
            return -(p or 0.0)
        key = {"device": lambda g: (g.get("device") or 0, g.get("pid") or 0), "busy": busy,
               "pressure": pressure, "pid": lambda g: (g.get("pid") or 0, g.get("device") or 0)}[self.sort]
        return sorted(rows, key=key)

    def describe(self) -> str:
        """The selection in words, for the frame's key line."""
        gpu = "all" if self.gpu is None else str(self.gpu)
        pid = "all" if self.pid is None else str(self.pid)
        return f"sort {self.sort}, GPU {gpu}, pid {pid}"
