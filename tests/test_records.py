"""probes.records: the typed records, their wire numbers, and the one table of phase codes.

The numbers pinned below are the table ``aggregator.wire`` carried as a literal before the
records declared them: generating it from the Structs must give back every one of them
(a recording made with any earlier build decodes by these numbers).
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np
import pytest

from ridgeline.aggregator import phases, wire
from ridgeline.probes import records
from ridgeline.probes.records import N, Phase

DATA = Path(__file__).parent / "data"

PINNED = {
    "start_ns": 1, "end_ns": 2, "duration_ns": 3, "host": 4, "sources": 5, "gpus": 6, "device": 7,
    "engine": 8, "sched": 9, "verdict": 10, "agent": 11, "pid": 12, "gpu": 13, "kernels": 14,
    "kernel_time_ns": 15, "busy_ns": 16, "span_ns": 17, "idle_ns": 18, "copy_bytes": 19, "launch": 20,
    "sync": 21, "phases": 22, "ceilings": 23, "phase_source": 24, "count": 25, "p50_ns": 26, "p99_ns": 27,
    "time_share_pct": 28, "flops": 29, "bytes": 30, "achieved_flops_per_s": 31, "achieved_bytes_per_s": 32,
    "arithmetic_intensity": 33, "pct_of_peak_flops": 34, "pct_of_peak_bytes": 35, "evidence": 36,
    "work_source": 37, "steps": 38, "phase": 39, "tokens": 40, "prefill_tokens": 41, "decode_tokens": 42,
    "hbm_bytes_per_s": 43, "flops_per_s": 44, "source": 45, "cpu_pct": 46, "rss_bytes": 47, "records": 48,
    "drops": 49, "errors": 50, "records_per_s": 51, "bpf_run_time_ns": 52, "tid": 53, "comm": 54,
    "on_cpu_ns": 55, "runq_wait_ns": 56, "blocked_ns": 57, "voluntary_switches": 58,
    "involuntary_switches": 59, "threads": 60, "kv_usage": 61, "num_running": 62, "num_waiting": 63,
    "preemptions_total": 64, "prefix_cache_hit_rate": 65, "name": 66, "index": 67, "data": 68, "p90_ns": 69,
    "p95_ns": 70, "mean_ns": 71, "reason": 72, "value": 73, "queue_mean_s": 74, "prefill_mean_s": 75,
    "decode_mean_s": 76, "ttft_mean_s": 77, "e2e_mean_s": 78, "queue_share_of_ttft_ratio": 79,
    "segment_kinds": 80, "num_swapped_requests": 81, "external_prefix_cache_hit_ratio": 82,
    "prompt_tokens_cached_ratio": 83, "kv_evicted_tokens": 84, "kv_eviction_rate_tokens_per_s": 85,
    "kv_eviction_source": 86, "estimated_flops_per_gpu": 87, "estimated_read_bytes_per_gpu": 88,
    "estimated_write_bytes_per_gpu": 89, "estimated_flops_per_gpu_per_s": 90,
    "estimated_bytes_per_gpu_per_s": 91, "estimated_arithmetic_intensity": 92, "work_estimate_source": 93,
    "preemption_episode_active": 94, "preemption_episode_elapsed_s": 95,
    "preemption_episode_preemptions": 96, "preemption_episode_baseline_waiting": 97,
    "preemption_episodes_total": 98, "preemption_episodes_recovered_total": 99, "preemption_recovery_s": 100,
    "preemption_last_recovery_s": 101, "latency_histograms": 102, "bounds": 103, "cumulative": 104,
    "launch_tids": 105, "kv_read_bytes_per_s": 106, "kv_read_source": 107,
    "achieved_bytes_with_kv_per_s": 108, "requests": 109, "requests_dropped": 110, "decode_ns": 111,
    "dragged_ns": 112, "dragged_share_ratio": 113, "queue_p99_ns": 114, "prefill_p99_ns": 115,
    "decode_p99_ns": 116, "dragged_p99_ns": 117, "e2e_p99_ns": 118, "top_culprit_id": 119,
    "top_culprit_added_ns": 120, "top_culprit_tokens": 121, "dragged_source": 122, "slowest": 123,
    "request_id": 124, "e2e_ns": 125, "queue_ns": 126, "kv_usage_max_queued_ratio": 127,
    "kv_full_while_queued": 128, "prefill_ns": 129, "prefill_chunks": 130, "decode_steps": 131,
    "ns_per_token": 132, "dragged_by_prefill_ns": 133, "dragged_by_long_ns": 134, "alone_decode_ns": 135,
    "preemptions": 136, "recovery_ns": 137, "prompt_tokens": 138, "completion_tokens": 139, "culprits": 140,
    "kind": 141, "added_ns": 142, "stories": 143, "stragglers": 144, "groups": 145, "ranks": 146,
    "last_count": 147, "wait_ns": 148, "collectives": 149, "waiting_share_ratio": 150, "straggler_pid": 151,
    "straggler_device": 152, "straggler_last_share_ratio": 153, "late_by_p50_ns": 154, "late_by_p99_ns": 155,
    "cause": 156, "straggler_kernels_dropped": 157, "e2e_total_ns": 158, "e2e_bucket_counts": 159,
    "exemplars": 160, "bucket": 161, "trace_id": 162, "straggler_launch_off_cpu_ratio": 163,
    "others_launch_off_cpu_ratio": 164, "paused_ns": 165, "pauses": 166,
    "recompute_ns": 167, "recompute_steps": 168, "recompute_share_ratio": 169, "recompute_end_ns": 170,
}


def test_generated_field_table_is_the_pinned_one():
    assert wire.FIELDS == PINNED
    assert records.wire_fields() == PINNED


def test_every_numbered_name_has_one_number_across_records():
    seen: dict[str, set[int]] = {}
    for cls in records.RECORDS:
        for name, no in records._numbers(cls).items():
            seen.setdefault(name, set()).add(no)
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}
    # a retired number is no longer declared by any record
    assert not set(records.RETIRED) & set(seen)


def test_a_conflicting_number_is_refused(monkeypatch):
    class Bad(msgspec.Struct):
        kernel_time_ns: Annotated[int, N(999)] = 0

    monkeypatch.setattr(records, "RECORDS", records.RECORDS + (Bad,))
    with pytest.raises(ValueError, match="kernel_time_ns is field 999, elsewhere 15"):
        records.wire_fields()

    class Reused(msgspec.Struct):
        a_new_name: Annotated[int, N(15)] = 0

    monkeypatch.setattr(records, "RECORDS", records.RECORDS[:-1] + (Reused,))
    with pytest.raises(ValueError, match="field 15 is both"):
        records.wire_fields()


def test_golden_window_reads_as_typed_records():
    env = wire.decode_envelope((DATA / "wire_envelope_window_v1.bin").read_bytes())
    w = records.window_of(wire.decode_window(env.payload))
    assert (w.start_ns, w.duration_ns, w.sources) == (1_700_000_000_000_000_000, 1_000_000_000, ["cupti"])
    g = w.gpus[0]
    assert (g.device, g.pid, g.kernels, g.span_ns, g.copy_bytes) == (0, 4242, 51234, 0, {"HtoD": 1 << 20, "DtoH": 4096})
    assert g.launch == records.Latency(count=51234, p50_ns=4100, p99_ns=18000) and g.sync is None
    dec = g.phases["decode"]
    assert (dec.achieved_bytes_per_s, dec.verdict, dec.evidence, dec.flops) == \
        (3.25e12, "memory-bound", ["grid.x=64 per-token"], None)
    assert g.phases["prefill"].verdict is None and g.phases["prefill"].kernel_time_ns == 112_345_678
    assert (w.agent.cpu_pct, w.agent.rss_bytes, w.agent.drops) == (0.8, 83_000_000, {"cupti": 0})
    assert w.requests is None


def test_golden_engine_and_requests_windows_read_as_typed_records():
    env = wire.decode_envelope((DATA / "wire_envelope_engine_window_v1.bin").read_bytes())
    w = records.window_of(wire.decode_window(env.payload))
    ep = w.engine["engine"]["endpoints"]["http://127.0.0.1:8000/metrics"]
    e = msgspec.convert(ep, records.EngineFigures)
    assert (e.engine, e.queue_share_of_ttft_ratio, e.preemption_episode_active) == ("vllm", 0.5333, True)
    assert e.latency_histograms["ttft_s"].cumulative == [1.0, 2.0, 3.0]
    assert w.gpus[0].launch_tids == [4243]
    env = wire.decode_envelope((DATA / "wire_envelope_requests_window_v1.bin").read_bytes())
    w = records.window_of(wire.decode_window(env.payload))
    assert (w.requests.requests, w.requests.top_culprit_id) == (3, "long-4000")
    assert w.requests.slowest[0].culprits[0].tokens == 4000


def test_a_wrongly_typed_field_is_refused_by_name():
    with pytest.raises(msgspec.ValidationError, match=r"gpus\[0\]"):
        records.window_of({"gpus": [{"phases": "not a map"}]})


def test_phase_is_one_table():
    assert [(int(p), p.label) for p in Phase] == \
        [(0, "unknown"), (1, "prefill"), (2, "decode"), (3, "mixed"), (4, "other")]
    assert records.PHASE_NAMES == {0: "unknown", 1: "prefill", 2: "decode", 3: "mixed", 4: "other"}
    assert phases.PHASE_NAMES is records.PHASE_NAMES and phases.DECODE is Phase.DECODE
    # the codes are stored in uint8 columns and compared against them
    col = np.array([0, 2, 2, 3], dtype=np.uint8)
    assert int((col == Phase.DECODE).sum()) == 2 and records.PHASE_NAMES[col[3]] == "mixed"


def test_a_window_of_a_real_trace_reads_as_typed_records(shared_traces):
    """The records declare what the window builder really writes: a window of a real trace,
    through the wire, converts, and its typed figures are the dict's."""
    from ridgeline.aggregator.windows import WindowBuilder
    from ridgeline.probes.kineto import load_trace
    t = load_trace(shared_traces / "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz")
    b = WindowBuilder(host="h")
    b.add_events(t, "replay")
    d = wire.decode_window(wire.encode_window(b.close(0, 1, agent={"cpu_pct": 1.0}, final=True)))
    w = records.window_of(d)
    assert sum(g.kernels for g in w.gpus) == len(t.kernels) > 0
    for g, gd in zip(w.gpus, d["gpus"], strict=True):
        assert (g.source, g.span_ns, g.launch.count) == ("replay", gd["span_ns"], gd["launch"]["count"])
        assert g.ceilings.hbm_bytes_per_s == gd["ceilings"]["hbm_bytes_per_s"] > 0
        assert set(g.phases) == set(gd["phases"]) and g.phases
        for ph, f in g.phases.items():
            fd = gd["phases"][ph]
            assert (f.kernel_time_ns, f.verdict, f.evidence, f.work_busy_ns) == \
                (fd["kernel_time_ns"], fd["verdict"], fd["evidence"], fd["work_busy_ns"])
    assert w.agent.cpu_pct == 1.0 and w.host == "h"
