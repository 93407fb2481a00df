"""Time windows: what the probes saw in the last ``window_s``, folded into one record.

Contract: a :class:`WindowBuilder` receives probe data as it is polled
(:meth:`~WindowBuilder.add_events` for columnar :class:`probes.events.Trace` batches,
:meth:`~WindowBuilder.add_sched`, :meth:`~WindowBuilder.add_device`,
:meth:`~WindowBuilder.add_engine` for plain dicts) and :meth:`~WindowBuilder.close`
returns the window record, a typed :class:`probes.records.Window` (its GPUs as
``GpuProcess`` with ``PhaseFigures``, the agent's ``Health``, ``WindowRequests`` and
``WindowStragglers``; the device, engine and scheduling sections stay as the probes
delivered them, plain), ready for ``aggregator.wire.encode_window``, and starts the next
window empty.

Windows are arrival-time windows: a batch belongs to the window open when it was polled,
whatever clock its timestamps use (CUPTI, a replay, a simulator each have their own), so
no source's clock has to agree with the agent's. Within a window, figures are computed
from the events' own timestamps: ``span_ns`` (first start to last end on that GPU),
``busy_ns`` (union of kernel intervals), ``idle_ns`` = span - busy.

Record layout (keys with units in their names):

* ``start_ns``, ``end_ns``, ``duration_ns``: the window on the agent's wall clock.
* ``sources``: where the events came from (``"replay"``, ``"simulated"``, ``"cupti"``).
* ``gpus``: one entry per (GPU, served process): ``device``, ``pid``, ``gpu`` (name),
  ``kernels``, ``kernel_time_ns``, ``busy_ns``, ``span_ns``, ``idle_ns``,
  ``copy_bytes`` (by direction name), ``launch``/``sync`` latency (``count``,
  ``p50_ns``, ``p99_ns``), ``phases`` (per phase name: ``kernels``,
  ``kernel_time_ns``, ``time_share_pct`` and, where the roofline module can compute
  them, ``flops``, ``bytes``, ``achieved_flops_per_s``, ``achieved_bytes_per_s``,
  ``arithmetic_intensity``, ``pct_of_peak_flops``, ``pct_of_peak_bytes``, ``verdict``,
  ``evidence``, ``work_source`` and the rest of
  :func:`aggregator.phase_figures.phase_figures`), ``ceilings`` (when known) and
  ``phase_source``. ``launch``/``sync`` (API call durations) and ``idle_gaps`` (device idle
  between kernels) are summarised from fixed log2 histograms: ``p50_ns``/``p99_ns`` are the
  geometric middle of the bin that holds the percentile (within a factor of sqrt(2)).
* ``device``: the latest device sample per GPU; ``engine``: the latest engine figures per
  endpoint (an endpoint not scraped for ``ENGINE_STALE_S``, or 3 of its intervals, is left out);
  ``sched``: the latest scheduling figures (each as the probe delivered them, plain).
* ``verdict``: the window's verdict from ``aggregator.verdict`` where it can judge.
* ``agent``: the agent's own cost and counters, as given to :meth:`close`.

Incremental fold (:class:`SourceFold`, one per event source): each batch is folded when
it arrives into the phase accumulator of :mod:`aggregator.phase_figures` (per (device,
pid, phase): kernel count and time, busy time, steps and their windows, idle gaps and the
host calls inside them, FLOPs and bytes with their source, histograms of kernel duration,
gap and launch latency), the same accumulator and the same figure function ``ridgeline
analyze`` uses on a whole trace, so a window's per-phase figures are those ``analyze``
gives for the same kernels (tests/test_phase_figures.py); and per (device, pid) copy bytes
by direction, busy time, idle gaps and the time extent. Batches are not kept: memory is
bounded by one batch, the open step of each device (held for the next batch so that a step
cut by a batch edge is mapped whole, with the host calls from its start on; at most
``MAX_CARRY_KERNELS``) and small batches waiting to be folded together
(``FOLD_MIN_EVENTS``). Window close is O(groups). Phases come from
:class:`aggregator.stream_phases.StreamPhaser` (the layered method of
:mod:`aggregator.phases`, decided once per distinct step shape). Launch latency joins a
kernel to its launch record within one batch. The step open at window close is not mapped
in pieces: it is held and mapped whole, and its kernels counted, in the window where it
ends (a window's figures may lag by one step per device; a device that sends no kernel for
a whole window, or the agent's last window, releases it), so the streaming labels do not
depend on where windows close. A step still open at the close after the one that first held
it, and at least half a window long in its own clock, is decided then with the kernels it
has (``window_open_steps_cut``): every kernel is counted within two window lengths of its
arrival at any rate (a step that never visibly ends was held until ``MAX_CARRY_KERNELS``,
200,000 kernels: 5.5 hours at 10 kernels/s); only steps longer than a window are mapped in
pieces.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import lru_cache

import msgspec
import numpy as np

from ridgeline.probes.buffer_reuse import unshared
from ridgeline.probes.errors import InputError
from ridgeline.probes.events import API_GRAPH_LAUNCH, API_LAUNCH, API_SYNC, COPY_DIRECTION_NAMES, Trace
from ridgeline.probes.records import (
    PHASE_NAMES,
    Ceilings,
    EngineSource,
    GpuProcess,
    Health,
    Latency,
    Phase,
    PhaseFigures,
    Window,
)
from ridgeline.probes.trace_joins import kernel_cpu_op_index

from . import fold_native
from .columns import distinct, distinct_inverse
from .phase_figures import (
    LAUNCH_RECORD_U8,
    PhaseSums,
    figures_by_phase,
    fold_kernels,
    fold_records,
    group_key,
    host_intervals,
    launch_latency_join_ns,
    split_group_key,
)

log = logging.getLogger("ridgeline.windows")

_KINDS = ("kernels", "copies", "api", "ranges", "cpu_ops")
MAX_DEVICE_SAMPLES = 256
MAX_ENGINE_SCRAPES = 64
#: Steps per source and window kept for the request join (aggregator.request_history).
MAX_STEP_LOG = 50_000
#: Request stories a window hands to the ``requests`` topic at most (the rest are counted).
MAX_STORIES_PUBLISHED = 2_000
# An endpoint not scraped successfully for this long (or 3 of its scrape intervals, if
# longer) leaves the window's engine figures: a dead server's last KV usage and queue must
# not stay on /metrics, in alerts and dashboards, as if current.
ENGINE_STALE_S = 30.0


# Types plain() passes through unchanged, tested by exact type (a subclass takes the
# general path: numpy's float64 is a float, and is converted there).
_PLAIN_AS_IS = frozenset((int, str, bool, type(None)))


def plain(obj):
    """Convert numpy scalars/arrays (and nested containers) into msgpack-ready Python.
    :func:`plain_reference` defines the conversion; this is the same walk with the common
    types found by exact type first (a window close walked the agent's health record and
    the figures with about 1,300 isinstance checks; tests/test_wire_plain.py compares)."""
    t = type(obj)
    if t in _PLAIN_AS_IS:
        return obj
    if t is float:
        return obj if math.isfinite(obj) else None
    if t is dict:
        return {(k if type(k) is str else str(k)): (v if type(v) in _PLAIN_AS_IS else plain(v))
                for k, v in obj.items()}
    if t is list or t is tuple:
        return [v if type(v) in _PLAIN_AS_IS else plain(v) for v in obj]
    return plain_reference(obj, plain)


def plain_reference(obj, walk=None):
    """:func:`plain` by isinstance, its definition; ``walk``: what converts the parts
    (itself when None)."""
    walk = walk or plain_reference
    if isinstance(obj, dict):
        return {str(k): walk(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [walk(v) for v in obj]
    if isinstance(obj, np.ndarray):
        if obj.dtype.names:
            # Small record arrays (per-thread rows): one dict per row, as consumers expect.
            return [{n: walk(r[n]) for n in obj.dtype.names} for r in obj]
        return walk(obj.tolist()) if obj.dtype.kind in "SV" else obj.tolist()
    if isinstance(obj, bytes):
        return obj.decode("utf-8", "replace").rstrip("\x00")
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if hasattr(obj, "__dataclass_fields__"):
        return walk({k: getattr(obj, k) for k in obj.__dataclass_fields__})
    return obj


def busy_ns(starts: np.ndarray, ends: np.ndarray) -> int:
    """Length of the union of intervals [start, end) (overlapping streams count once)."""
    if len(starts) == 0:
        return 0
    order = np.argsort(starts, kind="stable")
    s = starts[order]
    e = np.maximum.accumulate(ends[order])
    # A new busy run starts where a start lies past every earlier end.
    new_run = np.empty(len(s), dtype=bool)
    new_run[0] = True
    new_run[1:] = s[1:] > e[:-1]
    run_id = np.cumsum(new_run) - 1
    run_start = s[new_run]
    run_end = np.zeros(len(run_start), dtype=np.int64)
    np.maximum.at(run_end, run_id, e)
    return int(np.sum(run_end - run_start))


def concat_traces(parts: list[Trace]) -> Trace:
    """One Trace from batches of one source (they share its name table)."""
    if len(parts) == 1:
        return parts[0]
    arrays = {k: np.concatenate([getattr(p, k) for p in parts]) for k in _KINDS}
    meta = dict(parts[-1].meta)
    return Trace(arrays["kernels"], arrays["copies"], arrays["api"], arrays["ranges"], arrays["cpu_ops"],
                 parts[0].names, parts[0].devices, meta)


def _ceilings(gpu_name: str) -> Ceilings | None:
    """The window record's ceilings of a GPU (a new record each time: the caller's own)."""
    c = _device_entry(gpu_name)
    if c is None:
        return None
    return Ceilings(gpu=c.gpu, hbm_bytes_per_s=c.hbm_bytes_per_s, flops_per_s=plain(dict(c.flops_per_s)))


@lru_cache(maxsize=64)
def _device_entry(gpu_name: str):
    """The ceilings table's entry for a device name, matched once per name (the match
    tries every entry's patterns: it was redone for every GPU every window), as
    :func:`_ceilings_obj` is."""
    from ridgeline.aggregator import ceilings
    try:
        return ceilings.from_device_name(gpu_name) if gpu_name else None
    except InputError:      # the ceilings table unreadable: no ceilings, the figures go on
        return None


@dataclass
class WindowBuilder:
    """Accumulates one window of probe data; :meth:`close` emits it and starts afresh."""
    host: str = ""
    model: object = None             # aggregator.model_config.ModelShape or None
    gpu: str = ""                    # ceilings override when events do not name their GPU
    events: dict = field(default_factory=dict)      # source key -> list[Trace]
    sched: dict = field(default_factory=dict)
    device: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    records: int = 0
    engine_errors: int = 0
    max_events: int = 4_000_000      # kernels + copies + API calls held per window
    drops: int = 0                   # events dropped because a window was full (cumulative)
    _events_held: int = 0
    _device_recs: dict = field(default_factory=dict)   # source -> device samples this window
    _scrapes: dict = field(default_factory=dict)       # source -> raw scrapes this window
    _trackers: dict = field(default_factory=dict)      # source -> EngineTracker
    _engine_seen: dict = field(default_factory=dict)   # (source, endpoint) -> (end_ns last scraped, stale after s)
    _folds: dict = field(default_factory=dict)         # (source, name table id) -> SourceFold
    fold_errors: int = 0
    open_steps_cut: int = 0          # open steps decided at the carry bound (cumulative)
    # aggregator.request_history.RequestHistory when request spans are taken in (the OTLP
    # probe runs), else None: then no step is kept and the window has no "requests".
    requests: object = None
    stories: list = field(default_factory=list)     # the stories told at the last close
    # aggregator.straggler_window.LiveStragglers: the kernels of the sources that run
    # collectives, held a few windows for the tensor-parallel straggler analysis.
    stragglers: object = None
    stories_unpublished: int = 0                    # over MAX_STORIES_PUBLISHED (cumulative)

    def add_events(self, trace: Trace, source: str = "") -> None:
        """Keep a batch for this window; past ``max_events`` per window the batch is
        dropped and counted in ``drops`` (bounded memory and close time)."""
        n = len(trace.kernels) + len(trace.copies) + len(trace.api)
        if self._events_held + n > self.max_events:
            self.drops += n
            return
        self._events_held += n
        key = source or trace.meta.get("source", "") or "events"
        fold = self._folds.get((key, id(trace.names)))
        if fold is None or fold.names is not trace.names:
            fold = self._folds[(key, id(trace.names))] = SourceFold(trace.names, trace.devices, self.model, self.gpu)
        fold.model, fold.gpu = self.model, self.gpu
        # Folded now: the window keeps running figures, not the batch.
        try:
            fold.add(trace)
        except Exception as exc:  # noqa: BLE001  (one bad batch loses its own figures only; counted, logged)
            log.warning("window: events from %s could not be folded: %s: %s", key, type(exc).__name__, exc)
            self.fold_errors += 1
        self.events[(key, id(trace.names))] = True
        self.records += n
        if self.stragglers is None:
            from .straggler_window import LiveStragglers
            self.stragglers = LiveStragglers()
        self.stragglers.add(trace, key)

    def add_sched(self, data: dict, source: str = "sched") -> None:
        """Scheduling figures of the window (the probe is polled once per window). Thread
        rows get ``pid`` (their tgid) so they join the GPU work of the same process."""
        data = plain(data)
        threads = data.get("threads") if isinstance(data, dict) else None
        if isinstance(threads, list):
            for t in threads:
                if isinstance(t, dict) and "pid" not in t and "tgid" in t:
                    t["pid"] = t["tgid"]
        self.sched[source] = data
        self.records += 1

    def add_device(self, data: dict, source: str = "nvml") -> None:
        """Device samples: ``{"devices": [record, ...]}`` accumulate over the window (the
        verdict folds them per GPU); any other dict replaces the previous one."""
        recs = data.get("devices") if isinstance(data, dict) else None
        if isinstance(recs, list):
            self._device_recs.setdefault(source, []).extend(recs)
            # Bounded: a window never holds more than the newest samples per source.
            del self._device_recs[source][:-MAX_DEVICE_SAMPLES]
            self.records += len(recs)
            return
        self.device[source] = data
        self.records += 1

    def add_engine(self, data: dict, source: str = "engine") -> None:
        """Engine data: the engine probe's raw scrapes (``{"scrapes": [{endpoint, ts_ns,
        exposition}], "errors": [...]}``) accumulate over the window and are reduced when
        it closes by :class:`aggregator.engine_metrics.EngineTracker` (rates from deltas
        between scrapes, KV alerts with hysteresis), one tracker per source. Other dicts
        are kept as given."""
        if isinstance(data, dict) and isinstance(data.get("scrapes"), list):
            acc = self._scrapes.setdefault(source, {"scrapes": [], "errors": []})
            acc["scrapes"].extend(data["scrapes"])
            acc["errors"].extend(data.get("errors") or [])
            # Bounded: a stalled window keeps the newest scrapes only.
            del acc["scrapes"][:-MAX_ENGINE_SCRAPES]
            del acc["errors"][:-MAX_ENGINE_SCRAPES]
            self.records += len(data["scrapes"])
            return
        self.engine[source] = data
        self.records += 1

    def add_requests(self, spans: list, arrived_ns: int | None = None) -> None:
        """Request spans (``probes.request_spans.RequestSpan``) the engines sent, at the
        agent's wall clock ``arrived_ns`` (None in a replay); joined with the steps when
        they are due (see :mod:`aggregator.request_history`)."""
        if self.requests is None:
            from .request_history import RequestHistory
            self.requests = RequestHistory()
        self.requests.add_requests(spans, arrived_ns)
        self.records += len(spans)

    def _request_estimate(self) -> None:
        """The roofline baseline of the request join (aggregator.request_roofline), for the
        served model (analysis.model) on this window's GPU, when both are known."""
        names = [d.name for f in self._folds.values() for d in f.devices.values() if d.name]
        gpu = self.gpu or (names[0] if names else "")
        key = (id(self.model), gpu)
        if getattr(self.requests, "estimate_key", None) == key:
            return
        self.requests.estimate_key = key
        ceil = _ceilings_obj(gpu) if self.model is not None else None
        if ceil is None:
            self.requests.estimate_step_ns = None
            return
        from .request_roofline import step_time_estimator
        self.requests.estimate_step_ns = step_time_estimator(self.model, ceil)

    def _requests_close(self, end_ns: int, window: Window) -> None:
        """The request join's part of the window: steps and KV samples go to the history,
        the due requests are joined; ``window.requests`` gets the aggregates."""
        steps = []
        for f in self._folds.values():
            steps.extend(f.step_log)
            f.step_log = []
        if self.requests is None:
            self.stories = []
            return
        from .request_history import HELD_DTYPE
        self._request_estimate()
        if steps:
            self.requests.add_steps(np.array(steps, dtype=HELD_DTYPE))
        for e in engine_endpoints(window.engine):
            if e.kv_usage_ratio is not None:
                self.requests.add_kv(end_ns, float(e.kv_usage_ratio))
        figures, stories = self.requests.close(end_ns)
        self.stories_unpublished += max(0, len(stories) - MAX_STORIES_PUBLISHED)
        self.stories = stories[:MAX_STORIES_PUBLISHED]
        window.requests = figures

    def _engine_close(self, end_ns: int) -> None:
        from ridgeline.aggregator import engine_metrics
        for source, polled in self._scrapes.items():
            tracker = self._trackers.get(source)
            if tracker is None:
                tracker = self._trackers[source] = engine_metrics.EngineTracker()
            try:
                rec = tracker.update(polled)
            except Exception as exc:  # noqa: BLE001  (one bad scrape set loses this window's engine figures only; counted, logged)
                log.warning("engine figures from %s failed: %s: %s", source, type(exc).__name__, exc)
                self.engine_errors += 1
                continue
            # Endpoints scraped in this window replace their figures; the others keep
            # their last ones until stale (see _engine_prune).
            prev = self.engine.get(source)
            eps = dict(prev.get("endpoints") or {}) if isinstance(prev, dict) else {}
            for ep, r in (rec.get("endpoints") or {}).items():
                eps[ep] = r
                interval = r.get("interval_s") if isinstance(r, dict) else None
                self._engine_seen[(source, ep)] = (
                    int(end_ns), max(ENGINE_STALE_S, 3 * interval if isinstance(interval, (int, float)) else 0.0))
            if rec.get("endpoints") or not isinstance(prev, dict):
                self.engine[source] = dict(rec, endpoints=eps)
            elif rec.get("errors"):
                self.engine[source] = dict(prev, errors=rec["errors"])
        self._scrapes = {}

    def _engine_prune(self, end_ns: int) -> None:
        """Drop endpoints whose last successful scrape is older than their stale limit."""
        for (source, ep), (seen_ns, stale_s) in list(self._engine_seen.items()):
            if end_ns - seen_ns <= stale_s * 1e9:
                continue
            del self._engine_seen[(source, ep)]
            data = self.engine.get(source)
            if isinstance(data, dict) and isinstance(data.get("endpoints"), dict) and ep in data["endpoints"]:
                self.engine[source] = dict(data, endpoints={k: v for k, v in data["endpoints"].items() if k != ep})

    def close(self, start_ns: int, end_ns: int, agent: dict | None = None, final: bool = False) -> Window:
        """Emit the window record and start the next window. Each source's open step (the
        last step of each device, still running at close) is held and counted in the
        window where it ends (see :meth:`SourceFold.figures`); ``final=True`` (agent
        shutdown) folds them into this one. ``agent``: the agent's own health record
        (read as :class:`probes.records.Health`); its ``window_open_steps_cut``: open steps
        decided before they ended, because the held kernels reached ``MAX_CARRY_KERNELS``
        or the step was still open one window close later and at least half a window long
        (cumulative)."""
        if self._scrapes:
            self._engine_close(end_ns)
        self._engine_prune(end_ns)
        for src, recs in self._device_recs.items():
            self.device[src] = {"devices": recs}
        self._device_recs = {}
        sources, gpus = self._gpus_close(start_ns, end_ns, final)
        health = msgspec.convert(plain(agent or {}), Health)
        for f in self._folds.values():
            self.open_steps_cut += f.open_steps_cut
            f.open_steps_cut = 0
        health.window_open_steps_cut = self.open_steps_cut
        window = Window(start_ns=int(start_ns), end_ns=int(end_ns), duration_ns=int(end_ns - start_ns),
                        host=self.host, sources=sorted(set(sources)), gpus=gpus,
                        device=plain(self.device), engine=plain(self.engine), sched=plain(self.sched),
                        agent=health)
        self._requests_close(int(end_ns), window)
        if self.stragglers is not None:
            figures = self.stragglers.close()
            if figures is not None:
                from .straggler_window import annotate_launch_threads
                window.stragglers = figures
                annotate_launch_threads(window)
        fill_decode_kv_read(window)
        window.verdict = verdict_of(window)
        # Sources that sent nothing this window (an exited process) let go of their
        # fold; the others keep theirs (remembered step shapes, kernel classes).
        self._folds = {key: f for key, f in self._folds.items() if key in self.events}
        self.events = {}
        self.records = 0
        self._events_held = 0
        # Device/engine/sched keep their latest sample: a slow scraper still shows its
        # last value; the sample's own timestamp (if any) tells its age.
        return window

    def _gpus_close(self, start_ns: int, end_ns: int, final: bool) -> tuple[list[str], list[GpuProcess]]:
        """Each source's (GPU, process) figures of the window, and the sources."""
        gpus: list[GpuProcess] = []
        sources = []
        # A source that sent nothing this window but holds an open step: the step is over
        # (a whole window went by without more of it); figures() maps and counts it now.
        quiet = [key for key, f in self._folds.items() if key not in self.events and f.held_kernels]
        for src, nid in list(self.events) + quiet:
            sources.append(src)
            try:
                fold = self._folds[(src, nid)]
                if final:
                    fold.flush()
                # Held steps still open one window later and at least half a window long
                # (in their own clock) are decided now: kernels within two windows.
                figs = fold.figures(hold_ns=max(0, int(end_ns - start_ns)) // 2)
            except Exception as exc:  # noqa: BLE001  (one bad source loses its own figures only; counted, logged)
                log.warning("window: events from %s could not be folded: %s", src, exc)
                self.fold_errors += 1
                continue
            for g in figs:
                g.source = src
            gpus.extend(figs)
        return sources, gpus


def engine_endpoints(engine: dict):
    """The typed figures of every endpoint of a window's engine section (the trackers'
    ``{"endpoints": {url: record}}`` per source); a record of another shape is skipped."""
    from ridgeline.probes.records import EngineFigures
    for data in engine.values():
        try:
            src = msgspec.convert(data, EngineSource)
        except msgspec.ValidationError:
            continue
        for rec in (src.endpoints or {}).values():
            try:
                yield msgspec.convert(rec, EngineFigures)
            except msgspec.ValidationError:
                continue


def fill_decode_kv_read(window: Window) -> None:
    """Decode's KV-cache read bytes from the engine's own estimate, where the model's
    analytic work leaves them out (no per-sequence context lengths in a live window).

    For each GPU record whose served process is an engine endpoint's (``pid``) with
    ``estimated_bytes_per_gpu_per_s`` (vLLM / SGLang ``--enable-mfu-metrics``): the
    engine's bytes per second minus the model-derived bytes per second of all the GPU's
    phases in this window (weights, activations) is the KV-cache traffic; it is added to
    the decode phase as ``kv_read_bytes_per_s`` with ``kv_read_source: "engine_estimate"``,
    and ``achieved_bytes_with_kv_per_s`` = achieved + that. Nothing is filled when the
    decode work is not model-derived, the engine gives no estimate, or the difference is
    not positive. The two rates cover nearly the same span (the engine's last scrape
    interval vs the window); the verdict is not changed by it.
    """
    est = {int(e.pid): float(e.estimated_bytes_per_gpu_per_s) for e in engine_endpoints(window.engine)
           if e.pid is not None and e.estimated_bytes_per_gpu_per_s}
    span_s = window.duration_ns / 1e9
    if not est or span_s <= 0:
        return
    for g in window.gpus:
        rate = est.get(g.pid)
        dec = g.phases.get("decode")
        if rate is None or dec is None or dec.work_source != "model":
            continue
        kv = rate - sum(float(ph.bytes or 0.0) for ph in g.phases.values()) / span_s
        if kv <= 0:
            continue
        dec.kv_read_bytes_per_s = kv
        dec.kv_read_source = "engine_estimate"
        if dec.achieved_bytes_per_s is not None:
            dec.achieved_bytes_with_kv_per_s = float(dec.achieved_bytes_per_s) + kv


def verdict_of(window: Window):
    """The verdict module's judgement of a window: its verdict records (an "unknown" one naming
    the error where judging failed)."""
    from ridgeline.aggregator import verdict
    try:
        return [plain(verdict.verdict_record(v)) for v in verdict.window_verdict(window)]
    except Exception as exc:  # noqa: BLE001  (a verdict bug loses the verdict, not the window; logged, and said in it)
        log.warning("verdict failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        return {"verdict": "unknown", "error": f"{type(exc).__name__}: {exc}"}


# ---------------------------------------------------------------------------------------
# Incremental fold: each batch is folded into bounded running figures as it arrives.

HIST_BINS = 64                   # log2 bins of nanoseconds: bin e holds [2**(e-1), 2**e)
MAX_CARRY_KERNELS = 200_000      # a device's open step held for the next batch, at most
FOLD_MAX_KERNELS = 65_536       # bigger batches are folded in slices (bounded temporaries)
FOLD_MIN_EVENTS = 65_536         # small batches are folded together once this many wait
MAX_LAUNCH_TIDS = 16             # launch threads remembered per process and window


# API record category -> 0 launch (kernel or graph), 1 synchronisation, 2 anything else.
_API_WHAT = np.full(256, 2, dtype=np.int8)
_API_WHAT[[API_LAUNCH, API_GRAPH_LAUNCH]] = 0
_API_WHAT[API_SYNC] = 1
_API_WHAT_U8 = _API_WHAT.view(np.uint8)     # as fold_native reads it


def log2_bins(values_ns: np.ndarray) -> np.ndarray:
    """Bin index per value: 0 for <= 0, else the binary exponent (1 ns -> 1, 2-3 ns -> 2, ...).
    Read from the float64 exponent bits (no logarithm per value)."""
    v = np.asarray(values_ns, dtype=np.float64)
    v = np.maximum(v, 0.5, out=v if v is not values_ns else None)
    e = v.view(np.int64)
    e >>= 52
    e -= 1022                      # >= 0: values were raised to 0.5 (exponent 1022)
    return np.minimum(e, HIST_BINS - 1, out=e)


@dataclass
class ApiCallFigures:
    """One batch's host calls as the window keeps them (:func:`api_call_figures`)."""
    # (pid, "launch" | "sync") -> log2 histogram (HIST_BINS) of the call durations, pids
    # ascending, launch before sync; histograms without a call are left out.
    hist: dict[tuple[int, str], np.ndarray]
    # (pid, tid) of the threads that made launch calls, ascending by (pid, tid as uint32),
    # the first 256 at most (the window keeps MAX_LAUNCH_TIDS per process).
    launch_threads: list[tuple[int, int]]


def api_call_figures(a: np.ndarray) -> ApiCallFigures:
    """:class:`SourceFold`'s figures of a batch's API records by numpy, its general path:
    the launch (kernel and graph launches) and synchronisation call histograms per process
    and the launching threads; other calls count in neither. ``fold_native.ingest_pass``
    gives the histogram of a kernel stream (launches of one thread) in its pass instead,
    which tests/test_fold_native.py compares with this."""
    out = ApiCallFigures({}, [])
    if not len(a):
        return out
    dur = np.maximum(a["end_ns"] - a["start_ns"], 0)
    what = _API_WHAT[a["category"]]      # 0 launch, 1 sync, 2 other: one table lookup
    launches_only = int(what.max()) == 0
    m = slice(None) if launches_only else what < 2
    if not (launches_only or m.any()):
        return out
    upid, pinv = distinct_inverse(a["pid"][m])
    if launches_only and len(upid) == 1:
        # One process, only launch records (a kernel stream): the histogram of the
        # durations alone, no per-record index.
        h = np.zeros((1, 2, HIST_BINS), dtype=np.int64)
        h[0, 0] = np.bincount(log2_bins(dur), minlength=HIST_BINS)
    else:
        idx = (pinv * 2 + what[m]) * HIST_BINS + log2_bins(dur[m])
        h = np.bincount(idx, minlength=len(upid) * 2 * HIST_BINS).reshape(len(upid), 2, HIST_BINS)
    lm = slice(None) if launches_only else what == 0
    if launches_only or lm.any():
        pairs = distinct((a["pid"][lm].astype(np.int64) << 32) | (a["tid"][lm].astype(np.int64) & 0xFFFFFFFF))
        out.launch_threads = [(int(pt >> 32), int(np.int64(pt & 0xFFFFFFFF).astype(np.int32)))
                              for pt in pairs[:256].tolist()]
    for i, pid in enumerate(upid.tolist()):
        for w, name in ((0, "launch"), (1, "sync")):
            if h[i, w].any():
                out.hist[(int(pid), name)] = h[i, w]
    return out


def hist_percentile_ns(hist: np.ndarray, q: float) -> float | None:
    """The q-th percentile of a log2 histogram, as the geometric middle of its bin."""
    total = int(hist.sum())
    if total == 0:
        return None
    b = int(np.searchsorted(np.cumsum(hist), q / 100.0 * total, side="left"))
    if b == 0:
        return 0.0
    return float(2.0 ** (b - 1) * math.sqrt(2.0)) if b > 1 else 1.0


def _hist_summary(hist: np.ndarray) -> Latency:
    n = int(hist.sum())
    if not n:
        return Latency(count=0)
    return Latency(count=n, p50_ns=int(hist_percentile_ns(hist, 50)), p99_ns=int(hist_percentile_ns(hist, 99)),
                   histogram="log2 ns bins")


def _bincount2(index: np.ndarray, weights, size: int) -> np.ndarray:
    return np.bincount(index, weights=weights, minlength=size) if len(index) else np.zeros(size)


class _GroupAcc:
    """One (device, pid) of one source in one window."""
    __slots__ = ("kernels", "kernel_time_ns", "busy_ns", "t_min", "t_max", "copy_bytes", "idle_hist", "last_end")

    def __init__(self):
        self.kernels = self.kernel_time_ns = self.busy_ns = 0
        self.t_min, self.t_max = None, None
        self.copy_bytes: dict[str, int] = {}
        self.idle_hist = np.zeros(HIST_BINS, np.int64)
        self.last_end = None

    def extent(self, lo: int, hi: int) -> None:
        self.t_min = lo if self.t_min is None else min(self.t_min, lo)
        self.t_max = hi if self.t_max is None else max(self.t_max, hi)


class SourceFold:
    """Running figures of one event source (one name table) over one window.

    :meth:`add` folds a batch in O(batch) numpy work and keeps only bounded state: per
    (device, pid, phase) sums and log2 histograms, plus the kernels of each device's open
    step (held back so that a step cut by a batch or window edge is phase-mapped whole).
    :meth:`figures` returns the per-(device, pid) window figures (see the module
    docstring), then starts the next window empty, still holding the open steps. The phase
    mapper's remembered step shapes and kernel classes live as long as the source.
    """

    def __init__(self, names, devices, model=None, gpu: str = ""):
        from .stream_phases import StreamPhaser
        self.phaser = StreamPhaser(names)
        self.names = names
        self.devices = {d.index: d for d in devices}
        self.model, self.gpu = model, gpu
        self._step_work: dict = {}
        # (kernels, lat_ns, shape_flops, shape_bytes, ranges, cpu_ops, api): the open steps,
        # and for an annotated stream the ranges, CPU operators and launch records that may
        # describe them.
        self._carry = None
        # Open steps decided before they ended because the carry bound was reached, since
        # WindowBuilder.close last collected the count (it publishes the running total).
        self.open_steps_cut = 0
        self.shape_errors = 0           # batches whose operator shapes gave no work figures
        self._active: set[int] = set()  # devices that sent kernels since the last figures()
        # device -> (start_ns, correlation_id) of the first kernel of its open step at the
        # last figures(): the same step still open at the next close is decided then.
        self._held_at_close: dict[int, tuple[int, int]] = {}
        # device -> where its open step starts when an earlier step waits with it in the
        # carry (_waiting_steps): the end of that step; the open step's age counts from there.
        self._open_from: dict[int, int] = {}
        self._pending: list[Trace] = []
        # The concatenations of the folds, each into a buffer reused from fold to fold.
        self._buf = {f: RecordBuffer() for f in ("kernels", "api", "copies")}
        self._pending_n = 0
        # (start_ns, end_ns, phase, device, pid) of each step folded since the window last
        # closed: the request join's GPU side (bounded; past it counted in steps_unlogged).
        self.step_log: list[tuple] = []
        self.steps_unlogged = 0
        self.reset()

    def reset(self) -> None:
        self.groups: dict[tuple[int, int], _GroupAcc] = {}
        self.sums = PhaseSums()                   # per (device, pid, phase): aggregator.phase_figures
        self.api_hist: dict[tuple[int, str], np.ndarray] = {}
        self.launch_tids: dict[int, set] = {}     # pid -> threads that launched kernels (bounded)
        self.shape_hits = self.shape_misses = 0

    def _group(self, dev: int, pid: int) -> _GroupAcc:
        g = self.groups.get((dev, pid))
        if g is None:
            g = self.groups[(dev, pid)] = _GroupAcc()
        return g

    # -- batches ---------------------------------------------------------------------------
    def add(self, trace: Trace) -> None:
        """Take one batch. Small batches wait (bounded, ``FOLD_MIN_EVENTS``) and are
        folded together: a fold has a fixed cost, a poll every 50 ms at a low rate would
        pay it twenty times a second."""
        for d in trace.devices:
            self.devices.setdefault(d.index, d)
        if len(trace.ranges) or len(trace.cpu_ops):
            self._drain()
            self._ingest(trace)
            return
        nk = len(trace.kernels)
        if nk > FOLD_MAX_KERNELS:
            # A big batch (a probe that drained a backlog) is folded in slices, so the
            # fold's temporaries stay bounded whatever the probe hands over. API records
            # are sliced in the same proportions (they come in launch order, as kernels
            # do); a kernel whose launch record lands in another slice loses its latency.
            self._drain()
            parts = -(-nk // FOLD_MAX_KERNELS)
            kb = np.linspace(0, nk, parts + 1).astype(np.int64)
            na = len(trace.api)
            ab = np.linspace(0, na, parts + 1).astype(np.int64)
            for i in range(parts):
                self._ingest(Trace(kernels=trace.kernels[kb[i]:kb[i + 1]], api=trace.api[ab[i]:ab[i + 1]],
                                   copies=trace.copies if i == 0 else trace.copies[:0], names=trace.names,
                                   devices=trace.devices, meta=trace.meta))
            return
        self._pending.append(trace)
        self._pending_n += len(trace.kernels) + len(trace.api) + len(trace.copies)
        if self._pending_n >= FOLD_MIN_EVENTS:
            self._drain()

    def _drain(self) -> None:
        parts, self._pending, self._pending_n = self._pending, [], 0
        if not parts:
            return
        if len(parts) == 1:
            self._ingest(parts[0])
            return
        # The held open step's kernels and launch records go first in the same copies:
        # _ingest would otherwise copy the whole batch a second time to put them in front.
        c = self._carry
        ck, ca = (c[0], c[6]) if c is not None and not len(c[4]) and not len(c[5]) else (None, None)
        lead = [ck] if ck is not None else []
        both = self._buf["kernels"].concat(lead + [p.kernels for p in parts])
        n0 = len(ck) if ck is not None else 0
        lead_a = [ca] if ca is not None and len(ca) else []
        api = self._buf["api"].concat(lead_a + [p.api for p in parts])
        na0 = len(ca) if lead_a else 0
        self._ingest(Trace(kernels=both[n0:], copies=self._buf["copies"].concat([p.copies for p in parts]),
                           api=api[na0:], names=self.names, devices=list(self.devices.values()),
                           meta=parts[-1].meta),
                     with_carry=both if ck is not None else None, api_with_carry=api if lead_a else None)

    def _ingest(self, trace: Trace, with_carry: np.ndarray | None = None,
                api_with_carry: np.ndarray | None = None) -> None:
        """Fold one batch, after the held open steps. ``with_carry``: the held kernels
        followed by ``trace.kernels`` in one array, ``api_with_carry`` the held API records
        followed by ``trace.api``, when the caller has made them."""
        a = trace.api
        k = trace.kernels
        fast = dev_range = lat = None
        native = not fold_native.REFERENCE and bool(len(a) or len(k))
        if native:
            # One native pass over the batch's records for the kernels' devices, a kernel
            # stream's launch-call histogram and its kernels' launch latency (each None
            # where the records are not that case: the general paths below).
            dev_range, fast, lat = fold_native.ingest_pass(k, a, _API_WHAT_U8, LAUNCH_RECORD_U8)
        if fast is not None:
            # A kernel stream's records (launches of one thread): one native pass, the
            # figures of the general path below.
            hist, pid, tid = fast
            tids = self.launch_tids.setdefault(pid, set())
            if len(tids) < MAX_LAUNCH_TIDS:
                tids.add(tid)
            self.api_hist[(pid, "launch")] = self.api_hist.get((pid, "launch"), 0) + hist
        elif len(a):
            calls = api_call_figures(a)
            for pid, tid in calls.launch_threads:    # /metrics keeps their scheduling series
                tids = self.launch_tids.setdefault(pid, set())
                if len(tids) < MAX_LAUNCH_TIDS:
                    tids.add(tid)
            for key, h in calls.hist.items():
                self.api_hist[key] = self.api_hist.get(key, 0) + h
        c = trace.copies
        if len(c):
            key = (c["device"].astype(np.int64) << 32) | (c["pid"].astype(np.int64) & 0xFFFFFFFF)
            for kv in np.unique(key).tolist():
                m = key == kv
                g = self._group(kv >> 32, np.int64(kv & 0xFFFFFFFF).astype(np.int32).item())
                cm = c[m]
                g.extent(int(cm["start_ns"].min()), int(cm["end_ns"].max()))
                for d in np.unique(cm["direction"]).tolist():
                    name = COPY_DIRECTION_NAMES.get(d, str(d))
                    g.copy_bytes[name] = g.copy_bytes.get(name, 0) + int(cm["bytes"][cm["direction"] == d].sum())
        if len(k):
            d0, d1 = dev_range if dev_range is not None else fold_native.field_range(k, "device")
            # Several devices: one counting pass (np.unique sorted the batch's device column).
            if d0 == d1:
                self._active.add(d0)
            else:
                devs = None if fold_native.REFERENCE else fold_native.distinct_devices(k, d0, d1)
                self._active.update(devs if devs is not None else distinct(k["device"]).tolist())
        if not len(k) and self._carry is None:
            return
        # Per kernel, while its API records are in the same batch: launch latency (API
        # call start to kernel start, -1 unknown) and work from operator shapes.
        if lat is None:
            # The join itself: the native pass (when it ran) found the records not aligned
            # with the kernels, its one other case; under fold_native.REFERENCE the join is
            # the reference; without records it answers -1 per kernel.
            lat = launch_latency_join_ns(k, a)
        shf = shb = None
        if len(k) and len(trace.cpu_ops):
            try:
                from .work import kernel_work_from_shapes
                kw = kernel_work_from_shapes(trace)
                # (flops, bytes) per kernel and the dtype code: carried with held kernels.
                shf, shb = np.stack([np.where(kw.known, kw.flops, np.nan), kw.bytes], axis=1), kw.dtype_code
            except Exception as exc:  # noqa: BLE001  (shapes are optional figures: they alone are lost; counted, logged)
                self.shape_errors += 1
                log.warning("work from operator shapes failed: %s: %s", type(exc).__name__, exc)
        ranges, cpu_ops, api = trace.ranges, trace.cpu_ops, a
        if self._carry is not None:
            ck, cl, cf, cb, cr, co, ca = self._carry
            if cf is not None or shf is not None:     # shapes on one side only: NaN = unknown
                cf, cb = (cf, cb) if cf is not None else (np.full((len(ck), 2), np.nan), np.full(len(ck), -1, np.int8))
                shf, shb = (shf, shb) if shf is not None else (np.full((len(k), 2), np.nan), np.full(len(k), -1, np.int8))
                shf, shb = np.concatenate([cf, shf]), np.concatenate([cb, shb])
            k = with_carry if with_carry is not None else self._buf["kernels"].concat([ck, k])
            lat = np.concatenate([cl, lat])
            if len(cr):
                ranges = concat_records([cr, ranges])
            if len(co):
                cpu_ops = concat_records([co, cpu_ops])
            if len(ca):
                api = api_with_carry if api_with_carry is not None else self._buf["api"].concat([ca, api])
            self._carry = None
        self._fold(Trace(kernels=k, api=api, ranges=ranges, cpu_ops=cpu_ops, names=self.names,
                         devices=list(self.devices.values()), meta=trace.meta), lat, shf, shb, flush=False)

    @property
    def held_kernels(self) -> int:
        """Kernels of open steps held for the next batch or window."""
        return len(self._carry[0]) if self._carry is not None else 0

    def _release_idle(self) -> None:
        """Fold the held steps of devices that sent no kernel since the last window close."""
        active, self._active = self._active, set()
        if self._carry is None:
            return
        k = self._carry[0]
        rel = ~np.isin(k["device"], list(active))
        if not rel.any():
            return
        self._release_carry(rel)

    def _release_carry(self, rel: np.ndarray) -> None:
        """Fold the carried kernels selected by ``rel`` as finished steps; keep the rest."""
        k, lat, shf, shb, r, o, a = self._carry
        keep = ~rel
        self._carry = (k[keep], lat[keep], shf[keep] if shf is not None else None,
                       shb[keep] if shb is not None else None, r, o, a) if keep.any() else None
        self._fold(Trace(kernels=k[rel], api=a, ranges=r, cpu_ops=o, names=self.names,
                         devices=list(self.devices.values())), lat[rel], shf[rel] if shf is not None else None,
                   shb[rel] if shb is not None else None, flush=True)

    def _release_overdue(self, hold_ns: int) -> None:
        """Decide the open steps that were already open at the previous window close and
        span at least ``hold_ns`` of their own clock, with the kernels they have (each
        counted in ``open_steps_cut``): a step that never visibly ends (no idle gap, no
        layer-pattern restart, e.g. a host that launches one kernel at a time) would
        otherwise be held until ``MAX_CARRY_KERNELS``, and the windows would publish none
        of its kernels. So every kernel is counted within two window lengths of its arrival,
        whatever the rate; a step longer than a window is mapped in pieces (at most one
        piece per window)."""
        held, self._held_at_close = self._held_at_close, {}
        if self._carry is None:
            return
        k = self._carry[0]
        dev = k["device"]
        devs = np.unique(dev).tolist()
        firsts = {}
        rel = np.zeros(len(k), dtype=bool)
        for d in devs:
            m = dev == d if len(devs) > 1 else np.ones(len(k), dtype=bool)
            # The open step alone, without a step that waits for it (its age is the open
            # step's, not the idle gap between the two).
            mo = m & (k["start_ns"] >= self._open_from[d]) if d in self._open_from else m
            if not mo.any():
                mo = m
            i = int(np.flatnonzero(mo)[np.argmin(k["start_ns"][mo])])
            first = (int(k["start_ns"][i]), int(k["correlation_id"][i]))
            age = int(k["end_ns"][mo].max()) - first[0]
            if held.get(d) == first and age >= hold_ns:
                rel |= m
                self.open_steps_cut += 1
            else:
                firsts[d] = first
        self._held_at_close = firsts
        if not rel.any():
            return
        self._release_carry(rel)

    def flush(self) -> None:
        """Fold everything now, the open steps too (mapped with the kernels they have):
        for a source that has gone quiet for a whole window, and at agent shutdown."""
        self._drain()
        if self._carry is None:
            return
        k, lat, shf, shb, r, o, a = self._carry
        self._carry = None
        self._fold(Trace(kernels=k, api=a, ranges=r, cpu_ops=o, names=self.names, devices=list(self.devices.values())),
                   lat, shf, shb, flush=True)

    def _fold(self, t: Trace, lat, shf, shb, flush: bool) -> None:
        k = t.kernels
        n = len(k)
        if not n:
            return
        held = seg = cut = None
        if not flush and self.phaser.kernels_only(t):
            # The steps to hold back are chosen from the segmentation, before any step is
            # phase-mapped: the held ones are mapped whole in a later fold, not now.
            seg = self.phaser.segment(t)
            held = self._held_steps(seg[1].segments, seg[1].kernel_step)
            bp = self.phaser.map_batch(t, seg=seg, skip=held)
        else:
            bp = self.phaser.map_batch(t)
        self.shape_hits += bp.shape_hits
        self.shape_misses += bp.shape_misses
        kstep = bp.kernel_step.astype(np.int64)
        order = bp.order
        if order is None:
            # Full mapper (annotated batch): kernels by (step, start).
            st = k["start_ns"]
            order = np.argsort(((kstep + 1) << 40) | np.minimum(st - st.min(), (1 << 40) - 1), kind="stable")
        else:
            loose = np.flatnonzero(kstep < 0)
            if len(loose):                 # kernels in no step: by start, after the steps
                order = np.concatenate([order, loose[np.argsort(k["start_ns"][loose], kind="stable")]])
        if not flush and (held is not None or bp.steps):
            # Hold back each device's last step: more of it may come in the next batch (or
            # the next window). Bounded: at most MAX_CARRY_KERNELS held in all; a step over
            # the bound is decided now with the kernels it has (counted in open_steps_cut).
            # An annotated batch also holds its ranges and CPU operators from the earliest
            # operator that launched a held kernel on (the ranges and parents enclosing it).
            if held is None:
                held = self._held_steps(bp.steps, kstep)
            waiting = self._waiting_steps(bp.steps, held)
            if waiting is not None:
                held = held.copy()
                held[waiting] = True
            hold = held[kstep]              # kstep -1 -> the last slot (False)
            hi = np.flatnonzero(hold)
            cr, co, ca = self._carry_records(t, hi, annotated=bp.order is None)
            if waiting is not None and len(hi) + len(cr) + len(co) + len(ca) > MAX_CARRY_KERNELS:
                # Over the bound, the waiting steps (decided, in order) are folded as they are.
                held[waiting] = False
                waiting = None
                hold = held[kstep]
                hi = np.flatnonzero(hold)
                cr, co, ca = self._carry_records(t, hi, annotated=bp.order is None)
            if len(hi):
                if len(hi) + len(cr) + len(co) + len(ca) > MAX_CARRY_KERNELS:
                    self.open_steps_cut += int(held.sum())
                    hold[:] = False
                    if bp.order is not None and seg is not None:
                        # map_batch skipped the held steps (none of their kernels is in
                        # order, none mapped): they are folded now on their own, mapped whole
                        # with the kernels they have, after the rest (each is its device's
                        # last step). Dropping them lost their kernels (found by review).
                        cut = (Trace(kernels=k[hi], api=ca, ranges=cr, cpu_ops=co, names=self.names,
                                     devices=list(self.devices.values())),
                               lat[hi], shf[hi] if shf is not None else None, shb[hi] if shb is not None else None)
                else:
                    self._carry = (k[hi], lat[hi], shf[hi] if shf is not None else None,
                                   shb[hi] if shb is not None else None, cr, co, ca)
                    self._open_from = {int(bp.steps[i].device): int(bp.steps[i].end_ns) for i in waiting or ()}
                    if bp.order is None or seg is None or waiting is not None:
                        # (waiting steps were decided: their kernels are in order)
                        order = order[~hold[order]]
                    # else map_batch skipped the held steps: none of their kernels is in order
        if len(order):
            self._fold_kernels(k, order, bp.kernel_phase, kstep, bp.steps, lat, shf, shb, t.api)
        if cut is not None:
            self._fold(*cut, flush=True)

    @staticmethod
    def _carry_records(t: Trace, hi: np.ndarray, annotated: bool):
        """The ranges, CPU operators and API records held with the held kernels ``hi`` of
        ``t`` (``annotated``: the batch went through the full mapper)."""
        k = t.kernels
        cr, co, ca = t.ranges[:0], t.cpu_ops[:0], t.api[:0]
        if not len(hi):
            return cr, co, ca
        if len(t.api) and not (len(t.ranges) or len(t.cpu_ops)):
            # The host calls from the held step on: its idle gaps are covered by
            # them when it is folded (aggregator.phase_figures); and the held kernels'
            # own launches, which may end before the step's first kernel starts (the
            # step cut reads them: aggregator.steps HOST_TOGETHER_NS).
            t0 = int(k["start_ns"][hi].min())
            if fold_native.REFERENCE:
                ca = t.api[(t.api["end_ns"] >= t0) | np.isin(t.api["correlation_id"], k["correlation_id"][hi])]
            else:
                # One native pass over the records (np.isin sorted the records' ids with the
                # held ones: a fifth of the fold at 8 GPUs x 100k kernels/s).
                ca = t.api[fold_native.carry_api_mask(t.api, t0, k["correlation_id"][hi])]
        if annotated and (len(t.ranges) or len(t.cpu_ops)):
            # The launch records of the held kernels (CPU ranges and older Kineto's
            # operators map kernels through them).
            ca = t.api[np.isin(t.api["correlation_id"], k["correlation_id"][hi])]
            t0 = int(k["start_ns"][hi].min())
            if len(t.cpu_ops):
                op = kernel_cpu_op_index(t)[hi]
                if (op >= 0).any():
                    t0 = min(t0, int(t.cpu_ops["start_ns"][op[op >= 0]].min()))
            cr = t.ranges[t.ranges["end_ns"] >= t0]
            co = t.cpu_ops[t.cpu_ops["end_ns"] >= t0]
        return cr, co, ca

    @staticmethod
    def _waiting_steps(steps, held: np.ndarray) -> list[int] | None:
        """The steps to hold with the open ones (None: none): per device, its latest step
        not held already when it is an unknown step whose layers could take its next step's
        phase (``layers_wait``, aggregator.phases.same_layers_by_continuity), mapped again
        with that step once it is decided. The MI300X HF Qwen forward's first step repeats
        the layers of the next, which every window fold held open while the first was
        decided (unknown there, prefill over the whole trace)."""
        if not any(s.layers_wait for s in steps):
            return None
        latest: dict[int, int] = {}
        for i, s in enumerate(steps):
            if not held[i] and (s.device not in latest or s.start_ns >= steps[latest[s.device]].start_ns):
                latest[s.device] = i
        out = [i for i in latest.values() if steps[i].layers_wait]
        return out or None

    def _held_steps(self, steps, kstep: np.ndarray) -> np.ndarray:
        """Per step (``device``, ``start_ns``), and one more slot for "no step": True for
        each device's last step, held for the next batch; at most MAX_CARRY_KERNELS in
        all, smallest first, a step over the bound counted in ``open_steps_cut``."""
        last: dict[int, int] = {}
        for i, s in enumerate(steps):
            if s.device not in last or s.start_ns >= steps[last[s.device]].start_ns:
                last[s.device] = i
        size = np.bincount(kstep + 1, minlength=len(steps) + 1)[1:]     # kstep >= -1
        held = np.zeros(len(steps) + 1, dtype=bool)
        room = MAX_CARRY_KERNELS
        for i in sorted(last.values(), key=lambda i: int(size[i])):
            if size[i] <= room:
                held[i] = True
                room -= int(size[i])
            else:
                self.open_steps_cut += 1
        return held

    def _fold_kernels(self, k, order, phase, kstep, steps, lat, shf, shb, api) -> None:
        """Fold the kernels ``order`` (indices sorted by step, then start) with their
        phase, batch-local step, launch latency and shapes work (``shf``: flops and bytes
        columns, ``shb``: dtype code) into the phase accumulator
        (:func:`aggregator.phase_figures.fold_kernels`, the fold ``analyze`` runs on a whole
        trace), then the per-device figures from its units: a device's busy time is the
        sum over its steps (steps of one device follow each other), its idle gaps those
        between and inside its units."""
        def log_steps(sts, gks):
            room = max(0, MAX_STEP_LOG - len(self.step_log))
            if len(sts) > room:
                self.steps_unlogged += len(sts) - room
                sts, gks = sts[:room], gks[:room]
            # split_group_key's (device, pid), the pid as the signed 32-bit value it was
            dev = (gks >> 32).tolist()
            pid = (gks & 0xFFFFFFFF).astype(np.uint32).view(np.int32).tolist()
            self.step_log.extend((int(st.start_ns), int(st.end_ns), int(st.phase), d, p)
                                 for st, d, p in zip(sts, dev, pid))
        work = self._work if self.model is not None else None
        if shf is None:
            # No operator shapes (a kernel stream): one native pass over the records.
            u = fold_records(self.sums, k, order, phase=phase, step=kstep, steps=steps, latency_ns=lat,
                             step_work=work, host=host_intervals(api), on_steps=log_steps)
        else:
            d0, d1 = fold_native.field_range(k, "device")
            p0, p1 = fold_native.field_range(k, "pid")
            # One GPU and process (the common case): no per-kernel key to gather.
            gkey = int(group_key(d0, p0)) if d0 == d1 and p0 == p1 else group_key(k["device"][order], k["pid"][order])
            u = fold_kernels(
                # the two time columns gathered straight from the packed records (fold_native.gather)
                self.sums, start_ns=fold_native.gather(k, "start_ns", order),
                end_ns=fold_native.gather(k, "end_ns", order), phase=phase[order], step=kstep[order], gkey=gkey,
                steps=steps, latency_ns=lat[order], shape_flops=shf[order, 0], shape_bytes=shf[order, 1],
                shape_dtype=shb[order], step_work=work, host=host_intervals(api), on_steps=log_steps)
        if u is None:
            return
        # Per (device, pid): busy = sum over its units; idle gaps between its units.
        ug, g_of_unit = distinct_inverse(u.gkey)
        g_busy = np.bincount(g_of_unit, weights=u.busy_ns, minlength=len(ug))
        g_cnt = np.bincount(g_of_unit, weights=u.kernels, minlength=len(ug))
        g_kt = np.bincount(g_of_unit, weights=u.kernel_time_ns, minlength=len(ug))
        for gi, gk in enumerate(ug.tolist()):
            g = self._group(*split_group_key(gk))
            m = np.flatnonzero(g_of_unit == gi) if len(ug) > 1 else slice(None)
            us, ue = u.start_ns[m], u.end_ns[m]
            o = np.argsort(us, kind="stable")
            us, ue = us[o], np.maximum.accumulate(ue[o])
            g.busy_ns += int(g_busy[gi])
            g.kernels += int(g_cnt[gi])
            g.kernel_time_ns += int(g_kt[gi])
            g.extent(int(us[0]), int(ue[-1]))
            gaps = us[1:] - ue[:-1]
            if g.last_end is not None and us[0] > g.last_end:
                gaps = np.r_[us[0] - g.last_end, gaps]
            gaps = gaps[gaps > 0]
            if len(gaps):
                g.idle_hist += np.bincount(log2_bins(gaps), minlength=HIST_BINS)
            g.last_end = max(int(ue[-1]), g.last_end if g.last_end is not None else int(ue[-1]))
        # Within-unit gaps are device idle too.
        if u.gap_log2_by_group is not None:
            # binned by the native pass (fold_records), per group
            for gk, h in u.gap_log2_by_group.items():
                self._group(*split_group_key(gk)).idle_hist += h
        elif len(u.gap_ns):
            gg = g_of_unit[u.gap_unit]
            h = np.bincount(gg * HIST_BINS + log2_bins(u.gap_ns), minlength=len(ug) * HIST_BINS).reshape(-1, HIST_BINS)
            for gi, gk in enumerate(ug.tolist()):
                self._group(*split_group_key(gk)).idle_hist += h[gi]

    def _work(self, st):
        mixed = st.tokens if st.phase == Phase.MIXED else None
        key = (st.prefill_tokens, st.decode_tokens, mixed, st.source != "annotation")
        if key not in self._step_work:
            from .work import step_work_of
            # A failure here is the project's own: it reaches fold.add's handler (counted, logged).
            w = step_work_of(self.model, key[0], key[1], mixed_tokens=mixed, estimate=key[3])
            if len(self._step_work) > 4096:
                self._step_work.clear()
            self._step_work[key] = w
        return self._step_work[key]

    # -- window close ------------------------------------------------------------------------
    def figures(self, hold_ns: int | None = None) -> list[GpuProcess]:
        """The window's figures; starts the next window. The open step of each device
        stays held (see :meth:`add`) and is mapped, and counted, in a later window when
        it is whole: a step cut by the window edge is never mapped in pieces, so the
        streaming labels do not depend on where windows close. Call :meth:`flush` first to
        fold the open steps into this window instead. A device that sent no kernel during
        the whole window has finished its open step: it is mapped and counted now. With
        ``hold_ns`` (the caller's window length), an open step already held at the previous
        call and spanning at least ``hold_ns`` is decided now (:meth:`_release_overdue`)."""
        self._drain()
        self._release_idle()
        if hold_ns is not None:
            self._release_overdue(hold_ns)
        held: dict[int, int] = {}
        if self._carry is not None:
            d, n = np.unique(self._carry[0]["device"], return_counts=True)
            held = dict(zip(d.tolist(), n.tolist()))
        out = [self._gpu_process(dev, pid, g, held.get(int(dev), 0)) for (dev, pid), g in sorted(self.groups.items())]
        self.reset()
        return out

    def _api_hists(self, pid: int) -> tuple[np.ndarray, np.ndarray]:
        """The launch and sync call histograms of a process; a source of one GPU and process
        whose API calls carry another pid (a replay) gets all of them."""
        launch = self.api_hist.get((pid, "launch"))
        sync = self.api_hist.get((pid, "sync"))
        if launch is None and sync is None and len(self.groups) == 1:
            launch = sum((h for (p, w), h in self.api_hist.items() if w == "launch"), np.zeros(HIST_BINS, np.int64))
            sync = sum((h for (p, w), h in self.api_hist.items() if w == "sync"), np.zeros(HIST_BINS, np.int64))
        empty = np.zeros(HIST_BINS, np.int64)
        return (launch if launch is not None else empty), (sync if sync is not None else empty)

    def _gpu_process(self, dev: int, pid: int, g: _GroupAcc, held_kernels: int) -> GpuProcess:
        """One (GPU, process)'s figures of the window, as the window record holds them."""
        dev_obj = self.devices.get(dev)
        name = dev_obj.name if dev_obj else (self.gpu or "")
        ceil = _ceilings_obj(self.gpu or name)
        span = int(g.t_max - g.t_min) if g.t_min is not None else 0
        launch, sync = self._api_hists(pid)
        phases = figures_by_phase(self.sums.select(self.sums.group_rows(int(group_key(dev, pid)))),
                                  PHASE_NAMES, ceilings=ceil,
                                  model_dtype=self.model.ceiling_dtype if self.model is not None else None)
        held = (f"; {held_kernels} kernels of the open step held for the window where it ends"
                if held_kernels else "")
        return GpuProcess(
            device=int(dev), pid=int(pid), gpu=name,
            kernels=int(g.kernels), kernel_time_ns=int(g.kernel_time_ns),
            busy_ns=int(min(g.busy_ns, span) if span else g.busy_ns), span_ns=span,
            idle_ns=int(max(0, span - g.busy_ns)),
            idle_gaps=_hist_summary(g.idle_hist),
            copy_bytes={k: int(v) for k, v in g.copy_bytes.items()},
            launch=_hist_summary(launch),
            launch_tids=sorted(self.launch_tids.get(int(pid), ())),
            sync=_hist_summary(sync),
            # the figures of aggregator.phase_figures (shared with analyze), typed here
            phases=msgspec.convert(plain(phases), dict[str, PhaseFigures]),
            phase_source=(f"stream: layered phase mapping per step shape ({self.shape_hits} steps from "
                          f"remembered shapes, {self.shape_misses} mapped{held})"),
            ceilings=_ceilings(self.gpu or name))


def concat_records(parts: list[np.ndarray]) -> np.ndarray:
    """Concatenate structured arrays of one dtype as raw records (one memcpy each;
    numpy's field-wise concatenation of structured arrays is several times slower)."""
    parts = [p for p in parts if len(p)] or parts[:1]
    if len(parts) == 1:
        return parts[0]
    dt = parts[0].dtype
    raw = np.dtype((np.void, dt.itemsize))
    return np.concatenate([np.ascontiguousarray(p).view(raw) for p in parts]).view(dt)


#: The largest concatenation a RecordBuffer keeps for reuse (1 GPU x 50k kernels/s folds
#: about 2.6 MB of kernel records at a time).
MAX_KEPT_BYTES = 4 << 20


class RecordBuffer:
    """:func:`concat_records` into one buffer kept from fold to fold (one per record kind of
    a :class:`SourceFold`). A fresh concatenation of a window's batches (MBs) lands in
    pages the allocator has just handed back to the kernel, and faulting them in again cost
    more than the copy itself (bench_fold: about 1,200 minor faults per window, 1 GPU x 50k
    kernels/s). The buffer is reused only when no array made from its last result is still
    alive (a view holds its owner: ``probes.buffer_reuse.unshared``), so a result that something kept is
    never overwritten; otherwise, and when the records do not fit, a new one is made.
    ``fold_native.REFERENCE``: a fresh concatenation each time (the tests compare the two)."""
    __slots__ = ("_raw", "reuses")

    def __init__(self):
        self._raw: np.ndarray | None = None
        self.reuses = 0                 # concatenations written into the previous buffer

    def concat(self, parts: list[np.ndarray]) -> np.ndarray:
        parts = [p for p in parts if len(p)] or parts[:1]
        if len(parts) == 1 or fold_native.REFERENCE:
            return concat_records(parts)
        dt = parts[0].dtype
        nbytes = sum(len(p) for p in parts) * dt.itemsize
        if nbytes > MAX_KEPT_BYTES:
            # A fold this large (a held step near MAX_CARRY_KERNELS, a backlog) is rare:
            # kept, its buffer would hold tens of MB for the agent's life (a loaded CI
            # host's 10-minute replay grew 66 MB); made fresh, it is given back.
            self._raw = None
            return concat_records(parts)
        raw = self._raw
        # Nothing made from the last result (a view, a field, a slice) may be alive.
        if raw is None or len(raw) < nbytes or len(raw) > 4 * nbytes or not unshared(raw):
            # Room for a somewhat bigger fold; one 4x smaller gives its memory back.
            raw = self._raw = np.empty(nbytes + nbytes // 4, np.uint8)
        else:
            self.reuses += 1
        rec = np.dtype((np.void, dt.itemsize))
        out = raw[:nbytes].view(rec)
        np.concatenate([np.ascontiguousarray(p).view(rec) for p in parts], out=out)
        return out.view(dt)




@lru_cache(maxsize=64)
def _ceilings_obj(gpu_name: str):
    if not gpu_name:
        return None
    from ridgeline.aggregator import ceilings
    try:
        return ceilings.from_device_name(gpu_name) or ceilings.lookup(gpu_name)
    except InputError:      # a GPU the table does not know (or cannot tell apart): no ceilings
        return None
