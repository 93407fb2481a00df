"""The one interface every probe implements, so the agent starts and polls them alike.

A probe is a thin collector (CUPTI, eBPF, NVML, an engine's /metrics, a replayed
trace). The agent's registry calls, in order:

* ``check()`` -> :class:`Availability`: can this probe run here? Never raises; when
  it cannot run it says why (``reason``) and what the operator can do (``hint``).
* ``start()``: acquire resources. May raise; the agent logs it once and goes on
  without the probe when the probe is ``optional``.
* ``poll()``: non-blocking. Returns the data collected since the last poll, or
  ``None``/``{}`` when there is nothing new. Must return quickly; never waits for data.
  What it returns for its topic is written down once, in :func:`poll_result`, which
  turns it into the typed :class:`PollResult` the daemon reads (trace, sched, device,
  engine, requests, process news).
* ``stop()``: release resources. Idempotent: calling it twice, or before ``start()``,
  is harmless.
* ``counters()`` -> dict with at least ``records``, ``drops`` and ``errors`` (ints,
  cumulative since start). Probes may add more keys (e.g. ``bpf_run_time_ns``).

:class:`Probe` is a base class with the bookkeeping done; subclasses override
``check``, ``start``, ``poll`` and ``stop``. Duck-typed classes that provide the same
attributes work too (:class:`ProbeLike` is the structural type). What a probe can do
beyond that is a capability, a :class:`typing.Protocol` the daemon tests with
``isinstance``: :class:`Targeted` (the scheduling probes follow served processes),
:class:`CuptiControl` (the CUPTI probe's takeover and reclaim) and :class:`Readiness` (a
descriptor that says when ``poll()`` has something: the agent waits on it instead of
polling the probe on a timer).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .events import Trace


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


@runtime_checkable
class Targeted(Protocol):
    """A probe that follows chosen processes (sched, cuda_uprobes): the daemon hands it the
    served processes the CUPTI library announces, and those that ended."""

    def add_target(self, pid: int) -> object: ...
    def remove_target(self, pid: int) -> None: ...


@runtime_checkable
class CuptiControl(Protocol):
    """The CUPTI probe's takeover side: which served processes another CUPTI client took
    over, and asking them to take it back (agent.cupti_takeover holds the policy)."""
    socket_path: str

    def taken_over_pids(self) -> set[int]: ...
    def taken_over_owners(self) -> dict[int, tuple[int, str]]: ...
    def reclaim(self, pid: int | None = None) -> int: ...


@runtime_checkable
class Readiness(Protocol):
    """A probe that says when it has data: ``ready_fd()`` is a descriptor (or None, then
    the probe is polled on the agent's timer) that becomes readable when ``poll()`` has
    something to hand on, and that ``poll()`` itself reads empty. The agent's loop sleeps
    on these descriptors and its deadlines while every probe it polls between windows has
    one (issue 21.1: an idle agent woke 20 times a second to poll a quiet socket)."""

    def ready_fd(self) -> int | None: ...


def wake_pipe() -> tuple[int, int]:
    """(read end, write end) of a non-blocking pipe whose bytes only mean "look again"."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w


def poke(fd: int) -> None:
    """One byte into a wake-up pipe's write end; never blocks (a full pipe already says it)."""
    try:
        os.write(fd, b"\0")
    except (BlockingIOError, InterruptedError):
        pass
    except OSError:
        pass          # closed by a stop meanwhile: nobody waits on it any more


def drain_fd(fd: int) -> None:
    """Read a wake-up pipe's read end empty."""
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, InterruptedError):
        pass
    except OSError:
        pass          # closed by a stop meanwhile: nothing left to wake


@dataclass
class ProcessNews:
    """Served processes an event source saw appear (``new``: pid or ``(pid, comm)``) or end
    (``closed``: pids), and the status lines they sent (``{pid: text}``, escaped)."""
    new: list = field(default_factory=list)
    closed: list = field(default_factory=list)
    status: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.new or self.closed or self.status)


@dataclass
class PollResult:
    """What one ``poll()`` hands the daemon, typed: each field goes to its own place.

    ``trace``: events for the window (and the ``events`` topic); ``sched``, ``device``,
    ``engine``: a payload for that topic (engine scrapes become figures at window close);
    ``requests``: request spans for the request join; ``news``: served processes that
    appeared or ended; ``records``: how many records it counts toward ``records_total``.
    """
    trace: Trace | None = None
    sched: dict | None = None
    device: dict | None = None
    engine: dict | None = None
    requests: list | None = None
    news: ProcessNews | None = None
    records: int = 0


def _news(data: dict) -> ProcessNews | None:
    news = ProcessNews(list(data.get("new_pids") or []), list(data.get("closed_pids") or []),
                       dict(data.get("status") or {}))
    return news or None


def poll_result(topic: str, data) -> PollResult:
    """The typed result of what a probe of ``topic`` returned from ``poll()`` (not None or
    empty). The shapes, once for every probe:

    * an event source (``events``: cupti, simulator, replay): a :class:`Trace`, or a dict
      with ``trace`` and, beside it, side payloads ``engine``/``device``/``sched`` (dicts)
      and process news ``new_pids``/``closed_pids``/``status``; a dict without a trace
      carries news, and engine scrapes (``scrapes``: a list) are an engine payload;
    * ``requests`` (otlp): ``{"requests": [RequestSpan, ...]}``;
    * ``sched``, ``device``, ``engine``: the dict is that topic's payload, one record.

    Raises TypeError for any other shape (the daemon counts it as the probe's error).
    """
    if isinstance(data, Trace):
        data = {"trace": data}
    if not isinstance(data, dict):
        raise TypeError(f"poll() returned {type(data).__name__}, expected a dict or a Trace")
    trace = data.get("trace")
    if isinstance(trace, Trace):
        res = PollResult(trace=trace, news=_news(data),
                         records=len(trace.kernels) + len(trace.copies) + len(trace.api) + len(trace.ranges))
        for key in ("engine", "device", "sched"):
            if isinstance(data.get(key), dict):
                setattr(res, key, data[key])
        return res
    if topic == "requests":
        spans = data.get("requests")
        if not isinstance(spans, list):
            raise TypeError("a requests probe's poll() must return {'requests': [RequestSpan, ...]}")
        return PollResult(requests=spans, records=len(spans))
    if topic == "events":
        return PollResult(news=_news(data), engine=data if isinstance(data.get("scrapes"), list) else None)
    if topic not in ("sched", "device", "engine"):
        raise TypeError(f"no probe topic {topic!r}")
    return PollResult(records=1, **{topic: data})
