"""Time windows: what the probes saw in the last ``window_s``, folded into one record.

Contract: a :class:`WindowBuilder` receives probe data as it is polled
(:meth:`~WindowBuilder.add_events` for columnar :class:`probes.events.Trace` batches,
:meth:`~WindowBuilder.add_sched`, :meth:`~WindowBuilder.add_device`,
:meth:`~WindowBuilder.add_engine` for plain dicts) and :meth:`~WindowBuilder.close`
returns the window record (a plain dict of str/int/float/list/dict, ready for
``aggregator.wire.encode_window``) and starts the next window empty.

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
  ``evidence``, ``work_source``), ``ceilings`` (when known) and ``phase_source``.
* ``device``: the latest device sample per GPU; ``engine``: the latest engine figures;
  ``sched``: the latest scheduling figures (each as the probe delivered them, plain).
* ``verdict``: the window's verdict from ``aggregator.verdict`` where it can judge.
* ``agent``: the agent's own cost and counters, as given to :meth:`close`.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np

from probes.events import (API_LAUNCH, API_GRAPH_LAUNCH, API_SYNC, COPY_DIRECTION_NAMES,
                           Trace)

log = logging.getLogger("ridgeline.windows")

_KINDS = ("kernels", "copies", "api", "ranges", "cpu_ops")
MAX_DEVICE_SAMPLES = 256
MAX_ENGINE_SCRAPES = 64


def plain(obj):
    """Convert numpy scalars/arrays (and nested containers) into msgpack-ready Python."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        if obj.dtype.names:
            # Small record arrays (per-thread rows): one dict per row, as consumers expect.
            return [{n: plain(r[n]) for n in obj.dtype.names} for r in obj]
        return plain(obj.tolist()) if obj.dtype.kind in "SV" else obj.tolist()
    if isinstance(obj, bytes):
        return obj.decode("utf-8", "replace").rstrip("\x00")
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if hasattr(obj, "__dataclass_fields__"):
        return plain({k: getattr(obj, k) for k in obj.__dataclass_fields__})
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


def _latency(api: np.ndarray, categories: tuple[int, ...]) -> dict:
    sel = api[np.isin(api["category"], categories)] if len(api) else api
    if not len(sel):
        return {"count": 0, "p50_ns": None, "p99_ns": None}
    d = (sel["end_ns"] - sel["start_ns"]).astype(np.int64)
    p50, p99 = np.percentile(d, [50, 99])
    return {"count": int(len(d)), "p50_ns": int(p50), "p99_ns": int(p99)}


def concat_traces(parts: list[Trace]) -> Trace:
    """One Trace from batches of one source (they share its name table)."""
    if len(parts) == 1:
        return parts[0]
    arrays = {k: np.concatenate([getattr(p, k) for p in parts]) for k in _KINDS}
    meta = dict(parts[-1].meta)
    return Trace(arrays["kernels"], arrays["copies"], arrays["api"], arrays["ranges"], arrays["cpu_ops"],
                 parts[0].names, parts[0].devices, meta)


def _phase_figures(trace: Trace, model=None, gpu: str | None = None) -> tuple[dict, str]:
    """Per-phase figures of one GPU/process slice: the phase mapper and roofline of
    :func:`aggregator.analysis.analyze_trace` (FLOPs, bytes, achieved rates against the
    ceilings, verdict, evidence) where they can run; kernel time and counts always."""
    k = trace.kernels
    dur = np.maximum(k["end_ns"] - k["start_ns"], 0).astype(np.int64)
    total = int(dur.sum())
    try:
        from aggregator import analysis
        res = analysis.analyze_trace(trace, model=model, gpu=gpu or None)
        phases = {}
        for name, f in (res.get("phases") or {}).items():
            f = plain(f)
            share = f.get("share_of_gpu_time_ratio")
            f["time_share_pct"] = 100.0 * share if isinstance(share, (int, float)) else (
                100.0 * f.get("kernel_time_ns", 0) / total if total else 0.0)
            phases[str(name)] = f
        if phases or not len(k):
            return phases, "analysis"
        source = "analysis: no phases"
    except ImportError:
        source = "none"
    except Exception as exc:   # a mapper/roofline failure loses the phase split, not the window
        log.debug("phase analysis failed: %s", exc)
        source = f"analysis failed: {type(exc).__name__}: {exc}"[:200]
    return ({"unknown": {"kernels": int(len(k)), "kernel_time_ns": total, "time_share_pct": 100.0 if total else 0.0}}
            if len(k) else {}), source


def _ceilings(gpu_name: str) -> dict | None:
    try:
        from aggregator import ceilings
        c = ceilings.from_device_name(gpu_name) if gpu_name else None
    except Exception:
        return None
    if c is None:
        return None
    return {"gpu": c.gpu, "hbm_bytes_per_s": c.hbm_bytes_per_s, "flops_per_s": plain(dict(c.flops_per_s))}


def gpu_figures(trace: Trace, model=None, gpu: str | None = None) -> list[dict]:
    """Figures per (device, pid) of one source's events in one window. ``model``: an
    :class:`aggregator.model_config.ModelShape` for FLOPs/bytes per step; ``gpu``: a GPU
    name for the ceilings when the events do not name their device."""
    k, c, a = trace.kernels, trace.copies, trace.api
    devices = {d.index: d for d in trace.devices}

    def key(a):
        return (a["device"].astype(np.int64) << 32) | (a["pid"].astype(np.int64) & 0xFFFFFFFF)
    kk = key(k) if len(k) else np.empty(0, np.int64)
    ck = key(c) if len(c) else np.empty(0, np.int64)
    keys = np.unique(np.concatenate([kk, ck]))
    out = []
    for kv in keys.tolist():
        dev, pid = kv >> 32, np.int64(kv & 0xFFFFFFFF).astype(np.int32).item()
        # One (GPU, process) pair is the common case: no masking copies then.
        km = k if len(keys) == 1 else k[kk == kv]
        cm = c if len(keys) == 1 else c[ck == kv]
        # API calls carry no device: those of the process (or all of them when the
        # source does not know pids) describe its launch thread(s).
        am = a[a["pid"] == pid] if (len(a) and pid >= 0 and len(keys) > 1) else a
        starts = np.concatenate([km["start_ns"], cm["start_ns"]])
        ends = np.concatenate([km["end_ns"], cm["end_ns"]])
        span = int(ends.max() - starts.min()) if len(starts) else 0
        busy = busy_ns(km["start_ns"], km["end_ns"])
        copy_bytes: dict[str, int] = {}
        if len(cm):
            for d in np.unique(cm["direction"]).tolist():
                copy_bytes[COPY_DIRECTION_NAMES.get(d, str(d))] = int(cm["bytes"][cm["direction"] == d].sum())
        sub = Trace(km, cm, am, trace.ranges, trace.cpu_ops, trace.names, trace.devices, trace.meta)
        phases, phase_source = _phase_figures(sub, model, gpu)
        dev_obj = devices.get(dev)
        name = dev_obj.name if dev_obj else (gpu or "")
        out.append({
            "device": int(dev), "pid": int(pid), "gpu": name,
            "kernels": int(len(km)),
            "kernel_time_ns": int((km["end_ns"] - km["start_ns"]).sum()) if len(km) else 0,
            "busy_ns": busy, "span_ns": span, "idle_ns": max(0, span - busy),
            "copy_bytes": copy_bytes,
            "launch": _latency(am, (API_LAUNCH, API_GRAPH_LAUNCH)),
            "sync": _latency(am, (API_SYNC,)),
            "phases": phases, "phase_source": phase_source,
            "ceilings": _ceilings(name),
        })
    return out


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

    def add_events(self, trace: Trace, source: str = "") -> None:
        """Keep a batch for this window; past ``max_events`` per window the batch is
        dropped and counted in ``drops`` (bounded memory and close time)."""
        n = len(trace.kernels) + len(trace.copies) + len(trace.api)
        if self._events_held + n > self.max_events:
            self.drops += n
            return
        self._events_held += n
        key = source or trace.meta.get("source", "") or "events"
        self.events.setdefault((key, id(trace.names)), []).append(trace)
        self.records += n

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

    def _engine_close(self) -> None:
        from aggregator import engine_metrics
        for source, polled in self._scrapes.items():
            tracker = self._trackers.get(source)
            if tracker is None:
                tracker = self._trackers[source] = engine_metrics.EngineTracker()
            try:
                rec = tracker.update(polled)
            except Exception as exc:   # one bad scrape set loses this window's engine figures only
                log.warning("engine figures from %s failed: %s: %s", source, type(exc).__name__, exc)
                self.engine_errors += 1
                continue
            if rec.get("endpoints") or source not in self.engine:
                self.engine[source] = rec
            elif rec.get("errors"):
                self.engine[source] = dict(self.engine[source], errors=rec["errors"])
        self._scrapes = {}

    def close(self, start_ns: int, end_ns: int, agent: dict | None = None) -> dict:
        if self._scrapes:
            self._engine_close()
        for src, recs in self._device_recs.items():
            self.device[src] = {"devices": recs}
        self._device_recs = {}
        gpus: list[dict] = []
        sources = []
        for (src, _), parts in self.events.items():
            sources.append(src)
            try:
                figs = gpu_figures(concat_traces(parts), self.model, self.gpu)
            except Exception as exc:   # one bad batch loses its own figures only
                log.warning("window: events from %s could not be folded: %s", src, exc)
                continue
            for g in figs:
                g["source"] = src
            gpus.extend(figs)
        window = {
            "start_ns": int(start_ns), "end_ns": int(end_ns), "duration_ns": int(end_ns - start_ns),
            "host": self.host, "sources": sorted(set(sources)),
            "gpus": gpus,
            "device": plain(self.device), "engine": plain(self.engine), "sched": plain(self.sched),
            "agent": plain(agent or {}),
        }
        window["verdict"] = verdict_of(window)
        self.events = {}
        self.records = 0
        self._events_held = 0
        # Device/engine/sched keep their latest sample: a slow scraper still shows its
        # last value; the sample's own timestamp (if any) tells its age.
        return window


def verdict_of(window: dict):
    """The verdict module's judgement of a window, or None where it cannot judge."""
    try:
        from aggregator import verdict
    except ImportError:
        return None
    fn = getattr(verdict, "window_verdict", None) or getattr(verdict, "judge_window", None)
    if fn is None:
        return None
    try:
        res = fn(window)
        rec = getattr(verdict, "verdict_record", None)
        if isinstance(res, list) and rec is not None:
            return [plain(rec(v)) for v in res]
        return plain(res)
    except Exception as exc:
        log.debug("verdict failed: %s", exc)
        return {"verdict": "unknown", "error": f"{type(exc).__name__}: {exc}"}
