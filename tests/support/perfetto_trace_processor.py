"""What Perfetto's own trace processor (a ``trace_processor_shell`` binary) makes of our
Perfetto export, in the form of :func:`perfetto_import.summary`, so that the real
importer and our transcription of its rules can be compared figure for figure.

Run as a script with a binary to record the real figures for every shared trace:

    python tests/support/perfetto_trace_processor.py /path/to/trace_processor_shell \
        tests/data/perfetto/shared_traces.json "where the binary came from"

(needs ../shared/traces, or RIDGELINE_SHARED). The fixture it writes is what
tests/test_perfetto.py checks the export against, with or without a binary.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script: tests/ for `support`
from support.perfetto_import import track_order  # noqa: E402

# The shared traces exported and checked (tests/test_perfetto.py); names under SHARED/traces.
SHARED = ["nvidia-inference/tracelens_b200_vllm_gptoss_tp8_prefill888.json.gz",
          "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz",
          "nvidia-inference/nanovllm_rtx4080laptop_decode_step0_fragment.json.gz",
          "nvidia-inference/nanovllm_rtx4080laptop_decode_step100_fragment.json.gz",
          "nvidia-training/hta_a100_alexnet_benchmark.json.gz",
          "nvidia-training/hta_a100_rank0_training.json.gz"]

# a thread's main slice track has type 'thread_execution' (track_tracker.h,
# InternThreadTrack); the importer spills a partially overlapping "X" slice to a
# 'thread_overlapping_slice' track of the same thread (json_trace_parser.cc)
_MAIN_TRACK, _SPILL_TRACK = "thread_execution", "thread_overlapping_slice"
_TRACKS_SQL = """
select p.name as process, th.name as thread, tt.type as type, count(*) as n
from slice s join thread_track tt on s.track_id = tt.id
join thread th using (utid) left join process p using (upid)
group by tt.utid, tt.type"""
_ERRORS_SQL = """
select name, sum(value) as n from stats
where severity in ('error', 'data_loss') and value > 0 group by name"""
_NONZERO_SQL = "select name, idx, severity, source, value from stats where value > 0 order by name, idx"


def _x(**kw):
    return {"ph": "X", "cat": "c", "name": "s", "pid": 1, "tid": 2, **kw}


def _m(what, pid=1, tid=2, name="n"):
    return {"ph": "M", "name": what, "pid": pid, "tid": tid, "args": {"name": name}}


# Small documents on the importer's edges, each a rule of perfetto_import.py: recorded
# with the real trace processor next to the shared traces, so the transcription is
# checked against it on every run.
EDGE_CASES = {
    "partial_overlap_spills": [_x(ts=0, dur=2), _x(ts=1, dur=5)],
    "display_time_unit": {"traceEvents": [_x(ts=0, dur=1)], "displayTimeUnit": "ns"},
    "no_ph": [{"name": "a", "ts": 1, "pid": 1, "tid": 1}],
    "no_ts": [{"ph": "X", "name": "a", "dur": 1, "pid": 1, "tid": 1}],
    "string_dur": [_x(ts=0, dur="x")],
    "x_without_dur": [_x(ts=0)],
    "empty_thread_name": [_m("thread_name", name=""), _x(ts=0, dur=1)],
    "flow_end_before_start": [_x(ts=0, dur=1, bind_id=5, flow_in=True),
                              _x(ts=10, dur=1, tid=3, bind_id=5, flow_out=True)],
    "flow_duplicate_begin": [_x(ts=0, dur=1, bind_id=5, flow_out=True), _x(ts=2, dur=1, bind_id=5, flow_out=True),
                             _x(ts=4, dur=1, tid=3, bind_id=5, flow_in=True)],
    "flow_no_direction": [_x(ts=0, dur=1, bind_id=5)],
    "flow_one_to_many": [_x(ts=0, dur=1, bind_id=7, flow_out=True), _x(ts=2, dur=1, tid=3, bind_id=7, flow_in=True),
                         _x(ts=3, dur=1, tid=3, bind_id=7, flow_in=True)],
    "flow_step": [_x(ts=0, dur=1, bind_id=7, flow_out=True),
                  _x(ts=2, dur=1, tid=3, bind_id=7, flow_in=True, flow_out=True),
                  _x(ts=4, dur=1, tid=4, bind_id=7, flow_in=True)],
    "tid_zero_is_pid": [_m("thread_name", pid=9, tid=9, name="main"), _x(ts=0, dur=1, pid=9, tid=0)],
    "tid_under_two_pids": [_m("thread_name", pid=1, tid=2, name="a"), _x(ts=0, dur=1, pid=1, tid=2),
                           _x(ts=5, dur=1, pid=4, tid=2), _x(ts=9, dur=1, pid=1, tid=2)],
    "touching_and_nesting": [_x(ts=0, dur=10), _x(ts=10, dur=10), _x(ts=10, dur=5), _x(ts=12, dur=2),
                             _x(ts=20, dur=0), _x(ts=20, dur=0)],
    "equal_start_shorter_first_in_file": [_x(ts=0, dur=1), _x(ts=0, dur=3), _x(ts=2, dur=2)],
    "float_ts_rounding": [_x(ts=0.0004, dur=0.0015), _x(ts=0.0015, dur=0.0005)],
    "zero_dur_at_end": [_x(ts=0, dur=5), _x(ts=5, dur=0), _x(ts=5, dur=0)],
}


def transcribed_stats(imp) -> dict:
    """The transcription's non-zero stats (errors and the info ones it records)."""
    return {k: v for k, v in sorted(imp.stats.items()) if v}


def version(binary: str | Path) -> str:
    """The binary's own version line ("Perfetto v58.2-..."), as ``--version`` prints it."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=True)
    return next(line.strip() for line in out.stdout.splitlines() if line.strip())


class RealImport:
    """A trace loaded by the real trace processor (over its HTTP RPC, via the ``perfetto``
    Python package); close() it."""

    def __init__(self, binary: str | Path, trace: str | Path):
        from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig
        self.tp = TraceProcessor(trace=str(trace), config=TraceProcessorConfig(bin_path=str(binary)))

    def rows(self, sql: str) -> list:
        return list(self.tp.query(sql))

    def one(self, sql: str):
        return self.rows(sql)[0].n

    def summary(self) -> dict:
        """:func:`perfetto_import.summary`'s figures, from the trace processor's tables."""
        per_cat = {r.category: r.n for r in self.rows(
            "select category, count(*) as n from slice group by category")}
        def track(r):
            if r.type == _MAIN_TRACK:
                return r.thread
            return f"{r.thread} (spilled)" if r.type == _SPILL_TRACK else f"{r.thread} [{r.type}]"
        tracks = sorted(([r.process, track(r), r.n] for r in self.rows(_TRACKS_SQL)), key=track_order)
        return {"slices": self.one("select count(*) as n from slice"),
                "slices_by_category": dict(sorted(per_cat.items())),
                "flows": self.one("select count(*) as n from flow"),
                "error_stats": {r.name: r.n for r in sorted(self.rows(_ERRORS_SQL), key=lambda r: r.name)},
                "tracks": tracks}

    def nonzero_stats(self) -> list:
        return [[r.name, r.idx, r.severity, r.source, r.value] for r in self.rows(_NONZERO_SQL)]

    def import_stats(self) -> dict:
        """Non-zero stats but the importer's own timings (``*_duration_ns``)."""
        return {name: v for name, _, _, _, v in self.nonzero_stats() if not name.endswith("_duration_ns")}

    def slices_off_thread_tracks(self) -> int:
        return self.one("select count(*) as n from slice where track_id not in (select id from thread_track)")

    def close(self) -> None:
        self.tp.close()


def record(binary: str, out: str, names: list[str], traces: Path, source: str) -> dict:
    """Export every shared trace with ``ridgeline analyze --perfetto``, load each export in
    the real trace processor and write its figures, the binary's version and ``source``
    (where the binary came from) to ``out``."""
    from ridgeline.agent.cli import main
    from support.perfetto_import import import_json, summary
    doc = {"perfetto_version": version(binary), "perfetto_source": source, "traces": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            exported = Path(tmp) / "p.json"
            with open(os.devnull, "w") as null:
                stdout, sys.stdout = sys.stdout, null
                try:
                    rc = main(["analyze", str(traces / name), "--perfetto", str(exported), "--json"])
                finally:
                    sys.stdout = stdout
            assert rc == 0, name
            real = RealImport(binary, exported)
            try:
                entry = {"summary": real.summary(), "stats": real.import_stats(),
                         "slices_off_thread_tracks": real.slices_off_thread_tracks()}
            finally:
                real.close()
            entry["transcription_agrees"] = summary(import_json(exported)) == entry["summary"]
            doc["traces"][name] = entry
            print(name, entry["summary"]["slices"], "slices", entry["summary"]["flows"], "flows",
                  entry["summary"]["error_stats"], "transcription agrees:", entry["transcription_agrees"])
        doc["edge_cases"] = {}
        for name, events in EDGE_CASES.items():
            path = Path(tmp) / f"{name}.json"
            path.write_text(json.dumps(events))
            real = RealImport(binary, path)
            try:
                entry = {"summary": real.summary(), "stats": real.import_stats()}
            finally:
                real.close()
            imp = import_json(path)
            entry["transcription_agrees"] = (summary(imp) == entry["summary"]
                                             and transcribed_stats(imp) == entry["stats"])
            doc["edge_cases"][name] = entry
            print("edge case", name, "transcription agrees:", entry["transcription_agrees"])
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    shared = Path(os.environ.get("RIDGELINE_SHARED", Path(__file__).resolve().parents[2].parent / "shared"))
    if len(sys.argv) != 4:
        print("usage: perfetto_trace_processor.py TRACE_PROCESSOR_SHELL OUT.json SOURCE_NOTE", file=sys.stderr)
        sys.exit(2)
    record(sys.argv[1], sys.argv[2], SHARED, shared / "traces", sys.argv[3])
