"""aggregator.wire: golden bytes, round trips on real traces, rejection of bad input.

Golden files (tests/data/wire_*.bin) were produced by this module's encoder from the
literals below (``python tests/test_wire.py --regenerate`` rewrites them; only do that
for a deliberate schema change, together with a SCHEMA_VERSION bump).
"""
from __future__ import annotations

import dataclasses
import sys
import zlib
from pathlib import Path

import msgpack
import msgspec
import numpy as np
import pytest

from ridgeline.aggregator import wire
from ridgeline.probes import events as ev
from ridgeline.probes.errors import InputError
from ridgeline.probes.events import Device, NameTable, Trace, empty

DATA = Path(__file__).parent / "data"

WINDOW = {
    "start_ns": 1_700_000_000_000_000_000, "end_ns": 1_700_000_001_000_000_000,
    "duration_ns": 1_000_000_000, "sources": ["cupti"],
    "gpus": [{"device": 0, "pid": 4242, "gpu": "NVIDIA H100 80GB HBM3", "kernels": 51234,
              "kernel_time_ns": 912_345_678, "busy_ns": 900_000_000, "idle_ns": 100_000_000,
              "copy_bytes": {"HtoD": 1 << 20, "DtoH": 4096},
              "launch": {"count": 51234, "p50_ns": 4100, "p99_ns": 18000},
              "phases": {"decode": {"kernels": 50000, "kernel_time_ns": 800_000_000,
                                    "time_share_pct": 87.7, "bytes": 2.6e12,
                                    "achieved_bytes_per_s": 3.25e12, "arithmetic_intensity": 1.9,
                                    "verdict": "memory-bound", "evidence": ["grid.x=64 per-token"],
                                    "work_source": "model"},
                         "prefill": {"kernels": 1234, "kernel_time_ns": 112_345_678,
                                     "verdict": None}}}],
    "agent": {"cpu_pct": 0.8, "rss_bytes": 83_000_000, "drops": {"cupti": 0}},
    "a_key_not_in_the_table": [1, 2, {"nested_unknown": True}],
}


def _literal_trace() -> Trace:
    names = NameTable(["ampere_bf16_s16816gemm_bf16_128x64", "flash_fwd_splitkv_kernel",
                       "cudaLaunchKernel", "Memcpy HtoD (Pinned -> Device)", "ProfilerStep#3",
                       "aten::mm", "[[16, 1024], [1024, 4096]]"])
    k = empty(ev.KERNEL_DTYPE, 4)
    k["start_ns"] = [1_000_000_000, 1_000_012_000, 1_000_020_500, 1_000_031_000]
    k["end_ns"] = k["start_ns"] + [10_000, 7_250, 9_999, 10_000]
    k["device"], k["stream"], k["context"] = 0, 7, 1
    k["correlation_id"] = [101, 103, 105, 107]
    k["external_id"] = [11, 11, 12, 13]
    k["grid_x"], k["grid_y"], k["grid_z"] = [132, 16, 132, 16], 1, 1
    k["block_x"], k["block_y"], k["block_z"] = [256, 128, 256, 128], 1, 1
    k["registers"], k["shared_mem_bytes"] = [168, 96, 168, 96], [98304, 12288, 98304, 12288]
    k["name_id"] = [0, 1, 0, 1]
    k["pid"], k["tid"] = 4242, 4243
    c = empty(ev.COPY_DTYPE, 1)
    c[0] = (999_000_000, 999_001_500, 0, 7, 100, ev.COPY_KIND_MEMCPY, ev.COPY_HTOD, 65536, -1, 4242, 4243, 3)
    a = empty(ev.API_DTYPE, 2)
    a["start_ns"], a["end_ns"] = [999_990_000, 1_000_005_000], [999_995_000, 1_000_009_000]
    a["pid"], a["tid"], a["correlation_id"], a["external_id"] = 4242, 4243, [101, 103], [11, 11]
    a["cbid"], a["domain"], a["category"], a["name_id"] = 211, ev.API_DOMAIN_RUNTIME, ev.API_LAUNCH, 2
    r = empty(ev.RANGE_DTYPE, 1)
    r[0] = (990_000_000, 1_001_000_000, 4242, 4243, -1, ev.RANGE_PROFILER_STEP, 4, 10)
    o = empty(ev.CPU_OP_DTYPE, 1)
    o[0] = (999_980_000, 1_000_010_000, 4242, 4243, 5, 11, 6, -1, 1)   # is_causal=1: column 29
    return Trace(k, c, a, r, o, names, [Device(0, "NVIDIA H100 80GB HBM3", 132, 85018279936, "9.0")],
                 {"source": "literal"})


# An engine window with the issue-12 fields (wire fields 74-108, see wire.py "Version notes").
ENGINE_WINDOW = {
    "start_ns": 1_700_000_000_000_000_000, "end_ns": 1_700_000_002_000_000_000, "duration_ns": 2_000_000_000,
    "sources": ["engine"],
    "gpus": [{"device": 0, "pid": 4242, "launch_tids": [4243]}],
    "engine": {"engine": {"endpoints": {"http://127.0.0.1:8000/metrics": {
        "engine": "vllm", "kv_usage_ratio": 0.91, "num_swapped_requests": None,
        "queue_mean_s": 0.4, "prefill_mean_s": 0.35, "decode_mean_s": 2.0, "ttft_mean_s": 0.75, "e2e_mean_s": 2.75,
        "queue_share_of_ttft_ratio": 0.5333, "segment_kinds": {"queue": "measured", "prefill": "measured"},
        "external_prefix_cache_hit_ratio": 0.25, "prompt_tokens_cached_ratio": 0.55, "kv_evicted_tokens": None,
        "kv_eviction_rate_tokens_per_s": None, "kv_eviction_source": None,
        "estimated_flops_per_gpu": 2e15, "estimated_read_bytes_per_gpu": 4e12, "estimated_write_bytes_per_gpu": None,
        "estimated_flops_per_gpu_per_s": 1e15, "estimated_bytes_per_gpu_per_s": 2e12,
        "estimated_arithmetic_intensity": 500.0, "work_estimate_source": "engine_estimate",
        "preemption_episode_active": True, "preemption_episode_elapsed_s": 6.0, "preemption_episode_preemptions": 4.0,
        "preemption_episode_baseline_waiting": 2.0, "preemption_episodes_total": 3,
        "preemption_episodes_recovered_total": 2, "preemption_recovery_s": None, "preemption_last_recovery_s": 8.0,
        "latency_histograms": {"ttft_s": {"bounds": [0.1, 1.0], "cumulative": [1.0, 2.0, 3.0],
                                          "count": 3.0, "sum": 2.5}}}}}},
}

# A window with the issue-22 request aggregates (wire fields 109-143), and a "requests"
# message: the seed example's figures (tests/support/request_scenarios.py), written out as literals.
STORY = {"request_id": "answer-500", "engine": "vllm", "start_ns": 1_700_000_000_600_000_000,
         "end_ns": 1_700_000_020_615_000_000, "e2e_ns": 20_015_000_000, "queue_ns": 0,
         "kv_usage_max_queued_ratio": -1.0, "kv_full_while_queued": False, "prefill_ns": 15_000_000,
         "prefill_chunks": 1, "decode_ns": 20_000_000_000, "decode_steps": 500, "ns_per_token": 39920159.68,
         "dragged_ns": 12_500_000_000, "dragged_by_prefill_ns": 100_000_000, "dragged_by_long_ns": 12_400_000_000,
         "dragged_source": "measured", "alone_decode_ns": 7_500_000_000, "preemptions": 0, "recovery_ns": -1,
         "prompt_tokens": 100, "completion_tokens": 501,
         "culprits": [{"request_id": "long-4000", "kind": "prefill_chunk+long_sequence", "added_ns": 12_500_000_000,
                       "tokens": 4000}]}
REQUESTS_WINDOW = {
    "start_ns": 1_700_000_020_000_000_000, "end_ns": 1_700_000_021_000_000_000, "duration_ns": 1_000_000_000,
    "sources": ["simulated"],
    "requests": {"requests": 3, "requests_dropped": 0, "decode_ns": 40_410_000_000, "dragged_ns": 12_500_000_000,
                 "dragged_share_ratio": 0.3093, "queue_p99_ns": 0, "prefill_p99_ns": 157_100_000,
                 "decode_p99_ns": 19_996_800_000, "dragged_p99_ns": 12_250_000_000, "e2e_p99_ns": 20_014_700_000,
                 "top_culprit_id": "long-4000", "top_culprit_added_ns": 12_500_000_000, "top_culprit_tokens": 4000,
                 "dragged_source": "measured", "slowest": [STORY]},
}

# A preempted request's story (wire fields 165-166: the time paused and the pauses, each
# ``start_ns``/``end_ns`` as everywhere): the preempted seed example's figures
# (tests/support/request_scenarios.py, seed_preempted), written out as literals.
STORY_PAUSED = {**STORY, "end_ns": 1_700_000_019_615_000_000, "e2e_ns": 19_015_000_000, "decode_ns": 17_500_000_000,
                "ns_per_token": 34930139.72, "dragged_ns": 10_000_000_000, "dragged_by_long_ns": 9_900_000_000,
                "preemptions": 1, "recovery_ns": 1_500_000_000,
                "culprits": [{**STORY["culprits"][0], "added_ns": 10_000_000_000}],
                "paused_ns": 1_500_000_000,
                "pauses": [{"start_ns": 1_700_000_014_975_000_000, "end_ns": 1_700_000_016_475_000_000}]}

# A story with a re-prefill after its pause (wire fields 167-168): the literal scenario of
# tests/test_request_preemption.py (R: 2 re-prefill steps of 40 ms), written out.
STORY_RECOMPUTE = {**STORY_PAUSED, "recompute_ns": 80_000_000, "recompute_steps": 2}

STRAGGLERS_WINDOW = {
    "start_ns": 1_700_000_030_000_000_000, "end_ns": 1_700_000_031_000_000_000, "duration_ns": 1_000_000_000,
    "sources": ["cupti"],
    "stragglers": {"groups": [{
        "ranks": [{"pid": 101, "device": 0, "last_count": 0, "wait_ns": 7_200_000},
                  {"pid": 102, "device": 1, "last_count": 0, "wait_ns": 7_150_000},
                  {"pid": 103, "device": 2, "last_count": 60, "wait_ns": 0},
                  {"pid": 104, "device": 3, "last_count": 0, "wait_ns": 7_230_000}],
        "collectives": 60, "waiting_share_ratio": 0.1563, "straggler_pid": 103, "straggler_device": 2,
        "straggler_last_share_ratio": 1.0, "late_by_p50_ns": 120_500, "late_by_p99_ns": 123_000,
        "cause": "kernel", "straggler_launch_off_cpu_ratio": 0.04, "others_launch_off_cpu_ratio": 0.05}],
        "straggler_kernels_dropped": 0},
}

GOLDEN = {
    "wire_envelope_stragglers_window_v1.bin": lambda: wire.encode_envelope(
        "window", 10, wire.encode_window(STRAGGLERS_WINDOW), "gpu-host-1", 1_700_000_031_000_000_123),
    "wire_envelope_requests_window_v1.bin": lambda: wire.encode_envelope(
        "window", 9, wire.encode_window(REQUESTS_WINDOW), "gpu-host-1", 1_700_000_021_000_000_123),
    "wire_envelope_requests_v1.bin": lambda: wire.encode_envelope(
        "requests", 2, {"end_ns": 1_700_000_021_000_000_000, "stories": [STORY]}, "gpu-host-1",
        1_700_000_021_000_000_456),
    "wire_envelope_requests_paused_v1.bin": lambda: wire.encode_envelope(
        "requests", 3, {"end_ns": 1_700_000_021_000_000_000, "stories": [STORY_PAUSED]}, "gpu-host-1",
        1_700_000_021_000_000_789),
    "wire_envelope_requests_recompute_v1.bin": lambda: wire.encode_envelope(
        "requests", 4, {"end_ns": 1_700_000_021_000_000_000, "stories": [STORY_RECOMPUTE]}, "gpu-host-1",
        1_700_000_021_000_000_999),
    "wire_envelope_engine_window_v1.bin": lambda: wire.encode_envelope(
        "window", 8, wire.encode_window(ENGINE_WINDOW), "gpu-host-1", 1_700_000_002_000_000_123),
    "wire_envelope_window_v1.bin": lambda: wire.encode_envelope(
        "window", 7, wire.encode_window(WINDOW), "gpu-host-1", 1_700_000_001_000_000_123),
    "wire_event_batch_v1.bin": lambda: wire.encode_event_batch(_literal_trace()),
    "wire_envelope_health_v1.bin": lambda: wire.encode_envelope(
        "health", 3, {"cpu_pct": 1.5, "rss_bytes": 90_000_000, "drops": {"cupti": 2}},
        "gpu-host-1", 42),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes(name):
    assert GOLDEN[name]() == (DATA / name).read_bytes()


def test_golden_window_decodes_to_literal():
    env = wire.decode_envelope((DATA / "wire_envelope_window_v1.bin").read_bytes())
    assert (env.version, env.topic, env.kind, env.host, env.seq, env.ts_ns) == \
        (1, "window", "window", "gpu-host-1", 7, 1_700_000_001_000_000_123)
    assert wire.decode_window(env.payload) == WINDOW


def test_golden_engine_window_numbers_the_issue12_fields():
    raw = (DATA / "wire_envelope_engine_window_v1.bin").read_bytes()
    env = wire.decode_envelope(raw)
    assert wire.decode_window(env.payload) == ENGINE_WINDOW
    # The new keys travel as their numbers, not as text.
    for key in ("queue_share_of_ttft_ratio", "preemption_last_recovery_s", "latency_histograms", "launch_tids"):
        assert key.encode() not in raw and wire.FIELDS[key] >= 74


def test_golden_requests_window_and_topic_number_the_issue22_fields():
    raw = (DATA / "wire_envelope_requests_window_v1.bin").read_bytes()
    assert wire.decode_window(wire.decode_envelope(raw).payload) == REQUESTS_WINDOW
    raw2 = (DATA / "wire_envelope_requests_v1.bin").read_bytes()
    env = wire.decode_envelope(raw2)
    assert env.topic == "requests" and env.payload["stories"] == [STORY]
    for key in ("dragged_share_ratio", "top_culprit_tokens", "alone_decode_ns", "culprits"):
        assert key.encode() not in raw and key.encode() not in raw2 and wire.FIELDS[key] >= 109
    # Every field of the typed records is numbered (none travels as text).
    from ridgeline.aggregator import request_join as rj
    for cls in (rj.WindowRequests, rj.RequestStory, rj.Culprit):
        assert set(cls.__struct_fields__) <= set(wire.FIELDS), cls


def test_golden_paused_story_numbers_its_new_fields_and_reads_as_a_story():
    """The fields added for preemption pauses (165, 166) travel as numbers; the older
    golden files (without them) are unchanged and read with the defaults (0, [])."""
    from ridgeline.probes import records
    raw = (DATA / "wire_envelope_requests_paused_v1.bin").read_bytes()
    env = wire.decode_envelope(raw)
    assert env.payload["stories"] == [STORY_PAUSED]
    assert (wire.FIELDS["paused_ns"], wire.FIELDS["pauses"]) == (165, 166)
    for key in ("paused_ns", "pauses", "recovery_ns"):
        assert key.encode() not in raw
    msg = msgspec.convert(env.payload, records.RequestsMessage)
    st = msg.stories[0]
    assert st.paused_ns == 1_500_000_000 and st.pauses == [records.Pause(1_700_000_014_975_000_000,
                                                                          1_700_000_016_475_000_000)]
    old = msgspec.convert(wire.decode_envelope((DATA / "wire_envelope_requests_v1.bin").read_bytes()).payload,
                          records.RequestsMessage)
    assert (old.stories[0].paused_ns, old.stories[0].pauses) == (0, [])


def test_golden_recompute_story_numbers_its_new_fields_and_reads_as_a_story():
    """The fields added for re-prefills after preemption (167, 168) travel as numbers; the
    older golden stories (without them) read with the defaults (0, 0)."""
    from ridgeline.probes import records
    raw = (DATA / "wire_envelope_requests_recompute_v1.bin").read_bytes()
    env = wire.decode_envelope(raw)
    assert env.payload["stories"] == [STORY_RECOMPUTE]
    assert (wire.FIELDS["recompute_ns"], wire.FIELDS["recompute_steps"], wire.FIELDS["recompute_share_ratio"]) == \
        (167, 168, 169)
    for key in ("recompute_ns", "recompute_steps"):
        assert key.encode() not in raw
    st = msgspec.convert(env.payload, records.RequestsMessage).stories[0]
    assert (st.recompute_ns, st.recompute_steps, st.paused_ns) == (80_000_000, 2, 1_500_000_000)
    old = msgspec.convert(wire.decode_envelope((DATA / "wire_envelope_requests_paused_v1.bin").read_bytes()).payload,
                          records.RequestsMessage)
    assert (old.stories[0].recompute_ns, old.stories[0].recompute_steps) == (0, 0)
    w = records.window_of(wire.decode_window(wire.decode_envelope(
        (DATA / "wire_envelope_requests_window_v1.bin").read_bytes()).payload))
    assert (w.requests.recompute_ns, w.requests.recompute_share_ratio) == (0, 0.0)


def test_golden_stragglers_window_numbers_the_issue23_fields():
    raw = (DATA / "wire_envelope_stragglers_window_v1.bin").read_bytes()
    assert wire.decode_window(wire.decode_envelope(raw).payload) == STRAGGLERS_WINDOW
    from ridgeline.aggregator import straggler_window as sw
    for cls in (sw.WindowStragglers, sw.GroupStragglers, sw.RankStragglers):
        for key in cls.__struct_fields__:
            assert key.encode() not in raw, key
    assert all(wire.FIELDS[k] >= 144 for k in ("stragglers", "straggler_last_share_ratio", "cause"))


def test_golden_health_decodes_to_literal():
    env = wire.decode_envelope((DATA / "wire_envelope_health_v1.bin").read_bytes())
    assert env.payload == {"cpu_pct": 1.5, "rss_bytes": 90_000_000, "drops": {"cupti": 2}}


def _assert_same(t1: Trace, t2: Trace):
    for kind in wire.KINDS:
        x, y = getattr(t1, kind), getattr(t2, kind)
        assert len(x) == len(y), kind
        for f in x.dtype.names:
            if f in ("name_id", "input_dims_id", "input_types_id"):
                assert t1.names.names_of(x[f]) == t2.names.names_of(y[f]), f"{kind}.{f}"
            else:
                assert np.array_equal(x[f], y[f]), f"{kind}.{f}"


def test_golden_event_batch_decodes_to_literal():
    lit = _literal_trace()
    got = wire.decode_event_batch((DATA / "wire_event_batch_v1.bin").read_bytes())
    _assert_same(lit, got)
    assert got.meta == {"source": "literal"}
    assert got.devices == lit.devices


def test_window_keys_are_numbers_on_the_wire():
    raw = msgpack.unpackb(wire.encode_window({"kernel_time_ns": 5, "phases": {"decode": {"flops": 1}}}),
                          strict_map_key=False)
    assert raw == {0: 1, 1: {15: 5, 22: {"decode": {29: 1}}}}


def test_unknown_field_number_decodes_by_number():
    blob = msgpack.packb({0: 1, 1: {9999: 1, 15: 2}})
    assert wire.decode_window(blob) == {"field_9999": 1, "kernel_time_ns": 2}


def test_field_numbers_unique_and_stable():
    assert len(set(wire.FIELDS.values())) == len(wire.FIELDS)
    assert len(set(wire.COLUMNS.values())) == len(wire.COLUMNS)
    # pinned: changing these breaks every recording ever made
    assert (wire.FIELDS["start_ns"], wire.FIELDS["phases"], wire.FIELDS["verdict"]) == (1, 22, 10)
    for dt in (ev.KERNEL_DTYPE, ev.COPY_DTYPE, ev.API_DTYPE, ev.RANGE_DTYPE, ev.CPU_OP_DTYPE):
        assert set(dt.names) <= set(wire.COLUMNS), "every event column needs a wire number"


def test_numpy_values_become_plain():
    w = {"kernels": np.int64(5), "busy_ns": np.array([1, 2]), "time_share_pct": np.float32(0.5)}
    assert wire.decode_window(wire.encode_window(w)) == {"kernels": 5, "busy_ns": [1, 2], "time_share_pct": 0.5}


def test_int_keys_travel_as_text():
    assert wire.decode_window(wire.encode_window({"threads": {4242: {"on_cpu_ns": 5}}})) == \
        {"threads": {"4242": {"on_cpu_ns": 5}}}


# ----------------------------------------------------------------- rejection

def _bad(fn, blob, text):
    with pytest.raises(InputError) as ei:
        fn(blob)
    assert text in str(ei.value) and "\n" not in str(ei.value)


def test_unknown_versions_rejected():
    env = msgpack.packb({0: 2, 1: "window", 2: "h", 3: 1, 4: 1, 5: b""})
    _bad(wire.decode_envelope, env, "schema version 2")
    _bad(wire.decode_window, msgpack.packb({0: 99, 1: {}}), "schema version 99")
    batch = bytearray((DATA / "wire_event_batch_v1.bin").read_bytes())
    m = msgpack.unpackb(bytes(batch), strict_map_key=False)
    m[0] = 0
    _bad(wire.decode_event_batch, msgpack.packb(m), "schema version 0")


def test_malformed_input_rejected():
    good = (DATA / "wire_envelope_window_v1.bin").read_bytes()
    _bad(wire.decode_envelope, b"\xc1garbage", "not valid msgpack")
    _bad(wire.decode_envelope, good[: len(good) // 2], "not valid msgpack")
    _bad(wire.decode_envelope, msgpack.packb([1, 2]), "not a map")
    _bad(wire.decode_envelope, msgpack.packb({0: 1, 1: "nope", 2: "h", 3: 1, 4: 1, 5: 1}), "unknown topic")
    _bad(wire.decode_envelope, msgpack.packb({0: 1, 1: "window", 2: "h", 3: "x", 4: 1, 5: b""}), "types")
    _bad(wire.decode_envelope, msgpack.packb({0: 1, 1: "window", 2: "h", 3: 1, 4: 1, 5: 5}), "not bin")
    _bad(wire.decode_envelope, "text", "expected bytes")
    batch = (DATA / "wire_event_batch_v1.bin").read_bytes()
    _bad(wire.decode_event_batch, batch[:-7], "not valid msgpack")
    m = msgpack.unpackb(batch, strict_map_key=False)
    m2 = dict(m)
    m2[8] = dict(m[8])
    m2[8][3] = b"not zlib at all"
    _bad(wire.decode_event_batch, msgpack.packb(m2), "not valid zlib")
    m2[8][3] = zlib.compress(b"\x00" * 10)
    m2[8][4] = 10
    _bad(wire.decode_event_batch, msgpack.packb(m2), "runs past the data")
    m2[8] = dict(m[8])
    m2[8][1] = 10**12
    _bad(wire.decode_event_batch, msgpack.packb(m2), "header is malformed")
    m3 = dict(m)
    m3[3] = m[3][:2]      # names it refers to are missing
    m3[4] = 2
    _bad(wire.decode_event_batch, msgpack.packb(m3), "does not ship")
    # a zlib bomb claiming a small size is cut at the stated length
    m4 = dict(m)
    m4[8] = dict(m[8])
    m4[8][3] = zlib.compress(b"\x00" * 10_000_000)
    _bad(wire.decode_event_batch, msgpack.packb(m4), "stated length")


# ----------------------------------------------------------------- real traces

TRACES = [
    "nvidia-inference/nanovllm_rtx4080laptop_decode_step0_fragment.json.gz",
    "nvidia-inference/tracelens_b200_vllm_gptoss_tp8_prefill888.json.gz",
    "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz",
    "nvidia-training/hta_a100_rank0_training.json.gz",
]


@pytest.mark.parametrize("name", TRACES)
def test_round_trip_real_traces(name, trace_path):
    from ridgeline.probes.kineto import load_trace
    t = load_trace(trace_path(name))
    blob = wire.encode_event_batch(t)
    back = wire.decode_event_batch(blob)
    _assert_same(t, back)
    assert [d.name for d in back.devices] == [d.name for d in t.devices]
    env = wire.decode_envelope(wire.encode_envelope("events", 1, blob, "h", 2))
    _assert_same(t, wire.decode_event_batch(env.payload))


def test_bytes_per_kernel_event_h100(trace_path):
    """The H100 trace's kernels, names included, fit the 16-byte budget."""
    from ridgeline.probes.kineto import load_trace
    t = load_trace(trace_path(TRACES[2]))
    kt = Trace(kernels=t.kernels, names=t.names)
    assert len(wire.encode_event_batch(kt)) / len(t.kernels) <= 16


def test_stateful_stream_ships_names_once_and_resyncs(trace_path):
    from ridgeline.probes.kineto import load_trace
    t = load_trace(trace_path(TRACES[2]))
    parts = [Trace(kernels=t.kernels[i:i + 300], names=t.names) for i in range(0, len(t.kernels), 300)]
    enc = wire.EventBatchEncoder(full_every=3, stream=77)
    blobs = [enc.encode(p) for p in parts]
    names_shipped = [len(msgpack.unpackb(b, strict_map_key=False)[3]) for b in blobs]
    assert names_shipped[1] < names_shipped[0] or names_shipped[1] == 0
    dec = wire.EventBatchDecoder()
    for p, b in zip(parts, blobs):
        got = dec.decode(b)
        assert got.names.names_of(got.kernels["name_id"]) == t.names.names_of(p.kernels["name_id"])
        assert np.array_equal(got.kernels["start_ns"], p.kernels["start_ns"])
    # a late subscriber misses batch 0: names unknown until the full table of batch 3
    late = wire.EventBatchDecoder()
    got1 = late.decode(blobs[1])
    assert got1.meta["names_missing"] > 0
    got3 = late.decode(blobs[3])
    assert "names_missing" not in got3.meta
    assert got3.names.names_of(got3.kernels["name_id"]) == t.names.names_of(parts[3].kernels["name_id"])


def test_a_streams_batches_share_its_name_table_rather_than_copy_it():
    """Decoding a batch of a stream costs its new names, not the stream's whole table: the
    batches of one stream share one growing table (before, each batch copied the table and
    interned it again: 36 ms a batch at 100k names, against 2.4 ms now with 2,500 new names
    a batch, 0.25 ms with none). What an earlier batch holds never changes: a different
    full table, or a late subscriber's gap, replaces the table instead of editing it."""
    nt = NameTable([f"k{i}" for i in range(40)])

    def part(lo, hi):
        k = np.zeros(hi - lo, dtype=ev.KERNEL_DTYPE)
        k["name_id"] = np.arange(lo, hi)
        return Trace(kernels=k, names=nt)

    enc = wire.EventBatchEncoder(full_every=4, stream=79)
    blobs = [enc.encode(part(10 * i, 10 * i + 10)) for i in range(4)] + [enc.encode(part(0, 40))]
    dec, cols = wire.EventBatchDecoder(), wire.EventBatchDecoder()
    got = [dec.decode(b) for b in blobs]
    got_cols = [cols.decode_columns(b) for b in blobs]
    # batches 0-3 grow one table; batch 4 is a full table equal to it: kept, not rebuilt
    assert all(g.names is got[0].names for g in got), [id(g.names) for g in got]
    assert all(c.names is got_cols[0].names for c in got_cols)
    for g, c, lo in zip(got, got_cols, (0, 10, 20, 30, 0)):
        want = [f"k{i}" for i in range(lo, lo + (40 if lo == 0 and g is got[4] else 10))]
        assert g.names.names_of(g.kernels["name_id"]) == want
        assert [c.names[i] for i in c.kernels["name_id"].tolist()] == want
    assert got[0].names.lookup("k25") == 25
    # a full table that differs (another numbering) replaces it: batch 0 still reads its names
    other = wire.EventBatchEncoder(full_every=4, stream=79)
    renamed = NameTable([f"r{i}" for i in range(40)])
    k = np.zeros(3, dtype=ev.KERNEL_DTYPE)
    k["name_id"] = [2, 1, 0]
    g5 = dec.decode(other.encode(Trace(kernels=k, names=renamed)))
    assert g5.names is not got[0].names and g5.names.names_of(g5.kernels["name_id"]) == ["r2", "r1", "r0"]
    assert got[0].names.names_of(got[0].kernels["name_id"]) == [f"k{i}" for i in range(10)]
    # a subscriber that joined late fills the gap with unknown names in a new table
    late = wire.EventBatchDecoder()
    g1 = late.decode(blobs[1])
    assert g1.meta["names_missing"] == 10 and g1.names.names_of(g1.kernels["name_id"]) == [f"k{i}" for i in range(10, 20)]
    g2 = late.decode(blobs[2])
    assert g2.names is not g1.names and g1.names.names_of(g1.kernels["name_id"]) == [f"k{i}" for i in range(10, 20)]


def test_cpu_op_causal_flag_column_travels_and_is_unknown_from_an_older_encoder():
    """cpu_ops.is_causal is column 29 (appended to schema 1): it round-trips, and a batch
    written before it (no column 29) decodes with the flag unknown (-1)."""
    tr = _literal_trace()
    assert wire.decode_event_batch(wire.encode_event_batch(tr)).cpu_ops["is_causal"].tolist() == [1]
    old_dtype = np.dtype([(f, tr.cpu_ops.dtype[f]) for f in tr.cpu_ops.dtype.names if f != "is_causal"])
    old = np.zeros(len(tr.cpu_ops), dtype=old_dtype)
    for f in old_dtype.names:
        old[f] = tr.cpu_ops[f]
    back = wire.decode_event_batch(wire.encode_event_batch(dataclasses.replace(tr, cpu_ops=old)))
    assert back.cpu_ops["is_causal"].tolist() == [-1]
    assert back.cpu_ops["input_dims_id"].tolist() != [] and back.names[int(back.cpu_ops["name_id"][0])] == \
        tr.names[int(tr.cpu_ops["name_id"][0])]

def _regenerate():
    for name, make in GOLDEN.items():
        (DATA / name).write_bytes(make())
        print("wrote", DATA / name)


if __name__ == "__main__" and "--regenerate" in sys.argv:
    _regenerate()


# ------------------------------------------------------- columns (the Parquet writer's decode)

def _same_as_rows(trace: Trace, cols) -> None:
    """decode_columns' batch holds exactly decode's rows: every field, contiguous, of the
    field's type, and the same name table."""
    for kind in wire.KINDS:
        rows, c = getattr(trace, kind), getattr(cols, kind)
        assert len(c) == len(rows) and c.dtype == rows.dtype, kind
        for f in rows.dtype.names:
            assert c[f].dtype == rows.dtype[f] and c[f].flags.c_contiguous, (kind, f)
            assert np.array_equal(c[f], rows[f]), (kind, f)
        assert set(c.fields) == set(rows.dtype.names), kind
    assert cols.names == trace.names.strings
    assert cols.meta == trace.meta
    assert [(d.index, d.name) for d in cols.devices] == [(d.index, d.name) for d in trace.devices]


@pytest.mark.parametrize("name", TRACES)
def test_columns_decode_gives_the_rows_of_the_row_decode_on_real_traces(name, trace_path):
    from ridgeline.probes.kineto import load_trace
    t = load_trace(trace_path(name))
    blob = wire.encode_event_batch(t)
    _same_as_rows(wire.EventBatchDecoder().decode(blob), wire.EventBatchDecoder().decode_columns(blob))


def test_columns_decode_of_the_golden_batch_and_an_older_encoder_is_the_row_decode():
    blob = (DATA / "wire_event_batch_v1.bin").read_bytes()
    _same_as_rows(wire.EventBatchDecoder().decode(blob), wire.EventBatchDecoder().decode_columns(blob))
    tr = _literal_trace()     # no column 29: is_causal filled as unknown, as the rows are
    old_dtype = np.dtype([(f, tr.cpu_ops.dtype[f]) for f in tr.cpu_ops.dtype.names if f != "is_causal"])
    old = np.zeros(len(tr.cpu_ops), dtype=old_dtype)
    for f in old_dtype.names:
        old[f] = tr.cpu_ops[f]
    blob = wire.encode_event_batch(dataclasses.replace(tr, cpu_ops=old))
    cols = wire.EventBatchDecoder().decode_columns(blob)
    assert cols.cpu_ops["is_causal"].tolist() == [-1]
    _same_as_rows(wire.EventBatchDecoder().decode(blob), cols)


def test_columns_decode_follows_a_stateful_stream_as_the_row_decode(trace_path):
    """Both decoders of one stream, joined late: the same names (missing ones too), batch
    by batch, and the same snapshot for a journal."""
    from ridgeline.probes.kineto import load_trace
    t = load_trace(trace_path(TRACES[2]))
    parts = [Trace(kernels=t.kernels[i:i + 300], names=t.names) for i in range(0, len(t.kernels), 300)]
    enc = wire.EventBatchEncoder(full_every=3, stream=78)
    blobs = [enc.encode(p) for p in parts]
    rows_dec, cols_dec = wire.EventBatchDecoder(), wire.EventBatchDecoder()
    for b in blobs[1:]:
        _same_as_rows(rows_dec.decode(b), cols_dec.decode_columns(b))
    assert rows_dec.snapshot() == cols_dec.snapshot()


def test_columns_decode_rejects_what_the_row_decode_rejects():
    batch = (DATA / "wire_event_batch_v1.bin").read_bytes()
    m = msgpack.unpackb(batch, strict_map_key=False)
    bad = [batch[:-7]]
    m2 = dict(m)
    m2[8] = dict(m[8])
    m2[8][3] = b"not zlib at all"
    bad.append(msgpack.packb(m2))
    m2[8][3] = zlib.compress(b"\x00" * 10)
    m2[8][4] = 10
    bad.append(msgpack.packb(m2))
    m3 = dict(m)
    m3[3] = m[3][:2]
    m3[4] = 2
    bad.append(msgpack.packb(m3))
    for col, base in ((0, 2**63), (2, 2**64 - 1), (6, 2**63)):
        # a raw delta column, a constant and a duration column: uint64 and beyond on the
        # wire raised numpy's OverflowError, which no reader of the stream catches
        m4 = dict(m)
        m4[8] = dict(m[8])
        m4[8][2] = [list(c) for c in m[8][2]]
        m4[8][2][col][3] = base
        bad.append(msgpack.packb(m4))
    for blob in bad:
        with pytest.raises(InputError) as rows_err:
            wire.EventBatchDecoder().decode(blob)
        with pytest.raises(InputError) as cols_err:
            wire.EventBatchDecoder().decode_columns(blob)
        assert str(cols_err.value) == str(rows_err.value)
