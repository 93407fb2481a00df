"""Prometheus exposition of the agent's windows (``/metrics``, prometheus-client).

Contract: :class:`WindowCollector` turns the latest window (gauges) and running totals
(``_total`` counters, accumulated by :meth:`WindowCollector.observe` once per window)
into metric families named by Prometheus conventions: ``ridgeline_`` prefix, base units
in the name (``_seconds``, ``_bytes``, ``_ratio`` for 0..1 fractions, ``_flops`` and
``_flops_per_second``), counters ending in ``_total``. Figures ending ``_ns`` become
seconds and ``_pct`` become ratios. :class:`MetricsServer` serves them over HTTP on the
configured loopback address in a daemon thread; a scrape never touches the probes.

Series are bounded: at most :data:`MAX_SERIES_PER_FAMILY` label sets per family, so a
misbehaving source cannot grow the exposition without limit.
"""
from __future__ import annotations

import math
import re
import threading

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

MAX_SERIES_PER_FAMILY = 2000
_NAME_RX = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(*parts: str) -> tuple[str, float]:
    """Prometheus name for a figure path, and the factor converting to its base unit."""
    name = "_".join(p for p in parts if p)
    name = _NAME_RX.sub("_", name).strip("_").lower()
    factor = 1.0
    if name.endswith("_ns"):
        name, factor = name[:-3] + "_seconds", 1e-9
    elif name.endswith("_pct"):
        name, factor = name[:-4] + "_ratio", 0.01
    elif name.endswith("_bps"):
        name = name[:-4] + "_bytes_per_second"
    elif name.endswith("_per_s"):
        name = name[:-6] + "_per_second"
    elif name.endswith("_s"):
        name = name[:-2] + "_seconds"
    return "ridgeline_" + name, factor


def _num(v) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


def flatten(obj, path: tuple[str, ...] = (), labels: dict | None = None):
    """Yield (path, labels, value) for every numeric leaf of a plain record.

    A dict holding an ``index``/``device``/``gpu`` entry labels its leaves ``gpu``; lists
    of dicts are labelled by position when they carry no such key."""
    labels = dict(labels or {})
    if isinstance(obj, dict):
        for key in ("index", "device", "gpu_index"):
            if isinstance(obj.get(key), int) and not isinstance(obj.get(key), bool):
                labels["gpu"] = str(obj[key])
                break
        for k, v in obj.items():
            if k in ("index", "device", "gpu_index", "pid", "timestamp_ns", "ts_ns"):
                continue
            yield from flatten(v, path + (str(k),), labels)
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:64]):
            if isinstance(v, dict):
                lab = dict(labels)
                lab.setdefault("gpu", str(i))
                yield from flatten(v, path, lab)
    else:
        n = _num(obj)
        if n is not None:
            yield path, labels, n


class WindowCollector:
    def __init__(self):
        self._lock = threading.Lock()
        self.window: dict | None = None
        self.windows = 0
        self.phase_kernel_seconds: dict[tuple, float] = {}
        self.phase_kernels: dict[tuple, float] = {}
        self.copy_bytes: dict[tuple, float] = {}
        self.idle_seconds: dict[tuple, float] = {}
        self.records = 0.0

    def observe(self, window: dict) -> None:
        with self._lock:
            self.window = window
            self.windows += 1
            for g in window.get("gpus", []):
                base = (str(g.get("device")), str(g.get("pid")), g.get("gpu") or "", g.get("source") or "")
                for ph, f in (g.get("phases") or {}).items():
                    k = base + (ph,)
                    self.phase_kernel_seconds[k] = self.phase_kernel_seconds.get(k, 0.0) + f.get("kernel_time_ns", 0) * 1e-9
                    self.phase_kernels[k] = self.phase_kernels.get(k, 0.0) + f.get("kernels", 0)
                for d, b in (g.get("copy_bytes") or {}).items():
                    k = base + (d,)
                    self.copy_bytes[k] = self.copy_bytes.get(k, 0.0) + b
                self.idle_seconds[base] = self.idle_seconds.get(base, 0.0) + g.get("idle_ns", 0) * 1e-9
            self.records = float((window.get("agent") or {}).get("records_total", self.records))

    def collect(self):
        with self._lock:
            w = self.window
            yield from self._counters()
            if w is None:
                return
            yield from self._phase_gauges(w)
            for section in ("device", "engine", "sched"):
                yield from self._generic(section, w.get(section) or {})
            yield from self._verdicts(w)
            yield from self._agent(w.get("agent") or {})

    def _counters(self):
        gl = ["device", "pid", "gpu", "source"]
        c = CounterMetricFamily("ridgeline_phase_kernel_seconds", "GPU kernel time per phase", labels=gl + ["phase"])
        for k, v in list(self.phase_kernel_seconds.items())[:MAX_SERIES_PER_FAMILY]:
            c.add_metric(list(k), v)
        yield c
        c = CounterMetricFamily("ridgeline_phase_kernels", "kernels per phase", labels=gl + ["phase"])
        for k, v in list(self.phase_kernels.items())[:MAX_SERIES_PER_FAMILY]:
            c.add_metric(list(k), v)
        yield c
        c = CounterMetricFamily("ridgeline_copy_bytes", "bytes copied by direction", labels=gl + ["direction"])
        for k, v in list(self.copy_bytes.items())[:MAX_SERIES_PER_FAMILY]:
            c.add_metric(list(k), v)
        yield c
        c = CounterMetricFamily("ridgeline_gpu_idle_seconds", "GPU idle time between kernels", labels=gl)
        for k, v in list(self.idle_seconds.items())[:MAX_SERIES_PER_FAMILY]:
            c.add_metric(list(k), v)
        yield c
        yield CounterMetricFamily("ridgeline_windows", "windows closed", value=self.windows)
        yield CounterMetricFamily("ridgeline_agent_records", "records the probes delivered", value=self.records)

    def _phase_gauges(self, w):
        gl = ["device", "pid", "gpu", "source", "phase"]
        specs = {
            "time_share_pct": ("ridgeline_phase_time_share_ratio", "share of kernel time in this phase", 0.01),
            "achieved_bytes_per_s": ("ridgeline_phase_achieved_bytes_per_second", "achieved memory bandwidth", 1.0),
            "achieved_flops_per_s": ("ridgeline_phase_achieved_flops_per_second", "achieved FLOP rate", 1.0),
            "arithmetic_intensity": ("ridgeline_phase_arithmetic_intensity_flops_per_byte", "FLOPs per byte", 1.0),
            "pct_of_peak_bytes": ("ridgeline_phase_peak_bandwidth_ratio", "achieved / peak bandwidth", 0.01),
            "pct_of_peak_flops": ("ridgeline_phase_peak_flops_ratio", "achieved / peak FLOP rate", 0.01),
        }
        fams = {k: GaugeMetricFamily(n, h, labels=gl) for k, (n, h, _) in specs.items()}
        busy = GaugeMetricFamily("ridgeline_gpu_busy_ratio", "kernel-busy share of the covered span",
                                 labels=gl[:-1])
        for g in w.get("gpus", [])[:MAX_SERIES_PER_FAMILY]:
            base = [str(g.get("device")), str(g.get("pid")), g.get("gpu") or "", g.get("source") or ""]
            if g.get("span_ns"):
                busy.add_metric(base, g.get("busy_ns", 0) / g["span_ns"])
            for ph, f in (g.get("phases") or {}).items():
                for key, (_, _, factor) in specs.items():
                    v = _num(f.get(key))
                    if v is not None:
                        fams[key].add_metric(base + [ph], v * factor)
        yield busy
        yield from fams.values()

    def _generic(self, section: str, data: dict):
        fams: dict[str, GaugeMetricFamily] = {}
        names: dict[str, tuple] = {}     # family -> its label names (fixed by the first series)
        for source, rec in data.items():
            for path, labels, value in flatten(rec):
                name, factor = metric_name(section, *path)
                lab = {"source": str(source), **labels}
                keys = tuple(sorted(lab))
                if name not in fams:
                    fams[name] = GaugeMetricFamily(name, f"{section} figure {'.'.join(path)}", labels=list(keys))
                    names[name] = keys
                fam = fams[name]
                if keys != names[name] or len(fam.samples) >= MAX_SERIES_PER_FAMILY:
                    continue
                fam.add_metric([lab[k] for k in keys], value * factor)
        for name, fam in fams.items():
            # A name ending _total must be a counter in the exposition format.
            if name.endswith("_total"):
                c = CounterMetricFamily(name[:-6], fam.documentation, labels=list(names[name]))
                for s in fam.samples:
                    c.add_metric([s.labels[k] for k in names[name]], s.value)
                yield c
            else:
                yield fam

    def _verdicts(self, w):
        info = InfoMetricFamily("ridgeline_phase_verdict", "verdict per GPU, process and phase",
                                labels=["device", "pid", "gpu", "source", "phase"])
        for g in w.get("gpus", [])[:MAX_SERIES_PER_FAMILY]:
            for ph, f in (g.get("phases") or {}).items():
                if f.get("verdict"):
                    info.add_metric([str(g.get("device")), str(g.get("pid")), g.get("gpu") or "",
                                     g.get("source") or "", ph], {"verdict": str(f["verdict"])})
        yield info
        v = w.get("verdict")
        if isinstance(v, list):
            win = InfoMetricFamily("ridgeline_verdict", "verdict per GPU and served process (latest window)",
                                   labels=["device", "pid"])
            for x in v[:MAX_SERIES_PER_FAMILY]:
                if isinstance(x, dict) and x.get("verdict"):
                    win.add_metric([str(x.get("device")), str(x.get("pid"))],
                                   {"verdict": str(x["verdict"]), "face": str(x.get("face") or "")})
            yield win
        elif isinstance(v, dict):
            label = v.get("verdict") or v.get("face") or v.get("name")
            if label:
                win = InfoMetricFamily("ridgeline_window_verdict", "the latest window's overall verdict")
                win.add_metric([], {"verdict": str(label)})
                yield win
        elif isinstance(v, str):
            win = InfoMetricFamily("ridgeline_window_verdict", "the latest window's overall verdict")
            win.add_metric([], {"verdict": v})
            yield win

    def _agent(self, a: dict):
        yield GaugeMetricFamily("ridgeline_agent_cpu_ratio", "agent CPU, fraction of one core",
                                value=(a.get("cpu_pct") or 0) / 100)
        yield GaugeMetricFamily("ridgeline_agent_resident_memory_bytes", "agent RSS", value=a.get("rss_bytes") or 0)
        yield GaugeMetricFamily("ridgeline_agent_records_per_second", "records per second", value=a.get("records_per_s") or 0)
        drops = CounterMetricFamily("ridgeline_agent_probe_drops", "records dropped per probe", labels=["probe"])
        errors = CounterMetricFamily("ridgeline_agent_probe_errors", "errors per probe", labels=["probe"])
        for name, c in (a.get("probes") or {}).items():
            drops.add_metric([name], float(c.get("drops", 0) or 0))
            errors.add_metric([name], float(c.get("errors", 0) or 0))
        yield drops
        yield errors
        pd = CounterMetricFamily("ridgeline_agent_publisher_drops", "stream messages dropped (slow subscribers)",
                                 labels=["topic"])
        for t, n in (a.get("publisher_drops_by_topic") or {}).items():
            pd.add_metric([t], float(n))
        yield pd
        if _num(a.get("bpf_run_time_ns")) is not None:
            yield CounterMetricFamily("ridgeline_agent_bpf_run_seconds", "BPF program run time",
                                      value=a["bpf_run_time_ns"] * 1e-9)


class MetricsServer:
    """Serve a :class:`WindowCollector` on ``listen`` (HOST:PORT); :meth:`observe` feeds it."""

    def __init__(self, agent, listen: str):
        host, _, port = listen.rpartition(":")
        self.collector = WindowCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.server, self.thread = start_http_server(int(port), addr=host.strip("[]"), registry=self.registry)
        self.port = self.server.server_port

    def observe(self, window: dict) -> None:
        self.collector.observe(window)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
