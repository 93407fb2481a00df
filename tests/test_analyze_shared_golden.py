"""``ridgeline analyze`` on the six shared third-party traces, pinned byte for byte.

The speed work of issue 21 (items 2 and 3: fewer passes, joins done once, arrays freed
early) must leave every figure as it was. Each shared trace of ``../shared/traces``
(``PROVENANCE.md`` there: real Kineto traces of PyTorch on A100, H100, B200 and an RTX
4080 laptop GPU, none written here) is analysed, ``--json`` and the text report, and
compared with ``tests/data/analyze_shared/<trace>.{json,txt}``, written by the code of
commit 74bf999 (before that work). A changed figure, key or line shows as a diff. Skipped
where the shared folder is absent.

After a deliberate change, rewrite them and review the diff::

    RIDGELINE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_analyze_shared_golden.py -q
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
from conftest import TRACES

from ridgeline.agent import cli

DATA = Path(__file__).parent / "data" / "analyze_shared"
UPDATE = os.environ.get("RIDGELINE_UPDATE_GOLDEN") == "1"
NAMES = sorted(p.relative_to(TRACES).as_posix() for p in TRACES.glob("*/*.json.gz")) if TRACES.is_dir() else []


def _golden(name: str, suffix: str) -> Path:
    return DATA / (Path(name).name.removesuffix(".json.gz") + suffix)


def _analyze(capsysbinary, monkeypatch, tmp: Path, name: str, *flags: str) -> str:
    # the trace under its own file name in a temporary folder: the report names it, and a
    # path outside the checkout would make the golden file depend on where it lies
    link = tmp / Path(name).name
    if not link.exists():
        link.symlink_to(TRACES / name)
    monkeypatch.chdir(tmp)
    assert cli.main(["analyze", *flags, link.name]) == 0
    return capsysbinary.readouterr().out.decode()


def _check(text: str, golden: Path) -> None:
    if UPDATE:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    if not golden.is_file():
        pytest.fail(f"{golden} is missing (RIDGELINE_UPDATE_GOLDEN=1 writes it)")
    want = golden.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                            str(golden), "now", n=2))
        pytest.fail(f"analyze output differs from {golden.name}:\n" + diff[:6000])


def test_the_six_shared_traces_are_there(shared_traces):
    # a trace added to or gone from the shared folder must be seen, not silently skipped
    assert len(NAMES) == 6, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_analyze_json_of_shared_trace_is_unchanged(name, tmp_path, capsysbinary, monkeypatch):
    _check(_analyze(capsysbinary, monkeypatch, tmp_path, name, "--json"), _golden(name, ".json"))


@pytest.mark.parametrize("name", NAMES)
def test_analyze_report_of_shared_trace_is_unchanged(name, tmp_path, capsysbinary, monkeypatch):
    _check(_analyze(capsysbinary, monkeypatch, tmp_path, name), _golden(name, ".txt"))
