"""The 30-minute recording of issue 14's case, analysed in bounded memory: its own file so
that, with the suite on several workers (one file per worker), it runs beside the other
input-bound tests rather than after them (it takes minutes)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from support.bounded_analyze import CEILING_BYTES, run_bounded  # noqa: E402


@pytest.fixture(scope="module")
def sim_source(tmp_path_factory):
    from support.recording_synth import simulated_trace
    return simulated_trace(tmp_path_factory.mktemp("sim") / "sim10.json.gz")


@pytest.mark.slow
def test_thirty_minute_recording_is_analysed_in_bounded_memory(tmp_path, sim_source):
    """The issue's case at full length: 30 minutes of the simulated vLLM stream (75M
    kernels; the real 83 MB recording drove the host's OOM killer at 23 GB)."""
    from support.recording_synth import write_recording
    f = tmp_path / "thirty.rlrec"
    info = write_recording(f, sim_source, minutes=30, restart_at_s=900, lost_at_s=300)
    code, rss, wall, out, err = run_bounded(f, "--json", timeout=1800)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["kernels"] == info["kernels"] and doc["recording"]["restarts"] == 1
    assert rss < CEILING_BYTES, rss
