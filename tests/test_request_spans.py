"""The engines' request spans decoded (probes.request_spans), against their real source.

vLLM, ``vllm/tracing.py``, ``class SpanAttributes``, read at these commits of
github.com/vllm-project/vllm (the attribute values below are the source's, verbatim):

* 91310096deedb007defd3f019a7058ac4e8587d9: the names used here, with
  ``GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL/DECODE/INFERENCE`` (added after the first
  releases with tracing) and ``OTEL_TRACES_EXPORTER`` handling;
* 03b8a674ec7e654ab285df6f013a53a24381f941: the same names plus the journey-event names
  (``JOURNEY_NUM_PREEMPTIONS = "num_preemptions"``, events named ``journey.<TYPE>``);
* e3b3acf1604e1631799cdc73e8aef6cc18ad8303, ``vllm/v1/core/sched/journey_events.py``: the
  journey event types (``RequestJourneyEventType``: QUEUED=1, SCHEDULED=2, FIRST_TOKEN=3,
  PREEMPTED=4, FINISHED=5; ``ScheduleKind``: FIRST=1, RESUME=2 "Resumed after preemption
  (PREEMPTED -> RUNNING)"), emitted as span events ``journey.<type name>`` stamped with
  ``time.time_ns()`` and the attributes ``event.type``, ``schedule.kind`` (03b8a674's
  ``JOURNEY_EVENT_TYPE``/``JOURNEY_SCHEDULE_KIND``);
* an older stored version (no prefill/decode/inference attributes, forward/execute
  split over two lines): the same values for every name it has.
The request span is named ``llm_request`` (vLLM's output processor, SERVER kind).

SGLang, ``python/sglang/srt/tracing/trace.py`` at
021a89235fcc8d4bff2069b2530ad34886974c04: ``trace_req_start`` opens the request's root
span named ``f"{role} Req {orig_rid[:8]}"`` with ``attrs = {"rid": orig_rid}``; stage
slices (``trace_slice_start(name, rid)``) are children of the per-thread span under it.
Later SGLang: ``python/sglang/srt/observability/trace.py`` at
02a580880ee625d1d4a8c317ad913dcc0506cf79 (the same root span and slices; ``trace_event``
caches events onto the slice holding them or the thread span),
``python/sglang/srt/observability/req_time_stats.py`` at
00ce49e05c17e08f643afab34f3cdcef14935ac0 (the ``retract`` and ``schedule`` events, the
re-traced prefill after a retraction) and
``python/sglang/srt/managers/tokenizer_manager_components/request_tracing.py`` at
2d396b526f4fd2749397c0bc3f966e79f3f4ab71 (``make_span_attrs``: the gen_ai.* names on the
root span).
"""
from __future__ import annotations

import gzip

import pytest

from ridgeline.probes import request_spans as rs

# (SpanAttributes constant, value) as in vllm/tracing.py at 91310096.
VLLM_SPAN_ATTRIBUTES = {
    "GEN_AI_USAGE_COMPLETION_TOKENS": "gen_ai.usage.completion_tokens",
    "GEN_AI_USAGE_PROMPT_TOKENS": "gen_ai.usage.prompt_tokens",
    "GEN_AI_RESPONSE_MODEL": "gen_ai.response.model",
    "GEN_AI_REQUEST_ID": "gen_ai.request.id",
    "GEN_AI_LATENCY_TIME_IN_QUEUE": "gen_ai.latency.time_in_queue",
    "GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN": "gen_ai.latency.time_to_first_token",
    "GEN_AI_LATENCY_E2E": "gen_ai.latency.e2e",
    "GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL": "gen_ai.latency.time_in_model_prefill",
    "GEN_AI_LATENCY_TIME_IN_MODEL_DECODE": "gen_ai.latency.time_in_model_decode",
    "GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE": "gen_ai.latency.time_in_model_inference",
    "JOURNEY_NUM_PREEMPTIONS": "num_preemptions",   # at 03b8a674
    "JOURNEY_SCHEDULE_KIND": "schedule.kind",        # at 03b8a674
}
# RequestJourneyEventType / ScheduleKind member names (journey_events.py at e3b3acf1).
VLLM_JOURNEY_TYPES = ("QUEUED", "SCHEDULED", "FIRST_TOKEN", "PREEMPTED", "FINISHED", "DEPARTED")
VLLM_SCHEDULE_KINDS = ("FIRST", "RESUME")
OURS = {"GEN_AI_USAGE_COMPLETION_TOKENS": rs.VLLM_COMPLETION_TOKENS, "GEN_AI_USAGE_PROMPT_TOKENS": rs.VLLM_PROMPT_TOKENS,
        "GEN_AI_RESPONSE_MODEL": rs.VLLM_MODEL, "GEN_AI_REQUEST_ID": rs.VLLM_REQUEST_ID,
        "GEN_AI_LATENCY_TIME_IN_QUEUE": rs.VLLM_QUEUE_S, "GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN": rs.VLLM_TTFT_S,
        "GEN_AI_LATENCY_E2E": rs.VLLM_E2E_S, "GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL": rs.VLLM_PREFILL_S,
        "GEN_AI_LATENCY_TIME_IN_MODEL_DECODE": rs.VLLM_DECODE_S,
        "GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE": rs.VLLM_INFERENCE_S,
        "JOURNEY_NUM_PREEMPTIONS": rs.VLLM_NUM_PREEMPTIONS, "JOURNEY_SCHEDULE_KIND": rs.VLLM_SCHEDULE_KIND}


def test_attribute_names_are_vllms():
    assert OURS == VLLM_SPAN_ATTRIBUTES
    assert rs.VLLM_JOURNEY_PREEMPTED == "journey." + VLLM_JOURNEY_TYPES[3]
    assert rs.VLLM_JOURNEY_SCHEDULED == "journey." + VLLM_JOURNEY_TYPES[1]
    assert rs.VLLM_SCHEDULE_RESUME == VLLM_SCHEDULE_KINDS[1]


def sdk_spans(make):
    """Spans made by the real OpenTelemetry SDK, encoded by its real OTLP encoder."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    make(tp.get_tracer("vllm.v1.engine.output_processor"))
    return encode_spans(mem.get_finished_spans()).SerializeToString()


def vllm_request(tracer, rid="cmpl-abc", start=1_000_000_000, queue=0.25, ttft=0.4, e2e=8.0, preempt=None):
    sp = tracer.start_span("llm_request", start_time=start)
    sp.set_attributes({rs.VLLM_REQUEST_ID: rid, rs.VLLM_QUEUE_S: queue, rs.VLLM_TTFT_S: ttft, rs.VLLM_E2E_S: e2e,
                       rs.VLLM_PREFILL_S: ttft - queue, rs.VLLM_DECODE_S: e2e - ttft,
                       rs.VLLM_PROMPT_TOKENS: 100, rs.VLLM_COMPLETION_TOKENS: 500, rs.VLLM_MODEL: "m"})
    if preempt is not None:
        sp.add_event("journey.PREEMPTED", attributes={"event.type": "PREEMPTED", "num_preemptions": preempt})
    sp.end(end_time=start + int(e2e * 1e9))


def test_vllm_span_from_the_real_sdk():
    body = sdk_spans(lambda t: vllm_request(t, preempt=2))
    spans, stats = rs.decode_protobuf(body)
    assert stats.spans_seen == 1 and stats.spans_ignored == 0
    s = spans[0]
    assert (s.request_id, s.engine, s.queue_ns, s.ttft_ns, s.e2e_ns) == ("cmpl-abc", "vllm", 250_000_000,
                                                                        400_000_000, 8_000_000_000)
    assert (s.prompt_tokens, s.completion_tokens, s.preemptions, s.model) == (100, 500, 2, "m")
    assert s.first_token_ns == s.start_ns + 400_000_000


def journey_request(tracer, rid="cmpl-p", start=10**9, pauses=((2.0, 2.6), (5.0, 5.9)), resumed=True,
                    split=False):
    """A vLLM request preempted and resumed, its journey events as the scheduler emits them
    (``span.add_event(name=f"journey.{event_type.name}", attributes=..., timestamp=...)``).
    ``split``: the journey events on a second span of the same request id."""
    sp = tracer.start_span("llm_request", start_time=start)
    sp.set_attributes({rs.VLLM_REQUEST_ID: rid, rs.VLLM_QUEUE_S: 0.1, rs.VLLM_TTFT_S: 0.3, rs.VLLM_E2E_S: 8.0,
                       rs.VLLM_PROMPT_TOKENS: 100, rs.VLLM_COMPLETION_TOKENS: 500})
    ev = tracer.start_span("llm_core", start_time=start, attributes={rs.VLLM_REQUEST_ID: rid}) if split else sp

    def event(kind, t, n, sched=None):
        a = {"event.type": kind, "num_preemptions": n}
        if sched:
            a["schedule.kind"] = sched
        ev.add_event(f"journey.{kind}", attributes=a, timestamp=start + int(t * 1e9))
    event("QUEUED", 0.0, 0)
    event("SCHEDULED", 0.1, 0, "FIRST")
    for i, (p, r) in enumerate(pauses):
        event("PREEMPTED", p, i + 1)
        if resumed or i < len(pauses) - 1:
            event("SCHEDULED", r, i + 1, "RESUME")
    event("FINISHED", 8.0, len(pauses))
    if split:
        ev.end(end_time=start + 8 * 10**9)
    sp.end(end_time=start + 8 * 10**9)


def test_preemption_recovery_from_journey_events():
    spans, _ = rs.decode_protobuf(sdk_spans(lambda t: journey_request(t)))
    (s,) = spans
    assert s.preemptions == 2
    assert s.recovery_ns == pytest.approx(600_000_000 + 900_000_000, abs=1_000)


def test_a_pause_never_resumed_is_not_recovered_time():
    spans, _ = rs.decode_protobuf(sdk_spans(lambda t: journey_request(t, resumed=False)))
    (s,) = spans
    assert s.preemptions == 2 and s.recovery_ns == pytest.approx(600_000_000, abs=1_000)


def test_no_journey_events_no_recovery_and_scheduled_only_is_zero():
    spans, _ = rs.decode_protobuf(sdk_spans(lambda t: vllm_request(t)))
    assert spans[0].recovery_ns == -1 and spans[0].preemptions == -1
    spans, _ = rs.decode_protobuf(sdk_spans(lambda t: journey_request(t, pauses=())))
    assert spans[0].recovery_ns == 0 and spans[0].preemptions == 0


def test_journey_events_on_their_own_span_are_merged_into_the_request():
    from ridgeline.aggregator.request_history import RequestHistory
    spans, _ = rs.decode_protobuf(sdk_spans(lambda t: journey_request(t, split=True)))
    assert len(spans) == 2
    h = RequestHistory(join_delay_s=0)
    h.add_requests(spans)
    _w, (story,) = h.close(20 * 10**9)
    assert story.preemptions == 2 and story.recovery_ns == pytest.approx(1_500_000_000, abs=1_000)
    assert story.queue_ns == 100_000_000            # the timings kept from llm_request
    from ridgeline.aggregator.request_join import story_text
    assert story.pauses == [rs_pause(3 * 10**9, 36 * 10**8), rs_pause(6 * 10**9, 69 * 10**8)]
    assert ("preempted 2 time(s): paused 1.50 s by preemption (in no GPU step then: left out of its prefill and "
            "decode), 1.50 s to recover.") in story_text(story)


def rs_pause(a, b):
    from ridgeline.probes.records import Pause
    return Pause(a, b)


def test_the_pauses_themselves_from_journey_events():
    start = 10**9
    (s,), _ = rs.decode_protobuf(sdk_spans(lambda t: journey_request(t)))
    assert s.pauses == ((start + 2 * 10**9, start + 26 * 10**8), (start + 5 * 10**9, start + 59 * 10**8))
    # Never resumed: a pause to the span's end, not recovered time.
    (s,), _ = rs.decode_protobuf(sdk_spans(lambda t: journey_request(t, resumed=False)))
    assert s.pauses == ((start + 2 * 10**9, start + 26 * 10**8), (start + 5 * 10**9, start + 8 * 10**9))
    assert s.recovery_ns == pytest.approx(600_000_000, abs=1_000)


def test_pauses_are_clipped_to_the_request_and_disjoint():
    """A client's events in any order, overlapping, outside the span: the record keeps
    disjoint pauses inside the request's life."""
    ev = [("journey.PREEMPTED", 5, ""), ("journey.SCHEDULED", 50, "RESUME"), ("journey.PREEMPTED", 40, ""),
          ("journey.SCHEDULED", 70, "RESUME"), ("journey.PREEMPTED", 95, ""), ("journey.SCHEDULED", 400, "RESUME")]
    r = rs.to_record("llm_request", 10, 100, {rs.VLLM_REQUEST_ID: "x"}, journey=ev)
    # in time order: PREEMPTED 5 opens, PREEMPTED 40 is a second preemption inside the open
    # pause, SCHEDULED 50 closes it; SCHEDULED 70 resumes nothing; PREEMPTED 95 -> 400.
    assert r.preemptions == 3 and r.pauses == ((10, 50), (95, 100))
    many = [(n, t, "RESUME") for k in range(rs.MAX_EVENTS) for n, t in (("journey.PREEMPTED", 2 * k + 1),
                                                                       ("journey.SCHEDULED", 2 * k + 2))]
    r = rs.to_record("llm_request", 1, 10**6, {rs.VLLM_REQUEST_ID: "y"}, journey=many)
    assert len(r.pauses) == rs.MAX_PAUSES


def sglang_request(t, retract_at_ms=None, gen_ai=False):
    """An SGLang request as its tracing sends it (python/sglang/srt/observability/trace.py at
    02a58088: root span ``" Req <rid[:8]>"`` with ``rid``, a thread span under it, stage
    slices under that; ``trace_event`` caches an event and adds it to the slice whose
    [start, end) holds it, else to the thread span when it ends). The stages and events of
    ``SchedulerReqTimeStats`` (python/sglang/srt/observability/req_time_stats.py at
    00ce49e0): ``prefill_waiting`` to the first forward, ``prefill_forward``, a
    ``decode_loop`` slice per token, a ``schedule`` event each time it is scheduled; a
    retracted request re-entering the waiting queue gets the event ``retract``
    (``set_retract_time``), and its prefill is traced again from its new forward entry
    (``set_prefill_finished_time``, the retract branch)."""
    from opentelemetry import trace
    ms = 10**6
    root = t.start_span(" Req 8f3a2b1c", start_time=10**9, attributes={"rid": "8f3a2b1c9d"})
    th = t.start_span("Scheduler [TP 0] (host:abcd | pid:1)", start_time=10**9, context=trace.set_span_in_context(root))
    c2 = trace.set_span_in_context(th)

    def slice_(name, a, b, events=()):
        sl = t.start_span(name, start_time=10**9 + a * ms, context=c2)
        for ev, at in events:
            sl.add_event(ev, timestamp=10**9 + at * ms)
        sl.end(end_time=10**9 + b * ms)
    slice_("prefill_waiting", 0, 100)
    slice_("prefill_forward", 100, 300, [("schedule", 100)])
    if retract_at_ms is None:
        for k in range(10):
            slice_("decode_loop", 300 + 100 * k, 400 + 100 * k, [("schedule", 300 + 100 * k)])
    else:
        for k in range(3):
            slice_("decode_loop", 300 + 100 * k, 400 + 100 * k, [("schedule", 300 + 100 * k)])
        # retracted at 600 ms (no slice holds the event: the thread span gets it), back in
        # a forward step at 900 ms: the prefill again, then its decode
        slice_("prefill_forward", 900, 1000, [("schedule", 900)])
        for k in range(3):
            slice_("decode_loop", 1000 + 100 * k, 1100 + 100 * k, [("schedule", 1000 + 100 * k)])
        th.add_event("retract", timestamp=10**9 + retract_at_ms * ms)
    th.end(end_time=10**9 + 1300 * ms)
    if gen_ai:
        # trace_req_finish(attrs) sets make_span_attrs' names on the root
        # (python/sglang/srt/managers/tokenizer_manager_components/request_tracing.py at
        # 2d396b52: gen_ai.usage.*, gen_ai.request.id, gen_ai.response.model and the
        # gen_ai.latency.* of APIServerReqTimeStats.convert_to_gen_ai_span_attrs)
        root.set_attributes({"gen_ai.usage.completion_tokens": 10, "gen_ai.usage.prompt_tokens": 120,
                             "gen_ai.usage.cached_tokens": 0, "gen_ai.request.id": "8f3a2b1c9d",
                             "gen_ai.response.model": "qwen", "gen_ai.latency.time_to_first_token": 0.3,
                             "gen_ai.latency.e2e": 1.3, "gen_ai.latency.time_in_model_decode": 1.0})
    root.end(end_time=10**9 + 1300 * ms)


def test_sglang_root_with_gen_ai_names_stays_sglang():
    """Later SGLang puts vLLM's gen_ai.* names (gen_ai.request.id among them) on its root
    span: the record is still SGLang's, with its slices, marks and the token counts."""
    (s,), stats = rs.decode_protobuf(sdk_spans(lambda t: sglang_request(t, retract_at_ms=600, gen_ai=True)))
    assert stats.spans_ignored > 0
    assert (s.engine, s.request_id, s.prompt_tokens, s.completion_tokens, s.model) == \
        ("sglang", "8f3a2b1c9d", 120, 10, "qwen")
    assert (s.ttft_ns, s.e2e_ns, s.queue_ns) == (300 * 10**6, 1300 * 10**6, 100 * 10**6)
    assert s.preemptions == 1 and s.pauses == ((10**9 + 600 * 10**6, 10**9 + 900 * 10**6),)


def test_sglang_retraction_is_a_pause():
    (s,), _ = rs.decode_protobuf(sdk_spans(lambda t: sglang_request(t, retract_at_ms=600)))
    assert (s.engine, s.preemptions) == ("sglang", 1)
    assert s.pauses == ((10**9 + 600 * 10**6, 10**9 + 900 * 10**6),) and s.recovery_ns == 300 * 10**6
    (s,), _ = rs.decode_protobuf(sdk_spans(lambda t: sglang_request(t)))
    assert (s.preemptions, s.pauses, s.recovery_ns) == (0, (), 0)


def test_sglang_retraction_in_otlp_json():
    """The same marks in the OTLP/JSON form: a retract event on the thread span, the next
    prefill slice starting later (no schedule event: a trace level under 3)."""
    body = b"""{"resourceSpans":[{"scopeSpans":[{"spans":[
      {"spanId":"01","name":" Req abc","startTimeUnixNano":"1000000000","endTimeUnixNano":"9000000000",
       "attributes":[{"key":"rid","value":{"stringValue":"abc"}}]},
      {"spanId":"02","parentSpanId":"01","name":"Scheduler","startTimeUnixNano":"1000000000",
       "endTimeUnixNano":"9000000000","events":[{"name":"retract","timeUnixNano":"3000000000"}]},
      {"spanId":"03","parentSpanId":"02","name":"prefill_forward","startTimeUnixNano":"1100000000",
       "endTimeUnixNano":"1200000000"},
      {"spanId":"04","parentSpanId":"02","name":"prefill_forward","startTimeUnixNano":"4000000000",
       "endTimeUnixNano":"4100000000"}]}]}]}"""
    (s,), _ = rs.decode_json(body)
    assert s.preemptions == 1 and s.pauses == ((3 * 10**9, 4 * 10**9),)


def test_journey_events_in_otlp_json():
    body = b'''{"resourceSpans":[{"scopeSpans":[{"spans":[{"spanId":"01","name":"llm_request",
      "startTimeUnixNano":"1000000000","endTimeUnixNano":"9000000000",
      "attributes":[{"key":"gen_ai.request.id","value":{"stringValue":"r1"}}],
      "events":[{"name":"journey.PREEMPTED","timeUnixNano":"3000000000",
                 "attributes":[{"key":"num_preemptions","value":{"intValue":"1"}}]},
                {"name":"journey.SCHEDULED","timeUnixNano":"3250000000",
                 "attributes":[{"key":"schedule.kind","value":{"stringValue":"RESUME"}}]}]}]}]}]}'''
    (s,), _ = rs.decode_json(body)
    assert s.preemptions == 1 and s.recovery_ns == 250_000_000
    assert s.pauses == ((3_000_000_000, 3_250_000_000),)


def test_sglang_root_span_and_slices():
    def make(t):
        from opentelemetry import trace
        root = t.start_span(" Req 8f3a2b1c", start_time=10**9, attributes={"rid": "8f3a2b1c9d"})
        ctx = trace.set_span_in_context(root)
        th = t.start_span("Scheduler [TP 0] (host:abcd | pid:1)", start_time=10**9, context=ctx)
        c2 = trace.set_span_in_context(th)
        for name, a, b in (("wait_queue", 0, 100), ("prefill_forward", 100, 300), ("decode_loop", 300, 1300)):
            sl = t.start_span(name, start_time=10**9 + a * 10**6, context=c2)
            sl.end(end_time=10**9 + b * 10**6)
        th.end(end_time=10**9 + 1300 * 10**6)
        root.end(end_time=10**9 + 1300 * 10**6)
    spans, stats = rs.decode_protobuf(sdk_spans(make))
    assert stats.spans_seen == 5 and len(spans) == 1
    s = spans[0]
    assert (s.engine, s.request_id, s.queue_ns, s.prefill_ns, s.decode_ns) == ("sglang", "8f3a2b1c9d", 100 * 10**6,
                                                                             200 * 10**6, 1000 * 10**6)


def test_json_mapping_same_record():
    body = b'''{"resourceSpans":[{"resource":{},"scopeSpans":[{"scope":{"name":"vllm"},"spans":[{
      "traceId":"5B8EFFF798038103D269B633813FC60C","spanId":"EEE19B7EC3C1B174","name":"llm_request",
      "startTimeUnixNano":"1000000000","endTimeUnixNano":"9000000000","kind":2,
      "attributes":[{"key":"gen_ai.request.id","value":{"stringValue":"r1"}},
                    {"key":"gen_ai.usage.completion_tokens","value":{"intValue":"500"}},
                    {"key":"gen_ai.latency.time_in_queue","value":{"doubleValue":0.5}},
                    {"key":"other","value":{"arrayValue":{"values":[{"intValue":"1"}]}}}]}]}]}]}'''
    spans, stats = rs.decode_json(body)
    s = spans[0]
    assert (s.request_id, s.completion_tokens, s.queue_ns, s.start_ns) == ("r1", 500, 500_000_000, 10**9)
    assert s.trace_id == "5b8efff798038103d269b633813fc60c"


def test_bounds_on_attributes():
    # Built with the real schema directly: the SDK itself caps a span at 128 attributes.
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    msg = trace_service_pb2.ExportTraceServiceRequest()
    sp = msg.resource_spans.add().scope_spans.add().spans.add()
    sp.name, sp.start_time_unix_nano, sp.end_time_unix_nano = "llm_request", 10**9, 2 * 10**9
    a = sp.attributes.add()
    a.key, a.value.string_value = rs.VLLM_REQUEST_ID, "x" * 10_000
    for i in range(200):
        a = sp.attributes.add()
        a.key, a.value.int_value = f"junk.{i}", i
    spans, stats = rs.decode_protobuf(msg.SerializeToString(), max_attributes=64, max_attribute_bytes=4096)
    assert spans == [] and stats.spans_ignored == 1
    assert stats.attributes_too_long == 1 and stats.attributes_dropped == 201 - 64


@pytest.mark.parametrize("body", [b"\xff" * 64, b"\x0a\x05abc", gzip.compress(b"x", mtime=0),
                                  b"\x0a" + b"\x80" * 12])
def test_garbage_protobuf_one_line(body):
    with pytest.raises(rs.SpanDecodeError):
        rs.decode_protobuf(body)


def test_deeply_nested_protobuf_refused():
    # An AnyValue kvlist nested 10,000 deep inside a span attribute: upb's recursion limit.
    from opentelemetry.proto.common.v1 import common_pb2  # noqa: F401
    inner = b""
    for _ in range(10_000):
        # AnyValue{kvlist_value(6): KeyValueList{values(1): KeyValue{key(1)="k", value(2): inner}}}
        kv = b"\x0a\x01k" + b"\x12" + _varint(len(inner)) + inner
        kvl = b"\x0a" + _varint(len(kv)) + kv
        inner = b"\x32" + _varint(len(kvl)) + kvl
    attr = b"\x0a\x01a\x12" + _varint(len(inner)) + inner
    span = b"\x3a" + _varint(len(attr)) + attr          # Span.attributes = 9? see below
    with pytest.raises(rs.SpanDecodeError):
        rs.decode_protobuf(_export(span))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _export(span_fields: bytes) -> bytes:
    # Span.attributes is field 9 (wire type 2: tag 0x4a); ScopeSpans.spans 2; ResourceSpans.scope_spans 2;
    # ExportTraceServiceRequest.resource_spans 1.
    span_fields = b"\x4a" + span_fields[1:]
    span = b"\x12" + _varint(len(span_fields)) + span_fields
    ss = b"\x12" + _varint(len(span)) + span
    return b"\x0a" + _varint(len(ss)) + ss


def test_json_garbage_and_depth():
    for body in (b"{", b"[1,2", b'{"resourceSpans": 5}', b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(rs.SpanDecodeError):
            rs.decode_json(body)


def test_sglang_long_request_keeps_its_late_retraction():
    """A schedule event per token (thousands) never pushes a late retraction out of the
    bounded marks."""
    def make(t):
        from opentelemetry import trace
        ms = 10**6
        root = t.start_span(" Req 1234abcd", start_time=10**9, attributes={"rid": "1234abcd"})
        th = t.start_span("Scheduler", start_time=10**9, context=trace.set_span_in_context(root))
        c2 = trace.set_span_in_context(th)
        for k in range(1000):
            sl = t.start_span("decode_loop", start_time=10**9 + k * ms, context=c2)
            sl.add_event("schedule", timestamp=10**9 + k * ms)
            sl.end(end_time=10**9 + (k + 1) * ms)
        th.add_event("retract", timestamp=10**9 + 1000 * ms)
        sl = t.start_span("prefill_forward", start_time=10**9 + 1200 * ms, context=c2)
        sl.end(end_time=10**9 + 1300 * ms)
        th.end(end_time=10**9 + 1400 * ms)
        root.end(end_time=10**9 + 1400 * ms)
    (s,), _ = rs.decode_protobuf(sdk_spans(make))
    assert s.preemptions == 1 and s.pauses == ((10**9 + 1000 * 10**6, 10**9 + 1200 * 10**6),)
