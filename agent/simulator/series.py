"""Windows of a simulated run as the agent would see them from the engine's metrics.

:func:`engine_windows` runs a :class:`~agent.simulator.engine.SimEngine` in simulated
time, takes one scrape of its Prometheus exposition per window (exactly the text the
HTTP endpoint serves), and folds consecutive scrapes with the agent's own code
(:mod:`probes.prom_text` -> :mod:`aggregator.engine_metrics`). Each window also carries
the kernels the engine emitted in it (a :class:`probes.events.Trace`) when
``with_events`` is set, for the kernel-side verdict.
"""
from __future__ import annotations

from ridgeline.aggregator import engine_metrics
from ridgeline.probes import prom_text

from .engine import SimEngine


def engine_windows(engine: SimEngine, window_s: float, until_s: float, with_events: bool = False) -> list[dict]:
    """One dict per window: ``t_s`` (window end), ``figures`` (engine_metrics.window_figures),
    ``record`` (engine_metrics.engine_record) and optionally ``trace``."""
    step_ns = int(window_s * 1e9)
    endpoint = "simulated://engine/metrics"
    prev = engine_metrics.snapshot(prom_text.parse(engine.metrics.text().decode()), engine.clock_ns, endpoint)
    out = []
    t = step_ns
    while t <= until_s * 1e9:
        engine.run_until(t)
        trace = engine.drain()
        snap = engine_metrics.snapshot(prom_text.parse(engine.metrics.text().decode()), t, endpoint)
        fig = engine_metrics.window_figures([snap], prev)
        w = {"t_s": t / 1e9, "figures": fig, "record": engine_metrics.engine_record(fig)}
        if with_events:
            w["trace"] = trace
        out.append(w)
        prev = snap
        t += step_ns
    return out
