"""The simulated engine's Prometheus metrics, with vLLM V1 names, served over HTTP.

Names, types, units and bucket bounds follow vLLM V1 (``vllm/v1/metrics/loggers.py``, as
summarised in docs/reference/engine-metrics.md section 3): fractions for
``kv_cache_usage_perc``, ``_total`` counters, seconds for latencies, ``model_name`` and
``engine`` labels. Every family also carries the label ``simulated="true"`` and its help
text starts with ``[simulated]``, so no scrape of it can pass for a real engine.

Each :class:`SimMetrics` has its own registry (several simulated engines can live in
one process). :meth:`SimMetrics.serve` binds ``127.0.0.1`` only.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

# vLLM V1 bucket bounds (loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

SIM = "[simulated] "


class SimMetrics:
    """vLLM V1 metric families of one simulated engine."""

    def __init__(self, model_name: str, engine: str = "0", *, block_size: int = 16, num_gpu_blocks: int = 0,
                 gpu_memory_utilization: float = 0.9):
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name, "engine": engine, "simulated": "true"}
        names = tuple(self.labels)
        r = self.registry

        def g(name, doc):
            return Gauge(name, SIM + doc, names, registry=r).labels(**self.labels)

        def c(name, doc):
            return Counter(name, SIM + doc, names, registry=r).labels(**self.labels)

        def h(name, doc, buckets):
            return Histogram(name, SIM + doc, names, buckets=buckets, registry=r).labels(**self.labels)

        self.running = g("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = g("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = c("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = c("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = c("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_queries = c("vllm:prefix_cache_queries",
                                "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = c("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens_cached = c("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        # vLLM --enable-mfu-metrics (vllm/v1/metrics/perf.py): the simulated step's FLOPs and
        # bytes from its cost model (which does not split reads from writes: all counted as read).
        self.estimated_flops = c("vllm:estimated_flops_per_gpu",
                                 "Estimated number of floating point operations per GPU.")
        self.estimated_read_bytes = c("vllm:estimated_read_bytes_per_gpu",
                                      "Estimated number of bytes read from memory per GPU.")
        self._success = Counter("vllm:request_success", SIM + "Count of successfully processed requests.",
                                names + ("finished_reason",), registry=r)
        self.iteration_tokens = h("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                  ITERATION_TOKEN_BUCKETS)
        self.ttft = h("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                      TTFT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                     ITL_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                     REQUEST_LATENCY_BUCKETS)
        self.queue_time = h("vllm:request_queue_time_seconds",
                            "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = h("vllm:request_prefill_time_seconds",
                              "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = h("vllm:request_decode_time_seconds",
                             "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = h("vllm:request_inference_time_seconds",
                                "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        info = Gauge("vllm:cache_config_info", SIM + "Information of the LLMEngine CacheConfig",
                     ("engine", "simulated", "block_size", "num_gpu_blocks", "gpu_memory_utilization",
                      "enable_prefix_caching", "cache_dtype"), registry=r)
        info.labels(engine=engine, simulated="true", block_size=str(block_size), num_gpu_blocks=str(num_gpu_blocks),
                    gpu_memory_utilization=str(gpu_memory_utilization), enable_prefix_caching="True",
                    cache_dtype="auto").set(1.0)
        self._server = None

    def success(self, reason: str) -> None:
        self._success.labels(**self.labels, finished_reason=reason).inc()

    def text(self) -> bytes:
        """One scrape, exactly as the HTTP endpoint serves it."""
        return generate_latest(self.registry)

    def serve(self, port: int = 0) -> int:
        """Serve ``/metrics`` on 127.0.0.1 (``port`` 0 picks a free one); returns the port."""
        server, _thread = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        self._server = server
        return server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
