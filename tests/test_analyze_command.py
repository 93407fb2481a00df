"""`ridgeline analyze` end to end: report, --json keys, --plot, --perfetto, errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ridgeline.agent.cli import main

ROOT = Path(__file__).resolve().parent.parent
B200 = "nvidia-inference/tracelens_b200_vllm_gptoss_tp8_prefill888.json.gz"
H100 = "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz"
DECODE = "nvidia-inference/nanovllm_rtx4080laptop_decode_step0_fragment.json.gz"
ALL = [B200, H100, DECODE, "nvidia-inference/nanovllm_rtx4080laptop_decode_step100_fragment.json.gz",
       "nvidia-training/hta_a100_alexnet_benchmark.json.gz", "nvidia-training/hta_a100_rank0_training.json.gz"]


def run_json(capsys, *argv):
    assert main(["analyze", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", ALL)
def test_terminal_report_on_every_shared_trace(trace_path, capsys, name):
    assert main(["analyze", str(trace_path(name))]) == 0
    out = capsys.readouterr().out
    assert "Phases" in out and "GPU idle gaps" in out
    assert any(v in out for v in ("memory-bound", "compute-bound", "latency/launch-bound", "host-bound",
                                  "undetermined"))


def test_json_documented_keys(trace_path, capsys):
    doc = run_json(capsys, trace_path(B200))
    assert {"gpu", "phases", "steps"} <= set(doc)
    assert doc["gpu"]["key"] == "b200" and doc["gpu"]["source"]["document"]
    p = doc["phases"]["prefill"]
    for key in ("kernel_time_ns", "kernels", "flops", "bytes", "achieved_flops_per_s", "achieved_bytes_per_s",
                "arithmetic_intensity", "verdict", "evidence"):
        assert key in p
    step = doc["steps"][0]
    for key in ("start_ns", "end_ns", "phase", "evidence"):
        assert key in step
    assert step["tokens"]["prefill"] == 888
    assert doc["annotations_used"] is True


def test_json_without_annotations_and_with_model(trace_path, capsys):
    doc = run_json(capsys, trace_path(H100), "--no-annotations", "--model", "qwen1.5-0.5b",
                   "--context-len", "559")
    assert doc["annotations_used"] is False
    assert doc["work"]["model"]["name"] == "qwen1.5-0.5b" and doc["work"]["context_len"] == 559
    assert "prefill" in doc["phases"]


def test_several_traces_give_a_list_and_numbered_files(trace_path, capsys, tmp_path):
    plot = tmp_path / "roof.png"
    docs = run_json(capsys, trace_path(DECODE), trace_path(H100), "--plot", plot)
    assert isinstance(docs, list) and len(docs) == 2
    assert [Path(d["plot"]).name for d in docs] == ["roof.1.png", "roof.2.png"]
    assert all(Path(d["plot"]).exists() for d in docs)


def test_plot_is_a_png(trace_path, capsys, tmp_path):
    out = tmp_path / "r.png"
    assert main(["analyze", str(trace_path(H100)), "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_perfetto_has_phase_track(trace_path, capsys, tmp_path):
    out = tmp_path / "p.json"
    assert main(["analyze", str(trace_path(B200)), "--perfetto", str(out), "--json"]) == 0
    doc = json.loads(out.read_text())
    ev = doc["traceEvents"]
    phase_pids = {e["pid"] for e in ev if e.get("ph") == "M" and e["args"].get("name") == "Ridgeline phases"}
    assert len(phase_pids) == 1
    slices = [e for e in ev if e.get("cat") == "ridgeline_phase"]
    assert [s["name"] for s in slices] == ["prefill"] and slices[0]["pid"] in phase_pids
    assert slices[0]["args"]["prefill_tokens"] == 888
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    assert len(kernels) == 768 and all(k["args"]["phase"] == "prefill" for k in kernels)
    assert all(e["ph"] in ("X", "M") for e in ev)


def _err(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("ridgeline: error: ") and err.count("\n") == 1, err
    return err


def test_error_cases_exit_2_one_line(trace_path, capsys, tmp_path):
    t = str(trace_path(DECODE))
    assert "no such file" in _err(capsys, ["analyze", str(tmp_path / "missing.json")])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "bad.json" in _err(capsys, ["analyze", str(bad)])
    _err(capsys, ["analyze", str(tmp_path)])
    assert "unknown GPU" in _err(capsys, ["analyze", t, "--gpu", "voodoo-5"])
    assert "model config" in _err(capsys, ["analyze", t, "--model", str(tmp_path / "nope.json")])
    assert "PNG" in _err(capsys, ["analyze", t, "--plot", str(tmp_path / "x.svg")])
    _err(capsys, ["analyze", t, "--context-len", "100"])
    _err(capsys, ["analyze", t, "--model", "qwen3-0.6b", "--context-len", "0"])
    _err(capsys, ["analyze", t, "--tensor-parallel", "0"])
    cfile = tmp_path / "c.toml"
    cfile.write_text("[[gpu]]\nkey = 1\n")
    _err(capsys, ["analyze", t, "--ceilings", str(cfile)])
    assert "cannot write" in _err(capsys, ["analyze", t, "--perfetto", str(tmp_path / "no" / "dir.json")])


def test_error_without_traceback_in_a_real_process(tmp_path):
    bad = tmp_path / "trace.json.gz"
    bad.write_bytes(b"\x1f\x8b\x08truncated")
    r = subprocess.run([sys.executable, "-m", "ridgeline", "analyze", str(bad)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stderr.startswith("ridgeline: error: ")


def test_trace_without_kernels_reports_and_plot_error_keeps_report(tmp_path, capsys):
    f = tmp_path / "cpu_only.json"
    f.write_text('{"schemaVersion": 1, "deviceProperties": [], "traceEvents": [{"ph": "X", "cat": "cpu_op", '
                 '"name": "aten::add", "pid": 1, "tid": 1, "ts": 1.0, "dur": 2.0, "args": {"External id": 1}}]}')
    doc = run_json(capsys, f)
    assert doc["kernels"] == 0 and doc["phases"] == {} and doc["gpu"]["ceilings_from"].endswith("--gpu NAME")
    code = main(["analyze", str(f), "--plot", str(tmp_path / "r.png")])
    cap = capsys.readouterr()
    assert code == 2 and "no GPU kernels" in cap.out and "cannot plot" in cap.err


def test_recordings_are_dispatched_by_magic(tmp_path, capsys):
    recording = pytest.importorskip("ridgeline.agent.recording")
    f = tmp_path / "stream.rlrec"
    f.write_bytes(recording.MAGIC + b"\x01\x02")         # magic, then a torn frame header
    code = main(["analyze", str(f)])
    err = capsys.readouterr().err
    # Whatever the recording loader says of it, it is the recording loader saying it
    # (the Kineto importer would complain about JSON), or the report of an empty stream.
    assert code == 2 and err.startswith("ridgeline: error: ") and "JSON" not in err
    assert "truncated recording" in err and err.count("\n") == 1, err


def test_analyze_a_recording_of_the_stream(trace_path, capsys, tmp_path):
    """An agent recording holding the nano-vllm decode trace's events gives the same phase figures
    as the Kineto file (events only: the recording carries no operator shapes)."""
    recording = pytest.importorskip("ridgeline.agent.recording")
    wire = pytest.importorskip("ridgeline.aggregator.wire")
    from ridgeline.probes.kineto import load_trace
    t = load_trace(trace_path(DECODE))
    f = tmp_path / "stream.rlrec"
    with recording.RecordingWriter(f) as w:
        w.write(wire.encode_envelope("events", 0, wire.encode_event_batch(t), "host", 1), 1)
    doc = run_json(capsys, f)
    assert doc["kernels"] == len(t.kernels)
    direct = run_json(capsys, trace_path(DECODE))
    assert set(doc["phases"]) == set(direct["phases"])
    for name, p in doc["phases"].items():
        assert p["kernels"] == direct["phases"][name]["kernels"]
        assert p["busy_ns"] == direct["phases"][name]["busy_ns"]


def _events_recording(path, batches: int):
    """A recording of ``batches`` events messages (three kernels each), real wire encoding."""
    import numpy as np

    from ridgeline.agent.recording import RecordingWriter
    from ridgeline.aggregator import wire
    from ridgeline.probes.events import KERNEL_DTYPE, Device, NameTable, Trace, empty
    with RecordingWriter(path) as w:
        for i in range(batches):
            k = empty(KERNEL_DTYPE, 3)
            k["name_id"] = 0
            k["start_ns"] = 1_000_000 * i + np.arange(3) * 1000
            k["end_ns"] = k["start_ns"] + 500
            k["device"] = 0
            t = Trace(kernels=k, names=NameTable(["gemm_kernel"]), devices=[Device(0, "NVIDIA H100 80GB HBM3")])
            w.write(wire.encode_envelope("events", i, wire.encode_event_batch(t), "host", 1 + i), 1 + i)
    return path.read_bytes()


def test_truncated_recording_without_a_complete_frame_exits_2(tmp_path, capsys):
    """A recording cut inside its first frame: one line, exit 2, not a report of 0 kernels (issue 24.3)."""
    f = tmp_path / "stream.rlrec"
    raw = _events_recording(f, 1)
    f.write_bytes(raw[:len(raw) // 2])
    err = _err(capsys, ["analyze", str(f)])
    assert "truncated recording" in err and "0 complete message(s)" in err, err
    f.write_bytes(raw[:8])                       # the header and nothing else
    assert "empty recording" in _err(capsys, ["analyze", str(f)])
    f.write_bytes(raw[:5])                       # cut inside the header
    assert "cut off inside its 8-byte header" in _err(capsys, ["analyze", str(f)])


def test_truncated_recording_keeps_its_complete_frames_and_warns(tmp_path, capsys):
    f = tmp_path / "stream.rlrec"
    raw = _events_recording(f, 2)
    f.write_bytes(raw[:-7])                      # the second frame cut off
    assert main(["analyze", str(f), "--json"]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert doc["kernels"] == 3 and doc["recording"]["truncated"]
    assert "warning" in cap.err and "truncated recording" in cap.err


@pytest.mark.parametrize("name,content,says", [
    ("x.sqlite", b"\xcd\x2a\x9a\x45" * 64, "not an SQLite database"),
    ("x.sqlite", b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "its content is a PNG image"),
    ("x.rlrec", b"\xcd\x2a\x9a\x45" * 64, "not a ridgeline recording"),
    ("x.rlrec", b"PK\x03\x04" + b"\x00" * 64, "its content is a zip archive"),
    ("x.json", b"\x7fELF\x02\x01" + b"\x00" * 64, "its content is an ELF binary"),
    ("x.json.gz", b"", "empty file"),
])
def test_garbage_is_named_by_its_content(tmp_path, capsys, name, content, says):
    """Not "not valid JSON" for a file that was never JSON: what it is, from its magic bytes."""
    f = tmp_path / name
    f.write_bytes(content)
    err = _err(capsys, ["analyze", str(f)])
    assert says in err and "JSON" not in err.split(":", 2)[-1].replace("Kineto JSON", ""), err


def test_a_garbage_file_in_a_rank_folder_is_skipped_with_its_content_named(trace_path, tmp_path, capsys):
    import shutil
    d = tmp_path / "ranks"
    d.mkdir()
    shutil.copy(trace_path(DECODE), d / "rank0.json.gz")
    (d / "rank1.sqlite").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    assert main(["analyze", str(d), "--json"]) == 0
    assert "skipped" in capsys.readouterr().err
