"""Which processes the eBPF probes watch: discovery by GPU device, by announcement, or by pid.

Three sources, combined in :class:`TargetSet`:

* **GPU processes**: any process holding an open ``/dev/nvidia*`` file (the CUDA driver
  opens ``/dev/nvidiactl`` and ``/dev/nvidia<N>`` at context creation). Found by cheap,
  rate-limited rescans of ``/proc``: new pids are checked at the next rescan, pids
  already seen without a GPU file are rechecked every ``recheck_s`` (a server opens the
  GPU some time after it starts).
* **Announced processes**: the CUPTI injection library's agent-side probe calls
  :func:`announce` (or :meth:`TargetSet.announce`) when an injected process connects;
  the pid joins at the next :meth:`TargetSet.poll`. Thread-safe.
* **Explicit pids** (``--pid``).

Exited processes are dropped at the next poll. ``poll()`` returns what changed, so the
caller adds and removes probe targets without restarting anything.
"""
from __future__ import annotations

import collections
import os
import threading
import time
import weakref
from typing import Callable, Iterable

from . import proc

# Announcements from any thread (the CUPTI probe's socket thread), delivered to every
# TargetSet alive (the sched and uprobe probes each hold one).
_subscribers: "weakref.WeakSet[TargetSet]" = weakref.WeakSet()
_announce_lock = threading.Lock()

SOURCE_EXPLICIT = "explicit"
SOURCE_ANNOUNCED = "announced"
SOURCE_GPU = "gpu-device"


def announce(pid: int) -> None:
    """Ask the eBPF probes to watch ``pid`` (called by the CUPTI probe when a process announces itself).

    Thread-safe and non-blocking; every live :class:`TargetSet` adds it at its next poll.
    """
    with _announce_lock:
        for ts in list(_subscribers):
            ts._inbox.append(int(pid))


class TargetSet:
    """The current set of target processes, updated by :meth:`poll`.

    ``pids``: explicit targets. ``discover_gpu``: also watch processes with a
    ``device_prefixes`` file open. The /proc functions are injectable for tests.
    """

    def __init__(self, pids: Iterable[int] = (), *, discover_gpu: bool = True,
                 device_prefixes: tuple[str, ...] = ("/dev/nvidia",), rescan_s: float = 2.0,
                 recheck_s: float = 10.0, list_pids: Callable[[], list[int]] = proc.pids,
                 alive: Callable[[int], bool] = proc.alive,
                 has_device: Callable[[int, tuple[str, ...]], bool] = proc.has_open_device,
                 clock: Callable[[], float] = time.monotonic):
        self._explicit = {int(p) for p in pids}
        self.discover_gpu = discover_gpu
        self.device_prefixes = tuple(device_prefixes)
        self.rescan_s = rescan_s
        self.recheck_s = recheck_s
        self._list_pids, self._alive, self._has_device, self._clock = list_pids, alive, has_device, clock
        self.sources: dict[int, str] = {}           # current targets -> why
        self._checked: dict[int, float] = {}         # pid -> last time it was checked (no GPU file)
        self._last_scan = float("-inf")
        self._own = os.getpid()
        self.scans = 0
        self._inbox: collections.deque[int] = collections.deque(maxlen=4096)
        with _announce_lock:
            _subscribers.add(self)

    @property
    def targets(self) -> set[int]:
        return set(self.sources)

    def add(self, pid: int) -> None:
        """Add an explicit target (joins at the next poll; dropped when it exits)."""
        self._explicit.add(int(pid))

    def forget(self, pid: int) -> None:
        """Drop ``pid`` (a caller stopped watching it); a GPU process is found again at its next recheck."""
        pid = int(pid)
        self._explicit.discard(pid)
        if self.sources.pop(pid, None) is not None:
            self._checked[pid] = self._clock()

    def announce(self, pid: int) -> None:
        announce(pid)

    def poll(self) -> tuple[list[int], list[int]]:
        """Rescan as due; return ``(added, removed)`` pids since the previous poll."""
        added, removed = [], []
        now = self._clock()
        for pid in sorted(self._explicit):
            if pid not in self.sources and self._alive(pid):
                self.sources[pid] = SOURCE_EXPLICIT
                added.append(pid)
        while self._inbox:
            pid = self._inbox.popleft()
            if pid not in self.sources and pid != self._own and self._alive(pid):
                self.sources[pid] = SOURCE_ANNOUNCED
                added.append(pid)
        if self.discover_gpu and now - self._last_scan >= self.rescan_s:
            self._last_scan = now
            self.scans += 1
            current = set(self._list_pids())
            for pid in sorted(current):
                if pid in self.sources or pid == self._own:
                    continue
                last = self._checked.get(pid)
                if last is not None and now - last < self.recheck_s:
                    continue
                self._checked[pid] = now
                if self._has_device(pid, self.device_prefixes):
                    self.sources[pid] = SOURCE_GPU
                    added.append(pid)
                    self._checked.pop(pid, None)
            for pid in [p for p in self._checked if p not in current]:
                del self._checked[pid]
        for pid in list(self.sources):
            if not self._alive(pid):
                del self.sources[pid]
                self._explicit.discard(pid)
                removed.append(pid)
        return added, removed
