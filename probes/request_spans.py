"""The engines' per-request OpenTelemetry spans, decoded into one typed record.

Contract:

* :class:`RequestSpan` is the record every later stage reads: one served request, its
  times in nanoseconds (``*_ns``), its token counts (``*_tokens``), the engine it came
  from. Fields an engine did not send are ``-1`` (never guessed here).
* :func:`decode_protobuf` reads an OTLP ``ExportTraceServiceRequest`` with the real
  schema (``opentelemetry-proto``'s generated module); :func:`decode_json` reads the
  OTLP/JSON form (camelCase field names, ids as hex, 64-bit integers as strings, per
  the OTLP specification's JSON mapping) through msgspec Structs. Both return
  ``(spans, SpanStats)``: the request spans recognised, and counts of what was seen,
  ignored (a span that is no engine's request span) and cut (attributes over
  ``max_attributes`` per span or over ``max_attribute_bytes`` long are dropped, counted).
  Malformed input raises :class:`SpanDecodeError` with one line.
* Attribute names are the engines' own: vLLM's ``SpanAttributes`` (``vllm/tracing.py``,
  values unchanged since tracing appeared: the ``gen_ai.*`` names), SGLang's request root
  span (``python/sglang/srt/tracing/trace.py``: ``trace_req_start`` names it
  ``"{role} Req {rid[:8]}"`` with the attribute ``rid``; its stage slices are child spans;
  later releases also set the ``gen_ai.*`` names on it, and it stays SGLang's record).
  tests/test_request_spans.py names the commits these were read at.
* Preemption: the record carries the request's pauses (:attr:`RequestSpan.pauses`),
  from vLLM's journey events (PREEMPTED until SCHEDULED/RESUME) or SGLang's marks
  (``retract`` until the next ``schedule`` event or prefill slice), clipped to the
  request's life, disjoint, at most :data:`MAX_PAUSES`.
"""
from __future__ import annotations

import bisect
import math

import msgspec

# vLLM SpanAttributes (vllm/tracing.py, class SpanAttributes): the names used here.
VLLM_REQUEST_ID = "gen_ai.request.id"
VLLM_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
VLLM_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
VLLM_MODEL = "gen_ai.response.model"
VLLM_QUEUE_S = "gen_ai.latency.time_in_queue"
VLLM_TTFT_S = "gen_ai.latency.time_to_first_token"
VLLM_E2E_S = "gen_ai.latency.e2e"
VLLM_PREFILL_S = "gen_ai.latency.time_in_model_prefill"
VLLM_DECODE_S = "gen_ai.latency.time_in_model_decode"
VLLM_INFERENCE_S = "gen_ai.latency.time_in_model_inference"
#: vLLM's journey events (later releases) carry the request's preemption count.
VLLM_NUM_PREEMPTIONS = "num_preemptions"
#: vLLM's journey events: span events named ``journey.<RequestJourneyEventType name>``
#: (vllm/tracing.py at 03b8a674; the types in vllm/v1/core/sched/journey_events.py at
#: e3b3acf1: PREEMPTED moves a request out of RUNNING, SCHEDULED with ``schedule.kind``
#: RESUME moves it back), each stamped with its epoch time.
VLLM_JOURNEY_PREEMPTED = "journey.PREEMPTED"
VLLM_JOURNEY_SCHEDULED = "journey.SCHEDULED"
VLLM_SCHEDULE_KIND = "schedule.kind"
VLLM_SCHEDULE_RESUME = "RESUME"
#: SGLang: the root span of a request carries its id as ``rid``.
SGLANG_RID = "rid"
#: SGLang's retraction (its preemption) and scheduling marks: ``SchedulerReqTimeStats``
#: (python/sglang/srt/observability/req_time_stats.py at 00ce49e0) calls
#: ``trace_event("retract", 1, ts)`` when a retracted request re-enters the waiting queue
#: and ``trace_event("schedule", 3, ts)`` each time it is scheduled; ``trace_event``
#: (python/sglang/srt/observability/trace.py at 02a58088) attaches a cached event to the
#: request's slice span whose time holds it, or to its thread span: both under the root.
#: After a retraction the request's prefill is traced again as a slice starting when it
#: re-entered a forward step, which closes the pause too (a trace level under 3 sends no
#: "schedule" events).
SGLANG_RETRACT = "retract"
SGLANG_SCHEDULE = "schedule"
_PAUSE_EVENTS = (VLLM_JOURNEY_PREEMPTED, VLLM_JOURNEY_SCHEDULED, SGLANG_RETRACT, SGLANG_SCHEDULE)

#: Every attribute this module reads (others are dropped at decode: no memory spent).
WANTED = frozenset({VLLM_REQUEST_ID, VLLM_PROMPT_TOKENS, VLLM_COMPLETION_TOKENS, VLLM_MODEL, VLLM_QUEUE_S,
                    VLLM_TTFT_S, VLLM_E2E_S, VLLM_PREFILL_S, VLLM_DECODE_S, VLLM_INFERENCE_S, SGLANG_RID,
                    VLLM_NUM_PREEMPTIONS, VLLM_SCHEDULE_KIND})

MAX_ATTRIBUTES = 128
MAX_ATTRIBUTE_BYTES = 4096
MAX_EVENTS = 256
#: Pauses kept per request (each takes two events: a preemption and its resume).
MAX_PAUSES = MAX_EVENTS // 2
#: SGLang stage slices whose name says which segment of the request they are.
SGLANG_SEGMENTS = (("queue", "queue_ns"), ("wait", "queue_ns"), ("prefill", "prefill_ns"),
                   ("decode", "decode_ns"))


class SpanDecodeError(ValueError):
    """The body is no OTLP trace export; one line."""


class RequestSpan(msgspec.Struct, frozen=True):
    request_id: str
    engine: str                  # "vllm" | "sglang"
    start_ns: int                # arrival (span start), unix epoch ns
    end_ns: int                  # finished (span end)
    queue_ns: int = -1
    ttft_ns: int = -1
    prefill_ns: int = -1
    decode_ns: int = -1
    e2e_ns: int = -1
    prompt_tokens: int = -1
    completion_tokens: int = -1
    preemptions: int = -1
    model: str = ""
    trace_id: str = ""
    #: Time spent preempted: from each journey PREEMPTED event to the SCHEDULED (RESUME)
    #: event that put the request back to work, summed (-1: no journey events came).
    recovery_ns: int = -1
    #: The pauses themselves, ``(preempted_ns, resumed_ns)`` in time order, disjoint: the
    #: request was in no GPU step between them (the join leaves them out of its intervals).
    #: A pause never resumed ends at the span's end. At most :data:`MAX_PAUSES`.
    pauses: tuple[tuple[int, int], ...] = ()

    @property
    def first_token_ns(self) -> int:
        """When the first token came (arrival + TTFT), or -1."""
        return self.start_ns + self.ttft_ns if self.ttft_ns >= 0 else -1

    @property
    def scheduled_ns(self) -> int:
        """When the request left the queue (arrival + queue time), or -1."""
        return self.start_ns + self.queue_ns if self.queue_ns >= 0 else -1


_TIMING = ("queue_ns", "ttft_ns", "prefill_ns", "decode_ns", "e2e_ns")


def merge(a: RequestSpan, b: RequestSpan) -> RequestSpan:
    """Two spans of one request id (an engine may send the request's timings on one span
    and its journey events on another): the one with more timings known is kept, its
    unknown (-1) fields filled from the other, the preemption figures the larger of both."""
    known = lambda r: sum(getattr(r, f) >= 0 for f in _TIMING)  # noqa: E731
    base, other = (a, b) if known(a) >= known(b) else (b, a)
    fill = {f: getattr(other, f) for f in _TIMING + ("prompt_tokens", "completion_tokens")
            if getattr(base, f) < 0 <= getattr(other, f)}
    # The pauses come from one span's events (the one with the journey), never mixed.
    pauses = a.pauses if len(a.pauses) >= len(b.pauses) else b.pauses
    return msgspec.structs.replace(base, **fill, preemptions=max(a.preemptions, b.preemptions),
                                   recovery_ns=max(a.recovery_ns, b.recovery_ns), pauses=pauses,
                                   model=base.model or other.model)


class SpanStats(msgspec.Struct):
    spans_seen: int = 0
    spans_ignored: int = 0          # no engine's request span
    attributes_dropped: int = 0     # over the per-span count
    attributes_too_long: int = 0    # over the length bound
    events_dropped: int = 0

    def add(self, o: "SpanStats") -> None:
        for f in self.__struct_fields__:
            setattr(self, f, getattr(self, f) + getattr(o, f))


def _seconds_ns(v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or v > 1e7:
        return -1
    return int(round(v * 1e9))


def _count(v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or v > 2**40:
        return -1
    return int(v)


def _text(v, limit: int = 256) -> str:
    return v[:limit] if isinstance(v, str) else ""


def preemption_pauses(events: list[tuple[str, int, str]], end_ns: int) -> tuple[int, int, tuple]:
    """``(preemptions, recovery_ns, pauses)`` from a span's journey events ``(name, time_ns,
    schedule_kind)``: each PREEMPTED opens a pause that the next SCHEDULED (RESUME, or any
    SCHEDULED after a preemption) closes. A pause still open at the span's end (the
    request finished or was aborted while preempted) is not counted as recovered time,
    but it is a pause (to ``end_ns``). ``(-1, -1, ())`` when the span carries no journey
    events at all."""
    if not events:
        return -1, -1, ()
    n, total, open_at = 0, 0, -1
    pauses: list[tuple[int, int]] = []
    for name, ts, kind in sorted(events, key=lambda e: e[1]):
        if name in (VLLM_JOURNEY_PREEMPTED, SGLANG_RETRACT):
            n += 1
            if open_at < 0:
                open_at = ts
        elif open_at >= 0 and (name == SGLANG_SCHEDULE
                               or name == VLLM_JOURNEY_SCHEDULED and kind in (VLLM_SCHEDULE_RESUME, "")):
            total += max(0, ts - open_at)
            pauses.append((open_at, max(open_at, ts)))
            open_at = -1
    if open_at >= 0 and open_at < end_ns:
        pauses.append((open_at, end_ns))
    return n, total, tuple(pauses[:MAX_PAUSES])


def _clip(pauses: tuple, start_ns: int, end_ns: int) -> tuple[tuple[int, int], ...]:
    """The pauses inside the request's life, disjoint and in order (an engine's clock
    stamps and a hostile client's events alike)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(pauses):
        a, b = max(a, start_ns), min(b, end_ns)
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return tuple(out)


def to_record(name: str, start_ns: int, end_ns: int, attrs: dict, trace_id: str = "",
              preemptions: int = -1, children: list[tuple[str, int]] | None = None,
              journey: list[tuple[str, int, str]] | None = None) -> RequestSpan | None:
    """One decoded span as a :class:`RequestSpan`, or None when it is no request span."""
    if start_ns <= 0 or end_ns < start_ns:
        return None
    # SGLang's root span first: it names the request by ``rid`` and, in later releases,
    # carries vLLM's gen_ai.* names as well (gen_ai.request.id included).
    rid = attrs.get(SGLANG_RID)
    if isinstance(rid, str) and rid and " Req " in f" {name}":
        seg = {"queue_ns": -1, "prefill_ns": -1, "decode_ns": -1}
        for child, dur in children or ():
            low = child.lower()
            for word, key in SGLANG_SEGMENTS:
                if word in low:
                    seg[key] = max(seg[key], 0) + dur
                    break
        # Retractions: only a trace that carries any marks says how many (0 or more);
        # one without SGLang's events says nothing (-1).
        marks = [j for j in journey or () if j[0] in (SGLANG_RETRACT, SGLANG_SCHEDULE)]
        n_retract, recovery, pauses = preemption_pauses(marks, int(end_ns))
        # Later SGLang sets the gen_ai.* names on the root span too (request_tracing.py's
        # make_span_attrs): the token counts, the model, TTFT and e2e from there.
        e2e = _seconds_ns(attrs.get(VLLM_E2E_S))
        return RequestSpan(request_id=rid[:256], engine="sglang", start_ns=int(start_ns), end_ns=int(end_ns),
                           e2e_ns=e2e if e2e >= 0 else int(end_ns - start_ns), ttft_ns=_seconds_ns(attrs.get(VLLM_TTFT_S)),
                           prompt_tokens=_count(attrs.get(VLLM_PROMPT_TOKENS)),
                           completion_tokens=_count(attrs.get(VLLM_COMPLETION_TOKENS)),
                           model=_text(attrs.get(VLLM_MODEL)), trace_id=trace_id, preemptions=n_retract,
                           recovery_ns=recovery, pauses=_clip(pauses, int(start_ns), int(end_ns)), **seg)
    rid = attrs.get(VLLM_REQUEST_ID)
    if isinstance(rid, str) and rid:
        own = [j for j in journey or () if j[0] in (VLLM_JOURNEY_PREEMPTED, VLLM_JOURNEY_SCHEDULED)]
        n_journey, recovery, pauses = preemption_pauses(own, int(end_ns))
        # The events' own count wins over the counter attribute only when larger (an
        # event list cut at MAX_EVENTS under-counts; the attribute is the engine's).
        preemptions = max(preemptions, n_journey)
        return RequestSpan(
            request_id=rid[:256], engine="vllm", start_ns=int(start_ns), end_ns=int(end_ns),
            queue_ns=_seconds_ns(attrs.get(VLLM_QUEUE_S)), ttft_ns=_seconds_ns(attrs.get(VLLM_TTFT_S)),
            prefill_ns=_seconds_ns(attrs.get(VLLM_PREFILL_S)), decode_ns=_seconds_ns(attrs.get(VLLM_DECODE_S)),
            e2e_ns=_seconds_ns(attrs.get(VLLM_E2E_S)), prompt_tokens=_count(attrs.get(VLLM_PROMPT_TOKENS)),
            completion_tokens=_count(attrs.get(VLLM_COMPLETION_TOKENS)), preemptions=preemptions,
            model=_text(attrs.get(VLLM_MODEL)), trace_id=trace_id, recovery_ns=recovery,
            pauses=_clip(pauses, int(start_ns), int(end_ns)))
    return None


# -- protobuf ----------------------------------------------------------------------------
def _pb_value(v, max_bytes: int, stats: SpanStats):
    kind = v.WhichOneof("value")
    if kind == "string_value":
        s = v.string_value
        if len(s) > max_bytes:
            stats.attributes_too_long += 1
            return None
        return s
    if kind in ("int_value", "double_value", "bool_value"):
        return getattr(v, kind)
    return None      # arrays, maps, bytes: no request field is one


def _pb_attrs(kvs, max_attributes: int, max_bytes: int, stats: SpanStats) -> dict:
    out = {}
    n = len(kvs)
    if n > max_attributes:
        stats.attributes_dropped += n - max_attributes
    for i in range(min(n, max_attributes)):
        kv = kvs[i]
        if kv.key in WANTED:
            val = _pb_value(kv.value, max_bytes, stats)
            if val is not None:
                out[kv.key] = val
    return out


def trace_service_pb2():
    """OTLP's trace service messages (the request and its response)."""
    # Imported on first use: a daemon that never receives spans never loads protobuf.
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    return trace_service_pb2


def decode_protobuf(body: bytes, max_attributes: int = MAX_ATTRIBUTES,
                    max_attribute_bytes: int = MAX_ATTRIBUTE_BYTES) -> tuple[list[RequestSpan], SpanStats]:
    from google.protobuf.message import DecodeError
    pb = trace_service_pb2()
    msg = pb.ExportTraceServiceRequest()
    try:
        msg.ParseFromString(body)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise SpanDecodeError(f"not an OTLP ExportTraceServiceRequest: {str(exc)[:120]}") from None
    stats = SpanStats()
    raw = []
    for rs in msg.resource_spans:
        for ss in rs.scope_spans:
            for sp in ss.spans:
                stats.spans_seen += 1
                attrs = _pb_attrs(sp.attributes, max_attributes, max_attribute_bytes, stats)
                pre = -1
                nev = len(sp.events)
                if nev > MAX_EVENTS:
                    stats.events_dropped += nev - MAX_EVENTS
                journey = []
                for i in range(min(nev, MAX_EVENTS)):
                    ev = sp.events[i]
                    ea = _pb_attrs(ev.attributes, max_attributes, max_attribute_bytes, stats)
                    pre = max(pre, _count(ea.get(VLLM_NUM_PREEMPTIONS)))
                    if ev.name in _PAUSE_EVENTS:
                        journey.append((ev.name, int(ev.time_unix_nano), _text(ea.get(VLLM_SCHEDULE_KIND), 16)))
                raw.append((sp.name[:256], int(sp.start_time_unix_nano), int(sp.end_time_unix_nano), attrs,
                            sp.trace_id.hex(), sp.span_id.hex(), sp.parent_span_id.hex(), pre, journey))
    return _records(raw, stats), stats


def _sglang_marks(retracts: list[int], schedules: list[int]) -> list[tuple[str, int, str]]:
    """The marks :func:`preemption_pauses` needs of a root's descendants: its retractions
    (at most MAX_EVENTS) and, for each, the first schedule mark after it (a request's
    per-token ``schedule`` events are thousands; one closes a pause). A trace with marks
    but no retraction gives one schedule mark: "0 preemptions", not "not said"."""
    r = sorted(retracts)[:MAX_EVENTS]
    if not r:
        return [(SGLANG_SCHEDULE, min(schedules), "")] if schedules else []
    best: list[int | None] = [None] * len(r)
    for t in schedules:
        k = bisect.bisect_right(r, t) - 1
        if k >= 0 and (best[k] is None or t < best[k]):
            best[k] = t
    return [(SGLANG_RETRACT, t, "") for t in r] + [(SGLANG_SCHEDULE, t, "") for t in best if t is not None]


def _records(raw: list, stats: SpanStats) -> list[RequestSpan]:
    # SGLang's stage slices are children (or grandchildren, under the thread span) of the
    # request's root span, in the same export when its batch processor sent them together;
    # so are its retract/schedule events (on the slices and thread spans), and a prefill
    # slice's start marks the request back in a forward step.
    parent = {r[5]: r[6] for r in raw}
    children: dict[str, list[tuple[str, int]]] = {}
    retracts: dict[str, list[int]] = {}
    schedules: dict[str, list[int]] = {}
    for name, s, e, _a, _t, _sid, pid, _p, journey in raw:
        rt = [j[1] for j in journey if j[0] == SGLANG_RETRACT]
        sc = [j[1] for j in journey if j[0] == SGLANG_SCHEDULE]
        if "prefill" in name.lower():
            sc.append(s)
        seen = 0
        while pid and seen < 4:
            children.setdefault(pid, []).append((name, max(0, e - s)))
            if rt:
                retracts.setdefault(pid, []).extend(rt)
            if sc:
                schedules.setdefault(pid, []).extend(sc)
            pid = parent.get(pid, "")
            seen += 1
    out = []
    for name, s, e, attrs, tid, sid, _pid, pre, journey in raw:
        marks = _sglang_marks(retracts.get(sid, []), schedules.get(sid, []))
        rec = to_record(name, s, e, attrs, tid, pre, children.get(sid), journey + marks)
        if rec is None:
            stats.spans_ignored += 1
        else:
            out.append(rec)
    return out


# -- JSON (OTLP/JSON mapping) -------------------------------------------------------------
class _JValue(msgspec.Struct, omit_defaults=True):
    stringValue: str | None = None
    intValue: int | str | None = None
    doubleValue: float | str | None = None
    boolValue: bool | None = None


class _JKeyValue(msgspec.Struct):
    key: str = ""
    value: _JValue = msgspec.field(default_factory=_JValue)


class _JEvent(msgspec.Struct):
    name: str = ""
    timeUnixNano: int | str = 0
    attributes: list[_JKeyValue] = []


class _JSpan(msgspec.Struct):
    traceId: str = ""
    spanId: str = ""
    parentSpanId: str = ""
    name: str = ""
    startTimeUnixNano: int | str = 0
    endTimeUnixNano: int | str = 0
    attributes: list[_JKeyValue] = []
    events: list[_JEvent] = []


class _JScopeSpans(msgspec.Struct):
    spans: list[_JSpan] = []


class _JResourceSpans(msgspec.Struct):
    scopeSpans: list[_JScopeSpans] = []


class _JExport(msgspec.Struct):
    resourceSpans: list[_JResourceSpans] = []


_JSON = msgspec.json.Decoder(_JExport)


def _jnum(v):
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            try:
                return float(v)
            except ValueError:
                return None
    return v


def _j_attrs(kvs: list[_JKeyValue], max_attributes: int, max_bytes: int, stats: SpanStats) -> dict:
    out = {}
    if len(kvs) > max_attributes:
        stats.attributes_dropped += len(kvs) - max_attributes
    for kv in kvs[:max_attributes]:
        if kv.key not in WANTED:
            continue
        v = kv.value
        if v.stringValue is not None:
            if len(v.stringValue) > max_bytes:
                stats.attributes_too_long += 1
                continue
            out[kv.key] = v.stringValue
        elif v.intValue is not None:
            n = _jnum(v.intValue)
            if isinstance(n, int):
                out[kv.key] = n
        elif v.doubleValue is not None:
            n = _jnum(v.doubleValue)
            if isinstance(n, (int, float)):
                out[kv.key] = float(n)
        elif v.boolValue is not None:
            out[kv.key] = v.boolValue
    return out


def decode_json(body: bytes, max_attributes: int = MAX_ATTRIBUTES,
                max_attribute_bytes: int = MAX_ATTRIBUTE_BYTES) -> tuple[list[RequestSpan], SpanStats]:
    try:
        msg = _JSON.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise SpanDecodeError(f"not an OTLP/JSON trace export: {str(exc)[:120]}") from None
    stats = SpanStats()
    raw = []
    for rs in msg.resourceSpans:
        for ss in rs.scopeSpans:
            for sp in ss.spans:
                stats.spans_seen += 1
                attrs = _j_attrs(sp.attributes, max_attributes, max_attribute_bytes, stats)
                pre = -1
                if len(sp.events) > MAX_EVENTS:
                    stats.events_dropped += len(sp.events) - MAX_EVENTS
                journey = []
                for ev in sp.events[:MAX_EVENTS]:
                    ea = _j_attrs(ev.attributes, max_attributes, max_attribute_bytes, stats)
                    pre = max(pre, _count(ea.get(VLLM_NUM_PREEMPTIONS)))
                    if ev.name in _PAUSE_EVENTS:
                        t = _jnum(ev.timeUnixNano)
                        journey.append((ev.name, t if isinstance(t, int) else 0,
                                        _text(ea.get(VLLM_SCHEDULE_KIND), 16)))
                s, e = _jnum(sp.startTimeUnixNano), _jnum(sp.endTimeUnixNano)
                raw.append((sp.name[:256], s if isinstance(s, int) else 0, e if isinstance(e, int) else 0,
                            attrs, sp.traceId[:64].lower(), sp.spanId[:32].lower(), sp.parentSpanId[:32].lower(),
                            pre, journey))
    return _records(raw, stats), stats
