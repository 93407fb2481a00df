"""The simulated engine as a live probe: columnar event batches on the agent's clock.

:class:`SimulatorProbe` follows :mod:`probes.probe`. ``start()`` builds a
:class:`~agent.simulator.engine.SimEngine` whose simulated clock is anchored to the wall
clock (``time.time_ns()`` at start) and advances at ``speed`` times real time; each
``poll()`` runs the steps that are due (at most ``max_steps_per_poll``; a simulation
slower than real time lags, reported as ``lag_ns``) and returns ``{"kind": "events", "trace": Trace,
"engine": {"scrapes": [...]}}``: the kernels, copies, launch/sync API calls and step
annotations emitted since the previous poll (``trace.meta["source"] == "simulated"``)
and, once per ``scrape_interval_s``, one scrape of the engine's own vLLM V1 metrics in
the engine probe's format (``{"endpoint", "ts_ns", "exposition"}``), or ``None`` when
nothing is due. With ``serve_metrics`` the same metrics are served over HTTP on
127.0.0.1 (``metrics_port``), so the engine probe can scrape them as a real server's.

The workload runs indefinitely (another seeded run of arrivals is appended when one
ends). Events not polled pile up in a bounded buffer; past it, steps are dropped and
counted (``drops``). :meth:`restart_process` simulates the served process exiting and a
new one appearing (new pid, fresh engine state and counters).
"""
from __future__ import annotations

import time

from ridgeline.probes import prom_text
from ridgeline.probes.errors import InputError
from ridgeline.probes.probe import Availability, Probe

from .engine import SimConfig, SimEngine
from .scheduler import SchedulerConfig
from .workload import Workload


class SimulatorProbe(Probe):
    name = "simulator"
    optional = True

    def __init__(self, gpu: str = "h100", model: str = "llama-3-8b", rate_per_s: float = 4.0, seed: int = 0,
                 engine: str = "vllm", speed: float = 1.0, serve_metrics: bool = False, scrape_interval_s: float = 1.0,
                 config: SimConfig | None = None, device: int = 0, pid: int = 90_000,
                 max_buffer_kernels: int = 2_000_000, name: str = "simulator", engine_metrics: bool = True,
                 otlp_endpoint: str = "", **_ignored):
        super().__init__(name=name)
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.config = config or SimConfig(
            gpu=gpu, model=model, engine=engine, device=device, pid=pid, tid=pid,
            workload=Workload(rate_per_s=rate_per_s, duration_s=600.0),
            scheduler=SchedulerConfig(), max_buffer_kernels=max_buffer_kernels)
        self.seed, self.speed = seed, speed
        self.serve_metrics = serve_metrics
        self.engine_metrics = engine_metrics
        self.scrape_interval_ns = int(scrape_interval_s * 1e9)
        self.engine: SimEngine | None = None
        self.metrics_port: int | None = None
        self._t0_mono = 0
        self._next_scrape_ns = 0
        self.restarts = 0
        self._drops_before = 0
        self.max_steps_per_poll = 64
        self.lag_ns = 0
        # Per-request spans through the real OpenTelemetry exporter, as vLLM started with
        # --otlp-traces-endpoint sends them (agent/simulator/spans.py); "" sends none.
        self.otlp_endpoint = otlp_endpoint
        self.spans = None
        self._spans_told = 0
        self.spans_unavailable = ""

    def check(self) -> Availability:
        try:
            from .hardware import gpu_spec
            from .model import load_model
            gpu_spec(self.config.gpu)
            load_model(self.config.model)
        except InputError as exc:        # a GPU or model the tables do not know
            return Availability(False, f"simulator cannot run: {exc}", "pick a GPU and model the tables know")
        return Availability(True, "SIMULATED load source (no GPU needed)")

    def _new_engine(self, seed: int) -> SimEngine:
        cfg = self.config
        cfg.time_base_ns = time.time_ns() - self._sim_now()   # simulated t maps to the wall clock
        return SimEngine(cfg, seed=seed, metrics=True, keep_steps=4096)

    def _sim_now(self) -> int:
        return int((time.monotonic_ns() - self._t0_mono) * self.speed) if self._t0_mono else 0

    def start(self) -> None:
        if self.engine is not None:
            return
        self._t0_mono = time.monotonic_ns()
        self.engine = self._new_engine(self.seed)
        if self.serve_metrics:
            self.metrics_port = self.engine.metrics.serve(0)
        if self.otlp_endpoint and self.spans is None:
            from .spans import RequestSpanEmitter, SpansUnavailable
            try:
                self.spans = RequestSpanEmitter(self.otlp_endpoint, model=self.config.model)
            except SpansUnavailable as exc:
                self.spans_unavailable = str(exc)

    def _emit_spans(self, eng: SimEngine) -> None:
        """Spans of the requests finished since the last poll (their times on the wall clock)."""
        new = eng.finished_total - self._spans_told
        if self.spans is None or new <= 0:
            self._spans_told = eng.finished_total
            return
        base = eng.cfg.time_base_ns
        done = list(eng.finished)[-min(new, len(eng.finished)):]
        for i, r in enumerate(done):
            serial = eng.finished_total - len(done) + i
            # Queue time to its first admission (vLLM's time_in_queue); each preemption a
            # pause, from its eviction to its readmission.
            self.spans.emit(f"sim-{eng.cfg.pid}-{serial}", base + r.arrival_ns,
                            base + max(r.first_scheduled_ns, r.arrival_ns),
                            base + r.first_token_ns, base + r.last_token_ns, r.prompt, r.generated,
                            preemptions=r.preemptions,
                            pauses=[(base + a, base + (b if b >= 0 else r.last_token_ns)) for a, b in r.pauses])
        self._spans_told = eng.finished_total

    def restart_process(self) -> None:
        """The served process exits and a new one (next pid) takes its place."""
        if self.engine is None:
            return
        old = self.engine
        self._drops_before += old.dropped_kernels
        if old.metrics:
            old.metrics.close()
        self.restarts += 1
        self._spans_told = 0
        self.config.pid += 1
        self.config.tid += 1
        self._t0_mono = time.monotonic_ns()
        self.engine = self._new_engine(self.seed + 1000 * self.restarts)
        if self.serve_metrics:
            self.metrics_port = self.engine.metrics.serve(0)

    def poll(self):
        eng = self.engine
        if eng is None:
            return None
        now = self._sim_now()
        if eng._next_req >= len(eng.requests.arrival_ns):
            eng.extend()
        # Bounded work per poll: a simulation slower than real time falls behind (and
        # says so in ``lag_ns``) instead of making each poll longer than the last.
        eng.run_until(now, max_steps=self.max_steps_per_poll)
        self.lag_ns = max(0, now - eng.clock_ns)
        self._emit_spans(eng)
        trace = eng.drain()
        out = {}
        if len(trace.kernels) or len(trace.api):
            self.records += len(trace.kernels) + len(trace.api) + len(trace.copies)
            out = {"kind": "events", "trace": trace}
        if self.engine_metrics and now >= self._next_scrape_ns:
            self._next_scrape_ns = now + self.scrape_interval_ns
            text = eng.metrics.text().decode()
            scrape = {"endpoint": f"simulated://pid{eng.cfg.pid}/metrics", "ts_ns": eng.cfg.time_base_ns + now,
                      "exposition": prom_text.parse(text), "pid": eng.cfg.pid}
            if out:
                out["engine"] = {"scrapes": [scrape], "errors": []}
            else:
                out = {"scrapes": [scrape], "errors": []}
        return out or None

    def stop(self) -> None:
        if self.spans is not None:
            self.spans.close()
            self.spans = None
        if self.engine is not None and self.engine.metrics:
            self.engine.metrics.close()
        if self.engine is not None:
            self._drops_before += self.engine.dropped_kernels
        self.engine = None

    def counters(self) -> dict:
        drops = self._drops_before + (self.engine.dropped_kernels if self.engine else 0)
        return {"records": self.records, "drops": drops, "errors": self.errors, "restarts": self.restarts,
                "lag_ns": self.lag_ns, "simulated": True,
                "request_spans_sent": self.spans.emitted if self.spans is not None else 0}


def make_probe(section: dict) -> SimulatorProbe:
    """The agent's factory: a probe from the ``[probes.simulator]`` config section."""
    return SimulatorProbe(**dict(section))
