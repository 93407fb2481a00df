"""The Perfetto export's track per served request (issue 22), beside the GPU steps: its
queued, prefill and decode slices, imported whole by the transcription of Perfetto's JSON
importer (tests/support/perfetto_import.py), the decode slice naming the culprits."""
from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
from support import request_scenarios as sc
from support.perfetto_import import import_json
from support.phase_literals import NAMES, Step, annotated_literal_trace, phase_map

from ridgeline.aggregator import request_join as rj
from ridgeline.aggregator.perfetto import PHASE_PID, REQUEST_PID, write_perfetto


def export_with_requests(path, stories):
    """The literal annotated trace exported with request tracks; (the file, its import by
    Perfetto's JSON importer, with no error)."""
    t = annotated_literal_trace()
    pm = phase_map([Step(0, 1_000_000, 1_004_000, 0, 1, 512, 0, ["annotation x"])],
                   np.array([1, 1, 1], np.uint8), np.array([0, 0, 0], np.int32))
    out = write_perfetto(t, pm, NAMES, path, requests=stories)
    imp = import_json(out)
    assert imp.errors() == {}
    return out, imp


def seed_stories_near_the_literal():
    steps, spans = sc.seed_batched()
    shift = 500_000 - sc.T0
    return [msgspec.structs.replace(s, start_ns=s.start_ns + shift, end_ns=s.end_ns + shift)
            for s in rj.join(spans, steps)]


def test_a_track_per_request_beside_the_steps(tmp_path):
    out, imp = export_with_requests(tmp_path / "t.json", seed_stories_near_the_literal())
    assert imp.process_names[REQUEST_PID] == "Ridgeline requests" and PHASE_PID in imp.process_names
    ev = json.loads(out.read_text())["traceEvents"]
    req = [e for e in ev if e.get("cat") == "ridgeline_request"]
    tracks = {e["tid"] for e in req}
    assert len(tracks) == 3                                   # one track per request
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e.get("pid") == REQUEST_PID
             and e["name"] == "thread_name"}
    assert any(n.startswith("request answer-500 (20.0") for n in names)
    dec = next(e for e in req if e["name"] == "decode" and e["args"]["completion_tokens"] == 501)
    assert abs(dec["dur"] - 20e6) < 0.01 * 20e6                # microseconds
    assert dec["args"]["culprits"][0].startswith("long-4000 +12")
    # every request slice was imported, on its own request's track
    assert sum(1 for s in imp.slices if s[3] == "ridgeline_request") == len(req)


def test_a_preempted_request_track_holds_its_pause(tmp_path):
    """The preempted seed example: answer-500's decode slice spans its wall time with the
    pause inside it as a "preempted" slice (so the track nests), its args the decode time
    without the pause."""
    steps, spans = sc.seed_preempted()
    shift = 500_000 - sc.T0
    stories = [msgspec.structs.replace(s, start_ns=s.start_ns + shift, end_ns=s.end_ns + shift,
                                       pauses=[rj.Pause(p.start_ns + shift, p.end_ns + shift) for p in s.pauses])
               for s in rj.join(spans, steps)]
    out, imp = export_with_requests(tmp_path / "p.json", stories)
    ev = [e for e in json.loads(out.read_text())["traceEvents"] if e.get("cat") == "ridgeline_request"]
    ans = next(s for s in stories if s.request_id == "answer-500")
    dec = next(e for e in ev if e["name"] == "decode" and e["args"]["completion_tokens"] == 501)
    (pause,) = [e for e in ev if e["name"] == "preempted"]
    assert pause["tid"] == dec["tid"] and pause["dur"] == pytest.approx(1.5e6)
    assert dec["ts"] < pause["ts"] and pause["ts"] + pause["dur"] < dec["ts"] + dec["dur"]
    # the decode slice holds its 17.5 s of decode and the 1.5 s pause, and ends with the request
    assert dec["dur"] == pytest.approx((ans.decode_ns + ans.paused_ns) / 1e3)
    pf = next(e for e in ev if e["name"] == "prefill" and e["tid"] == dec["tid"])    # queued 0: its arrival
    assert dec["ts"] + dec["dur"] - pf["ts"] == pytest.approx((ans.end_ns - ans.start_ns) / 1e3)
    assert sum(1 for s in imp.slices if s[3] == "ridgeline_request") == len(ev)



def test_a_recompute_preempted_track_shows_its_re_prefill_after_the_pause(tmp_path):
    """R (tests/support/request_scenarios.recompute_literal) is preempted for 5 steps,
    then re-prefills its prompt and generated tokens in 2 steps of 40 ms (recompute,
    vLLM V1 ``_preempt_request``): its track holds a "recompute" slice from the pause's
    end to the re-prefill's last step, and its decode slice still ends with the request
    (its decode time leaves the re-prefill out, the slice holds it)."""
    steps, spans = sc.recompute_literal()
    stories = {s.request_id: s for s in rj.join(spans, steps)}
    r = stories["R"]
    (p,) = r.pauses
    assert p.recompute_ns == r.recompute_ns == 80 * sc.MS
    assert p.recompute_end_ns == int(steps["end_ns"][23])          # the re-prefill's last step
    assert stories["B"].pauses == []
    shift = 500_000 - sc.T0
    moved = [msgspec.structs.replace(
        s, start_ns=s.start_ns + shift, end_ns=s.end_ns + shift,
        pauses=[msgspec.structs.replace(q, start_ns=q.start_ns + shift, end_ns=q.end_ns + shift,
                                        recompute_end_ns=q.recompute_end_ns + shift
                                        if q.recompute_end_ns is not None else None) for q in s.pauses])
        for s in stories.values()]
    out, imp = export_with_requests(tmp_path / "r.json", moved)
    ev = [e for e in json.loads(out.read_text())["traceEvents"] if e.get("cat") == "ridgeline_request"]
    dec = next(e for e in ev if e["name"] == "decode" and e["args"]["completion_tokens"] == r.completion_tokens)
    (rc,) = [e for e in ev if e["name"] == "recompute"]
    (pause,) = [e for e in ev if e["name"] == "preempted"]
    assert rc["tid"] == pause["tid"] == dec["tid"]
    assert rc["ts"] == pytest.approx(pause["ts"] + pause["dur"])       # right after the pause
    assert rc["dur"] == pytest.approx((int(steps["end_ns"][23]) - p.end_ns) / 1e3)
    assert rc["args"]["gpu_ms"] == pytest.approx(80.0)
    assert dec["args"]["recompute_ms"] == pytest.approx(80.0) and dec["args"]["recompute_steps"] == 2
    # nested inside the decode slice, which ends with the request
    assert dec["ts"] < rc["ts"] and rc["ts"] + rc["dur"] <= dec["ts"] + dec["dur"] + 1e-6
    pf = next(e for e in ev if e["name"] == "prefill" and e["tid"] == dec["tid"])
    assert dec["ts"] + dec["dur"] - pf["ts"] == pytest.approx((r.end_ns - r.start_ns) / 1e3)
    assert sum(1 for s in imp.slices if s[3] == "ridgeline_request") == len(ev)
