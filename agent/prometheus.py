"""Prometheus exposition of the agent's windows (``/metrics``, prometheus-client).

Contract: :class:`WindowCollector` turns the latest window (gauges) and running totals
(``_total`` counters, accumulated by :meth:`WindowCollector.observe` once per window)
into metric families named by Prometheus conventions: ``ridgeline_`` prefix, base units
in the name (``_seconds``, ``_bytes``, ``_ratio`` for 0..1 fractions,
``_flops_per_second``), counters ending in ``_total``. Per-phase, per-GPU and thread
figures are named here; engine, device, verdict and alert samples come from their
aggregator modules' ``prometheus_samples`` so each figure is named once. :class:`MetricsServer` serves them over HTTP on the
configured loopback address in a daemon thread; a scrape never touches the probes.

Series are bounded: at most :data:`MAX_SERIES_PER_FAMILY` label sets per family, so a
misbehaving source cannot grow the exposition without limit.
"""
from __future__ import annotations

import math
import threading

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

MAX_SERIES_PER_FAMILY = 2000


def _num(v) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


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
        self.thread_seconds: dict[tuple, list] = {}   # (pid, tid, comm) -> [on_cpu, runq, blocked]

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
            from .top import _sched_threads
            for th in _sched_threads(window.get("sched") or {}):
                key = (str(th.get("pid")), str(th.get("tid")), str(th.get("comm", "")))
                if key not in self.thread_seconds and len(self.thread_seconds) >= MAX_SERIES_PER_FAMILY:
                    continue
                acc = self.thread_seconds.setdefault(key, [0.0, 0.0, 0.0])
                for i, k in enumerate(("on_cpu_ns", "runq_wait_ns", "blocked_ns")):
                    acc[i] += float(th.get(k) or 0) * 1e-9

    def collect(self):
        with self._lock:
            w = self.window
            yield from self._counters()
            if w is None:
                return
            yield from self._phase_gauges(w)
            yield from self._families(self._samples(w))
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
        for i, (what, doc) in enumerate((("on_cpu", "time on CPU"), ("runq_wait", "time waiting in the run queue"),
                                         ("blocked", "time blocked (off CPU, not runnable)"))):
            c = CounterMetricFamily(f"ridgeline_thread_{what}_seconds", f"watched threads' {doc}",
                                    labels=["pid", "tid", "comm"])
            for k, v in self.thread_seconds.items():
                c.add_metric(list(k), v[i])
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

    def _samples(self, w: dict) -> list[tuple[str, dict, float]]:
        """Engine, device, verdict and alert samples, named by their aggregator modules."""
        out: list[tuple[str, dict, float]] = []
        try:
            from ridgeline.aggregator import device_metrics, engine_metrics, verdict
        except ImportError:
            return out
        from .top import engine_records
        for ep, rec in engine_records(w.get("engine") or {}):
            try:
                out += engine_metrics.prometheus_samples(rec, {"endpoint": str(ep)})
            except Exception:
                continue
            for name, st in (rec.get("alerts") or {}).items() if isinstance(rec.get("alerts"), dict) else ():
                if isinstance(st, dict):
                    out.append(("ridgeline_alert_firing", {"endpoint": str(ep), "alert": str(name)},
                                1.0 if st.get("firing") else 0.0))
        for src, data in (w.get("device") or {}).items():
            recs = data.get("devices") if isinstance(data, dict) else None
            if isinstance(recs, list):
                try:
                    for fig in device_metrics.window_figures(recs).values():
                        out += device_metrics.prometheus_samples(fig)
                except Exception:
                    continue
        for v in w.get("verdict") or [] if isinstance(w.get("verdict"), list) else []:
            if isinstance(v, dict) and v.get("verdict") in getattr(verdict, "VERDICTS", ()):
                out += verdict.prometheus_samples(v)
        return out

    def _families(self, samples):
        gauges: dict[str, GaugeMetricFamily] = {}
        keys: dict[str, tuple] = {}
        for name, labels, value in samples:
            lk = tuple(sorted(labels))
            if name not in gauges:
                gauges[name] = GaugeMetricFamily(name, name.replace("ridgeline_", "").replace("_", " "), labels=list(lk))
                keys[name] = lk
            if keys[name] != lk or len(gauges[name].samples) >= MAX_SERIES_PER_FAMILY:
                continue
            gauges[name].add_metric([str(labels[k]) for k in lk], value)
        for name, fam in gauges.items():
            if name.endswith("_total"):
                # A _total name is a counter in the exposition format.
                c = CounterMetricFamily(name[:-6], fam.documentation, labels=list(keys[name]))
                for smp in fam.samples:
                    c.add_metric([smp.labels[k] for k in keys[name]], smp.value)
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
            pass   # per-GPU verdicts: ridgeline_verdict_info from aggregator.verdict (see _samples)
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
