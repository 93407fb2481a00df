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
    assert code in (0, 2)
    if code == 2:
        assert err.startswith("ridgeline: error: ") and "JSON" not in err


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
