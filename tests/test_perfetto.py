"""Perfetto export: the input's events plus a phase track, as Chrome-trace JSON that
Perfetto's trace processor imports whole (every slice, named tracks, launch flows, no
import error). Checked by the real trace processor where one can run (set
RIDGELINE_TRACE_PROCESSOR to a trace_processor_shell binary), and everywhere by the
transcription of its JSON importer rules in perfetto_import.py."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
from support.perfetto_import import import_json, summary
from support.perfetto_trace_processor import EDGE_CASES, SHARED, transcribed_stats
from support.phase_literals import NAMES, Step, annotated_literal_trace, phase_map

from ridgeline.aggregator.perfetto import GPU_PID_BASE, PHASE_PID, nesting_lanes, write_perfetto


def _export(tmp_path, t=None):
    t = t or annotated_literal_trace()
    pm = phase_map([Step(0, 1_000_000, 1_004_000, 0, 1, 512, 0, ["annotation x"]),
                    Step(1, 9_000_000, 9_000_100, 0, 2, None, 4, ["grid"])],
                   np.array([1, 1, 2], np.uint8), np.array([0, 0, 1], np.int32))
    return t, write_perfetto(t, pm, NAMES, tmp_path / "t.json")


def test_phase_track_and_kernel_args(tmp_path):
    _, out = _export(tmp_path)
    doc = json.loads(out.read_text())
    ev = doc["traceEvents"]
    steps = [e for e in ev if e.get("cat") == "ridgeline_phase"]
    assert [(s["name"], s["pid"]) for s in steps] == [("prefill", PHASE_PID), ("decode", PHASE_PID)]
    assert steps[0]["ts"] == 1.0 and steps[0]["dur"] == 4.0         # microseconds from the first event
    assert steps[0]["args"] == {"step": 0, "evidence": ["annotation x"], "prefill_tokens": 512,
                                "decode_tokens": 0}
    kern = [e for e in ev if e.get("cat") == "kernel"]
    assert [x["args"]["phase"] for x in kern] == ["prefill", "prefill", "decode"]
    assert [x["args"]["step"] for x in kern] == [0, 0, 1]
    assert kern[0]["dur"] == 2.0 and kern[0]["pid"] == GPU_PID_BASE
    api_ev = [e for e in ev if e.get("cat") == "cuda_api"]
    assert api_ev[0]["ts"] == 0.0 and api_ev[0]["pid"] == 10
    meta = [e for e in ev if e["ph"] == "M" and e["pid"] == PHASE_PID and e["name"] == "process_name"]
    assert meta[0]["args"]["name"] == "Ridgeline phases"
    assert "displayTimeUnit" not in doc


def test_tracks_named_copies_and_overlaps_apart(tmp_path):
    _, out = _export(tmp_path)
    imp = import_json(out)
    assert imp.errors() == {}
    track = {(s[3], s[1]): imp.thread_names.get(s[0]) for s in imp.slices}
    assert track[("kernel", 1_000)] == "stream 7 kernels"
    assert track[("gpu_memcpy", 1_500)] == "stream 7 copies"
    assert track[("kernel", 2_500)] == "stream 7 kernels (overlap 1)"     # partial overlap
    assert track[("kernel", 8_001_000)] == "stream 7 kernels"
    assert track[("gpu_user_annotation", 0)] == "stream 7 annotations"
    assert track[("cuda_api", 0)] == "thread 11"
    assert imp.process_names == {GPU_PID_BASE: "GPU 0", PHASE_PID: "Ridgeline phases", 10: "host process 10"}
    # every thread that holds a slice is named
    assert {s[0] for s in imp.slices} <= set(imp.thread_names)


def test_launch_flows_one_per_kernel_and_copy(tmp_path):
    t, out = _export(tmp_path)
    imp = import_json(out)
    pairs = sorted((imp.slices[a][3], imp.slices[a][1], imp.slices[b][3], imp.slices[b][1]) for a, b in imp.flows)
    assert pairs == [("cuda_api", 0, "kernel", 1_000), ("cuda_api", 600, "kernel", 2_500),
                     ("cuda_api", 800, "gpu_memcpy", 1_500), ("cuda_api", 8_000_000, "kernel", 8_001_000)]


def test_nesting_lanes_follow_the_importer():
    # disjoint, touching ends (closed on the left, open on the right) and nesting: one lane
    order, lanes = nesting_lanes(np.array([0, 10, 10, 12, 20]), np.array([10, 20, 15, 14, 20]))
    assert lanes.tolist() == [0, 0, 0, 0, 0]
    assert order.tolist() == [0, 1, 2, 3, 4]          # at equal starts the longer first
    # partial overlaps: [0,10) [5,15) [8,20) -> three lanes; [12,13) nests in lane 1's [5,15)
    order, lanes = nesting_lanes(np.array([0, 5, 8, 12]), np.array([10, 15, 20, 13]))
    assert lanes.tolist() == [0, 1, 2, 0]


def test_old_single_track_layout_is_what_the_importer_spills(tmp_path):
    """The rules file is not an echo of the exporter: kernels and copies of one stream
    on one track, as the export used to write them, give the import errors that real
    trace processors reported (the shared B200 trace lost 38 kernels that way)."""
    ev = [{"ph": "X", "cat": "kernel", "name": "a", "pid": 1, "tid": 7, "ts": 0.0, "dur": 2.0},
          {"ph": "X", "cat": "gpu_memcpy", "name": "m", "pid": 1, "tid": 7, "ts": 1.0, "dur": 5.0}]
    p = tmp_path / "old.json"
    p.write_text(json.dumps({"traceEvents": ev, "displayTimeUnit": "ns"}))
    imp = import_json(p)
    assert imp.errors() == {"slice_spill_overlapping_complete_event": 1}
    assert imp.stats["json_display_time_unit"] == 1


def _tp_binary():
    return os.environ.get("RIDGELINE_TRACE_PROCESSOR")


@pytest.mark.parametrize("name", SHARED)
def test_shared_traces_import_whole(name, trace_path, tmp_path, capsys):
    """analyze --perfetto on every shared trace: the importer keeps every kernel, copy and
    GPU annotation as a slice on a named GPU track, links each launched one to its API
    call by a flow, and records no error."""
    from ridgeline.agent.cli import main
    from ridgeline.probes.kineto import load_trace
    src = trace_path(name)
    out = tmp_path / "p.json"
    assert main(["analyze", str(src), "--perfetto", str(out), "--json"]) == 0
    capsys.readouterr()
    t = load_trace(src)
    imp = import_json(out)
    assert imp.errors() == {}
    gpu = [s for s in imp.slices if imp.threads[s[0]][0] >= GPU_PID_BASE]
    n_gpu_ranges = int((t.ranges["device"] >= 0).sum())
    assert len(gpu) == len(t.kernels) + len(t.copies) + n_gpu_ranges
    assert sum(s[3] == "kernel" for s in gpu) == len(t.kernels)
    assert {s[0] for s in imp.slices} <= set(imp.thread_names)
    assert {imp.threads[s[0]][0] for s in imp.slices} <= set(imp.process_names)
    assert not any(s[5] for s in imp.slices)
    # a flow for every kernel/copy whose launch record is in the trace and starts first
    launched = 0
    api_start = dict(zip(t.api["correlation_id"].tolist(), t.api["start_ns"].tolist()))
    for arr in (t.kernels, t.copies):
        for corr, start in zip(arr["correlation_id"].tolist(), arr["start_ns"].tolist()):
            launched += corr >= 0 and corr in api_start and api_start[corr] <= start
    assert len(imp.flows) == launched
    if name.endswith("prefill888.json.gz"):
        assert len(t.kernels) == 768 and launched == 768 + len(t.copies)


RECORDED = Path(__file__).parent / "data" / "perfetto" / "shared_traces.json"


def _recorded(name, section="traces"):
    doc = json.loads(RECORDED.read_text())
    return doc["perfetto_version"], doc[section][name]


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_transcription_agrees_with_the_real_importer_on_edge_cases(case, tmp_path):
    """Each importer rule the transcription states, on a small document, gives what the
    real trace processor gave when the fixture was recorded (slices per thread, spills,
    flows, stats): the transcription checked against Perfetto itself, binary or not."""
    path = tmp_path / "e.json"
    path.write_text(json.dumps(EDGE_CASES[case]))
    imp = import_json(path)
    _, rec = _recorded(case, "edge_cases")
    assert (summary(imp), transcribed_stats(imp)) == (rec["summary"], rec["stats"])


def _export_shared(name, trace_path, tmp_path, capsys):
    from ridgeline.agent.cli import main
    src = trace_path(name)
    out = tmp_path / "p.json"
    assert main(["analyze", str(src), "--perfetto", str(out), "--json"]) == 0
    capsys.readouterr()
    return src, out


@pytest.mark.parametrize("name", SHARED)
def test_export_still_gives_what_the_real_trace_processor_saw(name, trace_path, tmp_path, capsys):
    """The figures Perfetto's own trace processor gave for this trace's export when it was
    recorded (tests/data/perfetto/, see PROVENANCE.md there) still come out of today's
    export, by the transcription of its rules: a change to the exporter or to the
    transcription that moves a slice, a flow, a track name or an error shows here, and
    the fixture is then re-recorded with the real binary."""
    _, out = _export_shared(name, trace_path, tmp_path, capsys)
    version, rec = _recorded(name)
    assert rec["transcription_agrees"], f"the transcription disagreed with {version} when recorded"
    assert summary(import_json(out)) == rec["summary"]


@pytest.mark.skipif(not _tp_binary(), reason="no trace_processor_shell: no package registry reachable here "
                    "ships one (the perfetto package downloads it at run time); set RIDGELINE_TRACE_PROCESSOR "
                    "to a trace_processor_shell binary to run this check with Perfetto itself")
@pytest.mark.parametrize("name", SHARED)
def test_real_trace_processor(name, trace_path, tmp_path, capsys):
    """Perfetto's own importer on the export: a slice for every kernel and copy, one flow
    per launched kernel or copy, every slice on a named thread track of a named process
    (none spilled), no error or data-loss stat; and the same figures as the
    transcription and as the recorded fixture."""
    from support.perfetto_trace_processor import RealImport, version

    from ridgeline.probes.kineto import load_trace
    src, out = _export_shared(name, trace_path, tmp_path, capsys)
    t = load_trace(src)
    real = RealImport(_tp_binary(), out)
    try:
        got = real.summary()
        off_thread = real.slices_off_thread_tracks()
    finally:
        real.close()
    cats = got["slices_by_category"]
    assert cats.get("kernel", 0) == len(t.kernels)
    assert cats.get("gpu_memcpy", 0) + cats.get("gpu_memset", 0) == len(t.copies)
    assert got["error_stats"] == {}
    assert off_thread == 0
    assert sum(n for _, _, n in got["tracks"]) == got["slices"]
    assert all(p and th and not th.endswith("(spilled)") for p, th, _ in got["tracks"])
    api_start = dict(zip(t.api["correlation_id"].tolist(), t.api["start_ns"].tolist()))
    launched = sum(corr >= 0 and corr in api_start and api_start[corr] <= start
                   for arr in (t.kernels, t.copies)
                   for corr, start in zip(arr["correlation_id"].tolist(), arr["start_ns"].tolist()))
    assert got["flows"] == launched
    assert got == summary(import_json(out))
    recorded_version, rec = _recorded(name)
    assert got == rec["summary"], f"recorded with {recorded_version}, now {version(_tp_binary())}"


@pytest.mark.skipif(not _tp_binary(), reason="no trace_processor_shell (set RIDGELINE_TRACE_PROCESSOR)")
@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_real_trace_processor_edge_cases(case, tmp_path):
    from support.perfetto_trace_processor import RealImport
    path = tmp_path / "e.json"
    path.write_text(json.dumps(EDGE_CASES[case]))
    real = RealImport(_tp_binary(), path)
    try:
        got = (real.summary(), real.import_stats())
    finally:
        real.close()
    imp = import_json(path)
    assert got == (summary(imp), transcribed_stats(imp))


def test_simulated_data_is_marked_in_the_export(tmp_path):
    """Issue 24.5: the README promises SIMULATED in the trace metadata; the export says so in
    its otherData and on every process (track header) name, as imported."""
    t = annotated_literal_trace()
    t.meta["simulated"] = True
    _, out = _export(tmp_path, t)
    doc = json.loads(out.read_text())
    assert doc["otherData"]["simulated"] is True and "SIMULATED" in doc["otherData"]["note"]
    names = import_json(out).process_names
    assert names and all(n.startswith("SIMULATED ") for n in names.values()), names
    assert names[PHASE_PID] == "SIMULATED Ridgeline phases"
    (tmp_path / "real").mkdir()
    _, out = _export(tmp_path / "real")                   # measured data: no marker
    doc = json.loads(out.read_text())
    assert "simulated" not in doc["otherData"]
    assert not any("SIMULATED" in n for n in import_json(out).process_names.values())
