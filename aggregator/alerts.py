"""Alert states with hysteresis over consecutive windows (pure, one tracker per served engine).

Four alerts, each ``ok`` or ``firing``; a state changes only after the condition has held
(or stopped holding) for a configured number of consecutive windows, so a value hovering
at a threshold does not flap:

* ``kv_watermark``: KV usage (window max) >= ``kv_fire_ratio`` (85%) for
  ``kv_fire_windows`` windows fires; < ``kv_clear_ratio`` (80%) for ``kv_clear_windows``
  windows clears. Between the two ratios the state holds.
* ``queue_time_growth``: mean queue time rose in each of the last ``queue_growth_windows``
  windows, by at least ``queue_growth_min_s`` in total; clears after
  ``queue_clear_windows`` windows without a rise. Windows with no finished request (no
  queue figure) neither advance nor break the run.
* ``preemption_spike``: preemption rate > max(``preemption_spike_min_per_s``,
  ``preemption_spike_factor`` x baseline), the baseline being an exponential average of the
  rate in non-spiking windows; clears after ``preemption_clear_windows`` windows below it.
* ``prefix_hit_drop_with_preemption``: prefix-cache hit ratio below its baseline by at
  least ``hit_drop_ratio`` (absolute) in a window with preemptions (evicted prefixes are
  being recomputed); clears after ``hit_clear_windows`` windows without the coincidence.

Input per window: the engine record (:func:`aggregator.engine_metrics.engine_record`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

KV_WATERMARK = "kv_watermark"
QUEUE_GROWTH = "queue_time_growth"
PREEMPTION_SPIKE = "preemption_spike"
HIT_DROP = "prefix_hit_drop_with_preemption"
ALERTS = (KV_WATERMARK, QUEUE_GROWTH, PREEMPTION_SPIKE, HIT_DROP)


@dataclass(frozen=True)
class AlertThresholds:
    """Alert thresholds and hysteresis (agent config ``[alerts]``); see the module docstring."""
    kv_fire_ratio: float = 0.85
    kv_clear_ratio: float = 0.80
    kv_fire_windows: int = 1
    kv_clear_windows: int = 2
    queue_growth_windows: int = 3
    queue_growth_min_s: float = 0.05
    queue_clear_windows: int = 2
    preemption_spike_factor: float = 3.0
    preemption_spike_min_per_s: float = 0.5
    preemption_clear_windows: int = 2
    baseline_alpha: float = 0.2
    hit_drop_ratio: float = 0.15
    hit_clear_windows: int = 2

    def __post_init__(self):
        if not self.kv_clear_ratio <= self.kv_fire_ratio:
            raise ValueError("kv_clear_ratio must not exceed kv_fire_ratio (hysteresis band)")
        if self.queue_growth_windows < 1:
            raise ValueError("queue_growth_windows must be >= 1")


@dataclass
class _State:
    firing: bool = False
    on_run: int = 0      # consecutive windows with the fire condition
    off_run: int = 0     # consecutive windows with the clear condition
    since_ts_ns: int | None = None
    value: Any = None
    message: str = ""


def _step(st: _State, fire: bool, clear: bool, fire_n: int, clear_n: int) -> str | None:
    """Advance one state; returns "fired"/"resolved" on a transition."""
    st.on_run = st.on_run + 1 if fire else 0
    st.off_run = st.off_run + 1 if clear else 0
    if not st.firing and st.on_run >= fire_n:
        st.firing = True
        st.off_run = 0
        return "fired"
    if st.firing and st.off_run >= clear_n:
        st.firing = False
        st.on_run = 0
        return "resolved"
    return None


@dataclass
class AlertTracker:
    """Hysteresis state of the four alerts for one engine; feed it one record per window."""
    th: AlertThresholds = field(default_factory=AlertThresholds)
    states: dict[str, _State] = field(default_factory=lambda: {a: _State() for a in ALERTS})
    _queue: list[float] = field(default_factory=list)
    _pre_base: float | None = None
    _hit_base: float | None = None

    def update(self, rec: dict, ts_ns: int | None = None) -> list[dict]:
        """Evaluate one window; returns the transitions (``{"alert", "event", "ts_ns",
        "value", "message"}``), empty when nothing changed."""
        th = self.th
        events: list[dict] = []

        def note(name: str, ev: str | None, value: Any, msg: str) -> None:
            st = self.states[name]
            if st.firing or ev:
                st.value, st.message = value, msg
            if ev == "fired":
                st.since_ts_ns = ts_ns
            if ev:
                events.append({"alert": name, "event": ev, "ts_ns": ts_ns, "value": value, "message": msg})

        # KV watermark (band between clear and fire ratios holds the state).
        kv = rec.get("kv_usage_max_ratio")
        kv = rec.get("kv_usage_ratio") if kv is None else kv
        if kv is not None:
            ev = _step(self.states[KV_WATERMARK], kv >= th.kv_fire_ratio, kv < th.kv_clear_ratio,
                       th.kv_fire_windows, th.kv_clear_windows)
            note(KV_WATERMARK, ev, kv, f"KV usage {kv:.1%} (fire >= {th.kv_fire_ratio:.0%}, "
                                       f"clear < {th.kv_clear_ratio:.0%})")

        # Queue-time growth over N windows.
        q = rec.get("queue_time_mean_s")
        if q is not None:
            rising = bool(self._queue) and q > self._queue[-1]
            self._queue.append(q)
            del self._queue[:-(th.queue_growth_windows + 1)]
            growing = False
            if len(self._queue) == th.queue_growth_windows + 1:
                seq = self._queue
                growing = (all(b > a for a, b in zip(seq, seq[1:]))
                           and seq[-1] - seq[0] >= th.queue_growth_min_s)
            ev = _step(self.states[QUEUE_GROWTH], growing, not rising,
                       1, th.queue_clear_windows)
            note(QUEUE_GROWTH, ev, q, f"mean queue time {q:.3f} s over the last "
                                      f"{len(self._queue)} windows: {', '.join(f'{x:.3f}' for x in self._queue)}")

        # Preemption-rate spike against an exponential baseline.
        rate = rec.get("preemption_rate_per_s")
        if rate is not None:
            base = self._pre_base or 0.0
            limit = max(th.preemption_spike_min_per_s, th.preemption_spike_factor * base)
            spike = rate > limit
            ev = _step(self.states[PREEMPTION_SPIKE], spike, not spike, 1, th.preemption_clear_windows)
            note(PREEMPTION_SPIKE, ev, rate, f"preemptions {rate:.2f}/s vs limit {limit:.2f}/s "
                                             f"(baseline {base:.2f}/s)")
            if not spike:
                self._pre_base = rate if self._pre_base is None else (
                    (1 - th.baseline_alpha) * self._pre_base + th.baseline_alpha * rate)

        # Prefix-cache hit-rate drop coinciding with preemption.
        hit = rec.get("prefix_cache_hit_ratio")
        pre = rec.get("preemptions") or 0
        if hit is not None:
            base = self._hit_base
            dropped = base is not None and hit <= base - th.hit_drop_ratio
            coincide = dropped and pre > 0
            ev = _step(self.states[HIT_DROP], coincide, not coincide, 1, th.hit_clear_windows)
            note(HIT_DROP, ev, hit, f"prefix-cache hit ratio {hit:.1%} vs baseline "
                                    f"{(base if base is not None else float('nan')):.1%} with {pre:.0f} preemptions")
            if not dropped:
                self._hit_base = hit if base is None else (1 - th.baseline_alpha) * base + th.baseline_alpha * hit
        return events

    def active(self) -> dict[str, dict]:
        """The firing alerts: name -> ``{"since_ts_ns", "value", "message"}``."""
        return {n: {"since_ts_ns": s.since_ts_ns, "value": s.value, "message": s.message}
                for n, s in self.states.items() if s.firing}

    def record(self) -> dict:
        """All four states for the window record (``firing`` bool per alert, thresholds)."""
        return {"alerts": {n: {"firing": s.firing, "since_ts_ns": s.since_ts_ns, "value": s.value,
                               "message": s.message} for n, s in self.states.items()},
                "thresholds": asdict(self.th), "source": "engine"}


def prometheus_samples(tracker: AlertTracker, labels: dict | None = None) -> list[tuple[str, dict, float]]:
    """``ridgeline_alert_firing{alert=...}`` 0/1 per alert."""
    base = dict(labels or {})
    return [("ridgeline_alert_firing", dict(base, alert=n), 1.0 if s.firing else 0.0)
            for n, s in tracker.states.items()]
