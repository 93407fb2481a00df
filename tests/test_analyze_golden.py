"""``ridgeline analyze``'s output, pinned: the ``--json`` document and the text report.

Three inputs, each the project's own and fixed by a seed: a short simulated trace
(``ridgeline simulate --duration 1 --rate 6 --output-mean 8 ... --seed 1``: kernels, copies,
launch calls, steps
with token counts and the model's work), a recording replayed from it by
``tests/support/recording_synth.py`` (4 s with an agent restart and a lost ``events``
message: the segment combination of ``agent.recording_analysis``), and a folder of two
such traces (seeds 1 and 2: the per-rank report of ``agent.rank_report``). Each output is
compared byte for byte with ``tests/data/analyze_*_v1.{json,txt}``; the inputs are named
relative to their temporary folder (the report wraps a long first line by its length). The files were written by the code before the
analyze document became typed Structs (issue 19), so they prove that change left the
bytes as they were; a renamed key, a reordered one or a changed figure shows as a diff.

After a deliberate change, rewrite them and review the diff::

    RIDGELINE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_analyze_golden.py -q
"""
from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.recording_synth import write_recording

from ridgeline.agent import cli
from ridgeline.probes.kineto import load_trace

DATA = Path(__file__).parent / "data"
UPDATE = os.environ.get("RIDGELINE_UPDATE_GOLDEN") == "1"


def _simulate(path: Path, seed: int) -> Path:
    # few, short requests: 55 steps (prefill, decode and mixed), a file of a few kB
    subprocess.run([sys.executable, "-m", "ridgeline", "simulate", "--duration", "1", "--rate", "6",
                    "--output-mean", "8", "--output-max", "16", "--prompt-mean", "300", "--seed", str(seed),
                    "--trace", str(path)], check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("analyze_golden")
    ranks = tmp / "ranks"
    ranks.mkdir()
    one = _simulate(ranks / "rank0.json.gz", 1)
    _simulate(ranks / "rank1.json.gz", 2)
    rec = tmp / "replay.rlrec"
    write_recording(rec, load_trace(one), minutes=4 / 60, restart_at_s=2, restart_downtime_s=2.0,
                    lost_at_s=3, lost_batches=1)
    return tmp, {"trace": one, "recording": rec, "ranks": ranks}


def _analyze(capsysbinary, monkeypatch, tmp: Path, target: Path, *flags: str) -> str:
    monkeypatch.chdir(tmp)
    assert cli.main(["analyze", *flags, str(target.relative_to(tmp))]) == 0
    return capsysbinary.readouterr().out.decode()


def _check(text: str, golden: Path) -> None:
    if UPDATE:
        golden.write_text(text)
    want = golden.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                            str(golden), "now", n=2))
        pytest.fail(f"analyze output differs from {golden.name} (RIDGELINE_UPDATE_GOLDEN=1 rewrites it):\n"
                    + diff[:6000])


@pytest.mark.parametrize("case", ["trace", "recording", "ranks"])
def test_analyze_json_is_the_golden_document(inputs, case, capsysbinary, monkeypatch):
    tmp, paths = inputs
    _check(_analyze(capsysbinary, monkeypatch, tmp, paths[case], "--json"), DATA / f"analyze_{case}_v1.json")


@pytest.mark.parametrize("case", ["trace", "recording", "ranks"])
def test_analyze_text_report_is_the_golden_report(inputs, case, capsysbinary, monkeypatch):
    tmp, paths = inputs
    _check(_analyze(capsysbinary, monkeypatch, tmp, paths[case]), DATA / f"analyze_{case}_v1.txt")
