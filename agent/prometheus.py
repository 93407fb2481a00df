"""Prometheus exposition of the agent's windows (``/metrics``, prometheus-client).

Contract: :class:`WindowCollector` turns the latest window (gauges) and running totals
(counters accumulated by :meth:`WindowCollector.observe` once per window) into metric
families that pass ``promtool check metrics``:

* names: ``ridgeline_`` prefix, base units (``_seconds``, ``_bytes``, ``_hertz``,
  ``_watts``, ``_joules``, ``_celsius``), ``_ratio`` for 0..1 fractions (never percent),
  counters end in ``_total``; every family has its own HELP text.
* latencies are histograms: the engine's own histograms are passed through with the
  engine's bucket bounds (``ridgeline_engine_*_seconds``), so ``histogram_quantile`` works
  in PromQL; no gauge carries a ``quantile`` or ``le`` label.
* labels join with dcgm-exporter: GPU series carry ``gpu`` (the NVML device index, as
  dcgm-exporter's ``gpu``: a process's CUDA ordinal is placed on its NVML GPU with NVML's
  process lists, :mod:`aggregator.gpu_identity`; an unplaced one keeps its ordinal and
  ``UUID=""``), ``UUID`` and ``Hostname``, dcgm-exporter's own label names,
  so ``* on(Hostname, gpu, UUID) group_left(modelName) DCGM_...`` joins. The GPU model is
  ``gpu_model``, not dcgm-exporter's ``modelName``: promtool's linter rejects camelCase
  label names, and the identity labels are enough to join; every series of this
  agent carries ``Hostname``; per-process series carry ``pid`` (engine series too, from
  the served process the endpoint was discovered from), so phase, engine and thread
  series join on ``Hostname``/``pid`` and GPU series on ``gpu``/``UUID``.
* bounded series: per-thread series exist for the launch threads (those that called the
  CUDA launch API in a recent window) and the top :data:`TOP_THREADS` threads by on-CPU
  time; a thread not seen for :data:`THREAD_STALE_WINDOWS` windows is removed (its series
  disappear). Per-GPU-process counters (phase kernel time, kernels, copies, idle time) are
  removed once their (GPU, process) has not been seen for :data:`GPU_STALE_WINDOWS`
  windows (an exited or restarted server), and at most :data:`MAX_GPU_PROCESSES` are kept
  (the least recently seen one makes room, counted in ``ridgeline_gpu_series_evicted_total``).
  Other families are capped at :data:`MAX_SERIES_PER_FAMILY` label sets.
* ``ridgeline_build_info`` and the client library's process / platform / GC collectors.

:class:`MetricsServer` serves them over HTTP from one thread, with a deadline per
connection and a bounded number of connections; a scrape never touches the probes.
"""
from __future__ import annotations

import collections
import gzip
import logging
import math
import platform
import selectors
import socket
import threading
import time

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from ridgeline.aggregator import gpu_identity
from ridgeline.probes.records import (
    CuptiProbeCounters,
    DeviceSample,
    DeviceSamples,
    EngineFigures,
    EngineProbeCounters,
    GpuProcess,
    Health,
    ProbeCounters,
    SchedThread,
    Window,
    window_of,
)

from . import sink_metrics

log = logging.getLogger("ridgeline.prometheus")

MAX_SERIES_PER_FAMILY = 2000
TOP_THREADS = 32                 # non-launch threads exposed, by cumulative on-CPU time
THREAD_STALE_WINDOWS = 30        # a thread unseen this many windows is dropped
MAX_THREADS_TRACKED = 1024       # threads remembered at all (launch threads always fit)
GPU_STALE_WINDOWS = 300          # a (GPU, process) unseen this many windows loses its counters
MAX_GPU_PROCESSES = 256          # (GPU, process) pairs whose counters are kept at all

GPU_LABELS = ["Hostname", "gpu", "UUID", "gpu_model", "pid", "source"]


def _num(v) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


log = logging.getLogger("ridgeline.prometheus")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("ridgeline")
    except PackageNotFoundError:      # run from a source tree that was never installed
        return "unknown"


class _Thread:
    __slots__ = ("comm", "acc", "last_seen", "launch")

    def __init__(self, comm: str):
        self.comm = comm
        self.acc = [0.0, 0.0, 0.0]
        self.last_seen = 0
        self.launch = False


def simulated_sources(w: Window) -> list[str]:
    """The window's simulated sources, sorted: GPU sources named ``simulated`` (the
    simulator probe), and ``engine`` when an engine endpoint's record says ``simulated``
    (which endpoints: ``ridgeline_engine_info{simulated="true"}``)."""
    from .window_sections import engine_records
    out = {s for s in w.sources if s.startswith("simulat")}
    out |= {g.source for g in w.gpus if g.source and g.source.startswith("simulat")}
    if any(e is not None and e.simulated for e in (_engine_figures(rec) for _, rec in engine_records(w.engine))):
        out.add("engine")
    return sorted(out)


def _engine_figures(rec: dict) -> EngineFigures | None:
    try:
        return msgspec.convert(rec, EngineFigures)
    except msgspec.ValidationError as exc:     # one bad endpoint record loses its own labels
        log.debug("engine record not readable: %s", exc)
        return None


def _probe_counters(raw, cls: type[ProbeCounters]) -> ProbeCounters | None:
    """One probe's counters of :attr:`Health.probes` as ``cls``; None when absent or not
    readable (one bad probe record loses its own series, the others stay)."""
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        log.debug("probe counters not readable: %s", exc)
        return None


def _device_samples(data) -> list:
    """The samples of one source of :attr:`Window.device`; none when it is not a
    :class:`DeviceSamples` (another probe's shape, or a producer's bug: logged)."""
    try:
        return msgspec.convert(data, DeviceSamples).devices
    except msgspec.ValidationError as exc:
        log.debug("device record not readable: %s", exc)
        return []


class WindowCollector:
    def __init__(self, host: str = ""):
        self._lock = threading.Lock()
        self.host = host
        self.window: Window | None = None    # the latest window, as typed records
        self.windows = 0
        # Records a scrape could not render, by (section, error type): counted, the first of
        # each logged with its traceback (a bug met by odd data costs that record's series).
        self.render_errors: collections.Counter = collections.Counter()
        self.windows_unreadable = 0          # windows refused by window_of (logged), never exposed
        self.phase_kernel_seconds: dict[tuple, float] = {}
        self.phase_kernels: dict[tuple, float] = {}
        self.work_bytes: dict[tuple, float] = {}          # + (phase, work_source)
        self.work_flops: dict[tuple, float] = {}
        self.work_busy_seconds: dict[tuple, float] = {}
        self.copy_bytes: dict[tuple, float] = {}
        self.idle_seconds: dict[tuple, float] = {}
        self.records = 0.0
        self.threads: dict[tuple, _Thread] = {}      # (pid, tid) -> accumulated scheduling time
        self.threads_dropped = 0
        self._gpu_ids: dict[int, tuple[str, str]] = {}   # device index -> (UUID, GPU model name) from NVML
        self._gpu_seen: dict[tuple, int] = {}           # (GPU, process) label key -> last window it was in
        self._ident: dict[tuple, tuple] = {}            # (pid, CUDA ordinal) -> (NVML index, UUID, name)
        self._nvml_places = False                       # NVML has said which processes run on which GPU
        self.gpu_series_evicted = 0
        # -- issue 22: request join aggregates (agent/request_metrics.py) --
        from .request_metrics import RequestMetrics
        self.request_metrics = RequestMetrics()
        from .straggler_metrics import StragglerMetrics  # issue 23
        self.straggler_metrics = StragglerMetrics()

    # ------------------------------------------------------------------ accumulation
    def _host(self, w: Window | None) -> str:
        return str((w.host if w is not None else None) or self.host or "")

    def _gpu_identity(self, pid, dev) -> tuple[str, str, str]:
        """(``gpu`` label, UUID, model) of CUDA device ``dev`` of process ``pid``: the NVML
        GPU it was placed on (:mod:`aggregator.gpu_identity`); when NVML lists where
        processes run but this one was not placed, the ordinal and no UUID (never another
        GPU's); without process lists, the ordinal taken as the NVML index."""
        ident = self._ident.get((str(pid), dev))
        if ident is not None:
            return str(ident[0]), ident[1], ident[2]
        if self._nvml_places:
            return str(dev), "", ""
        uuid, model = self._gpu_ids.get(dev, ("", ""))
        return str(dev), uuid, model

    def _gpu_key(self, w: Window, g: GpuProcess) -> tuple:
        gpu, uuid, model = self._gpu_identity(g.pid, g.device)
        return (self._host(w), gpu, uuid, model or str(g.gpu or ""), str(g.pid), str(g.source or ""))

    def _place_gpus(self, window: Window, nvml_records: list) -> None:
        placed = gpu_identity.process_gpus(nvml_records)
        if placed is None:
            return
        self._nvml_places = True
        ordinals: dict[str, set] = {}
        for g in window.gpus:
            if isinstance(g.device, int) and not isinstance(g.device, bool):
                ordinals.setdefault(str(g.pid), set()).add(g.device)
        for pid, ords in ordinals.items():
            if not pid.isdigit():
                continue
            for o, gpu in gpu_identity.place(int(pid), ords, placed).items():
                self._ident.pop((pid, o), None)
                self._ident[(pid, o)] = gpu
        while len(self._ident) > 4 * MAX_GPU_PROCESSES:      # bounded: the oldest placements go
            del self._ident[next(iter(self._ident))]

    def observe(self, window: dict) -> None:
        try:
            w = window_of(window)
        except msgspec.ValidationError as exc:    # a producer's bug: logged and counted, the last window stays
            log.warning("window not exposed: %s", exc)
            self.windows_unreadable += 1
            return
        with self._lock:
            self.window = w
            self.windows += 1
            nvml_records = []
            for _src, nv in w.device.items():
                for r in _device_samples(nv):
                    if not isinstance(r, dict):
                        continue
                    try:
                        d = msgspec.convert(r, DeviceSample)
                    except msgspec.ValidationError:     # not an NVML sample: not placed
                        continue
                    if d.gpu_index is not None:
                        nvml_records.append(r)
                        self._gpu_ids[d.gpu_index] = (str(d.gpu_uuid or ""), str(d.gpu_name or ""))
            self._place_gpus(w, nvml_records)
            launch: set[tuple[str, str]] = set()
            for g in w.gpus:
                base = self._gpu_key(w, g)
                self._gpu_seen[base] = self.windows
                for tid in g.launch_tids:
                    launch.add((str(g.pid), str(tid)))
                for ph, f in g.phases.items():
                    k = base + (ph,)
                    self.phase_kernel_seconds[k] = self.phase_kernel_seconds.get(k, 0.0) + f.kernel_time_ns * 1e-9
                    self.phase_kernels[k] = self.phase_kernels.get(k, 0.0) + f.kernels
                    # The work behind the achieved rates, as counters: rate() over any scrape
                    # interval gives the achieved bandwidth / FLOP rate of that interval,
                    # where the window gauges are one window out of each scrape interval.
                    busy, nb, nf = _num(f.work_busy_ns), _num(f.bytes), _num(f.flops)
                    if busy and nb is not None and nf is not None and f.work_source:
                        kw = k + (str(f.work_source),)
                        self.work_busy_seconds[kw] = self.work_busy_seconds.get(kw, 0.0) + busy * 1e-9
                        self.work_bytes[kw] = self.work_bytes.get(kw, 0.0) + nb
                        self.work_flops[kw] = self.work_flops.get(kw, 0.0) + nf
                for d, b in g.copy_bytes.items():
                    k = base + (d,)
                    self.copy_bytes[k] = self.copy_bytes.get(k, 0.0) + b
                self.idle_seconds[base] = self.idle_seconds.get(base, 0.0) + g.idle_ns * 1e-9
            self._expire_gpu_series()
            if w.agent.records_total is not None:
                self.records = float(w.agent.records_total)
            self._observe_threads(w, launch)
            self.request_metrics.observe(w)     # issue 22
            self.straggler_metrics.observe(w)   # issue 23

    def _expire_gpu_series(self) -> None:
        """Drop the counters of (GPU, process) pairs unseen for :data:`GPU_STALE_WINDOWS`
        windows, then of the least recently seen ones beyond :data:`MAX_GPU_PROCESSES`
        (counted): exited servers' series go, a restarted server's always get in."""
        gone = {b for b, last in self._gpu_seen.items() if self.windows - last >= GPU_STALE_WINDOWS}
        if len(self._gpu_seen) - len(gone) > MAX_GPU_PROCESSES:
            live = sorted((last, b) for b, last in self._gpu_seen.items() if b not in gone)
            extra = live[:len(live) - MAX_GPU_PROCESSES]
            gone |= {b for _, b in extra}
            self.gpu_series_evicted += len(extra)
        if not gone:
            return
        for b in gone:
            del self._gpu_seen[b]
        n = len(GPU_LABELS)
        for store in (self.phase_kernel_seconds, self.phase_kernels, self.copy_bytes, self.idle_seconds,
                      self.work_bytes, self.work_flops, self.work_busy_seconds):
            for k in [k for k in store if k[:n] in gone]:
                del store[k]

    def _observe_threads(self, window: Window, launch: set) -> None:
        from .window_sections import sched_threads
        for row in sched_threads(window.sched):
            try:
                th = msgspec.convert(row, SchedThread)
            except msgspec.ValidationError as exc:    # one bad row loses that thread's figures
                log.debug("sched row not readable: %s", exc)
                continue
            key = (str(th.pid), str(th.tid))
            if th.launches:        # the sched probe counted CUDA launch calls from it
                launch.add(key)
            t = self.threads.get(key)
            if t is None:
                if len(self.threads) >= MAX_THREADS_TRACKED and not self._evict_one(key in launch):
                    self.threads_dropped += 1      # counted and published, never silent
                    continue
                t = self.threads[key] = _Thread(str(th.comm or ""))
            if th.comm is not None:
                t.comm = str(th.comm)
            t.last_seen = self.windows
            for i, v in enumerate((th.on_cpu_ns, th.runq_wait_ns, th.blocked_ns)):
                t.acc[i] += float(v or 0) * 1e-9
        for key in launch:
            if key in self.threads:
                self.threads[key].launch = True
        # Stale threads (exited, or idle for long) go: their series disappear.
        for key in [k for k, t in self.threads.items() if self.windows - t.last_seen >= THREAD_STALE_WINDOWS]:
            del self.threads[key]

    def _evict_one(self, for_launch: bool) -> bool:
        """Make room: drop the longest-unseen non-launch thread not seen in this window (a
        launch thread may also push out the lowest on-CPU one). False if nothing can go."""
        old = [(t.last_seen, t.acc[0], k) for k, t in self.threads.items()
               if not t.launch and (t.last_seen < self.windows or for_launch)]
        if not old:
            return False
        del self.threads[min(old)[2]]
        return True

    def exposed_threads(self) -> list[tuple[tuple, _Thread]]:
        """Launch threads, then the top :data:`TOP_THREADS` others by on-CPU time."""
        launch = [(k, t) for k, t in self.threads.items() if t.launch]
        rest = sorted(((k, t) for k, t in self.threads.items() if not t.launch), key=lambda kt: -kt[1].acc[0])
        return launch + rest[:TOP_THREADS]

    # ------------------------------------------------------------------ collection
    def collect(self):
        with self._lock:
            w = self.window
            yield self._build_info()
            yield self._simulated(w or Window())
            yield from self._counters(w)
            if w is None:
                return
            yield from self._phase_gauges(w)
            yield from self._engine(w)
            yield from self._device(w)
            yield from self._verdicts(w)
            yield from self._agent(w.agent, w)
            yield from self.request_metrics.families(self._host(w), w)     # issue 22
            yield from self.straggler_metrics.families(self._host(w))       # issue 23
            yield from sink_metrics.families(self._host(w), w.agent.sink)   # issue 23

    def _build_info(self):
        from ridgeline.aggregator import wire
        info = InfoMetricFamily("ridgeline_build", "Ridgeline agent build: version, wire schema, Python",
                                labels=["Hostname"])
        info.add_metric([self.host or ""], {"version": _version(), "schema_version": str(wire.SCHEMA_VERSION),
                                            "python_version": platform.python_version()})
        return info

    def _simulated(self, w: Window):
        """One series says whether this host's figures are simulated (docs/metrics.md,
        "Simulated data"): host-wide metadata is one series joined on Hostname, as
        ``ridgeline_build_info`` is, not a label on every series (which would change every
        series' identity, and break rate(), when a host goes from the demo to real data)."""
        sim = simulated_sources(w)
        g = GaugeMetricFamily("ridgeline_simulated", "1 while any figure this agent exposes comes from a simulated "
                              "source (sources: which); join on Hostname to mark or drop them",
                              labels=["Hostname", "sources"])
        g.add_metric([self._host(w), ",".join(sim)], 1.0 if sim else 0.0)
        return g

    def _counters(self, w: Window | None):
        gl = list(GPU_LABELS)
        specs = ((self.phase_kernel_seconds, "ridgeline_phase_kernel_seconds",
                  "GPU kernel time per phase, per GPU and served process", gl + ["phase"]),
                 (self.phase_kernels, "ridgeline_phase_kernels", "Kernels run per phase", gl + ["phase"]),
                 (self.copy_bytes, "ridgeline_copy_bytes", "Bytes copied between host and GPU, by direction",
                  gl + ["direction"]),
                 (self.idle_seconds, "ridgeline_gpu_idle_seconds", "GPU idle time between kernels", gl),
                 (self.work_bytes, "ridgeline_phase_work_bytes",
                  "Bytes the phase's kernels moved (work_source: kernel shapes or the model); "
                  "rate() over rate(ridgeline_phase_work_busy_seconds_total) is the achieved bandwidth",
                  gl + ["phase", "work_source"]),
                 (self.work_flops, "ridgeline_phase_work_flops",
                  "FLOPs the phase's kernels did (work_source: kernel shapes or the model)",
                  gl + ["phase", "work_source"]),
                 (self.work_busy_seconds, "ridgeline_phase_work_busy_seconds",
                  "Kernel-busy time the phase's work figures cover (the achieved rates' denominator)",
                  gl + ["phase", "work_source"]))
        for store, name, doc, labels in specs:
            c = CounterMetricFamily(name, doc, labels=labels)
            for k, v in list(store.items())[:MAX_SERIES_PER_FAMILY]:
                c.add_metric(list(k), v)
            yield c
        host = self._host(w)
        fams = [CounterMetricFamily(f"ridgeline_thread_{what}_seconds", doc,
                                    labels=["Hostname", "pid", "tid", "comm", "role"])
                for what, doc in (("on_cpu", "Watched thread's time on CPU"),
                                  ("runq_wait", "Watched thread's time runnable, waiting in the run queue"),
                                  ("blocked", "Watched thread's time off CPU and not runnable"))]
        for (pid, tid), t in self.exposed_threads():
            for i, fam in enumerate(fams):
                fam.add_metric([host, pid, tid, t.comm, "launch" if t.launch else "top"], t.acc[i])
        yield from fams
        for cls, name, doc, value in (
                (GaugeMetricFamily, "ridgeline_threads_tracked", "Threads the scheduling figures are kept for",
                 len(self.threads)),
                (CounterMetricFamily, "ridgeline_threads_dropped", "Threads not tracked: the thread table was full",
                 self.threads_dropped),
                (CounterMetricFamily, "ridgeline_gpu_series_evicted",
                 "(GPU, process) pairs whose counters were removed to keep the series bounded while still seen "
                 "recently (more than the table holds)", self.gpu_series_evicted),
                (CounterMetricFamily, "ridgeline_windows", "Windows the agent closed", self.windows),
                (CounterMetricFamily, "ridgeline_agent_records", "Records the probes delivered", self.records)):
            fam = cls(name, doc, labels=["Hostname"])
            fam.add_metric([host], value)
            yield fam

    def _phase_gauges(self, w: Window):
        gl = list(GPU_LABELS)
        specs = {
            "time_share_pct": ("ridgeline_phase_time_share_ratio", "Share of the GPU's kernel time in this phase", 0.01),
            "achieved_bytes_per_s": ("ridgeline_phase_achieved_bytes_per_second",
                                     "Achieved memory bandwidth in this phase", 1.0),
            "achieved_flops_per_s": ("ridgeline_phase_achieved_flops_per_second", "Achieved FLOP rate in this phase", 1.0),
            "arithmetic_intensity": ("ridgeline_phase_arithmetic_intensity_flops_per_byte",
                                     "FLOPs per byte moved in this phase (roofline x)", 1.0),
            "pct_of_peak_bytes": ("ridgeline_phase_peak_bandwidth_ratio",
                                  "Achieved / peak memory bandwidth in this phase", 0.01),
            "pct_of_peak_flops": ("ridgeline_phase_peak_flops_ratio", "Achieved / peak FLOP rate in this phase", 0.01),
            "kv_read_bytes_per_s": ("ridgeline_phase_kv_read_bytes_per_second",
                                    "Decode KV-cache reads per second from the engine's own estimate "
                                    "(estimated_read_bytes_per_gpu minus the model's weight and activation bytes)", 1.0),
        }
        fams = {k: GaugeMetricFamily(n, h, labels=gl + ["phase"]) for k, (n, h, _) in specs.items()}
        busy = GaugeMetricFamily("ridgeline_gpu_busy_ratio", "Kernel-busy share of the window's covered span",
                                 labels=gl)
        peak_bw = GaugeMetricFamily("ridgeline_gpu_peak_bytes_per_second",
                                    "Memory bandwidth ceiling of the GPU (ceilings table)", labels=gl)
        peak_fl = GaugeMetricFamily("ridgeline_gpu_peak_flops_per_second",
                                    "Dense FLOP-rate ceiling of the GPU per precision (ceilings table)",
                                    labels=gl + ["precision"])
        for g in w.gpus[:MAX_SERIES_PER_FAMILY]:
            base = list(self._gpu_key(w, g))
            if g.span_ns:
                busy.add_metric(base, g.busy_ns / g.span_ns)
            if g.ceilings is not None:
                if _num(g.ceilings.hbm_bytes_per_s) is not None:
                    peak_bw.add_metric(base, float(g.ceilings.hbm_bytes_per_s))
                for prec, v in g.ceilings.flops_per_s.items():
                    if _num(v) is not None:
                        peak_fl.add_metric(base + [str(prec)], float(v))
            for ph, f in g.phases.items():
                for key, (_, _, factor) in specs.items():
                    v = _num(getattr(f, key))
                    if v is not None:
                        fams[key].add_metric(base + [ph], v * factor)
        yield busy
        yield peak_bw
        yield peak_fl
        yield from fams.values()

    def _render_failed(self, section: str, exc: Exception) -> None:
        key = (section, type(exc).__name__)
        self.render_errors[key] += 1
        if self.render_errors[key] == 1:
            log.warning("/metrics: a %s record could not be rendered: %s: %s (counted; said once per kind)",
                        section, type(exc).__name__, exc, exc_info=exc)

    def _engine(self, w: Window):
        from ridgeline.aggregator import engine_metrics

        from .window_sections import engine_records
        host = self._host(w)
        fams: dict[str, object] = {}
        keys: dict[str, list] = {}
        hists: dict[str, HistogramMetricFamily] = {}
        info = InfoMetricFamily("ridgeline_engine", "Serving engine behind an endpoint: engine, version, "
                                "model, and where KV eviction and work estimates come from ('' = not exported)",
                                labels=["Hostname", "endpoint", "pid"])
        firing = GaugeMetricFamily("ridgeline_alert_firing", "1 while the agent's own alert is firing",
                                   labels=["Hostname", "endpoint", "pid", "alert"])
        for ep, rec in engine_records(w.engine):
            e = _engine_figures(rec)
            if e is None:
                continue
            pid = "" if e.pid is None else str(e.pid)
            lab = {"Hostname": host, "endpoint": str(ep), "pid": pid}
            info.add_metric([host, str(ep), pid], {
                "engine": str(e.engine or ""), "version": str(e.version_hint or ""),
                "model_name": ",".join(e.model_names or []) if isinstance(e.model_names, list) else "",
                "kv_eviction_source": str(e.kv_eviction_source or ""),
                "work_estimate_source": str(e.work_estimate_source or ""),
                "simulated": "true" if e.simulated else "false"})
            try:
                samples = engine_metrics.prometheus_samples(rec, lab)
                histograms = engine_metrics.prometheus_histograms(rec)
            except Exception as exc:  # noqa: BLE001  (one engine record's series lost, not the scrape; counted, logged)
                self._render_failed("engine", exc)
                continue
            for name, labels, value in samples:
                counter = name.endswith("_total")
                base = name[:-6] if counter else name
                if base not in fams:
                    doc = engine_metrics.prometheus_help(name) or base
                    keys[base] = sorted(labels)
                    cls = CounterMetricFamily if counter else GaugeMetricFamily
                    fams[base] = cls(base, doc, labels=keys[base])
                if sorted(labels) != keys[base] or len(fams[base].samples) >= MAX_SERIES_PER_FAMILY:
                    continue
                fams[base].add_metric([str(labels[k]) for k in keys[base]], value)
            for name, doc, buckets, total in histograms:
                h = hists.setdefault(name, HistogramMetricFamily(name, doc, labels=["Hostname", "endpoint", "pid",
                                                                                  "engine"]))
                h.add_metric([host, str(ep), pid, str(e.engine)], buckets, total)
            for aname, st in e.alerts.items():
                firing.add_metric([host, str(ep), pid, str(aname)], 1.0 if st.firing else 0.0)
        yield info
        yield from fams.values()
        yield from hists.values()
        yield firing

    def _device(self, w: Window):
        from ridgeline.aggregator import device_metrics
        host = self._host(w)
        fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        keys: dict[str, list] = {}
        for _src, data in w.device.items():
            recs = _device_samples(data)
            if not recs:
                continue
            try:
                figs = device_metrics.window_figures(recs).values()
            except Exception as exc:  # noqa: BLE001  (one source's device series lost, not the scrape; counted, logged)
                self._render_failed("device", exc)
                continue
            for fig in figs:
                try:
                    d = msgspec.convert(fig, DeviceSample)
                except msgspec.ValidationError as exc:     # one GPU's figures lose their series
                    log.debug("device figures not readable: %s", exc)
                    continue
                ids = {"Hostname": host, "gpu": str(d.gpu_index), "UUID": str(d.gpu_uuid or ""),
                       "gpu_model": str(d.gpu_name or "")}
                for name, labels, value in device_metrics.prometheus_samples(fig, ids):
                    labels.pop("gpu_name", None)
                    if name not in fams:
                        keys[name] = sorted(labels)
                        doc = device_metrics.prometheus_help(name)
                        fams[name] = (CounterMetricFamily(name.removesuffix("_total"), doc, labels=keys[name])
                                      if name.endswith("_total") else GaugeMetricFamily(name, doc, labels=keys[name]))
                    if sorted(labels) == keys[name] and len(fams[name].samples) < MAX_SERIES_PER_FAMILY:
                        fams[name].add_metric([str(labels[k]) for k in keys[name]], value)
        yield from fams.values()

    def _verdicts(self, w: Window):
        from ridgeline.aggregator import verdict
        host = self._host(w)
        info = InfoMetricFamily("ridgeline_phase_verdict", "Roofline verdict per GPU, served process and phase",
                                labels=GPU_LABELS + ["phase"])
        for g in w.gpus[:MAX_SERIES_PER_FAMILY]:
            for ph, f in g.phases.items():
                if f.verdict:
                    info.add_metric(list(self._gpu_key(w, g)) + [ph], {"verdict": str(f.verdict)})
        yield info
        state = GaugeMetricFamily("ridgeline_verdict_state",
                                  "Window verdict per GPU and served process: 1 for the current verdict, "
                                  "0 for the others (face: the bottleneck's face, '' when none)",
                                  labels=["Hostname", "gpu", "pid", "verdict", "face"])
        v = w.verdict
        if isinstance(v, list):
            for x in v[:MAX_SERIES_PER_FAMILY]:
                if isinstance(x, dict) and x.get("verdict") in verdict.VERDICTS:
                    gpu = self._gpu_identity(x.get("pid"), x.get("device"))[0]
                    for _name, labels, value in verdict.prometheus_samples(x):
                        state.add_metric([host, gpu, str(labels.get("pid", "")),
                                          str(labels["verdict"]), str(labels.get("face") or "")], value)
        yield state

    def _agent(self, a: Health, w: Window):
        host = self._host(w)
        for name, doc, value in (("ridgeline_agent_cpu_ratio", "Agent CPU use over the window, fraction of one core",
                                  (a.cpu_pct or 0) / 100),
                                 ("ridgeline_agent_resident_memory_bytes", "Agent resident memory",
                                  a.rss_bytes or 0)):
            fam = GaugeMetricFamily(name, doc, labels=["Hostname"])
            fam.add_metric([host], float(value))
            yield fam
        drops = CounterMetricFamily("ridgeline_agent_probe_drops", "Records a probe dropped (bounded buffers full)",
                                    labels=["Hostname", "probe"])
        errors = CounterMetricFamily("ridgeline_agent_probe_errors", "Errors a probe met", labels=["Hostname", "probe"])
        for name, raw in a.probes.items():
            c = _probe_counters(raw, ProbeCounters) or ProbeCounters()
            drops.add_metric([host, name], float(c.drops or 0))
            errors.add_metric([host, name], float(c.errors or 0))
        yield drops
        yield errors
        pd = CounterMetricFamily("ridgeline_agent_publisher_drops", "Stream messages dropped for slow subscribers",
                                 labels=["Hostname", "topic"])
        for t, n in a.publisher_drops_by_topic.items():
            pd.add_metric([host, t], float(n))
        yield pd
        # Engine scrapes that failed, by kind (timeout, too_large, connect, http_status, ...).
        sf = CounterMetricFamily("ridgeline_agent_engine_scrape_failures",
                                 "Engine /metrics scrapes that failed, by kind",
                                 labels=["Hostname", "kind"])
        engine = _probe_counters(a.probes.get("engine"), EngineProbeCounters) or EngineProbeCounters()
        for kind, n in sorted(engine.scrape_failures.items()):
            if _num(n) is not None:
                sf.add_metric([host, str(kind)], float(n))
        yield sf
        # The CUPTI socket's own defence: connections refused at the descriptor-derived
        # limit, at one user's share of it, and peers cut for claiming another pid.
        cr = CounterMetricFamily("ridgeline_agent_cupti_refused_connections",
                                 "Connections the CUPTI socket refused or cut, by reason "
                                 "(limit, per_user, peer_identity)", labels=["Hostname", "reason"])
        cupti = _probe_counters(a.probes.get("cupti"), CuptiProbeCounters) or CuptiProbeCounters()
        for reason, n in (("limit", cupti.server_refused_connections),
                          ("per_user", cupti.server_refused_connections_uid),
                          ("peer_identity", cupti.server_rejected_peers)):
            if _num(n) is not None:
                cr.add_metric([host, reason], float(n))
        yield cr
        yield from self._cupti_peers(host, cupti)
        yield from self._cupti_takeover_owners(host, a)
        # This endpoint's own defence: slow clients cut, connections evicted or refused.
        ms = CounterMetricFamily("ridgeline_agent_metrics_server_events",
                                 "Connection events of the agent's /metrics server (timeouts, evictions, ...)",
                                 labels=["Hostname", "event"])
        for ev, n in sorted(a.metrics_server.items()):
            if ev != "open_connections" and _num(n) is not None:
                ms.add_metric([host, str(ev)], float(n))
        yield ms
        for key, name, doc in (("dropped_records", "ridgeline_agent_dropped_records", "Records the probes lost"),
                               ("dropped_batches", "ridgeline_agent_dropped_batches",
                                "Batches or scrapes the probes lost whole (their record count is unknown)"),
                               ("window_drops", "ridgeline_agent_window_dropped_events",
                                "Events the window builder dropped (its bounded per-window buffers were full)"),
                               ("window_fold_errors", "ridgeline_agent_window_fold_errors",
                                "Event batches the window fold could not take (counted, the window still closes)"),
                               ("window_open_steps_cut", "ridgeline_agent_window_open_steps_cut",
                                "Open GPU steps decided before their end because the held kernels hit the carry bound")):
            if _num(getattr(a, key)) is not None:
                fam = CounterMetricFamily(name, doc, labels=["Hostname"])
                fam.add_metric([host], float(getattr(a, key)))
                yield fam
        if _num(a.cupti_processes_taken_over) is not None:
            # legacy CUPTI: another tool (torch.profiler) holds the callbacks; no kernels
            # come from these processes until it is done or they are told to reclaim
            fam = GaugeMetricFamily("ridgeline_agent_cupti_processes_taken_over",
                                    "Served processes whose CUPTI another tool took over (their records paused)",
                                    labels=["Hostname"])
            fam.add_metric([host], float(a.cupti_processes_taken_over))
            yield fam
        clk = cupti.clock_disagreements
        if _num(clk) is not None:
            # API/marker CPU timestamps not on the agent's clock (e.g. a profiler's TSC ticks)
            fam = CounterMetricFamily("ridgeline_agent_cupti_clock_disagreements",
                                      "CUPTI API and marker records whose CPU timestamps disagree with the agent's "
                                      "receive time (rejected, never published)", labels=["Hostname"])
            fam.add_metric([host], float(clk))
            yield fam
        if _num(a.bpf_run_time_ns) is not None:
            fam = CounterMetricFamily("ridgeline_agent_bpf_run_seconds", "Time the agent's BPF programs ran in the kernel",
                                      labels=["Hostname"])
            fam.add_metric([host], a.bpf_run_time_ns * 1e-9)
            yield fam


    # -- issue 18.3/18.4: CUPTI peers cut for their identity or for idling (own block) --
    #: (reason label, counter of the CUPTI probe) of ridgeline_agent_cupti_connections_cut
    CUPTI_CUTS = (("process_gone", "server_process_gone_cut"), ("pid_reused", "server_pid_reused_cut"),
                  ("idle", "server_idle_peer_cut"), ("fair_share", "server_evicted_fair_share"))

    def _cupti_peers(self, host: str, cupti: CuptiProbeCounters):
        """Connections the CUPTI socket cut after accepting them: the process behind it gone
        or its pid given to another process, idle after HELLO, or evicted so that root or a
        user holding fewer connections gets a slot; and the batches dropped with a reused
        pid's connection. Exported at 0 from the socket's start (the probe's counters)."""
        cut = CounterMetricFamily("ridgeline_agent_cupti_connections_cut",
                                  "Connections the CUPTI socket cut after accepting them, by reason "
                                  "(process_gone, pid_reused, idle, fair_share)", labels=["Hostname", "reason"])
        for reason, key in self.CUPTI_CUTS:
            n = getattr(cupti, key)
            if _num(n) is not None:
                cut.add_metric([host, reason], float(n))
        yield cut
        if _num(cupti.server_identity_dropped_batches) is not None:
            fam = CounterMetricFamily("ridgeline_agent_cupti_identity_dropped_batches",
                                      "CUPTI batches dropped because their connection's pid belonged to another "
                                      "process by the time they were checked", labels=["Hostname"])
            fam.add_metric([host], float(cupti.server_identity_dropped_batches))
            yield fam
        yield from self._cupti_names(host, cupti)

    def _cupti_names(self, host: str, cupti: CuptiProbeCounters):
        """What peers' kernel names cost the agent, by the probe's own counters: demangler
        workers the seccomp filter killed (a parsed name should never make one), and names
        left unmatched by the signatures because their process's or user's matching time
        was spent (issue 18.1/18.2)."""
        for n, name, doc in (
                (cupti.demangler_seccomp_kills, "ridgeline_agent_cupti_demangler_seccomp_kills",
                 "Demangler worker processes killed by their seccomp filter (a forbidden system call)"),
                (cupti.names_not_classified, "ridgeline_agent_cupti_names_unclassified",
                 "Kernel names from injected processes left unmatched by the signatures: the process's or "
                 "its user's matching time budget was spent")):
            if _num(n) is not None:
                fam = CounterMetricFamily(name, doc, labels=["Hostname"])
                fam.add_metric([host], float(n))
                yield fam

    def _cupti_takeover_owners(self, host: str, a: Health):
        """Taken-over processes per uid (any local user may flag its own process): the
        alert says whose. At most agent.cupti_takeover.UID_SERIES uids, then "other"."""
        by = a.cupti_taken_over_by_uid
        if not isinstance(by, dict):
            return
        fam = GaugeMetricFamily("ridgeline_agent_cupti_processes_taken_over_by_user",
                                "Served processes whose CUPTI another tool took over, by the uid the process "
                                "runs as (the kernel's; 'other' past 16 uids)", labels=["Hostname", "uid"])
        for uid, n in list(by.items())[:17]:
            if _num(n) is not None:
                fam.add_metric([host, str(uid)[:16]], float(n))
        yield fam

def registry_for(collector: WindowCollector) -> CollectorRegistry:
    """A registry with ``collector`` and the client library's process, platform and GC collectors."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class MetricsServer:
    """Serve a :class:`WindowCollector` on ``listen`` (HOST:PORT); :meth:`observe` feeds it.

    One thread serves every connection through a selector, so no number of clients can
    make the agent start threads (the unit's ``TasksMax``). Each connection has
    ``timeout_s`` in all to send its request (at most 8 KiB of head) and take the answer;
    then it is closed. At most ``max_connections`` are open: a new one past the limit
    closes the oldest connection still sending its request (a slow or idle client), or
    is closed itself when all are being answered. One request per connection
    (``Connection: close``); ``GET``/``HEAD`` of ``/metrics`` or ``/``, text or
    OpenMetrics by ``Accept``, gzip by ``Accept-Encoding``. What happened is counted in
    :attr:`stats` (``requests``, ``timeouts``, ``evicted``, ``refused``, ``bad_requests``,
    ``not_found``, ``errors``); the descriptors it uses are ``max_connections`` + 3.
    """

    MAX_HEAD_BYTES = 8192
    ACCEPT_PAUSE_S = 0.2

    def __init__(self, agent, listen: str, max_connections: int = 16, timeout_s: float = 5.0):
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")
        self.collector = WindowCollector(host=str(getattr(agent, "host", "") or ""))
        self.registry = registry_for(self.collector)
        self.max_connections = int(max_connections)
        self.timeout_s = float(timeout_s)
        self.stats = collections.Counter()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        ls = socket.socket(family, socket.SOCK_STREAM)
        try:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((host, int(port)))
            ls.listen(64)
            ls.setblocking(False)
        except BaseException:
            ls.close()
            raise
        self._listener = ls
        self.port = ls.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(ls, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: dict[socket.socket, _HttpConn] = {}     # in accept order
        self._cache: tuple | None = None
        self._accept_paused_until = 0.0
        self.wakeups = 0          # turns of the serving loop (a spin would show here)
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="ridgeline-metrics", daemon=True)
        self._thread.start()

    def observe(self, window: dict) -> None:
        self.collector.observe(window)

    def configure(self, max_connections: int, timeout_s: float) -> None:
        """New limits for connections accepted from now on (a reload)."""
        self.max_connections, self.timeout_s = int(max_connections), float(timeout_s)

    def counters(self) -> dict:
        return dict(self.stats, open_connections=len(self._conns))

    # -- the serving thread ------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop:
            self.wakeups += 1
            now = time.monotonic()
            wait = 0.5
            if self._accept_paused_until:
                if now >= self._accept_paused_until:
                    self._accept_paused_until = 0.0
                    self._sel.register(self._listener, selectors.EVENT_READ, "listen")
                else:
                    wait = min(wait, self._accept_paused_until - now)
            for c in self._conns.values():
                wait = min(wait, max(0.0, c.deadline - now))
            try:
                events = self._sel.select(wait)
            except OSError:
                self.stats["errors"] += 1
                time.sleep(0.05)
                continue
            for key, mask in events:
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    try:
                        self._wake_r.recv(64)
                    except OSError:
                        pass
                elif key.fileobj in self._conns:
                    conn = self._conns[key.fileobj]
                    try:
                        if mask & selectors.EVENT_READ:
                            self._read(conn)
                        elif mask & selectors.EVENT_WRITE:
                            self._write(conn)
                    except OSError:                    # the scraper went away
                        self.stats["errors"] += 1
                        self._close(conn)
                    except Exception:  # noqa: BLE001  (a bug met by one request must not stop /metrics; counted, logged)
                        self.stats["errors"] += 1
                        log.exception("/metrics: request handling failed (counted; connection closed)")
                        self._close(conn)
            now = time.monotonic()
            for conn in [c for c in self._conns.values() if c.deadline <= now]:
                self.stats["timeouts"] += 1
                self._close(conn)
        for conn in list(self._conns.values()):
            self._close(conn)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                s, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # EMFILE and friends: counted; the connection stays in the backlog. The
                # listener stays readable, so stop watching it for a moment rather than spin.
                self.stats["accept_errors"] += 1
                self._sel.unregister(self._listener)
                self._accept_paused_until = time.monotonic() + self.ACCEPT_PAUSE_S
                return
            if len(self._conns) >= self.max_connections:
                waiting = self._oldest_waiting()
                if len(self._conns) >= self.max_connections:
                    if waiting is None:
                        self.stats["refused"] += 1
                        s.close()
                        continue
                    self.stats["evicted"] += 1
                    self._close(waiting)
            s.setblocking(False)
            conn = _HttpConn(s, time.monotonic() + self.timeout_s)
            self._conns[s] = conn
            self._sel.register(s, selectors.EVENT_READ, "conn")

    def _oldest_waiting(self) -> "_HttpConn | None":
        """The oldest connection still sending its request, after giving each candidate one
        read: a scraper accepted in this same burst whose request already arrived is
        answered, not evicted for the flood behind it. None when all are being answered
        (or a read closed one, freeing a place)."""
        for c in list(self._conns.values()):
            if c.out:
                continue
            try:
                self._read(c)
            except OSError:                    # the scraper went away
                self.stats["errors"] += 1
                self._close(c)
            except Exception:  # noqa: BLE001  (a bug met by one request must not stop /metrics; counted, logged)
                self.stats["errors"] += 1
                log.exception("/metrics: request handling failed (counted; connection closed)")
                self._close(c)
            if c.sock not in self._conns:
                return None
            if not c.out:
                return c
        return None

    def _read(self, conn: "_HttpConn") -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            self._close(conn)
            return
        conn.buf += data
        end = conn.buf.find(b"\r\n\r\n")
        if end > self.MAX_HEAD_BYTES or (end < 0 and len(conn.buf) > self.MAX_HEAD_BYTES):
            self.stats["bad_requests"] += 1
            self._answer(conn, 431, b"request head too large\n")
            return
        if end < 0:
            return
        self._respond(conn, bytes(conn.buf[:end]))

    def _respond(self, conn: "_HttpConn", head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            self.stats["bad_requests"] += 1
            self._answer(conn, 400, b"bad request\n")
            return
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            self.stats["bad_requests"] += 1
            self._answer(conn, 405, b"only GET and HEAD\n", extra=b"Allow: GET, HEAD\r\n")
            return
        if target not in (b"/metrics", b"/"):
            self.stats["not_found"] += 1
            self._answer(conn, 404, b"not found: try /metrics\n")
            return
        headers = {}
        for line in lines[1:]:
            k, sep, v = line.partition(b":")
            if sep:
                headers[k.strip().lower()] = v.strip().decode("latin-1")
        body, ctype, gz = self._exposition(headers.get(b"accept", ""), headers.get(b"accept-encoding", ""))
        self.stats["requests"] += 1
        extra = b"Content-Encoding: gzip\r\n" if gz else b""
        self._answer(conn, 200, body, ctype=ctype.encode("latin-1"), extra=extra, head_only=method == b"HEAD")

    def _exposition(self, accept: str, accept_encoding: str) -> tuple[bytes, str, bool]:
        """The rendered body, reused while no new window arrived (a flood of scrapes costs
        one rendering per window, not one per request)."""
        encoder, ctype = choose_encoder(accept)
        gz = "gzip" in accept_encoding
        key = (self.collector.windows, ctype, gz)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1], ctype, gz
        body = encoder(self.registry)
        if gz:
            body = gzip.compress(body, compresslevel=5)
        self._cache = (key, body)
        return body, ctype, gz

    def _answer(self, conn: "_HttpConn", status: int, body: bytes, ctype: bytes = b"text/plain; charset=utf-8",
                extra: bytes = b"", head_only: bool = False) -> None:
        reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed",
                  431: b"Request Header Fields Too Large"}[status]
        head = (b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n%s\r\n"
                % (status, reason, ctype, len(body), extra))
        conn.out = memoryview(head + (b"" if head_only else body))
        self._sel.modify(conn.sock, selectors.EVENT_WRITE, "conn")
        self._write(conn)

    def _write(self, conn: "_HttpConn") -> None:
        try:
            n = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.out = conn.out[n:]
        if not len(conn.out):
            self._close(conn)

    def _close(self, conn: "_HttpConn") -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def close(self) -> None:
        """Stop serving and close every socket; idempotent."""
        if self._stop:
            return
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()


class _HttpConn:
    __slots__ = ("sock", "deadline", "buf", "out")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock = sock
        self.deadline = deadline
        self.buf = bytearray()
        self.out: memoryview | bytes = b""
