"""The request join's part of ``/metrics``: per-window aggregates, never one series per request.

Contract: :class:`RequestMetrics` is fed each window (:meth:`observe`) by
:class:`agent.prometheus.WindowCollector` and yields its families (:meth:`families`), all
labelled ``Hostname`` only (plus ``segment`` or ``source``, from fixed sets):

* counters ``ridgeline_requests_joined_total``, ``ridgeline_requests_dropped_total``,
  ``ridgeline_request_decode_seconds_total`` and ``ridgeline_request_dragged_seconds_total``
  (their ``rate()`` ratio is the dragged share over any interval), and
  ``ridgeline_request_recompute_seconds_total`` (the requests' re-prefills after a
  preemption, left out of their decode: its rate against decode + recompute is the
  preemptions' recompute share);
* gauges of the last window that joined a request (their time in
  ``ridgeline_request_figures_timestamp_seconds``): ``ridgeline_request_dragged_share_ratio``
  (``source``: measured, roofline_estimate or none), ``ridgeline_request_segment_p99_seconds``
  (``segment``: queue, prefill, decode, dragged, e2e), ``ridgeline_request_top_culprit_added_seconds``
  and ``ridgeline_request_top_culprit_tokens`` (the top culprit's size: its prompt, or prompt +
  generated for a re-prefill);
* the histogram ``ridgeline_request_e2e_seconds`` of the joined requests' end-to-end time
  (``request_join.E2E_BOUNDS_S``, cumulative over windows); in OpenMetrics (``Accept:
  application/openmetrics-text``) each bucket carries an exemplar: the slowest request of
  the last window that had one in that bucket, as ``{request_id, trace_id}`` with its
  time. Exemplars name requests; series never do (one histogram per host);
* the OTLP receiver's own counters, from the health record's ``probes.otlp``:
  ``ridgeline_otlp_spans_accepted_total``, ``ridgeline_otlp_spans_refused_total`` and
  ``ridgeline_otlp_refused_total`` by ``reason`` (the receiver's fixed refusal kinds).
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Exemplar

from ridgeline.aggregator.request_join import E2E_BOUNDS_S
from ridgeline.probes.records import Window, WindowRequests

SEGMENTS = ("queue", "prefill", "decode", "dragged", "e2e")
SOURCES = ("measured", "roofline_estimate", "none")


def _n(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


class RequestMetrics:
    def __init__(self):
        self.joined = self.dropped = self.decode_s = self.dragged_s = self.recompute_s = 0.0
        self.last: WindowRequests | None = None    # the last window's "requests" with requests joined
        self.last_end_ns = 0
        self.seen = False                    # a window ever carried "requests" (the join runs)
        self.e2e_counts = [0.0] * (len(E2E_BOUNDS_S) + 1)
        self.e2e_sum_s = 0.0
        self.exemplars: dict[int, tuple[dict, float, float]] = {}   # bucket -> (labels, value s, time s)

    def observe(self, window: Window) -> None:
        r = window.requests
        if r is None:
            return
        self.seen = True
        self.joined += r.requests
        self.dropped += r.requests_dropped
        self.decode_s += r.decode_ns * 1e-9
        self.dragged_s += r.dragged_ns * 1e-9
        self.recompute_s += r.recompute_ns * 1e-9
        if r.requests > 0:
            self.last, self.last_end_ns = r, window.end_ns
        counts = r.e2e_bucket_counts
        if len(counts) == len(self.e2e_counts):
            for i, c in enumerate(counts):
                self.e2e_counts[i] += c
            self.e2e_sum_s += r.e2e_total_ns * 1e-9
            for ex in r.exemplars:
                if 0 <= ex.bucket < len(self.e2e_counts):
                    labels = {"request_id": ex.request_id[:64]}
                    if ex.trace_id:
                        labels["trace_id"] = ex.trace_id[:32]
                    self.exemplars[ex.bucket] = (labels, ex.e2e_ns * 1e-9, self.last_end_ns * 1e-9)

    def families(self, host: str, window: Window):
        yield from self._receiver(host, window)
        if not self.seen:
            return
        for name, doc, value in (
                ("ridgeline_requests_joined", "Served requests joined with the GPU steps they ran in", self.joined),
                ("ridgeline_requests_dropped",
                 "Request spans not joined: over the held bound, or sent again after being told", self.dropped),
                ("ridgeline_request_decode_seconds", "Decode time of the joined requests", self.decode_s),
                ("ridgeline_request_dragged_seconds",
                 "Decode time of the joined requests added by co-batched prefill chunks and long sequences",
                 self.dragged_s),
                ("ridgeline_request_recompute_seconds",
                 "GPU time of the joined requests re-prefilling their prompt and generated tokens after a "
                 "preemption (left out of their decode)", self.recompute_s)):
            c = CounterMetricFamily(name, doc, labels=["Hostname"])
            c.add_metric([host], value)
            yield c
        h = HistogramMetricFamily("ridgeline_request_e2e_seconds",
                                  "End-to-end time of the joined requests (exemplars: the slowest request "
                                  "of a bucket in the last window that had one)", labels=["Hostname"])
        buckets, cum = [], 0.0
        for i, bound in enumerate(list(E2E_BOUNDS_S) + [float("inf")]):
            cum += self.e2e_counts[i]
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            ex = self.exemplars.get(i)
            buckets.append((le, cum, Exemplar(*ex)) if ex else (le, cum))
        h.add_metric([host], buckets, self.e2e_sum_s)
        yield h
        r = self.last
        if r is None:
            return
        ts = GaugeMetricFamily("ridgeline_request_figures_timestamp_seconds",
                               "End of the window the request gauges describe (the last one that joined a request)",
                               labels=["Hostname"])
        ts.add_metric([host], self.last_end_ns * 1e-9)
        yield ts
        share = GaugeMetricFamily("ridgeline_request_dragged_share_ratio",
                                  "Share of the window's request decode time added by co-batched work "
                                  "(source: how the baseline step time was had)", labels=["Hostname", "source"])
        src = r.dragged_source if r.dragged_source in SOURCES else "none"
        share.add_metric([host, src], float(r.dragged_share_ratio))
        yield share
        p99 = GaugeMetricFamily("ridgeline_request_segment_p99_seconds",
                                "99th percentile over the window's joined requests of each segment's time",
                                labels=["Hostname", "segment"])
        for seg in SEGMENTS:
            p99.add_metric([host, seg], getattr(r, f"{seg}_p99_ns") * 1e-9)
        yield p99
        for name, doc, value in (
                ("ridgeline_request_top_culprit_added_seconds",
                 "Decode time the window's top culprit added to the requests batched with it",
                 r.top_culprit_added_ns * 1e-9),
                ("ridgeline_request_top_culprit_tokens",
                 "Tokens of the window's top culprit: its prompt, or prompt + generated when re-prefilling",
                 float(r.top_culprit_tokens))):
            g = GaugeMetricFamily(name, doc, labels=["Hostname"])
            g.add_metric([host], value)
            yield g

    @staticmethod
    def _receiver(host: str, window: Window):
        c = window.agent.probes.get("otlp")
        if not isinstance(c, dict) or "spans_accepted" not in c:
            return
        for key, name, doc in (("spans_accepted", "ridgeline_otlp_spans_accepted",
                                "Request spans the OTLP receiver took in"),
                               ("spans_refused", "ridgeline_otlp_spans_refused",
                                "Request spans the OTLP receiver refused (span rate or queue bound)")):
            f = CounterMetricFamily(name, doc, labels=["Hostname"])
            f.add_metric([host], _n(c.get(key)))
            yield f
        r = CounterMetricFamily("ridgeline_otlp_refused", "OTLP export requests or connections the receiver refused, "
                                "by reason (body_too_large, rate, connections, timeout, bad_body, ...)",
                                labels=["Hostname", "reason"])
        from ridgeline.probes.otlp_receiver import REFUSAL_KINDS
        refused = c.get("refused") if isinstance(c.get("refused"), dict) else {}
        for kind in REFUSAL_KINDS:
            r.add_metric([host, kind], _n(refused.get(kind)))
        yield r
