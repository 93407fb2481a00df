"""The one interface every probe implements, so the agent starts and polls them alike.

A probe is a thin collector (CUPTI, eBPF, NVML, an engine's /metrics, a replayed
trace). The agent's registry calls, in order:

* ``check()`` -> :class:`Availability`: can this probe run here? Never raises; when
  it cannot run it says why (``reason``) and what the operator can do (``hint``).
* ``start()``: acquire resources. May raise; the agent logs it once and goes on
  without the probe when the probe is ``optional``.
* ``poll()``: non-blocking. Returns plain data collected since the last poll (a dict,
  possibly of numpy arrays or a :class:`probes.events.Trace`), or ``None``/``{}`` when
  there is nothing new. Must return quickly; never waits for data.
* ``stop()``: release resources. Idempotent: calling it twice, or before ``start()``,
  is harmless.
* ``counters()`` -> dict with at least ``records``, ``drops`` and ``errors`` (ints,
  cumulative since start). Probes may add more keys (e.g. ``bpf_run_time_ns``).

:class:`Probe` is a base class with the bookkeeping done; subclasses override
``check``, ``start``, ``poll`` and ``stop``. Duck-typed classes that provide the same
attributes work too (:class:`ProbeLike` is the structural type).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Availability:
    """Whether a probe can run here; ``reason`` and ``hint`` are one line each."""
    ok: bool
    reason: str = ""
    hint: str = ""

    def __bool__(self) -> bool:
        return self.ok


@runtime_checkable
class ProbeLike(Protocol):
    """Structural type of a probe (what the agent relies on)."""
    name: str
    optional: bool

    def check(self) -> Availability: ...
    def start(self) -> None: ...
    def poll(self) -> Any: ...
    def stop(self) -> None: ...
    def counters(self) -> dict: ...


class Probe:
    """Base class: holds ``name``, ``optional`` and the cumulative counters.

    Subclasses bump ``self.records``, ``self.drops`` and ``self.errors`` (or override
    :meth:`counters`) and implement the four lifecycle methods.
    """

    name: str = "probe"
    optional: bool = True

    def __init__(self, name: str | None = None, optional: bool | None = None):
        if name is not None:
            self.name = name
        if optional is not None:
            self.optional = optional
        self.records = 0
        self.drops = 0
        self.errors = 0

    def check(self) -> Availability:
        return Availability(True)

    def start(self) -> None:
        pass

    def poll(self) -> Any:
        return None

    def stop(self) -> None:
        pass

    def counters(self) -> dict:
        return {"records": self.records, "drops": self.drops, "errors": self.errors}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
