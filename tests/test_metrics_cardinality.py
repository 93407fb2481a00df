"""Cardinality budget of one host's ``/metrics`` (docs/metrics.md, "Cardinality budget").

A fixed synthetic state of a large serving host, 8 GPUs x 4 served processes, is rendered
through the real renderer (:class:`ridgeline.agent.prometheus.WindowCollector` and the
exposition prometheus-client writes for ``/metrics``), and the series are counted as
Prometheus counts them: one per sample line of the text format. The state is the dense
worst case of that host: every process seen on every GPU (32 (GPU, process) pairs, each
with every phase the phase classifier names), every verdict, every NVML clock-event reason,
a real vLLM 0.11 scrape per process (the shared sample, advanced), one launch thread per
(GPU, process) and more other threads than the exposed top. The budget is checked against
whatever the renderer emits, so a new family that grows with GPUs x processes shows up here.
"""
from __future__ import annotations

import collections
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.engine_samples import busy_vllm_v011

from ridgeline.agent import prometheus as prom
from ridgeline.aggregator import ceilings, phases, verdict
from ridgeline.aggregator import engine_metrics as em
from ridgeline.probes import nvml, prom_text

ROOT = Path(__file__).resolve().parent.parent
S = 1_000_000_000
GPUS, PROCESSES = 8, 4
HOST = "gpu-node-1"
# Series per host at 8 GPUs x 4 served processes (docs/metrics.md, "Cardinality budget"):
# the dense state below rendered 3948 when the budget was set; it leaves ~25% for families
# added later. deploy/prometheus/ridgeline-fleet-rules.yml alerts above it.
SERIES_BUDGET_8X4 = 5000
# Copy directions a served LLM process makes (probes/events.py COPY_DIRECTION_NAMES also
# names the CUDA-array ones, which serving engines do not use).
COPY_DIRECTIONS = ("HtoD", "DtoH", "DtoD", "PtoP", "HtoH")
PIDS = [4100 + p for p in range(PROCESSES)]


def _engine_section() -> dict:
    """The real vLLM 0.11 scrape, advanced once, for each of the 4 served processes."""
    base, busy = busy_vllm_v011()
    t = em.EngineTracker()

    def polled(text, ts):
        return {"scrapes": [{"endpoint": f"http://127.0.0.1:{8000 + i}/metrics", "ts_ns": ts,
                             "exposition": prom_text.parse(text), "pid": pid} for i, pid in enumerate(PIDS)]}
    t.update(polled(base, S))
    return {"engine": t.update(polled(busy, 3 * S))}


def _nvml_record(i: int, ts_ns: int, energy_j: float, pids) -> dict:
    """One NVML sample of GPU ``i`` with every figure the renderer knows set."""
    return {"gpu_index": i, "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_uuid": f"GPU-00000000-0000-0000-0000-00000000000{i}",
            "ts_ns": ts_ns, "memory_total_bytes": 8.1e10, "memory_used_bytes": 7e10, "memory_free_bytes": 1e10,
            "memory_reserved_bytes": 5e8, "processes": [{"pid": pid, "gpu_memory_used_bytes": 1.7e10} for pid in pids],
            "gpu_busy_time_pct": 87.0, "memory_busy_time_pct": 40.0, "sm_clock_mhz": 1755, "mem_clock_mhz": 2619,
            "sm_clock_max_mhz": 1980, "mem_clock_max_mhz": 2619, "power_w": 600.0, "power_limit_w": 700.0,
            "energy_total_j": energy_j, "temperature_c": 60.0, "pcie_tx_bytes_per_s": 1e9, "pcie_rx_bytes_per_s": 1e9,
            "nvlink_tx_total_bytes": ts_ns * 1e2, "nvlink_rx_total_bytes": ts_ns * 1e2,
            "gpm_sm_occupancy_pct": 30.0, "gpm_any_tensor_util_pct": 40.0, "gpm_dram_bw_util_pct": 60.0,
            # every reason at once: the family is bounded by NVML's reason bits, not by time
            "clock_event_reasons": list(nvml.CLOCK_EVENT_REASONS.values()), "clock_slowdown": True,
            "source": "nvml+gpm"}


def dense(pids) -> list[tuple[int, int]]:
    """Every process seen on every GPU: the worst case the budget is set for."""
    return [(pid, dev) for pid in pids for dev in range(GPUS)]


def tensor_parallel_2(pids) -> list[tuple[int, int]]:
    """The usual layout: each process serves one model on its own 2 GPUs (TP=2)."""
    return [(pid, 2 * i + k) for i, pid in enumerate(pids) for k in range(2)]


def synthetic_window(layout=dense) -> dict:
    h100 = ceilings.lookup("NVIDIA H100 80GB HBM3")
    ceil = {"hbm_bytes_per_s": h100.hbm_bytes_per_s, "flops_per_s": dict(h100.flops_per_s)}
    gpus, verdicts, threads = [], [], []
    for pid, dev in layout(PIDS):
        tid = pid * 100 + dev
        ph = {name: {"kernels": 3, "kernel_time_ns": 2_000_000, "time_share_pct": 20.0,
                     "achieved_bytes_per_s": 2.0e12, "achieved_flops_per_s": 4e13, "arithmetic_intensity": 20.0,
                     "pct_of_peak_bytes": 60.0, "pct_of_peak_flops": 4.0, "verdict": "memory-bound",
                     "bytes": 2.0e9, "flops": 4e10, "work_busy_ns": 1_000_000, "work_source": "model",
                     "kv_read_bytes_per_s": 1e12}
              for name in phases.PHASE_NAMES.values()}
        gpus.append({"device": dev, "pid": pid, "gpu": "h100-sxm", "source": "cupti", "span_ns": 10, "busy_ns": 5,
                     "idle_ns": 5, "launch_tids": [tid], "ceilings": ceil, "phases": ph,
                     "copy_bytes": {d: 100 for d in COPY_DIRECTIONS}})
        verdicts.append({"device": dev, "pid": pid, "verdict": verdict.BANDWIDTH, "face": "bandwidth"})
        threads.append({"pid": pid, "tid": tid, "comm": f"worker{dev}", "on_cpu_ns": 5e8, "runq_wait_ns": 1e5,
                        "blocked_ns": 1e6, "launches": 100})
    on_gpu = {i: [pid for pid, dev in layout(PIDS) if dev == i] for i in range(GPUS)}
    for pid in PIDS:
        # more non-launch threads per process than the exposed top holds
        threads += [{"pid": pid, "tid": pid * 100 + 50 + k, "comm": f"t{k}", "on_cpu_ns": 1e6 * (k + 1),
                     "runq_wait_ns": 1e5, "blocked_ns": 1e6, "launches": 0} for k in range(prom.TOP_THREADS)]
    return {
        "host": HOST, "gpus": gpus, "verdict": verdicts, "sched": {"sched": {"threads": threads}},
        "device": {"nvml": {"devices": [r for i in range(GPUS)
                                        for r in (_nvml_record(i, S, 5.0e6, on_gpu[i]),
                                                  _nvml_record(i, 2 * S, 5.0e6 + 600, on_gpu[i]))]}},
        "engine": _engine_section(),
        "agent": {"cpu_pct": 2.0, "rss_bytes": 1000, "records_total": 10,
                  "probes": {p: {"drops": 0, "errors": 0} for p in ("cupti", "sched", "nvml", "engine")}
                  | {"engine": {"drops": 0, "errors": 0, "scrape_failures": {"connect": 0, "timeout": 0, "too_large": 0}},
                     "cupti": {"drops": 0, "errors": 0, "server_refused_connections": 0,
                               "server_refused_connections_uid": 0, "server_rejected_peers": 0,
                               "clock_disagreements": 0}},
                  "publisher_drops_by_topic": {"window": 0, "health": 0, "events": 0},
                  "metrics_server": {"timeouts": 0, "evicted": 0, "accept_errors": 0},
                  "bpf_run_time_ns": 5e6, "dropped_records": 0, "dropped_batches": 0, "window_drops": 0,
                  "window_fold_errors": 0, "window_open_steps_cut": 0, "cupti_processes_taken_over": 0},
    }


def render(windows: int = 3, layout=dense) -> str:
    c = prom.WindowCollector(HOST)
    w = synthetic_window(layout)         # the same state every window (the renderer only reads it)
    for _ in range(windows):
        c.observe(w)
    return generate_latest(prom.registry_for(c)).decode()


def series_by_family(text: str) -> dict[str, int]:
    """Series per family as Prometheus stores them: one per sample (a histogram's buckets,
    _sum and _count each one)."""
    return {f.name: len(f.samples) for f in text_string_to_metric_families(text) if f.samples}


def grouped(counts: dict[str, int]) -> dict[str, int]:
    """Per part of /metrics (the breakdown table in docs/metrics.md)."""
    out: collections.Counter = collections.Counter()
    for name, n in counts.items():
        if name.startswith(("ridgeline_phase_", "ridgeline_copy_", "ridgeline_gpu_idle", "ridgeline_gpu_busy_ratio",
                            "ridgeline_gpu_peak_", "ridgeline_verdict_")):
            part = "GPU x process (CUPTI, verdicts)"
        elif name.startswith("ridgeline_engine_") or name == "ridgeline_alert_firing":
            part = "engine (per served process)"
        elif name.startswith("ridgeline_thread"):
            part = "threads"
        elif name.startswith("ridgeline_gpu_"):
            part = "GPU (NVML)"
        elif name.startswith("ridgeline_"):
            part = "agent"
        else:
            part = "client library (process_, python_)"
        out[part] += n
    return dict(out)


def test_series_at_8_gpus_x_4_processes_stay_within_the_budget():
    text = render()
    counts = series_by_family(text)
    total = sum(counts.values())
    # Every sample line is one series (prometheus-client's parser agrees with the text).
    assert total == sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    parts = grouped(counts)
    print(f"\nseries at {GPUS} GPUs x {PROCESSES} processes: {total} (budget {SERIES_BUDGET_8X4})")
    for part, n in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"| {part} | {n} |")
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {name}: {n}")
    assert total <= SERIES_BUDGET_8X4, (total, parts)
    # The state is what it claims: every (GPU, process) pair and every engine endpoint has its series.
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    pairs = {(s.labels["gpu"], s.labels["pid"]) for s in fams["ridgeline_gpu_busy_ratio"].samples}
    assert len(pairs) == GPUS * PROCESSES
    assert len(fams["ridgeline_engine_info"].samples) == PROCESSES
    assert len({s.labels["gpu"] for s in fams["ridgeline_gpu_sm_clock_hertz"].samples}) == GPUS
    launch = {s.labels["tid"] for s in fams["ridgeline_thread_on_cpu_seconds"].samples if s.labels["role"] == "launch"}
    assert len(launch) == GPUS * PROCESSES
    # The usual TP=2 layout of the same host, for the table in docs/metrics.md.
    tp2 = series_by_family(render(layout=tensor_parallel_2))
    print(f"TP=2 layout (8 (GPU, process) pairs): {sum(tp2.values())}", grouped(tp2))
    assert sum(tp2.values()) < total


def test_the_fleet_alert_and_the_agent_example_use_this_budget():
    rules = (ROOT / "deploy" / "prometheus" / "ridgeline-fleet-rules.yml").read_text()
    assert f'scrape_samples_scraped{{job=~"ridgeline.*"}} > {SERIES_BUDGET_8X4}' in rules
    assert f"per-host budget of {SERIES_BUDGET_8X4}" in rules
    example = (ROOT / "deploy" / "prometheus" / "prometheus-agent.yml").read_text()
    assert f"is {SERIES_BUDGET_8X4} at 8 GPUs" in example and f"sample_limit: {5 * SERIES_BUDGET_8X4}" in example


def test_series_do_not_grow_with_time_at_a_fixed_state():
    """Same state for 300 windows (5 minutes of 1 s windows): no series accrue per window."""
    assert sum(series_by_family(render(3)).values()) == sum(series_by_family(render(300)).values())


def test_gpu_process_series_grow_linearly_in_pairs():
    """Doubling the processes on the host doubles the GPU x process part: no series
    crosses pairs (its cap, MAX_GPU_PROCESSES pairs, is tested in test_agent_prometheus)."""
    global PIDS
    saved = PIDS
    try:
        one = grouped(series_by_family(render()))["GPU x process (CUPTI, verdicts)"]
        PIDS = [4100 + p for p in range(2 * PROCESSES)]
        two = grouped(series_by_family(render()))["GPU x process (CUPTI, verdicts)"]
    finally:
        PIDS = saved
    assert two == 2 * one


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not on PATH: install Debian's 'prometheus' package (scripts/setup.sh does)")
def test_the_8x4_exposition_passes_promtool():
    r = subprocess.run([shutil.which("promtool"), "check", "metrics"], input=render(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
