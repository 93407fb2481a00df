"""The agent's /metrics, pinned: the exposition of the golden wire windows.

Each ``tests/data/metrics_*_v1.txt`` is what :class:`agent.prometheus.WindowCollector`
exposes after observing one window: the window decoded from the golden wire file of the
same name (``tests/data/wire_envelope_*_v1.bin``, the bytes ``tests/test_wire.py`` pins),
host ``gpu-host-1``. The client library's process, platform and GC collectors are left out
(they describe the test process), and the build's version and Python version are fixed.
A renamed metric or label, a changed HELP text or a lost series shows as a diff here.

After a deliberate change, rewrite them and review the diff::

    RIDGELINE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_metrics_golden.py -q
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ridgeline.agent import prometheus as prom
from ridgeline.aggregator import wire

DATA = Path(__file__).parent / "data"
UPDATE = os.environ.get("RIDGELINE_UPDATE_GOLDEN") == "1"
WINDOWS = {"metrics_window_v1.txt": "wire_envelope_window_v1.bin",
           "metrics_engine_window_v1.txt": "wire_envelope_engine_window_v1.bin",
           "metrics_requests_window_v1.txt": "wire_envelope_requests_window_v1.bin",
           "metrics_stragglers_window_v1.txt": "wire_envelope_stragglers_window_v1.bin"}


def render(wire_file: str, monkeypatch) -> str:
    monkeypatch.setattr(prom, "_version", lambda: "0+golden")
    monkeypatch.setattr(prom.platform, "python_version", lambda: "3.x")
    env = wire.decode_envelope((DATA / wire_file).read_bytes())
    c = prom.WindowCollector(host=env.host)
    c.observe(wire.decode_window(env.payload))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(c)
    return generate_latest(registry).decode()


@pytest.mark.parametrize("golden", sorted(WINDOWS))
def test_metrics_of_the_golden_window_are_the_pinned_ones(golden, monkeypatch):
    text = render(WINDOWS[golden], monkeypatch)
    path = DATA / golden
    if UPDATE:
        path.write_text(text)
    want = path.read_text()
    diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(path), "rendered"))
    assert text == want, f"/metrics differs from {path.name} (RIDGELINE_UPDATE_GOLDEN=1 rewrites it):\n{diff}"


def test_golden_metrics_carry_the_windows_figures(monkeypatch):
    """The pinned files are not empty shells: the window's own figures are in them."""
    text = render("wire_envelope_window_v1.bin", monkeypatch)
    assert 'ridgeline_phase_kernels_total{Hostname="gpu-host-1",UUID="",gpu="0",gpu_model="NVIDIA H100 80GB HBM3",' \
           'phase="decode",pid="4242",source=""} 50000.0' in text
    assert 'ridgeline_phase_achieved_bytes_per_second{' in text and "} 3.25e+12\n" in text
    assert 'ridgeline_copy_bytes_total{' in text and 'direction="HtoD"' in text
