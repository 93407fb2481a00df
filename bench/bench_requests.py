"""The request join's costs: OTLP span decoding against the bare parse, and the per-window join.

    .venv/bin/python bench/bench_requests.py [--spans 2000]

1. Decoding an OTLP export of ``--spans`` vLLM request spans (the attributes of
   ``vllm/tracing.py``) into ``RequestSpan`` records, protobuf and JSON, against the
   physical floor measured side by side: the bare parse of the same body
   (``ExportTraceServiceRequest.ParseFromString``; ``orjson.loads`` for JSON). Spans per
   second of one core (process time, median of 5) and the ratio to the floor.
2. One window close of the agent's request history (``aggregator.request_history``)
   over 120 s of steps (one every 7 ms) and requests, for several numbers of requests due
   in the window: CPU seconds per close (median of 5) and that share of a 1 s window.
Prints markdown tables.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import orjson  # noqa: E402

from ridgeline.aggregator.request_history import HELD_DTYPE, MAX_JOIN_PER_WINDOW, RequestHistory  # noqa: E402
from ridgeline.probes import request_spans as rs  # noqa: E402
from ridgeline.probes.request_spans import RequestSpan  # noqa: E402


def _median_s(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return max(statistics.median(times), 1e-9)


def export_bodies(n: int) -> tuple[bytes, bytes]:
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    msg = trace_service_pb2.ExportTraceServiceRequest()
    ss = msg.resource_spans.add().scope_spans.add()
    spans_json = []
    for i in range(n):
        sp = ss.spans.add()
        sp.trace_id, sp.span_id, sp.name = i.to_bytes(16, "big"), (i + 1).to_bytes(8, "big"), "llm_request"
        sp.start_time_unix_nano, sp.end_time_unix_nano = 10**18 + i, 10**18 + i + 3 * 10**9
        attrs = {rs.VLLM_REQUEST_ID: f"cmpl-{i:08d}", rs.VLLM_MODEL: "meta-llama/Llama-3.1-8B-Instruct",
                 rs.VLLM_PROMPT_TOKENS: 512, rs.VLLM_COMPLETION_TOKENS: 256, rs.VLLM_QUEUE_S: 0.01,
                 rs.VLLM_TTFT_S: 0.05, rs.VLLM_E2E_S: 3.0, rs.VLLM_PREFILL_S: 0.04, rs.VLLM_DECODE_S: 2.95,
                 rs.VLLM_INFERENCE_S: 2.99, "gen_ai.request.temperature": 0.7, "gen_ai.request.top_p": 1.0,
                 "gen_ai.request.max_tokens": 256, "gen_ai.request.n": 1}
        jattrs = []
        for k, v in attrs.items():
            kv = sp.attributes.add()
            kv.key = k
            if isinstance(v, str):
                kv.value.string_value = v
                jattrs.append({"key": k, "value": {"stringValue": v}})
            elif isinstance(v, int):
                kv.value.int_value = v
                jattrs.append({"key": k, "value": {"intValue": str(v)}})
            else:
                kv.value.double_value = v
                jattrs.append({"key": k, "value": {"doubleValue": v}})
        spans_json.append({"traceId": sp.trace_id.hex(), "spanId": sp.span_id.hex(), "name": sp.name,
                           "startTimeUnixNano": str(sp.start_time_unix_nano),
                           "endTimeUnixNano": str(sp.end_time_unix_nano), "attributes": jattrs})
    js = orjson.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans_json}]}]})
    return msg.SerializeToString(), js


def decode_table(n: int) -> list[str]:
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    pb, js = export_bodies(n)
    assert len(rs.decode_protobuf(pb)[0]) == n and len(rs.decode_json(js)[0]) == n
    floor_pb = _median_s(lambda: trace_service_pb2.ExportTraceServiceRequest().ParseFromString(pb))
    ours_pb = _median_s(lambda: rs.decode_protobuf(pb))
    floor_js = _median_s(lambda: orjson.loads(js))
    ours_js = _median_s(lambda: rs.decode_json(js))
    rows = ["| encoding | body bytes/span | bare parse spans/s (floor) | decode to RequestSpan spans/s | ratio to floor |",
            "|---|---:|---:|---:|---:|"]
    for name, body, f, o in (("protobuf", pb, floor_pb, ours_pb), ("JSON", js, floor_js, ours_js)):
        rows.append(f"| {name} | {len(body) / n:.0f} | {n / f:,.0f} | {n / o:,.0f} | {o / f:.1f}x |")
    return rows


def join_table() -> list[str]:
    rng = np.random.default_rng(0)
    t_end = 120 * 10**9
    st = np.arange(0, t_end, 7_000_000, dtype=np.int64)
    held = np.zeros(len(st), HELD_DTYPE)
    held["start_ns"], held["end_ns"], held["phase"] = st, st + 6_500_000, 2
    rows = ["| requests due in the window | requests held | steps held | CPU s per close | share of a 1 s window |",
            "|---:|---:|---:|---:|---:|"]
    for due in sorted({4, 16, 64, MAX_JOIN_PER_WINDOW, 2 * MAX_JOIN_PER_WINDOW}):
        reqs = []
        # requests of 2-4 s, their ends spread over the history; `due` end in the last second
        n_old = 600
        for i in range(n_old + due):
            end = int(rng.uniform(5e9, t_end - 1.5e9)) if i < n_old else int(t_end - 1e9 - rng.uniform(0, 0.9e9))
            d = int(rng.uniform(2e9, 4e9))
            reqs.append(RequestSpan(f"r{i}", "vllm", end - d, end, queue_ns=1_000_000, ttft_ns=20_000_000,
                                    prompt_tokens=int(rng.integers(100, 3000)), completion_tokens=int(d / 7e6)))

        def one():
            h = RequestHistory(history_s=120, join_delay_s=0)
            h.add_steps(held)
            h.add_requests(reqs[:n_old])
            h._told.update((r.request_id, None) for r in reqs[:n_old])     # already told
            h.add_requests(reqs[n_old:])
            t = time.process_time()
            _w, told = h.close(t_end)
            assert len(told) == min(due, MAX_JOIN_PER_WINDOW)
            return time.process_time() - t
        one()       # warm (numpy's lazy imports)
        cpu = statistics.median(one() for _ in range(5))
        rows.append(f"| {due} | {n_old + due} | {len(held):,} | {cpu:.3f} | {cpu:.1%} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spans", type=int, default=2000)
    a = ap.parse_args()
    print("\n".join(decode_table(a.spans)))
    print()
    print("\n".join(join_table()))
    print("\nReproduce: .venv/bin/python bench/bench_requests.py" + (f" --spans {a.spans}" if a.spans != 2000 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
