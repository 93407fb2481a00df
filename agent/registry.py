"""Every probe the agent knows, as named start-up steps, and the code that starts them.

Contract:

* :data:`STEPS` maps a probe name (the names in ``probes.enabled`` of the config) to a
  :class:`Step`: the topic its data goes to (``events``, ``sched``, ``device``,
  ``engine``, ``requests``; :func:`probes.probe.poll_result` says what each hands over)
  and a factory that builds the probe's class from the configuration, every argument
  named. Factories import their module when called (the agent pays only for the probes
  it runs); what the host lacks (bcc, a driver) is the probe's ``check()`` to say. Its
  names, in its order, are :data:`agent.probe_names.PROBE_NAMES` (what the configuration
  checks ``probes.enabled`` against, without importing this module, whose factories take
  its ``Config``).
* :func:`availability(name, cfg)` builds the probe and returns ``(probe|None,
  Availability)`` without starting anything.
* :func:`start_all(cfg, log)` runs the steps in the configured order: build, ``check()``,
  ``start()``. An unavailable or failing probe is logged once (reason and hint) and
  skipped; a failing probe that is not ``optional`` raises
  :class:`probes.errors.InputError`. Returns the :class:`Running` probes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from ridgeline.probes.errors import InputError
from ridgeline.probes.probe import Availability, ProbeLike

from . import config


@dataclass
class Step:
    name: str
    topic: str
    factory: Callable[[config.Config], ProbeLike]
    about: str
    # Polled once per window, just before it closes (the probe reports deltas per poll:
    # one poll per window gives per-window figures and costs least).
    per_window: bool = False


@dataclass
class Running:
    step: Step
    probe: ProbeLike
    availability: Availability
    poll_errors: int = 0
    last_error: str = ""


class Unavailable(Exception):
    """Raised by a factory: the probe cannot even be built here."""

    def __init__(self, reason: str, hint: str = ""):
        super().__init__(reason)
        self.reason, self.hint = reason, hint


# One factory a probe, named for it and building its class with the arguments its
# configuration table gives, spelled out: a renamed class or parameter breaks here, at import
# or at the first build, and static tools see every probe. Each imports its module when
# called, so the agent pays only for the probes it runs (bcc, the CUPTI server).

def _sched(cfg: config.Config) -> ProbeLike:
    from ridgeline.probes.sched import SchedProbe
    return SchedProbe(pids=list(cfg.probes.pids))


def _cuda_uprobes(cfg: config.Config) -> ProbeLike:
    from ridgeline.probes.cuda_uprobes import CudaUprobeProbe
    return CudaUprobeProbe(pids=list(cfg.probes.pids))


def _cupti(cfg: config.Config) -> ProbeLike:
    from ridgeline.aggregator.signatures import PeerNameClassifier
    from ridgeline.probes.cupti import CuptiProbe
    c = cfg.probes.cupti
    # names are matched on the probe's pump thread, within a budget per process (issue 18.1)
    return CuptiProbe(socket_path=c.socket, socket_group=c.socket_group or None, idle_peer_s=c.idle_peer_s,
                      name_classifier=PeerNameClassifier())


def _nvml(cfg: config.Config) -> ProbeLike:
    from ridgeline.probes.nvml import NvmlProbe
    return NvmlProbe()


def _engine(cfg: config.Config) -> ProbeLike:
    from ridgeline.probes.engine import EngineProbe
    e = cfg.probes.engine
    return EngineProbe(urls=[e.url] if e.url else [], pids=list(cfg.probes.pids), interval_s=e.interval_s,
                       timeout_s=e.timeout_s, max_body_bytes=e.max_body_bytes, follow_redirects=e.follow_redirects)


def _otlp(cfg: config.Config) -> ProbeLike:
    from ridgeline.probes.otlp_receiver import OtlpProbe
    o = cfg.probes.otlp
    return OtlpProbe(o.listen, max_body_bytes=o.max_body_bytes, max_connections=o.max_connections,
                     request_timeout_s=o.request_timeout_s, spans_per_s=o.spans_per_s,
                     max_attributes=o.max_attributes, max_attribute_bytes=o.max_attribute_bytes,
                     max_queued_spans=o.max_queued_spans)


def _sglang_requests(cfg: config.Config) -> ProbeLike:
    from ridgeline.probes.sglang_request_metrics import SglangRequestMetricsProbe
    s = cfg.probes.sglang_requests
    return SglangRequestMetricsProbe(s.dir, max_bytes_per_poll=s.max_bytes_per_poll,
                                     max_line_bytes=s.max_line_bytes)


def _replay(cfg: config.Config) -> ProbeLike:
    from ridgeline.probes.replay import ReplayProbe
    r = cfg.probes.replay
    return ReplayProbe(r.path or None, speed=r.speed, loop=r.loop)


def _simulator(cfg: config.Config) -> ProbeLike:
    from ridgeline.agent.simulator.probe import make_probe
    s = config.as_table(cfg.probes.simulator)
    if not s.get("pid"):
        s.pop("pid", None)
    return make_probe(s)


STEPS: dict[str, Step] = {s.name: s for s in (
    Step("sched", "sched", _sched, "eBPF scheduler tracepoints: launch threads' on-CPU, run-queue and blocked time",
         per_window=True),
    Step("cuda_uprobes", "sched", _cuda_uprobes, "eBPF uprobes on libcudart/libcuda: launch and sync calls",
         per_window=True),
    Step("cupti", "events", _cupti, "CUPTI activity records from injected processes (kernels, copies, API)"),
    Step("nvml", "device", _nvml, "NVML: memory, clocks, power, busy time, GPM"),
    Step("engine", "engine", _engine, "the serving engine's Prometheus /metrics (vLLM, SGLang)"),
    Step("otlp", "requests", _otlp, "OTLP/HTTP receiver of the engines' per-request spans (vLLM, SGLang)"),
    Step("sglang_requests", "requests", _sglang_requests,
         "SGLang's per-request metrics files (--export-metrics-to-file), where it sends no traces"),
    Step("simulator", "events", _simulator, "SIMULATED continuous-batching server (no GPU needed)"),
    Step("replay", "events", _replay, "a recorded trace replayed as live"),
)}


def availability(name: str, cfg: config.Config) -> tuple[object | None, Availability]:
    step = STEPS.get(name)
    if step is None:
        return None, Availability(False, f"unknown probe {name!r}", f"known probes: {', '.join(STEPS)}")
    try:
        probe = step.factory(cfg)
    except Unavailable as exc:
        return None, Availability(False, exc.reason, exc.hint)
    except Exception as exc:  # noqa: BLE001  (said as the probe's unavailability: start_all logs it, or raises for a required one)
        return None, Availability(False, f"cannot build: {type(exc).__name__}: {exc}", "")
    try:
        av = probe.check()
    except Exception as exc:  # noqa: BLE001  (check() must not raise; one that does is reported as above)
        return probe, Availability(False, f"check() raised {type(exc).__name__}: {exc}", "")
    if not isinstance(av, Availability):
        return probe, Availability(False, f"check() returned {type(av).__name__}, not an Availability",
                                   "this probe breaks the probes.probe contract")
    return probe, av


def start_all(cfg: config.Config, log: logging.Logger, names: list[str] | None = None) -> list[Running]:
    running: list[Running] = []
    for name in (names if names is not None else cfg.probes.enabled):
        probe, av = availability(name, cfg)
        step = STEPS.get(name)
        optional = probe.optional if probe is not None else True
        if not av.ok:
            msg = f"probe {name} unavailable: {av.reason}" + (f" (hint: {av.hint})" if av.hint else "")
            if not optional:
                raise InputError(msg)
            log.warning(msg)
            continue
        try:
            probe.start()
        except Exception as exc:  # noqa: BLE001  (one probe failing to start costs that probe only; logged)
            msg = f"probe {name} failed to start: {type(exc).__name__}: {exc}"
            try:
                probe.stop()
            except Exception as exc2:  # noqa: BLE001  (releasing what it half acquired; logged)
                log.warning("probe %s: stop() after the failed start raised %s: %s", name, type(exc2).__name__, exc2)
            if not optional:
                raise InputError(msg) from None
            log.warning(msg)
            continue
        log.info("probe %s started", name)
        running.append(Running(step, probe, av))
    return running


def stop_all(running: list[Running], log: logging.Logger) -> None:
    for r in reversed(running):
        try:
            r.probe.stop()
        except Exception as exc:  # noqa: BLE001  (every probe is stopped whatever one raises; logged)
            log.warning("probe %s: stop() raised %s: %s", r.step.name, type(exc).__name__, exc)
