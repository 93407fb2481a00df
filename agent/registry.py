"""Every probe the agent knows, as named start-up steps, and the code that starts them.

Contract:

* :data:`STEPS` maps a probe name (the names in ``probes.enabled`` of the config) to a
  :class:`Step`: the topic its data goes to (``events``, ``sched``, ``device``,
  ``engine``) and a factory that builds the probe from the configuration. Factories
  import their module lazily, so a missing module (no bcc, no CUPTI, no simulator)
  makes only that probe unavailable. Its names, in its order, are
  :data:`agent.probe_names.PROBE_NAMES` (what the configuration checks ``probes.enabled``
  against, without importing this module, whose factories take its ``Config``).
* :func:`availability(name, cfg)` builds the probe and returns ``(probe|None,
  Availability)`` without starting anything.
* :func:`start_all(cfg, log)` runs the steps in the configured order: build, ``check()``,
  ``start()``. An unavailable or failing probe is logged once (reason and hint) and
  skipped; a failing probe that is not ``optional`` raises
  :class:`probes.errors.InputError`. Returns the :class:`Running` probes.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Callable

from ridgeline.probes.errors import InputError
from ridgeline.probes.probe import Availability

from . import config


@dataclass
class Step:
    name: str
    topic: str
    factory: Callable[[config.Config], object]
    about: str
    # Polled once per window, just before it closes (the probe reports deltas per poll:
    # one poll per window gives per-window figures and costs least).
    per_window: bool = False


@dataclass
class Running:
    step: Step
    probe: object
    availability: Availability
    poll_errors: int = 0
    last_error: str = ""


class Unavailable(Exception):
    """Raised by a factory: the probe cannot even be built here."""

    def __init__(self, reason: str, hint: str = ""):
        super().__init__(reason)
        self.reason, self.hint = reason, hint


def _module(name: str, hint: str):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise Unavailable(f"{name} cannot be imported ({exc})", hint) from None


def _cls(mod, names: tuple[str, ...]):
    for n in names:
        c = getattr(mod, n, None)
        if c is not None:
            return c
    raise Unavailable(f"{mod.__name__} has no probe class (looked for {', '.join(names)})",
                      "this ridgeline build is incomplete")


def _sched(cfg):
    mod = _module("ridgeline.probes.sched", "install the distro bcc (scripts/setup-ebpf.sh)")
    cls = _cls(mod, ("SchedProbe", "Probe"))
    return _build(cls, pids=list(cfg.probes.pids))


def _cuda_uprobes(cfg):
    mod = _module("ridgeline.probes.cuda_uprobes", "install the distro bcc (scripts/setup-ebpf.sh)")
    cls = _cls(mod, ("CudaUprobesProbe", "CudaUprobeProbe", "UprobeProbe", "Probe"))
    return _build(cls, pids=list(cfg.probes.pids))


def _cupti(cfg):
    mod = _module("ridgeline.probes.cupti", "build the native part (scripts/setup-native.sh)")
    cls = _cls(mod, ("CuptiProbe", "Probe"))
    c = cfg.probes.cupti
    from ridgeline.aggregator.signatures import PeerNameClassifier
    # names are matched on the probe's pump thread, within a budget per process (issue 18.1)
    return _build(cls, socket_path=c.socket, socket_group=c.socket_group or None,
                  idle_peer_s=c.idle_peer_s, name_classifier=PeerNameClassifier())


def _nvml(cfg):
    mod = _module("ridgeline.probes.nvml", "install nvidia-ml-py and the NVIDIA driver")
    cls = _cls(mod, ("NvmlProbe", "NVMLProbe", "Probe"))
    return _build(cls)


def _engine(cfg):
    mod = _module("ridgeline.probes.engine", "this ridgeline build is incomplete")
    cls = _cls(mod, ("EngineProbe", "Probe"))
    e = cfg.probes.engine
    urls = [e.url] if e.url else []
    return _build(cls, urls=urls, url=e.url, pids=list(cfg.probes.pids), interval_s=e.interval_s,
                  timeout_s=e.timeout_s, max_body_bytes=e.max_body_bytes,
                  follow_redirects=e.follow_redirects)


def _otlp(cfg):
    mod = _module("ridgeline.probes.otlp_receiver", "install opentelemetry-proto (a dependency of ridgeline)")
    o = cfg.probes.otlp
    return mod.OtlpProbe(o.listen, max_body_bytes=o.max_body_bytes, max_connections=o.max_connections,
                         request_timeout_s=o.request_timeout_s, spans_per_s=o.spans_per_s,
                         max_attributes=o.max_attributes, max_attribute_bytes=o.max_attribute_bytes,
                         max_queued_spans=o.max_queued_spans)


def _sglang_requests(cfg):
    from ridgeline.probes.sglang_request_metrics import SglangRequestMetricsProbe
    s = cfg.probes.sglang_requests
    return SglangRequestMetricsProbe(s.dir, max_bytes_per_poll=s.max_bytes_per_poll,
                                     max_line_bytes=s.max_line_bytes)


def _replay(cfg):
    from ridgeline.probes.replay import ReplayProbe
    r = cfg.probes.replay
    return ReplayProbe(r.path or None, speed=r.speed, loop=r.loop)


def _simulator(cfg):
    mod = _module("ridgeline.agent.simulator", "the workload generator is not installed")
    factory = getattr(mod, "make_probe", None)
    s = config.as_table(cfg.probes.simulator)
    if not s.get("pid"):
        s.pop("pid", None)
    if factory is not None:
        return factory(s)
    cls = _cls(mod, ("SimulatorProbe", "Probe"))
    return _build(cls, **s)


def _build(cls, **kwargs):
    """Construct ``cls`` with those keyword arguments its signature names (a ``**kw``
    catch-all does not count: it may forward them somewhere they do not belong)."""
    import inspect
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return cls()
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return cls(**{k: v for k, v in kwargs.items() if k in named})


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
    except Exception as exc:
        return None, Availability(False, f"cannot build: {type(exc).__name__}: {exc}", "")
    try:
        av = probe.check()
    except Exception as exc:   # check() must not raise; one that does is reported
        return probe, Availability(False, f"check() raised {type(exc).__name__}: {exc}", "")
    if not isinstance(av, Availability):
        # Tolerate a probe returning any object with ok/reason/hint.
        av = Availability(bool(getattr(av, "ok", av)), str(getattr(av, "reason", "")), str(getattr(av, "hint", "")))
    return probe, av


def start_all(cfg: config.Config, log: logging.Logger, names: list[str] | None = None) -> list[Running]:
    running: list[Running] = []
    for name in (names if names is not None else cfg.probes.enabled):
        probe, av = availability(name, cfg)
        step = STEPS.get(name)
        optional = bool(getattr(probe, "optional", True)) if probe is not None else True
        if not av.ok:
            msg = f"probe {name} unavailable: {av.reason}" + (f" (hint: {av.hint})" if av.hint else "")
            if not optional:
                raise InputError(msg)
            log.warning(msg)
            continue
        try:
            probe.start()
        except Exception as exc:
            msg = f"probe {name} failed to start: {type(exc).__name__}: {exc}"
            try:
                probe.stop()
            except Exception:
                pass
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
        except Exception as exc:
            log.warning("probe %s: stop() raised %s: %s", r.step.name, type(exc).__name__, exc)
