"""agent.recording_analysis.combine and agent.rank_report.together, with literals.

The literals are analysis documents as ``ridgeline analyze --json`` writes them (the keys
each test needs), read into :class:`aggregator.analysis.Analysis`; the results are checked
as the JSON document they give."""
import msgspec

from ridgeline.agent import rank_report
from ridgeline.agent.recording_analysis import MAX_STEPS_KEPT
from ridgeline.agent.recording_analysis import combine as combine_typed
from ridgeline.aggregator.analysis import Analysis, RecordingFacts, RecordingSegment, TopKernel, document


def _typed(docs: list[dict]) -> list[Analysis]:
    return [msgspec.convert(d, Analysis) for d in docs]


def combine(docs: list[dict], segs: list[dict], recording: dict) -> dict:
    return document(combine_typed(_typed(docs), msgspec.convert(segs, list[RecordingSegment]),
                                  msgspec.convert(recording, RecordingFacts)))


def together(directory: str, docs: list[dict]) -> dict:
    return document(rank_report.together(directory, _typed(docs)))


def not_one_job(docs: list[dict]) -> list[str]:
    return rank_report.not_one_job(_typed(docs))


def _doc(kernels, ktime, span, busy, idle, gaps, gap_max, flops, steps, verdict, lat_kernels, lat_p50):
    return {
        "kernels": kernels, "kernel_time_ns": ktime, "span_ns": span, "simulated": True,
        "gpu": {"key": "h100-sxm", "name": "H100"},
        "phases": {"decode": {"kernel_time_ns": ktime, "busy_ns": busy, "kernels": kernels, "steps": steps,
                              "window_ns": span, "idle_ns": idle, "gaps": gaps, "flops": flops, "bytes": flops / 2,
                              "work_busy_ns": busy, "peak_flops_per_s": 1e15, "peak_bytes_per_s": 3e12,
                              "verdict": verdict, "evidence": [verdict + " evidence"],
                              "top_kernels": [{"name": "gemm", "count": kernels, "time_ns": ktime,
                                               "flops": flops, "bytes": flops / 2}]}},
        "steps": [{"index": i, "phase": "decode"} for i in range(steps)],
        "idle_gaps": {"0": {"span_ns": span, "busy_ns": busy, "idle_ns": idle, "gaps": gaps,
                            "gap_p50_ns": 100.0, "gap_max_ns": gap_max,
                            "gap_histogram": {"<10us": gaps, "10-100us": 0}}},
        "launch_latency": {"kernels": lat_kernels, "p50_ns": lat_p50, "mean_ns": lat_p50},
        "copies": [{"kind": "memcpy", "direction": "HtoD", "count": 1, "bytes": 100, "time_ns": 10}],
    }


def test_combine_sums_and_keeps_downtime_out():
    a = _doc(10, 1000, 2000, 1000, 1000, 9, 500, 4e6, 3, "memory-bound", 10, 5.0)
    b = _doc(30, 5000, 6000, 5000, 1000, 29, 700, 6e6, 2, "compute-bound", 30, 7.0)
    segs = [{"index": 0, "started_by": "start", "start_ns": 0, "end_ns": 2000},
            {"index": 1, "started_by": "restart", "start_ns": 20_002_000, "end_ns": 20_008_000}]
    doc = combine([a, b], segs, {"segments": 2, "restarts": 1, "gaps": {}})
    assert doc["kernels"] == 40 and doc["kernel_time_ns"] == 6000
    assert doc["span_ns"] == 8000                       # not the 20 ms between the segments
    assert doc["recording"]["downtime_ns"] == 20_000_000
    g = doc["idle_gaps"]["0"]
    assert (g["span_ns"], g["busy_ns"], g["idle_ns"], g["gaps"], g["gap_max_ns"]) == (8000, 6000, 2000, 38, 700)
    assert g["gap_histogram"] == {"<10us": 38, "10-100us": 0} and g["idle_ratio"] == 0.25
    p = doc["phases"]["decode"]
    assert p["kernels"] == 40 and p["flops"] == 1e7 and p["achieved_flops_per_s"] == 1e7 / 6e-6
    assert p["verdict"] == "compute-bound" and p["percentiles_from_segment"] == 1   # the longest segment
    assert msgspec.convert(p["top_kernels"], list[TopKernel]) == [
        TopKernel(name="gemm", count=40, time_ns=6000, flops=1e7, bytes=5e6,
                  achieved_flops_per_s=1e7 / 6e-6, achieved_bytes_per_s=5e6 / 6e-6)]
    assert [s["index"] for s in doc["steps"]] == [0, 1, 2, 3, 4] and doc["steps_total"] == 5
    assert doc["launch_latency"]["kernels"] == 40 and doc["launch_latency"]["p50_ns"] == 7.0
    assert doc["launch_latency"]["mean_ns"] == (10 * 5.0 + 30 * 7.0) / 40
    assert doc["copies"] == [{"kind": "memcpy", "direction": "HtoD", "count": 2, "bytes": 200, "time_ns": 20,
                              "achieved_bytes_per_s": 200 / 20e-9}]


def test_work_by_source_is_summed_once_per_segment():
    """A source's work is each segment's once: the dict code added the first segment's
    figures to their own copy (a one-segment recording showed twice its model FLOPs)."""
    a = _doc(10, 1000, 2000, 1000, 1000, 9, 500, 4e6, 3, "memory-bound", 10, 5.0)
    b = _doc(30, 5000, 6000, 5000, 1000, 29, 700, 6e6, 2, "compute-bound", 30, 7.0)
    for d in (a, b):
        p = d["phases"]["decode"]
        p["work_by_source"] = {"model": {"flops": p["flops"], "bytes": p["bytes"], "busy_ns": p["busy_ns"],
                                         "coverage_ratio": 1.0, "dtype": "bf16", "steps": p["steps"],
                                         "notes": []}}
    segs = [{"index": 0, "started_by": "start", "start_ns": 0, "end_ns": 2000}]
    one = combine([a], segs, {"segments": 1})["phases"]["decode"]
    assert one["work_by_source"]["model"] == a["phases"]["decode"]["work_by_source"]["model"]
    both = combine([a, b], segs, {"segments": 2})["phases"]["decode"]
    m = both["work_by_source"]["model"]
    assert (m["flops"], m["bytes"], m["busy_ns"]) == (both["flops"], both["bytes"], both["busy_ns"]) == (1e7, 5e6, 6000)
    assert m["coverage_ratio"] == 1.0 and m["dtype"] == "bf16" and m["notes"] == []


def test_size_cuts_are_not_downtime_and_steps_are_capped():
    a = _doc(1, 1, 1, 1, 0, 0, 0, 1.0, MAX_STEPS_KEPT, "x", 1, 1.0)
    segs = [{"index": 0, "started_by": "start", "start_ns": 0, "end_ns": 10},
            {"index": 1, "started_by": "size", "start_ns": 1000, "end_ns": 1010}]
    doc = combine([a, a], segs, {"segments": 2, "restarts": 0, "gaps": {}})
    assert doc["recording"]["downtime_ns"] == 0
    assert len(doc["steps"]) == MAX_STEPS_KEPT and doc["steps_total"] == 2 * MAX_STEPS_KEPT


def test_together_sums_ranks_and_names_the_slowest():
    a = _doc(10, 1000, 2000, 1000, 1000, 9, 500, 4e6, 3, "memory-bound", 10, 5.0)
    b = _doc(30, 5000, 6000, 5000, 1000, 29, 700, 6e6, 2, "compute-bound", 30, 7.0)
    a["rank"], b["rank"] = 1, 0
    t = together("dir", [a, b])["together"]
    assert t["ranks"] == 2 and t["kernels"] == 40 and t["kernel_time_ns"] == 6000
    assert [r["rank"] for r in t["per_rank"]] == [1, 0] and t["slowest_rank"] == 0
    assert t["slowest_over_mean_ratio"] == 5000 / 3000
    assert t["phases"]["decode"] == {"kernel_time_ns": 6000, "kernels": 40, "ranks": 2,
                                     "verdicts": {"memory-bound": 1, "compute-bound": 1}}
    b["rank"] = 1                                         # repeated ranks: the files' order
    assert [r["rank"] for r in together("dir", [a, b])["together"]["per_rank"]] == [0, 1]


def test_together_refuses_to_rank_traces_of_different_jobs():
    """Issue 24.3: an RTX 4080 laptop, a B200 TP8 rank and an H100 (world sizes 1/1/8/none)
    are no job's ranks: said, and no slowest rank named."""
    a = _doc(10, 1000, 2000, 1000, 1000, 9, 500, 4e6, 3, "memory-bound", 10, 5.0)
    b = _doc(30, 5000, 6000, 5000, 1000, 29, 700, 6e6, 2, "compute-bound", 30, 7.0)
    a["rank"], b["rank"], a["world_size"], b["world_size"] = 0, 1, 2, 2
    assert not_one_job([a, b]) == []                                     # one job: ranked
    assert together("dir", [a, b])["together"]["slowest_rank"] == 1
    b["gpu"] = {"key": "b200", "device_name": "NVIDIA B200"}
    a["gpu"]["device_name"], a["trace"], b["trace"] = "NVIDIA H100 80GB HBM3", "/x/r0.json", "/x/r1.json"
    t = together("dir", [a, b])["together"]
    assert not t["one_job"] and t["slowest_rank"] is None and t["slowest_over_mean_ratio"] is None
    assert t["not_one_job"] == ["different GPUs: NVIDIA H100 80GB HBM3 (r0.json); NVIDIA B200 (r1.json)"]
    assert t["kernels"] == 40                                            # the sums remain
    b["gpu"] = a["gpu"]
    c = dict(a, world_size=8)
    d = {k: v for k, v in a.items() if k != "world_size"}
    assert not_one_job([a, b, c, d]) == ["different world sizes: 2/2/8/none"]
    a["world_size"] = b["world_size"] = 1
    assert not_one_job([a, b]) == ["2 traces declare world size 1: more than one job's ranks"]


def test_analyze_dir_of_unrelated_shared_traces_warns(trace_path, tmp_path, capsys):
    import json
    import shutil

    from ridgeline.agent.cli import main
    d = tmp_path / "mixed"
    d.mkdir()
    for name in ("nanovllm_rtx4080laptop_decode_step0_fragment.json.gz",
                 "tracelens_b200_vllm_gptoss_tp8_prefill888.json.gz",
                 "tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz"):
        shutil.copy(trace_path(f"nvidia-inference/{name}"), d / name)
    assert main(["analyze", str(d), "--json"]) == 0
    cap = capsys.readouterr()
    t = json.loads(cap.out)["together"]
    assert not t["one_job"] and t["slowest_rank"] is None
    assert any(w.startswith("different GPUs: ") and "NVIDIA B200" in w for w in t["not_one_job"])
    assert "not one job" in cap.err and "no slowest rank" in cap.err
