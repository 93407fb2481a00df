"""The request join on /metrics (agent.request_metrics): Prometheus' own linter passes,
the figures are the window's aggregates (the seed example's), and no series is per request."""
from __future__ import annotations

import subprocess

import msgspec
import pytest
from support import request_scenarios as sc
from support.metrics_windows import exposition, families, thread, window
from support.prometheus_server import PROMTOOL, needs_promtool

from ridgeline.aggregator import request_join as rj


def with_requests(stories=None, otlp=None):
    w = window([thread(8)])
    w["end_ns"] = 1_700_000_021_000_000_000
    if stories is not None:
        w["requests"] = msgspec.to_builtins(rj.window_figures(stories))
    if otlp is not None:
        w["agent"]["probes"]["otlp"] = otlp
    return w


def seed_stories():
    steps, spans = sc.seed_batched()
    return rj.join(spans, steps)


OTLP = {"drops": 7, "errors": 0, "spans_accepted": 3, "spans_refused": 7,
        "refused": {"body_too_large": 2, "rate": 1, "connections": 4}}


def test_request_families_carry_the_window_aggregates():
    text = exposition([with_requests(seed_stories(), OTLP), with_requests([], OTLP)])
    f = families(text)
    val = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in f.values() for s in fam.samples}
    h = ("Hostname", "node-a")
    assert val[("ridgeline_requests_joined_total", (h,))] == 3
    assert val[("ridgeline_request_dragged_seconds_total", (h,))] == pytest.approx(12.5, rel=0.1)
    share = val[("ridgeline_request_dragged_share_ratio", (h, ("source", "measured")))]
    assert share == pytest.approx(12.5 / 40.41, rel=0.1)
    # The gauges keep the last window that joined a request (the second joined none).
    assert val[("ridgeline_request_segment_p99_seconds", (h, ("segment", "decode")))] == pytest.approx(20.0, rel=0.01)
    assert val[("ridgeline_request_top_culprit_tokens", (h,))] == 4000
    assert val[("ridgeline_request_top_culprit_added_seconds", (h,))] == pytest.approx(12.5, rel=0.1)
    assert val[("ridgeline_request_figures_timestamp_seconds", (h,))] == pytest.approx(1_700_000_021.0)
    assert val[("ridgeline_otlp_refused_total", (h, ("reason", "connections")))] == 4
    assert val[("ridgeline_otlp_spans_refused_total", (h,))] == 7
    # Never one series per request: no label holds a request id.
    for fam in f.values():
        for s in fam.samples:
            assert not any(v in ("answer-500", "long-4000", "early-40") for v in s.labels.values()), s


def test_no_request_families_without_the_join():
    text = exposition([window([thread(8)])])
    assert "ridgeline_request" not in text and "ridgeline_otlp" not in text


@needs_promtool
def test_promtool_check_metrics_passes_with_the_request_families():
    text = exposition([with_requests(seed_stories(), OTLP)])
    assert "ridgeline_request_segment_p99_seconds" in text
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_top_shows_the_windows_requests():
    from rich.console import Console

    from ridgeline.agent.top import render
    w = with_requests(seed_stories())
    c = Console(width=200, record=True)
    c.print(render(w))
    text = c.export_text()
    assert "requests: 3 joined; decode dragged 31% (measured)" in text
    assert "top culprit long-4000 +12.50 s (4000 tokens)" in text


def test_e2e_histogram_with_request_exemplars_in_openmetrics():
    """The buckets carry the slowest request of each as an OpenMetrics exemplar (request id
    and trace id), parsed back by prometheus_client's own OpenMetrics parser; the plain text
    format has the same histogram without them, and no series is per request."""
    from prometheus_client.openmetrics.exposition import generate_latest as om_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families

    from ridgeline.agent import prometheus as prom
    stories = [msgspec.structs.replace(s, trace_id=f"{i:032x}") for i, s in enumerate(seed_stories())]
    c = prom.WindowCollector("node-a")
    c.observe(with_requests(stories, OTLP))
    om = om_latest(prom.registry_for(c)).decode()
    (fam,) = [f for f in om_families(om) if f.name == "ridgeline_request_e2e_seconds"]
    buckets = {s.labels["le"]: s for s in fam.samples if s.name.endswith("_bucket")}
    assert buckets["+Inf"].value == 3
    slowest = max(stories, key=lambda s: s.e2e_ns)
    ex = [s.exemplar for s in buckets.values() if s.exemplar is not None]
    assert len(ex) == len({rj.E2E_BOUNDS_S.index(b) if b in rj.E2E_BOUNDS_S else -1
                           for b in [next((x for x in rj.E2E_BOUNDS_S if s.e2e_ns / 1e9 <= x), None)
                                     for s in stories]})
    worst = next(e for e in ex if e.labels["request_id"] == slowest.request_id)
    assert worst.labels["trace_id"] == slowest.trace_id and worst.value == pytest.approx(slowest.e2e_ns / 1e9)
    assert buckets["30.0"].exemplar.labels["request_id"] == "answer-500"          # 20.02 s: le 30
    assert all(len("".join(k + v for k, v in e.labels.items())) <= 128 for e in ex)
    text = exposition([with_requests(stories, OTLP)])
    assert "ridgeline_request_e2e_seconds_bucket" in text and "answer-500" not in text


def test_recompute_seconds_count_the_windows_re_prefills():
    """A preempted request that re-prefilled (the seed example with answer-500 paused, its
    resume made a 2-step re-prefill): the counter sums the windows' recompute_ns, one
    series per host."""
    steps, spans = sc.seed_preempted()
    # Its resume step and the next become MIXED re-prefill steps of answer-500.
    a = next(s for s in spans if s.request_id == "answer-500")
    j = int(((steps["start_ns"] + steps["end_ns"]) // 2 >= a.pauses[0][1]).argmax())
    steps["phase"][j:j + 2] = rj.MIXED
    stories = rj.join(spans, steps)
    rec = {s.request_id: s.recompute_ns for s in stories}
    assert rec["answer-500"] > 0 and rec["long-4000"] == rec["early-40"] == 0
    text = exposition([with_requests(stories), with_requests(stories)])
    val = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in families(text).values() for s in fam.samples}
    assert val[("ridgeline_request_recompute_seconds_total", (("Hostname", "node-a"),))] == \
        pytest.approx(2 * rec["answer-500"] * 1e-9)
    assert sum(1 for k in val if k[0] == "ridgeline_request_recompute_seconds_total") == 1
