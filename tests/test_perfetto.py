"""Perfetto export: the input's events plus a phase track, as Chrome-trace JSON."""
import json

import numpy as np

from ridgeline.aggregator.perfetto import PHASE_PID, write_perfetto
from ridgeline.probes.events import API_DTYPE, API_LAUNCH, KERNEL_DTYPE, NameTable, Trace, empty

from phase_literals import NAMES, Step, phase_map


def test_phase_track_and_kernel_args(tmp_path):
    names = NameTable(["gemm", "cudaLaunchKernel"])
    k = empty(KERNEL_DTYPE, 3)
    k["start_ns"] = [1_000_000, 1_002_500, 9_000_000]
    k["end_ns"] = [1_002_000, 1_004_000, 9_000_100]
    k["device"], k["stream"], k["name_id"] = 0, 7, 0
    api = empty(API_DTYPE, 1)
    api["start_ns"], api["end_ns"], api["pid"], api["tid"] = 999_000, 999_500, 10, 11
    api["category"], api["name_id"] = API_LAUNCH, 1
    t = Trace(kernels=k, api=api, names=names)
    pm = phase_map([Step(0, 1_000_000, 1_004_000, 0, 1, 512, 0, ["annotation x"]),
                    Step(1, 9_000_000, 9_000_100, 0, 2, None, 4, ["grid"])],
                   np.array([1, 1, 2], np.uint8), np.array([0, 0, 1], np.int32))
    out = write_perfetto(t, pm, NAMES, tmp_path / "t.json")
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
    assert kern[0]["dur"] == 2.0 and kern[0]["tid"] == 7
    api_ev = [e for e in ev if e.get("cat") == "cuda_api"]
    assert api_ev[0]["ts"] == 0.0 and api_ev[0]["pid"] == 10
    meta = [e for e in ev if e["ph"] == "M" and e["pid"] == PHASE_PID and e["name"] == "process_name"]
    assert meta[0]["args"]["name"] == "Ridgeline phases"
