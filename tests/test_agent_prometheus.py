"""The agent's /metrics (agent.prometheus): Prometheus' own linter, histograms with the
engine's buckets, joinable labels, bounded per-thread series.

``promtool check metrics`` is Prometheus' tool (Debian package ``prometheus``, which
scripts/setup.sh installs); the tests that need it skip with the reason when it is absent.
"""
from __future__ import annotations

import subprocess

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.metrics_windows import S, engine_section, exposition, families, thread, window
from support.prometheus_server import PROMTOOL, needs_promtool

from ridgeline.agent import prometheus as prom
from ridgeline.aggregator import engine_metrics as em
from ridgeline.probes import prom_text


@needs_promtool
def test_promtool_check_metrics_passes_on_a_full_window():
    text = exposition([window([thread(8, 50, launches=100), thread(9)], engine=engine_section())])
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # And it does reject what /metrics used to carry (a quantile label on a gauge, percent).
    bad = ('# HELP ridgeline_engine_ttft_seconds x\n# TYPE ridgeline_engine_ttft_seconds gauge\n'
           'ridgeline_engine_ttft_seconds{quantile="99",bound="le"} 0.1\n'
           '# HELP ridgeline_gpu_busy_time_percent x\n# TYPE ridgeline_gpu_busy_time_percent gauge\n'
           'ridgeline_gpu_busy_time_percent 87\n')
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=bad, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "quantile" in (r.stdout + r.stderr)


def test_engine_histograms_keep_the_engines_buckets_and_no_gauge_has_quantiles():
    text = exposition([window([thread(8)], engine=engine_section())])
    fams = families(text)
    ttft = fams["ridgeline_engine_time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    les = [s.labels["le"] for s in ttft.samples if s.name.endswith("_bucket") and s.labels["pid"] == "4242"]
    assert len(les) == 23 and les[0] == "0.001" and les[-2] == "2560.0"          # vLLM's 22 bounds + Inf
    for name in ("ridgeline_engine_request_queue_time_seconds", "ridgeline_engine_request_prefill_time_seconds",
                 "ridgeline_engine_request_decode_time_seconds", "ridgeline_engine_inter_token_latency_seconds",
                 "ridgeline_engine_e2e_request_latency_seconds"):
        assert fams[name].type == "histogram", name
    for f in fams.values():
        if f.type in ("gauge", "counter", "info"):
            assert not any("quantile" in s.labels or "le" in s.labels for s in f.samples), f.name
        assert f.documentation and f.documentation.replace("_", " ") != f.name.replace("_", " "), f.name
    seg = {s.labels["segment"]: s.value for s in fams["ridgeline_engine_segment_mean_seconds"].samples
           if s.labels["pid"] == "4242"}
    assert seg["queue"] == pytest.approx(0.4) and seg["prefill"] == pytest.approx(0.35)
    assert seg["decode"] == pytest.approx(2.0)
    sgl_running = [s.value for s in fams["ridgeline_engine_running_requests"].samples if s.labels["pid"] == "5151"]
    assert sgl_running == [3.0]                                   # priority="" total not doubled


def test_labels_join_dcgm_exporter_and_each_other():
    fams = families(exposition([window([thread(8, launches=5)], engine=engine_section())]))
    busy = fams["ridgeline_gpu_busy_ratio"].samples[0].labels
    nvml = fams["ridgeline_gpu_busy_time_ratio"].samples[0].labels
    # dcgm-exporter's identity labels, same values on phase (CUPTI) and NVML series.
    for lab in (busy, nvml):
        assert lab["gpu"] == "0" and lab["UUID"].startswith("GPU-") and lab["Hostname"] == "node-a"
        assert lab["gpu_model"] == "NVIDIA H100 80GB HBM3"
    assert fams["ridgeline_gpu_busy_time_ratio"].samples[0].value == pytest.approx(0.87)
    assert fams["ridgeline_gpu_sm_clock_hertz"].samples[0].value == pytest.approx(1.755e9)
    # Engine, phase and thread series share Hostname and pid.
    eng = [s.labels for s in fams["ridgeline_engine_kv_usage_ratio"].samples]
    assert {"Hostname": "node-a", "pid": "4242"}.items() <= next(l for l in eng if l["pid"] == "4242").items()
    th = fams["ridgeline_thread_on_cpu_seconds"].samples[0].labels
    assert th["pid"] == "4242" and th["Hostname"] == "node-a" and th["role"] == "launch"
    verdict = fams["ridgeline_verdict_state"].samples
    assert all(s.labels["face"] != "None" for s in verdict)
    assert fams["ridgeline_build_info"].samples[0].labels["schema_version"] == "1"
    assert "process_cpu_seconds" in fams and "process_resident_memory_bytes" in fams


def test_thread_series_are_bounded_and_stale_ones_expire():
    # 3 live threads (8 launches kernels), and 5 new short-lived threads every window for 10
    # minutes of 1 s windows: 3000 thread ids seen in all.
    c = prom.WindowCollector("node-a")
    next_tid = 100
    for _ in range(600):
        churn = [thread(next_tid + k, on_cpu_ms=0.5) for k in range(5)]
        next_tid += 5
        c.observe(window([thread(8, 300, launches=1000), thread(9, 100), thread(10, 50)] + churn))
    exposed = c.exposed_threads()
    assert len(exposed) <= 1 + prom.TOP_THREADS
    assert len(c.threads) <= 5 * prom.THREAD_STALE_WINDOWS + 3          # stale ones were removed
    keys = {k for k, _ in exposed}
    assert {("4242", "8"), ("4242", "9"), ("4242", "10")} <= keys
    text = generate_latest(prom.registry_for(c)).decode()
    on_cpu = families(text)["ridgeline_thread_on_cpu_seconds"].samples
    assert len(on_cpu) == len(exposed)
    # A restarted server's launch thread (new pid/tid, first seen now) gets in at once,
    # even with the table full.
    prom_max = prom.MAX_THREADS_TRACKED
    try:
        prom.MAX_THREADS_TRACKED = len(c.threads)
        w = window([dict(thread(7777, 10, launches=50), pid=9999)], launch_tids=())
        c.observe(w)
    finally:
        prom.MAX_THREADS_TRACKED = prom_max
    assert ("9999", "7777") in {k for k, _ in c.exposed_threads()}
    assert c.threads_dropped == 0


def test_gpu_process_counters_of_gone_servers_expire_and_stay_bounded(monkeypatch):
    # A server restarted every 5 windows (a new pid each time) for 2000 windows: 400 pids.
    c = prom.WindowCollector("node-a")
    for i in range(2000):
        w = window([thread(8)])
        w["gpus"][0]["pid"] = 10_000 + i // 5
        c.observe(w)
    pids = {s.labels["pid"] for s in families(generate_latest(prom.registry_for(c)).decode())[
        "ridgeline_phase_kernel_seconds"].samples}
    assert "10399" in pids                                       # the running server's series are there
    assert len(pids) <= 300 // 5 + 1         # exited servers' series went (after GPU_STALE_WINDOWS = 300)
    assert len(c.phase_kernel_seconds) == len(pids) and len(c.idle_seconds) == len(pids)
    assert c.gpu_series_evicted == 0
    # More live (GPU, process) pairs than the table holds: the least recently seen make
    # room, counted; the newest is always exposed.
    monkeypatch.setattr(prom, "MAX_GPU_PROCESSES", 4)
    w = window([thread(8)])
    w["gpus"] = [dict(w["gpus"][0], pid=20_000 + k) for k in range(6)]
    c.observe(w)
    fams = families(generate_latest(prom.registry_for(c)).decode())
    pids = {s.labels["pid"] for s in fams["ridgeline_phase_kernel_seconds"].samples}
    assert len(pids) == 4 and "20005" in pids
    assert c.gpu_series_evicted > 0
    assert fams["ridgeline_gpu_series_evicted"].samples[0].value == c.gpu_series_evicted


def test_gpu_label_is_the_nvml_gpu_the_process_runs_on():
    # The served process sees one GPU (CUDA_VISIBLE_DEVICES=1 or a pod): CUPTI says device 0,
    # NVML lists the pid on GPU 1. Series must say gpu="1" and GPU 1's UUID, as
    # dcgm-exporter does for that GPU, not GPU 0's.
    w = window([thread(8)])
    gpu0 = dict(w["device"]["nvml"]["devices"][0], processes=[])
    gpu1 = dict(gpu0, gpu_index=1, gpu_uuid="GPU-11111111-2222-3333-4444-555555555555",
                processes=[{"pid": 4242, "gpu_memory_used_bytes": 7e10}])
    w["device"]["nvml"]["devices"] = [gpu0, gpu1]
    w["gpus"].append(dict(w["gpus"][0], pid=5555))          # a process NVML does not list
    fams = families(exposition([w]))
    for name in ("ridgeline_gpu_busy_ratio", "ridgeline_phase_time_share_ratio", "ridgeline_phase_kernel_seconds",
                 "ridgeline_phase_verdict_info"):
        lab = next(s.labels for s in fams[name].samples if s.labels["pid"] == "4242")
        assert (lab["gpu"], lab["UUID"]) == ("1", "GPU-11111111-2222-3333-4444-555555555555"), name
        other = next(s.labels for s in fams[name].samples if s.labels["pid"] == "5555")
        assert other["UUID"] == "", name                       # not placed: no UUID vouched for
    assert {s.labels["gpu"] for s in fams["ridgeline_verdict_state"].samples} == {"1"}


# dcgm-exporter's exposition of two GPUs, in the label layout its renderer writes for the
# 4.x releases (NVIDIA/dcgm-exporter internal/pkg/rendermetrics/render_metrics.go,
# gpuMetricsFormat: gpu, UUID, pci_bus_id, device, modelName, Hostname).
DCGM = (
    'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-5c7c3b4e-0000-1111-2222-333344445555",pci_bus_id="00000000:18:00.0",'
    'device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a"} 11\n'
    'DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-11111111-2222-3333-4444-555555555555",pci_bus_id="00000000:2A:00.0",'
    'device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a"} 87\n')


@needs_promtool
def test_documented_join_with_dcgm_exporter_evaluates_in_prometheus(tmp_path):
    """The join docs/metrics.md gives, evaluated by Prometheus' own engine (promtool test
    rules) on our exposition and dcgm-exporter's: the served process runs on node GPU 1
    (its CUDA device 0), and the join must pick GPU 1's DCGM series."""
    import json
    w = window([thread(8)])
    gpu0 = dict(w["device"]["nvml"]["devices"][0], processes=[])
    gpu1 = dict(gpu0, gpu_index=1, gpu_uuid="GPU-11111111-2222-3333-4444-555555555555",
                processes=[{"pid": 4242, "gpu_memory_used_bytes": 7e10}])
    w["device"]["nvml"]["devices"] = [gpu0, gpu1]
    ours = [s for s in families(exposition([w]))["ridgeline_phase_achieved_bytes_per_second"].samples]
    series = [(s.name, s.labels, s.value) for s in ours]
    series += [(s.name, s.labels, s.value) for f in text_string_to_metric_families(DCGM) for s in f.samples]

    def sel(name, labels):
        return name + "{" + ",".join(f'{k}={json.dumps(v)}' for k, v in sorted(labels.items())) + "}"
    expr = ('ridgeline_phase_achieved_bytes_per_second * on(Hostname, gpu, UUID) group_left(modelName) '
            'DCGM_FI_DEV_GPU_UTIL')
    want = dict(ours[0].labels, modelName="NVIDIA H100 80GB HBM3")
    spec = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": sel(n, l), "values": f"{v}x3"} for n, l, v in series],
        "promql_expr_test": [{"expr": expr, "eval_time": "2m",
                              "exp_samples": [{"labels": sel("", want), "value": ours[0].value * 87}]}]}]}
    (tmp_path / "join.test.yml").write_text(json.dumps(spec))
    r = subprocess.run([PROMTOOL, "test", "rules", "join.test.yml"], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_phase_work_counters_give_the_achieved_rates_over_any_interval():
    # Two windows of different achieved bandwidth: the counters hold both, so rate() over a
    # scrape interval averages them (the gauge shows the last window only).
    w1, w2 = window([thread(8)]), window([thread(8)])
    for w, gbytes in ((w1, 2.0), (w2, 6.0)):
        d = w["gpus"][0]["phases"]["decode"]
        d.update(bytes=gbytes * 1e9, flops=gbytes * 1e10, work_busy_ns=1_000_000_000, work_source="model",
                 achieved_bytes_per_s=gbytes * 1e9)
    fams = families(exposition([w1, w2]))
    (b,) = fams["ridgeline_phase_work_bytes"].samples
    (busy,) = fams["ridgeline_phase_work_busy_seconds"].samples
    (fl,) = fams["ridgeline_phase_work_flops"].samples
    assert b.name.endswith("_total") and b.labels["work_source"] == "model" and b.labels["phase"] == "decode"
    assert b.value / busy.value == pytest.approx(4e9) and fl.value == pytest.approx(8e10)
    assert fams["ridgeline_phase_achieved_bytes_per_second"].samples[0].value == pytest.approx(6e9)


def test_gpu_energy_is_a_counter_for_rate():
    w1, w2 = window([thread(8)]), window([thread(8)])
    for w, j in ((w1, 1000.0), (w2, 1700.0)):
        w["device"]["nvml"]["devices"][0]["energy_total_j"] = j
    text = exposition([w1, w2])
    (s,) = families(text)["ridgeline_gpu_energy_joules"].samples
    assert families(text)["ridgeline_gpu_energy_joules"].type == "counter"
    assert s.name == "ridgeline_gpu_energy_joules_total" and s.value == 1700.0
    assert s.labels["gpu"] == "0" and s.labels["UUID"].startswith("GPU-")


def test_window_builder_losses_are_published_as_counters():
    """Events the window builder dropped, batches its fold refused and open steps decided at
    the carry bound are each a counter on /metrics, not only in the health record."""
    fams = families(exposition([window([thread(8)])]))
    got = {n: fams[n].samples[0].value for n in ("ridgeline_agent_window_dropped_events",
                                                  "ridgeline_agent_window_fold_errors",
                                                  "ridgeline_agent_window_open_steps_cut")}
    assert got == {"ridgeline_agent_window_dropped_events": 3, "ridgeline_agent_window_fold_errors": 1,
                   "ridgeline_agent_window_open_steps_cut": 2}
    assert all(fams[n].type == "counter" for n in got)


def test_cupti_socket_refusals_are_counters_by_reason():
    fams = families(exposition([window([thread(8)])]))
    got = {s.labels["reason"]: s.value for s in fams["ridgeline_agent_cupti_refused_connections"].samples
           if s.name.endswith("_total")}
    assert got == {"limit": 944, "per_user": 3, "peer_identity": 1}


def test_cupti_connections_cut_and_takeovers_by_uid_are_published():
    """Issue 18.3/18.4: connections cut after accepting them, by reason, the batches dropped
    with a reused pid's connection, and taken-over processes by uid (bounded)."""
    w = window([thread(8)])
    w["agent"]["cupti_taken_over_by_uid"] = {"1000": 2, "0": 1, "other": 3}
    fams = families(exposition([w]))
    got = {s.labels["reason"]: s.value for s in fams["ridgeline_agent_cupti_connections_cut"].samples
           if s.name.endswith("_total")}
    assert got == {"process_gone": 5, "pid_reused": 2, "idle": 7, "fair_share": 4}
    assert [s.value for s in fams["ridgeline_agent_cupti_identity_dropped_batches"].samples
            if s.name.endswith("_total")] == [9]
    by = {s.labels["uid"]: s.value for s in fams["ridgeline_agent_cupti_processes_taken_over_by_user"].samples}
    assert by == {"1000": 2, "0": 1, "other": 3}
    # issue 18.1/18.2: demangler workers the seccomp filter killed, names left unmatched (budget)
    assert [s.value for s in fams["ridgeline_agent_cupti_demangler_seccomp_kills"].samples
            if s.name.endswith("_total")] == [1]
    assert [s.value for s in fams["ridgeline_agent_cupti_names_unclassified"].samples
            if s.name.endswith("_total")] == [12]
    assert fams["ridgeline_agent_cupti_processes_taken_over_by_user"].type == "gauge"


def fresh_cupti_families(tmp_path) -> dict:
    """/metrics families of a window whose agent section holds a fresh CUPTI socket's counters."""
    from ridgeline.probes.cupti.probe import CuptiProbe
    probe = CuptiProbe(socket_path=str(tmp_path / "c.sock"))
    probe.start()
    try:
        counters = probe.counters()
    finally:
        probe.stop()
    w = window([thread(8)])
    w["agent"]["probes"]["cupti"] = counters
    return families(exposition([w]))


def test_cupti_cut_counters_exist_at_zero_from_the_sockets_start(tmp_path):
    fams = fresh_cupti_families(tmp_path)
    got = {s.labels["reason"]: s.value for s in fams["ridgeline_agent_cupti_connections_cut"].samples
           if s.name.endswith("_total")}
    assert got == {"process_gone": 0, "pid_reused": 0, "idle": 0, "fair_share": 0}


@needs_promtool
def test_sglang_per_stage_prefill_passes_through_with_sglangs_buckets():
    """The SGLang per-stage fixture (tests/data/sglang_per_stage): its prefill_forward
    stage becomes ridgeline_engine_request_prefill_time_seconds with SGLang's 30
    exponential bounds, and the exposition still passes promtool."""
    from pathlib import Path
    data = Path(__file__).resolve().parent / "data" / "sglang_per_stage"
    url = "http://127.0.0.1:30000/metrics"
    t = em.EngineTracker()
    for i, name in enumerate(("scrape_t0.prom", "scrape_t1.prom")):
        out = t.update({"scrapes": [{"endpoint": url, "ts_ns": (i + 1) * 10 * S, "pid": 5151,
                                     "exposition": prom_text.parse((data / name).read_text())}]})
    text = exposition([window([thread(8)], engine={"engine": out})])
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    fam = families(text)["ridgeline_engine_request_prefill_time_seconds"]
    les = [s.labels["le"] for s in fam.samples if s.name.endswith("_bucket") and s.labels["pid"] == "5151"]
    assert len(les) == 31 and les[0] == "0.001" and les[-1] == "+Inf"
    count = [s.value for s in fam.samples if s.name.endswith("_count") and s.labels["pid"] == "5151"]
    assert count == [18.0]
    seg = {s.labels["segment"]: s.value for s in families(text)["ridgeline_engine_segment_mean_seconds"].samples
           if s.labels["pid"] == "5151"}
    assert seg["prefill"] == pytest.approx(0.12) and seg["decode"] == pytest.approx(2.0)


def test_cupti_refusal_counters_exist_at_zero_before_the_first_refusal(tmp_path):
    """RidgelineCuptiPeerRejected fires on increase(...[10m]) > 0 after a single event; a
    series that first appears at 1 has no earlier sample, so that one event (the common
    case: one misconfigured container) never fired. The counters of a fresh CUPTI socket
    are therefore exported at 0 for every reason the rules read."""
    got = {s.labels["reason"]: s.value
           for s in fresh_cupti_families(tmp_path)["ridgeline_agent_cupti_refused_connections"].samples
           if s.name.endswith("_total")}
    assert got == {"limit": 0, "per_user": 0, "peer_identity": 0}


def test_simulated_data_is_one_host_series_joined_on_hostname():
    """Issue 24.5 (docs/metrics.md, "Simulated data"): `ridgeline_simulated` is 1, naming the
    simulated sources, while any figure comes from the simulator; 0 on measured data. The
    GPU series of a simulated source carry source="simulated" themselves."""
    real = families(exposition([window([thread(8)])]))
    (s,) = real["ridgeline_simulated"].samples
    assert s.value == 0.0 and s.labels == {"Hostname": "node-a", "sources": ""}
    w = window([thread(8)])
    w["gpus"][0]["source"] = "simulated"
    w["sources"] = ["simulated"]
    fams = families(exposition([w]))
    (s,) = fams["ridgeline_simulated"].samples
    assert s.value == 1.0 and s.labels == {"Hostname": "node-a", "sources": "simulated"}
    gpu_series = [x for f in fams.values() if f.name.startswith("ridgeline_phase_") or f.name == "ridgeline_gpu_busy_ratio"
                  for x in f.samples]
    assert gpu_series and all(x.labels["source"] == "simulated" for x in gpu_series)
    # An engine endpoint whose record says simulated (the simulator's own engine view).
    w = window([thread(8)], engine={"simulator": {"endpoints": {"simulated://pid4242": {
        "engine": "vllm", "simulated": True, "kv_usage_ratio": 0.01}}}})
    (s,) = families(exposition([w]))["ridgeline_simulated"].samples
    assert s.value == 1.0 and s.labels["sources"] == "engine"


def test_a_window_of_the_wrong_shape_is_refused_counted_and_the_last_one_stays(caplog):
    c = prom.WindowCollector(host="h")
    c.observe(window([thread(8)]))
    before = generate_latest(prom.registry_for(c)).decode()
    c.observe({"gpus": [{"phases": {"decode": {"kernels": "three"}}}]})
    assert (c.windows, c.windows_unreadable) == (1, 1)
    assert "window not exposed" in caplog.text and "$.gpus[0].phases[...].kernels" in caplog.text
    fams = families(generate_latest(prom.registry_for(c)).decode())
    assert fams["ridgeline_phase_kernels"].samples[0].value == 3.0
    assert 'ridgeline_phase_kernels_total{' in before


def test_a_probes_counters_of_the_wrong_shape_lose_their_own_series_only():
    """The CUPTI counters are read as records.CuptiProbeCounters: a counter that is not a
    number loses the CUPTI probe's series, not the other probes' nor the device's."""
    w = window([thread(8)])
    w["agent"]["probes"]["cupti"]["server_rejected_peers"] = "one"
    w["device"]["other"] = {"devices": "not a list"}
    fams = families(exposition([w]))
    assert not [s for s in fams["ridgeline_agent_cupti_refused_connections"].samples if s.name.endswith("_total")]
    drops = {s.labels["probe"]: s.value for s in fams["ridgeline_agent_probe_drops"].samples
             if s.name.endswith("_total")}
    assert drops == {"sched": 1.0, "cupti": 0.0}
    assert [s.labels["gpu"] for s in fams["ridgeline_gpu_busy_time_ratio"].samples] == ["0"]
