"""Markers and options shared by the whole suite.

* ``ebpf``: needs root, BTF, tracefs and the distro bcc; skipped with the exact reason otherwise.
* ``gpu``: needs an NVIDIA GPU and driver; skipped with the reason otherwise.
* ``slow``: soak and scale tests; skipped unless ``--run-slow``.
* ``long``: a file whose tests take minutes (installs, object storage, the GPU check's
  bundle): not skipped, only started first when the suite runs on several workers.

``--require ebpf,gpu`` turns the skips of those markers into failures, for machines where
the hardware is known to be present (a GPU check run, or CI asserting eBPF works).

Files recorded or written by others are not kept in the project: the shared traces
(``SHARED/traces``, :func:`shared_trace`) and the third-party fixtures listed in
tests/THIRD_PARTY.md (:func:`third_party`). Tests that need them skip, naming the file and
where it was looked for, when they are absent.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from support import hardware  # noqa: E402
from support.third_party_files import third_party_missing, third_party_path  # noqa: E402,F401

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("RIDGELINE_SHARED", ROOT.parent / "shared"))
TRACES = SHARED / "traces"
DATA = Path(__file__).parent / "data"


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False, help="run tests marked slow")
    parser.addoption("--require", default=os.environ.get("RIDGELINE_REQUIRE", ""),
                     help="comma list of markers (ebpf,gpu,slow) whose skips become failures")


def _required(config) -> set[str]:
    return {x.strip() for x in config.getoption("--require").split(",") if x.strip()}


def _runs_for_minutes(item) -> bool:
    return "slow" in item.keywords or "long" in item.keywords


def pytest_collection_modifyitems(config, items):
    # Under xdist (--dist loadfile) files go to workers in this order: the files that run
    # for minutes first, so the longest is never started last (stable: files stay whole).
    items.sort(key=lambda item: not _runs_for_minutes(item))
    required = _required(config)
    checks = {"ebpf": hardware.ebpf_missing, "gpu": hardware.gpu_missing}
    for item in items:
        for marker, check in checks.items():
            if marker in item.keywords:
                reason = check()
                if reason:
                    if marker in required:
                        item.user_properties.append(("required_missing", f"--require {marker}: {reason}"))
                    else:
                        item.add_marker(pytest.mark.skip(reason=f"{marker}: {reason}"))
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            if "slow" in required:
                item.user_properties.append(("required_missing", "slow test not enabled"))
            item.add_marker(pytest.mark.skip(reason="slow: long-running test; enable with --run-slow"))


def pytest_runtest_setup(item):
    for name, value in item.user_properties:
        if name == "required_missing":
            pytest.fail(f"required hardware missing: {value}", pytrace=False)


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """The third-party traces folder (../shared/traces); skips when it is absent."""
    if not TRACES.is_dir():
        pytest.skip(f"shared traces not present at {TRACES}")
    return TRACES


def shared_trace(name: str) -> Path:
    """Path of one shared trace by relative name; skips the test when absent."""
    p = TRACES / name
    if not p.exists():
        pytest.skip(f"shared trace not present: {p}")
    return p


@pytest.fixture
def trace_path():
    return shared_trace


def third_party(rel: str) -> Path:
    """Path of one third-party file by relative name; skips the test (or fixture) when absent."""
    p = third_party_path(rel)
    if p is None:
        pytest.skip(third_party_missing(rel))
    return p
