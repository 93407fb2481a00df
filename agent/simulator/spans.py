"""The simulated engine's per-request spans, sent as vLLM sends them: through the real
OpenTelemetry SDK and its OTLP/HTTP protobuf exporter.

vLLM (``vllm/v1/engine/output_processor.py``, ``do_tracing``) opens one span per finished
request named ``llm_request``, kind SERVER, starting at the request's arrival, with the
``SpanAttributes`` of ``vllm/tracing.py`` (``gen_ai.request.id``,
``gen_ai.usage.prompt_tokens``, ``gen_ai.usage.completion_tokens``,
``gen_ai.latency.time_in_queue``, ``.time_to_first_token``, ``.e2e``,
``.time_in_model_prefill``, ``.time_in_model_decode``, ``.time_in_model_inference``, in
seconds); :class:`RequestSpanEmitter` does the same for a simulated request.

The SDK and exporter are the optional extra ``otlp`` (``pip install ridgeline[otlp]``);
without them :class:`RequestSpanEmitter` raises :class:`SpansUnavailable` with the hint.
"""
from __future__ import annotations

from ridgeline.probes import request_spans as rs

SPAN_NAME = "llm_request"


class SpansUnavailable(RuntimeError):
    """The OpenTelemetry SDK or its OTLP exporter is not installed."""


class RequestSpanEmitter:
    """``emit(...)`` one finished request; ``close()`` flushes and stops the exporter.
    ``batch=False`` exports each span as it ends (tests); the default batches them as a
    served engine's BatchSpanProcessor does (bounded queue: spans past it are dropped by
    the SDK)."""

    def __init__(self, endpoint: str, batch: bool = True, service_name: str = "ridgeline-simulated-vllm",
                 model: str = ""):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace import SpanKind
        except ImportError as exc:
            raise SpansUnavailable(f"the OpenTelemetry SDK and OTLP exporter are not installed ({exc}); "
                                   "install the extra: pip install 'ridgeline[otlp]'") from None
        self._kind = SpanKind.SERVER
        self.model = model
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=2)
        proc = (BatchSpanProcessor(exporter, max_queue_size=4096, schedule_delay_millis=500) if batch
                else SimpleSpanProcessor(exporter))
        self.provider.add_span_processor(proc)
        self.tracer = self.provider.get_tracer("vllm.tracing")
        self.emitted = 0

    def emit(self, request_id: str, arrival_ns: int, scheduled_ns: int, first_token_ns: int, end_ns: int,
             prompt_tokens: int, completion_tokens: int, preemptions: int | None = None,
             pauses: tuple | list = ()) -> None:
        """One span. With ``preemptions`` or ``pauses`` ((preempted_ns, resumed_ns) pairs; one
        resumed at or after ``end_ns`` was never resumed) it carries the request's journey
        events as vLLM's scheduler sends them (``journey.<RequestJourneyEventType>``, with
        ``event.type``, ``num_preemptions`` and, on SCHEDULED, ``schedule.kind``
        FIRST/RESUME: vllm/tracing.py at 03b8a674, vllm/v1/core/sched/journey_events.py at
        e3b3acf1)."""
        s = 1e-9
        attrs = {rs.VLLM_REQUEST_ID: request_id, rs.VLLM_PROMPT_TOKENS: int(prompt_tokens),
                 rs.VLLM_COMPLETION_TOKENS: int(completion_tokens),
                 rs.VLLM_QUEUE_S: max(0, scheduled_ns - arrival_ns) * s,
                 rs.VLLM_TTFT_S: max(0, first_token_ns - arrival_ns) * s, rs.VLLM_E2E_S: max(0, end_ns - arrival_ns) * s,
                 rs.VLLM_PREFILL_S: max(0, first_token_ns - scheduled_ns) * s,
                 rs.VLLM_DECODE_S: max(0, end_ns - first_token_ns) * s,
                 rs.VLLM_INFERENCE_S: max(0, end_ns - scheduled_ns) * s}
        if self.model:
            attrs[rs.VLLM_MODEL] = self.model
        span = self.tracer.start_span(SPAN_NAME, kind=self._kind, start_time=int(arrival_ns), attributes=attrs)
        if preemptions is not None or pauses:
            def event(kind: str, ts: int, n: int, sched: str = "") -> None:
                a = {"event.type": kind, rs.VLLM_NUM_PREEMPTIONS: n}
                if sched:
                    a[rs.VLLM_SCHEDULE_KIND] = sched
                span.add_event(f"journey.{kind}", a, timestamp=int(ts))
            event("QUEUED", arrival_ns, 0)
            event("SCHEDULED", scheduled_ns, 0, "FIRST")
            for i, (a, b) in enumerate(pauses):
                event("PREEMPTED", a, i + 1)
                if b < end_ns:
                    event("SCHEDULED", b, i + 1, rs.VLLM_SCHEDULE_RESUME)
            event("FINISHED", end_ns, int(preemptions if preemptions is not None else len(pauses)))
        span.end(end_time=int(end_ns))
        self.emitted += 1

    def close(self) -> None:
        self.provider.shutdown()
