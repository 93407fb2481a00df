"""``ridgeline analyze`` reads a recording's served requests (the ``requests`` topic the agent
publishes): the slowest with their segments and culprits, in the report and in --json."""
from __future__ import annotations

import json
import subprocess
import sys

import msgspec
from support import request_scenarios as sc

from ridgeline.agent.recording import RecordingWriter
from ridgeline.agent.simulator.engine import SimConfig, SimEngine
from ridgeline.agent.simulator.workload import Workload
from ridgeline.aggregator import request_join as rj
from ridgeline.aggregator import wire


def write(path):
    eng = SimEngine(SimConfig(workload=Workload(rate_per_s=20, duration_s=0.5, prompt_mean=128, prompt_max=256,
                                                output_mean=16, output_max=32)), seed=3)
    eng.run()
    steps, spans = sc.seed_batched()
    stories = msgspec.to_builtins(rj.join(spans, steps))
    with RecordingWriter(path) as w:
        w.write(wire.encode_envelope("events", 0, wire.encode_event_batch(eng.drain()), "h", 1), 1)
        w.write(wire.encode_envelope("requests", 0, {"end_ns": 2, "stories": stories[:2]}, "h", 2), 2)
        w.write(wire.encode_envelope("requests", 1, {"end_ns": 3, "stories": stories[2:]}, "h", 3), 3)


def test_analyze_shows_the_recordings_slowest_requests(tmp_path):
    rec = tmp_path / "r.rlrec"
    write(rec)
    r = subprocess.run([sys.executable, "-m", "ridgeline", "analyze", str(rec)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "requests told by the agent: 3" in r.stdout
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("answer-500", "long-4000", "early-40"))]
    assert [ln.split()[0] for ln in lines] == ["answer-500", "long-4000", "early-40"]     # slowest first
    assert "long-4000 +12.50 s" in lines[0]
    r = subprocess.run([sys.executable, "-m", "ridgeline", "analyze", "--json", str(rec)], capture_output=True,
                       text=True, timeout=300)
    doc = json.loads(r.stdout)
    doc = doc[0] if isinstance(doc, list) else doc
    assert doc["requests"]["told"] == 3
    assert doc["requests"]["slowest"][0]["culprits"][0]["request_id"] == "long-4000"


def test_analyze_perfetto_of_a_recording_has_a_track_per_request(tmp_path):
    rec = tmp_path / "r.rlrec"
    write(rec)
    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, "-m", "ridgeline", "analyze", str(rec), "--perfetto", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    from ridgeline.aggregator.perfetto import REQUEST_PID
    ev = json.loads(out.read_text())["traceEvents"]
    assert len({e["tid"] for e in ev if e.get("cat") == "ridgeline_request" and e["pid"] == REQUEST_PID}) == 3
