"""Terminal report: every phase, its verdict and evidence, the ceilings' source."""
from rich.console import Console
from support.phase_literals import decode_literal_trace

from ridgeline.aggregator.analysis import analyze_trace
from ridgeline.aggregator.report import render


def test_render_shows_phase_verdict_evidence_and_source():
    from ridgeline.aggregator import model_config
    t, pm = decode_literal_trace()
    doc = analyze_trace(t, model=model_config.builtin("llama-3-8b"), context_len=2048, phase_map=pm)
    c = Console(record=True, width=160)
    render(doc, c)
    text = c.export_text()
    assert "decode" in text and "memory-bound" in text
    assert "H200" in text and "datasheet" in text.lower()
    assert "work from model" in text
    assert "GPU idle gaps" in text and "Steps (4)" in text


def test_render_without_ceilings_says_why():
    t, pm = decode_literal_trace()
    from ridgeline.probes.events import Device
    t.devices = [Device(0, "Mystery GPU")]
    c = Console(record=True, width=160)
    render(analyze_trace(t, phase_map=pm), c)
    text = c.export_text()
    assert "no ceilings" in text and "undetermined" in text
