"""`ridgeline demo` end to end, shortened: the folder it leaves and what top showed."""
import json
import subprocess
import sys

from ridgeline.agent.recording import is_recording, load_recording


def test_demo_leaves_report_plot_perfetto_recording_and_metrics(tmp_path):
    out = tmp_path / "demo-out"
    r = subprocess.run([sys.executable, "-m", "ridgeline", "demo", "-o", str(out), "--duration", "6"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # top ran without a terminal: it printed frames of simulated data.
    assert "SIMULATED DATA" in r.stdout and "GPU 0" in r.stdout
    assert f"Output folder {out}" in r.stdout
    report = (out / "report.txt").read_text()
    assert "SIMULATED" in report and "Phases" in report and "decode" in report
    assert "agent cost while streaming" in report and "window verdicts" in report
    # issue 24.4: the simulator's context lengths reach the decode bytes (its step annotations
    # carry the key-token sums), and the report says so instead of asking for --context-len
    assert "KV-cache read left out" not in report and "--context-len" not in report
    words = " ".join(report.split()).replace("- ", "-")      # the report wraps at 120 columns
    assert "KV-cache read from the step annotation's per-sequence key lengths" in words, words[:4000]
    assert (out / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    perfetto = json.loads((out / "trace.perfetto.json").read_text())
    assert len(perfetto["traceEvents"]) > 1000
    assert is_recording(out / "stream.rlrec")
    rec = load_recording(out / "stream.rlrec")
    assert rec.messages["window"] >= 3 and len(rec.trace.kernels) > 10_000 and sum(rec.gaps.values()) == 0
    assert all(g["source"] == "simulated" for w in rec.windows for g in w["gpus"])
    metrics = (out / "metrics.txt").read_text()
    assert "ridgeline_phase_kernel_seconds_total" in metrics and "ridgeline_engine_kv_usage_ratio" in metrics
    # The per-request view (issue 22): the simulated engine's spans, sent through the real
    # OpenTelemetry SDK exporter to the agent's receiver, joined with the simulated steps.
    requests = (out / "requests.txt").read_text()
    assert "ridgeline requests" in requests and "ridgeline why sim-" in requests and "verdict:" in requests
    assert "ridgeline_requests_joined_total" in metrics and "ridgeline_otlp_spans_accepted_total" in metrics
