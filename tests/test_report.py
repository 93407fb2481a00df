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


def test_phase_table_names_the_gpus_own_idle_share_beside_the_phases():
    """Issue 24.2: every phase at idle 0% while the GPU idled between steps read as a
    contradiction; the caption gives the GPU's idle share of its span, as the idle-gap table."""
    from ridgeline.aggregator import model_config
    t, pm = decode_literal_trace()
    doc = analyze_trace(t, model=model_config.builtin("llama-3-8b"), context_len=2048, phase_map=pm)
    c = Console(record=True, width=400)
    render(doc, c)
    text = c.export_text()
    (dev, d), = doc.idle_gaps.items()
    share = f"{d.idle_ratio * 100:,.0f}%"
    assert f"GPU {dev} idle {share} of its span (between steps too: see the idle gaps)" in text
    assert f"({share})" in text            # the idle-gap table's figure: the same


def test_top_kernels_without_operator_shapes_say_why_instead_of_dashes():
    """Issue 24.2: the kind/TFLOP/s/TB/s columns were all "-" on a trace without operator
    shapes (the simulator's, a vLLM trace without record_shapes)."""
    from ridgeline.aggregator import model_config
    t, pm = decode_literal_trace()
    doc = analyze_trace(t, model=model_config.builtin("llama-3-8b"), context_len=2048, phase_map=pm)
    rows = [r for p in doc.phases.values() for r in p.top_kernels]
    assert rows and not any(r.category or r.achieved_flops_per_s for r in rows)
    c = Console(record=True, width=400)
    render(doc, c)
    text = c.export_text()
    flat = " ".join(text.replace("│", " ").split())
    assert "per-kernel kind, TFLOP/s and TB/s need the operators' input shapes" in flat
    assert "Top kernels:" in text and "┃ kind" not in text          # no column of dashes
