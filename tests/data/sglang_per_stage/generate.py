"""Write two scrapes of an SGLang server's latency histograms, as SGLang would expose them.

Run ``python tests/data/sglang_per_stage/generate.py`` to rewrite ``scrape_t0.prom`` and
``scrape_t1.prom`` beside it. The families, HELP texts, bucket bounds and label names are
SGLang's (sources and commits in tests/data/PROVENANCE.md, "SGLang per-stage latency");
the text is rendered by prometheus_client in multiprocess mode, as SGLang serves /metrics
(``PROMETHEUS_MULTIPROC_DIR`` set before the import, a ``MultiProcessCollector`` read at
scrape time), so the layout and number formatting (``le="0.0016200000000000001"``, no
``_created`` series) are what a real server writes. The observed values are ours: the
request mix below.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="sglang-prom-")

from prometheus_client import CollectorRegistry, Histogram, generate_latest, multiprocess  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# SchedulerMetricsCollector labels of a unified (non-disaggregated) server, one scheduler
# (scheduler_metrics_mixin.py: model_name, engine_type, tp_rank, pp_rank, moe_ep_rank).
SCHED = {"model_name": MODEL, "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0}
# TokenizerMetricsCollector labels (tokenizer_manager.py: model_name, engine_type).
TOK = {"model_name": MODEL, "engine_type": "unified"}


def exponential_buckets(start: float, width: float, length: int) -> list[float]:
    """sglang/srt/observability/utils.py, same arithmetic."""
    return [start * (width ** i) for i in range(length)]


QUEUE_BUCKETS = [0.000, 0.001, 0.005, 0.010, 0.050, 0.100, 0.200, 0.500, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50,
                 60, 70, 80, 90, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800,
                 2000, 2500, 3000]
TTFT_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
E2E_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400]


def scrape() -> bytes:
    """What GET /metrics answers: a fresh registry reading the multiprocess files."""
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg)
    return generate_latest(reg)


def server():
    reg = CollectorRegistry()
    h = {
        "queue": Histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.",
                           labelnames=list(SCHED), buckets=QUEUE_BUCKETS, registry=reg),
        "stage": Histogram("sglang:per_stage_req_latency_seconds", "The latency of each stage of requests.",
                           labelnames=list(SCHED) + ["stage"],
                           buckets=exponential_buckets(start=0.001, width=1.62, length=30), registry=reg),
        "ttft": Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                          labelnames=[*TOK, "is_streaming"], buckets=TTFT_BUCKETS, registry=reg),
        "e2e": Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                         labelnames=list(TOK) + ["is_streaming"], buckets=E2E_BUCKETS, registry=reg),
    }
    return reg, h


def request(h, *, process_s, queue_s, prefill_s, chunks_s, ttft_s, e2e_s, streaming):
    """One finished request, observed where SGLang observes it (req_time_stats.py): the
    scheduler's request_process at wait-queue entry, queue_time at forward entry (the
    prefill_waiting stage is not observed: it equals queue_time), chunked_prefill per
    chunk, prefill_forward once when its prefill ends; the tokenizer's TTFT and e2e.
    decode_loop is not observed (metrics_is_observed=False)."""
    stage = h["stage"]
    stage.labels(**SCHED, stage="request_process").observe(process_s)
    h["queue"].labels(**SCHED).observe(queue_s)
    for c in chunks_s:
        stage.labels(**SCHED, stage="chunked_prefill").observe(c)
    stage.labels(**SCHED, stage="prefill_forward").observe(prefill_s)
    flag = "true" if streaming else "false"
    h["ttft"].labels(**TOK, is_streaming=flag).observe(ttft_s)
    h["e2e"].labels(**TOK, is_streaming=flag).observe(e2e_s)


def main() -> None:
    _, h = server()
    # Before t0: 10 requests (the lifetime the window must not count).
    for _ in range(10):
        request(h, process_s=0.003, queue_s=0.4, prefill_s=0.5, chunks_s=(), ttft_s=1.0, e2e_s=5.0, streaming=True)
    (HERE / "scrape_t0.prom").write_bytes(scrape())
    # Between t0 and t1: 8 requests, queue 0.05 s, prefill 0.12 s (two of them in three
    # 0.04 s chunks), TTFT 0.2 s (tokenizer and transport on top), e2e 2.2 s; half streaming.
    for i in range(8):
        request(h, process_s=0.002, queue_s=0.05, prefill_s=0.12, chunks_s=(0.04,) * 3 if i < 2 else (),
                ttft_s=0.2, e2e_s=2.2, streaming=i % 2 == 0)
    (HERE / "scrape_t1.prom").write_bytes(scrape())


if __name__ == "__main__":
    main()
