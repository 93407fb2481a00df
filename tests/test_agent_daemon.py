"""agent.daemon in-process: the loop, window flush, probe faults, reload, /metrics."""
import socket
import threading
import time

import httpx
from support.net import free_port, wait_for

from ridgeline.agent import config
from ridgeline.agent.daemon import Agent
from ridgeline.agent.registry import STEPS, Running
from ridgeline.agent.sdnotify import Notifier
from ridgeline.agent.subscriber import Subscriber
from ridgeline.aggregator import wire as codec
from ridgeline.probes.events import API_DTYPE, API_LAUNCH, KERNEL_DTYPE, Device, NameTable, Trace, empty
from ridgeline.probes.probe import Availability, Probe
from ridgeline.probes.replay import ReplayProbe


def literal_trace(n=200, every_ns=5_000_000):
    """n kernels of 6 us, one every ``every_ns`` (1 s of GPU time at the default)."""
    k = empty(KERNEL_DTYPE, n)
    k["start_ns"] = 1_000_000 + every_ns * __import__("numpy").arange(n)
    k["end_ns"] = k["start_ns"] + 6_000
    k["device"], k["pid"], k["name_id"] = 0, 4242, 0
    a = empty(API_DTYPE, n)
    a["start_ns"] = k["start_ns"] - 3_000
    a["end_ns"] = a["start_ns"] + 2_000
    a["pid"], a["category"], a["name_id"] = 4242, API_LAUNCH, 1
    return Trace(kernels=k, api=a, names=NameTable(["sm90_xmma_gemm_bf16", "cudaLaunchKernel"]),
                 devices=[Device(0, "NVIDIA H100 80GB HBM3")])


class Exploding(Probe):
    name = "exploding"

    def __init__(self):
        super().__init__()
        self.polls = 0

    def poll(self):
        self.polls += 1
        raise RuntimeError("probe bug")


def cfg_for(tmp_path, **agent):
    return config.overlay(config.defaults(), {
        "agent": {"window_s": 0.2, **agent},
        "publisher": {"endpoint": f"ipc://{tmp_path}/agent.sock", "publish_events": True},
        "prometheus": {"enabled": False},
        "probes": {"enabled": []},
    })


def running(probe, step="replay"):
    return Running(STEPS[step], probe, Availability(True))


def collect(sub, seconds, topics=None, until=None):
    """Messages received for ``seconds``, or until ``until(messages)`` holds (then
    ``seconds`` is only the deadline: a loaded host may take long, a quick one does not wait)."""
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        m = sub.receive(0.1)
        if m is not None and (topics is None or m.topic in topics):
            out.append(m)
            if until is not None and until(out):
                break
    return out


def replay_of(trace):
    """A started replay that keeps every kernel: a loaded host can leave the agent thread
    unscheduled past the default 1 s catch-up limit, which skips (and counts) kernels,
    and these tests count them all (catching up is tested in test_replay.py)."""
    replay = ReplayProbe(trace=trace, speed=1.0, loop=False, max_catchup_s=60.0)
    replay.start()
    return replay


def start_agent(agent):
    agent.start()
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    return t


def test_windows_flow_and_a_raising_probe_is_counted(tmp_path):
    cfg = cfg_for(tmp_path)
    boom = Exploding()
    replay = replay_of(literal_trace())
    agent = Agent(cfg, probes=[running(boom, "nvml"), running(replay)], codec=codec, notifier=Notifier({}))
    t = start_agent(agent)
    sub = Subscriber(cfg.publisher.endpoint, codec=codec)

    def enough(msgs):
        health = [m.payload for m in msgs if m.topic == "health"]
        return (sum(m.topic == "window" for m in msgs) >= 3 and any(m.topic == "events" for m in msgs)
                and health and health[-1]["probes"]["nvml"]["errors"] >= 5 and boom.polls > 5
                and sum(g["kernels"] for m in msgs if m.topic == "window" for g in m.payload["gpus"]) > 0)
    try:
        msgs = collect(sub, 60, until=enough)
    finally:
        agent.request_stop()
        t.join(60)
        agent.shutdown()
        sub.close()
    windows = [m.payload for m in msgs if m.topic == "window"]
    health = [m.payload for m in msgs if m.topic == "health"]
    assert len(windows) >= 3 and health
    assert boom.polls > 5                                   # the loop went on polling
    errs = [h["probes"]["nvml"]["errors"] for h in health]
    assert errs[-1] >= 5 and errs == sorted(errs) and errs[-1] <= boom.polls
    assert sum(g["kernels"] for w in windows for g in w["gpus"]) > 0
    assert any(m.topic == "events" for m in msgs)
    seqs = [m.seq for m in msgs if m.topic == "window"]
    assert seqs == sorted(seqs) and sub.seq.gaps == {}


def test_stop_flushes_the_open_window(tmp_path):
    cfg = cfg_for(tmp_path, window_s=60.0)                   # no window would close on its own
    replay = replay_of(literal_trace(every_ns=1_000_000))
    agent = Agent(cfg, probes=[running(replay)], codec=codec, notifier=Notifier({}))
    t = start_agent(agent)
    sub = Subscriber(cfg.publisher.endpoint, codec=codec, topics=("window",))
    # the agent polled the whole trace (0.2 s of replay) and the subscription reached it
    assert wait_for(lambda: replay.records >= 400 and agent.publisher.subscriptions >= 1)
    agent.request_stop()
    t.join(60)
    agent.shutdown()
    msgs = collect(sub, 1.0)
    sub.close()
    assert len(msgs) == 1
    assert sum(g["kernels"] for g in msgs[0].payload["gpus"]) == 200


def test_reload_applies_good_config_and_keeps_running_on_bad(tmp_path):
    path = tmp_path / "agent.toml"
    ep = f"ipc://{tmp_path}/r.sock"
    path.write_text(f'[agent]\nwindow_s = 0.2\n[publisher]\nendpoint = "{ep}"\n[prometheus]\nenabled = false\n'
                    '[probes]\nenabled = []\n')
    cfg = config.load(path)
    agent = Agent(cfg, config_path=str(path), probes=[], codec=codec, notifier=Notifier({}))
    t = start_agent(agent)
    try:
        path.write_text(f'[agent]\nwindow_s = 0.3\n[publisher]\nendpoint = "{ep}"\nsndhwm = 50\n'
                        '[prometheus]\nenabled = false\n[probes]\nenabled = []\n')
        seq_before = dict(agent.publisher.seq)
        agent.request_reload()
        assert wait_for(lambda: agent.reloads == 1)
        assert agent.cfg.agent.window_s == 0.3 and agent.reloads == 1
        # The publisher was rebound on the same endpoint and its sequence numbers go on.
        assert agent.cfg.publisher.sndhwm == 50
        assert agent.publisher.seq["window"] >= seq_before["window"]
        sub = Subscriber(ep, codec=codec, topics=("window",))
        assert collect(sub, 30, until=len)
        sub.close()
        path.write_text('[agent]\nwindow_s = "fast"\n')
        agent.request_reload()
        assert wait_for(lambda: agent.reloads_refused == 1)
        assert agent.cfg.agent.window_s == 0.3 and agent.reloads == 1
        assert t.is_alive()
    finally:
        agent.request_stop()
        t.join(60)
        agent.shutdown()


def test_prometheus_exposition_names_and_values(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families
    port = free_port()
    cfg = config.overlay(cfg_for(tmp_path), {"prometheus": {"enabled": True, "listen": f"127.0.0.1:{port}"}})
    replay = replay_of(literal_trace(every_ns=1_000_000))
    agent = Agent(cfg, probes=[running(replay)], codec=codec, notifier=Notifier({}))
    t = start_agent(agent)

    def kernel_s(text):
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        f = fams.get("ridgeline_phase_kernel_seconds")
        return sum(s.value for s in f.samples if s.name.endswith("_total")) if f else 0.0
    try:
        # every kernel folded into a closed window (0.2 s of replay, 0.2 s windows)
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
            if abs(kernel_s(text) - 200 * 6e-6) < 1e-9 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        # Garbage on the HTTP socket does not take the endpoint down.
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"\x00\xff garbage \r\n\r\n" * 100)
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200
    finally:
        agent.request_stop()
        t.join(60)
        agent.shutdown()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["ridgeline_phase_kernel_seconds"].type == "counter"
    ks = [s for s in fams["ridgeline_phase_kernel_seconds"].samples if s.name.endswith("_total")]
    assert ks and abs(sum(s.value for s in ks) - 200 * 6e-6) < 1e-9
    assert "ridgeline_agent_resident_memory_bytes" in fams
    assert fams["ridgeline_agent_cpu_ratio"].type == "gauge"
    assert "ridgeline_gpu_busy_ratio" in fams
    for name in fams:
        assert name.startswith("ridgeline_") or name.startswith(("python_", "process_"))


def test_collector_exposes_engine_device_verdict_and_threads():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from ridgeline.agent.prometheus import WindowCollector
    w = {
        "gpus": [{"device": 0, "pid": 7, "gpu": "H100", "source": "simulated", "span_ns": 10, "busy_ns": 5,
                  "phases": {"decode": {"kernels": 3, "kernel_time_ns": 2_000_000_000, "time_share_pct": 100.0,
                                        "achieved_bytes_per_s": 2.0e12, "pct_of_peak_bytes": 60.0}},
                  "copy_bytes": {"HtoD": 100}}],
        "engine": {"engine": {"endpoints": {"http://127.0.0.1:8000/metrics": {
            "engine": "vllm", "kv_usage_ratio": 0.9, "num_waiting_requests": 4, "preemptions_total": 3,
            "alerts": {"kv_watermark": {"firing": True}}}}}},
        "sched": {"sched": {"threads": [{"pid": 7, "tid": 8, "comm": "python", "on_cpu_ns": 5e8,
                                         "runq_wait_ns": 1e8, "blocked_ns": 4e8}]}},
        "verdict": [{"device": 0, "pid": 7, "verdict": "kv-capacity-bound", "face": "memory-capacity"}],
        "agent": {"cpu_pct": 2.0, "rss_bytes": 1000, "probes": {"sched": {"drops": 1, "errors": 0}},
                  "publisher_drops_by_topic": {"window": 0}},
    }
    c = WindowCollector()
    c.observe(w)
    c.observe(w)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(c)
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    val = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}

    def one(name, **labels):
        hits = [v for (n, ls), v in val.items() if n == name and all((k, str(x)) in ls for k, x in labels.items())]
        assert len(hits) == 1, (name, labels, hits)
        return hits[0]

    assert one("ridgeline_phase_kernel_seconds_total", phase="decode") == 4.0     # counters accumulate
    assert one("ridgeline_phase_time_share_ratio", phase="decode") == 1.0
    assert one("ridgeline_phase_peak_bandwidth_ratio", phase="decode") == 0.6
    assert one("ridgeline_copy_bytes_total", direction="HtoD") == 200
    assert one("ridgeline_engine_kv_usage_ratio") == 0.9
    assert one("ridgeline_engine_preemptions_total") == 3
    assert fams["ridgeline_engine_preemptions"].type == "counter"
    assert one("ridgeline_alert_firing", alert="kv_watermark") == 1.0
    assert one("ridgeline_verdict_state", verdict="kv-capacity-bound") == 1.0
    assert one("ridgeline_thread_on_cpu_seconds_total", tid=8) == 1.0
    assert one("ridgeline_agent_probe_drops_total", probe="sched") == 1
    assert one("ridgeline_agent_cpu_ratio") == 0.02


def test_new_served_processes_become_sched_targets(tmp_path):
    class Source(Probe):
        name = "cupti"

        def __init__(self):
            super().__init__()
            self.news = [{"new_pids": [(777, "vllm")], "status": {777: "CUPTI conflict"}}, {"closed_pids": [777]}]

        def poll(self):
            return self.news.pop(0) if self.news else {}

    class Sched(Probe):
        name = "sched"

        def __init__(self):
            super().__init__()
            self.targets = set()
            self.log = []

        def add_target(self, pid):
            self.targets.add(pid)
            self.log.append(("add", pid))

        def remove_target(self, pid):
            self.targets.discard(pid)
            self.log.append(("remove", pid))

    cfg = cfg_for(tmp_path)
    sched = Sched()
    agent = Agent(cfg, probes=[running(Source(), "cupti"), running(sched, "sched")], codec=codec,
                  notifier=Notifier({}))
    agent.start()
    try:
        agent._poll_once()
        assert sched.targets == {777}
        agent._poll_once()
        assert sched.log == [("add", 777), ("remove", 777)]
        assert agent.builder.engine == {}          # process news is not engine data
    finally:
        agent.shutdown()


def test_a_failing_window_costs_one_window_not_the_agent(tmp_path, monkeypatch):
    cfg = cfg_for(tmp_path)
    replay = replay_of(literal_trace())
    agent = Agent(cfg, probes=[running(replay)], codec=codec, notifier=Notifier({}))
    calls = {"n": 0}
    real = agent.codec.encode_window

    class Codec:
        def __getattr__(self, name):
            return getattr(codec, name)

        def encode_window(self, w):
            calls["n"] += 1
            if calls["n"] == 2:
                raise ValueError("unencodable figure")
            return real(w)

    agent.codec = Codec()
    t = start_agent(agent)
    sub = Subscriber(cfg.publisher.endpoint, codec=codec, topics=("health",))
    try:
        health = collect(sub, 60, until=lambda h: h[-1].payload["loop_errors"] == 1)
    finally:
        agent.request_stop()
        t.join(60)
        agent.shutdown()
        sub.close()
    assert t is not None and agent.loop_errors == 1
    assert health and health[-1].payload["loop_errors"] == 1


def test_host_name_as_dcgm_exporter_names_it(tmp_path, monkeypatch):
    # dcgm-exporter's Hostname is $NODE_NAME when set (its DaemonSet sets it from
    # spec.nodeName), else the host name; in a pod the host name is the pod's.
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    assert Agent(cfg_for(tmp_path), probes=[], codec=codec, notifier=Notifier({})).host == "gpu-node-7"
    assert Agent(cfg_for(tmp_path, host="given"), probes=[], codec=codec, notifier=Notifier({})).host == "given"
    monkeypatch.delenv("NODE_NAME")
    assert Agent(cfg_for(tmp_path), probes=[], codec=codec, notifier=Notifier({})).host == socket.gethostname()


def test_an_engine_endpoint_that_does_not_answer_is_warned_once(tmp_path, caplog):
    """Issue 24.3: no engine at the configured endpoint -> one warning with the endpoint and
    the error (not 40 s of silence); one line when it answers again."""
    import logging

    from support.engine_samples import V011, MetricsServer, sample_text

    from ridgeline.probes.engine import EngineProbe
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    with MetricsServer(sample_text(V011), status=503) as srv:
        probe = EngineProbe(urls=[dead, srv.url], discover=False, timeout_s=2.0)
        agent = Agent(cfg_for(tmp_path), probes=[running(probe, "engine")], codec=codec, notifier=Notifier({}))
        agent.start()
        try:
            with caplog.at_level(logging.INFO, logger="ridgeline"):
                for now_s in (1e6, 2e6, 3e6):        # three scrape rounds past any back-off
                    probe.scrape_due(now_s)
                    agent._poll_once()
                warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
                assert len(warned) == 2, warned
                (refused,) = [w for w in warned if dead in w]
                assert refused == (f"engine endpoint {dead} not answering: cannot reach (Connection refused) "
                                   "(retrying with back-off; said once until it answers)"), refused
                (http,) = [w for w in warned if srv.url in w]
                assert http.startswith(f"engine endpoint {srv.url} not answering: HTTP 503"), http
                assert set(agent.engine_down) == {dead, srv.url}
                caplog.clear()
                srv.status = 200
                probe.scrape_due(4e6)
                agent._poll_once()
                assert [r.getMessage() for r in caplog.records if "answering again" in r.getMessage()] == [
                    f"engine endpoint {srv.url} answering again"]
                assert not [r for r in caplog.records if r.levelno == logging.WARNING]
                assert set(agent.engine_down) == {dead}
        finally:
            agent.shutdown()
