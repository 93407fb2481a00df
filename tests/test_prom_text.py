"""Tolerant Prometheus text parser: cross-checked against prometheus_client on the real scrapes."""
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.engine_samples import V011, V026, sample_text

from ridgeline.probes import prom_text


def _key(name):
    # prometheus_client renames a counter sample exposed without ``_total`` (aioprometheus
    # in vLLM 0.2.x) to ``..._total``: one reason Ridgeline keeps its own raw-name parser.
    return name.removesuffix("_total")


def _reference(text):
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.append((_key(s.name), tuple(sorted(s.labels.items())), s.value))
    return sorted(out)


@pytest.mark.parametrize("name", [V011, V026])
def test_same_samples_as_prometheus_client_on_real_scrapes(name):
    text = sample_text(name)
    ours = prom_text.parse(text)
    assert ours.bad_lines == 0
    mine = sorted((_key(s.name), tuple(sorted(s.labels.items())), s.value) for s in ours.samples)
    assert mine == _reference(text)
    assert len(mine) == {V011: 379, V026: 7}[name]


def test_prometheus_client_renames_counters_we_keep_raw():
    text = sample_text(V026)
    ref = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    ours = {s.name for s in prom_text.parse(text).samples}
    assert "requests_total_counter_total" in ref and "requests_total_counter" in ours


def test_raw_names_kept_and_created_visible_as_its_own_series():
    ours = prom_text.parse(sample_text(V011))
    names = {s.name for s in ours.samples}
    # _total is part of the exposed name; _created is a separate gauge-like series.
    assert "vllm:num_preemptions_total" in names and "vllm:num_preemptions_created" in names
    created = [s.value for s in ours.samples if s.name == "vllm:num_preemptions_created"]
    assert created and created[0] > 1.7e9
    assert ours.types["vllm:num_preemptions_total"] == "counter"
    # The capture is cut after a TYPE line with no samples: legal, nothing lost.
    assert ours.types["http_request_duration_seconds"] == "histogram"


def test_escapes_special_values_and_timestamps():
    text = ('m{path="C:\\\\models\\"x\\"",note="a\\nb"} 1.5 1700000000000\n'
            'inf_metric +Inf\nneg -Inf\nnanv NaN\nspaced { a = "1" , } 2\n')
    e = prom_text.parse(text)
    assert e.bad_lines == 0
    assert e.samples[0].labels == {"path": 'C:\\models"x"', "note": "a\nb"}
    assert e.samples[0].value == 1.5
    assert e.samples[1].value == math.inf and e.samples[2].value == -math.inf
    assert math.isnan(e.samples[3].value)
    assert e.samples[4].labels == {"a": "1"} and e.samples[4].value == 2


def test_bad_lines_counted_not_fatal():
    text = "good 1\nbad line here\n{novalue=\"x\"} 3\nunterminated{a=\"x} 4\nalso_good{a=\"b\"} 2\n"
    e = prom_text.parse(text)
    assert [s.name for s in e.samples] == ["good", "also_good"]
    assert e.bad_lines == 3
    assert e.bad_examples[0] == "bad line here"
