"""A literal window record and the /metrics the agent renders from it (agent.prometheus):
vLLM and SGLang engine sections from real scrapes, NVML, launch threads, the agent's own
counters (tests/test_agent_prometheus.py and the /metrics tests beside it).
"""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ridgeline.agent import prometheus as prom
from ridgeline.aggregator import engine_metrics as em
from ridgeline.probes import prom_text
from support.engine_samples import busy_vllm_v011

S = 1_000_000_000
URL = "http://127.0.0.1:8000/metrics"
SGL = "http://127.0.0.1:30000/metrics"
SGL_LABELS = 'engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"'


def engine_section():
    """Tracker output for a vLLM endpoint (the real 0.11 scrape, advanced) and an SGLang one."""
    base, busy = busy_vllm_v011()
    def sgl(k):
        return (f'sglang:func_latency_seconds_bucket{{le="+Inf",name="generate_request"}} 4\n'
                f'sglang:cache_hit_rate{{{SGL_LABELS}}} 0.0075\n'
                f'sglang:num_running_reqs{{{SGL_LABELS},priority=""}} 3\n'
                f'sglang:num_running_reqs{{{SGL_LABELS},priority="0"}} 3\n'
                f'sglang:token_usage{{{SGL_LABELS}}} 0.4\n'
                f'sglang:estimated_flops_per_gpu_total{{{SGL_LABELS}}} {k * 2e14}\n'
                f'sglang:estimated_read_bytes_per_gpu_total{{{SGL_LABELS}}} {k * 1e12}\n'
                f'sglang:evicted_tokens_total{{{SGL_LABELS}}} {k * 800}\n')
    t = em.EngineTracker()

    def polled(v, s, ts):
        return {"scrapes": [{"endpoint": URL, "ts_ns": ts, "exposition": prom_text.parse(v), "pid": 4242},
                            {"endpoint": SGL, "ts_ns": ts, "exposition": prom_text.parse(s), "pid": 5151}]}
    t.update(polled(base, sgl(0), S))
    return {"engine": t.update(polled(busy, sgl(1), 3 * S))}


def window(threads, launch_tids=(8,), engine=None):
    return {
        "host": "node-a",
        "gpus": [{"device": 0, "pid": 4242, "gpu": "h100-sxm", "source": "cupti", "span_ns": 10, "busy_ns": 5,
                  "launch_tids": list(launch_tids),
                  "ceilings": {"hbm_bytes_per_s": 3.35e12, "flops_per_s": {"bf16": 989e12, "fp8": 1979e12}},
                  "phases": {"decode": {"kernels": 3, "kernel_time_ns": 2_000_000, "time_share_pct": 80.0,
                                        "achieved_bytes_per_s": 2.0e12, "achieved_flops_per_s": 4e13,
                                        "arithmetic_intensity": 20.0, "pct_of_peak_bytes": 60.0,
                                        "pct_of_peak_flops": 4.0, "verdict": "memory-bound",
                                        "bytes": 2.0e9, "flops": 4e10, "work_busy_ns": 1_000_000,
                                        "work_source": "model"}},
                  "copy_bytes": {"HtoD": 100}}],
        "device": {"nvml": {"devices": [{"gpu_index": 0, "gpu_name": "NVIDIA H100 80GB HBM3",
                                         "gpu_uuid": "GPU-5c7c3b4e-0000-1111-2222-333344445555",
                                         "ts_ns": S, "gpu_busy_time_pct": 87.0, "sm_clock_mhz": 1755,
                                         "memory_used_bytes": 7e10, "memory_total_bytes": 8.1e10,
                                         "energy_total_j": 5.0e6}]}},
        "engine": engine or {},
        "sched": {"sched": {"threads": threads}},
        "verdict": [{"device": 0, "pid": 4242, "verdict": "undetermined", "face": None}],
        "agent": {"cpu_pct": 2.0, "rss_bytes": 1000, "probes": {"sched": {"drops": 1, "errors": 0},
                                                         "cupti": {"drops": 0, "errors": 0,
                                                                   "server_refused_connections": 944,
                                                                   "server_refused_connections_uid": 3,
                                                                   "server_rejected_peers": 1,
                                                                   "server_process_gone_cut": 5,
                                                                   "server_pid_reused_cut": 2,
                                                                   "server_idle_peer_cut": 7,
                                                                   "server_evicted_fair_share": 4,
                                                                   "server_identity_dropped_batches": 9,
                                                                   "demangler_seccomp_kills": 1,
                                                                   "names_not_classified": 12}},
                  "publisher_drops_by_topic": {"window": 0}, "bpf_run_time_ns": 5e6,
                  "window_drops": 3, "window_fold_errors": 1, "window_open_steps_cut": 2},
    }


def thread(tid, on_cpu_ms=1, launches=0):
    return {"pid": 4242, "tid": tid, "comm": f"t{tid}", "on_cpu_ns": on_cpu_ms * 1e6, "runq_wait_ns": 1e5,
            "blocked_ns": 1e6, "launches": launches}


def exposition(windows) -> str:
    c = prom.WindowCollector("node-a")
    for w in windows:
        c.observe(w)
    return generate_latest(prom.registry_for(c)).decode()


def families(text):
    return {f.name: f for f in text_string_to_metric_families(text)}
