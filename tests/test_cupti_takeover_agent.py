"""A torch.profiler takeover of legacy CUPTI, as the running agent shows and ends it.

The served process is the real injection library over the stand-in libcupti
(probes/native/tests/stub_cupti.c), which plays Kineto's CuptiActivityApi calls: on
start cuptiActivityRegisterCallbacks with its own functions, on stop a forced flush and
cuptiActivityDisable of its kinds, and here no cuptiFinalize (TEARDOWN_CUPTI unset, the
default; torch.compile's CUDA-graph mode forces it to 0). On CUPTI 12.x/13.0/13.1 the
library cannot tell that the other tool is done: only the agent's reclaim resumes it.

The agent is the real daemon (real CuptiProbe, wire codec, publisher and /metrics);
``ridgeline check`` and ``ridgeline cupti reclaim`` run as the operator runs them, in
subprocesses. /metrics is checked with Prometheus' own promtool.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from support.cupti_stub import StubApp, built  # noqa: F401  (the build fixture)
from support.net import free_port

from ridgeline.agent import config
from ridgeline.agent.daemon import Agent
from ridgeline.agent.registry import STEPS, Running
from ridgeline.agent.sdnotify import Notifier
from ridgeline.agent.subscriber import Subscriber
from ridgeline.probes.cupti.probe import CuptiProbe
from ridgeline.probes.probe import Availability

ROOT = Path(__file__).resolve().parent.parent
PROMTOOL = shutil.which("promtool")


class Host:
    """A running agent with the CUPTI probe, its config file, and a health reader."""

    def __init__(self, tmp: Path, reclaim_after_s: float = 0.0):
        self.sock = tmp / "cupti.sock"
        self.port = free_port()
        self.cfg = config.overlay(config.defaults(), {
            "agent": {"window_s": 0.2},
            "publisher": {"endpoint": f"ipc://{tmp}/stream.sock"},
            "prometheus": {"enabled": True, "listen": f"127.0.0.1:{self.port}"},
            "probes": {"enabled": [], "cupti": {"socket": str(self.sock), "reclaim_after_s": reclaim_after_s}},
        })
        self.cfg_path = tmp / "agent.toml"
        self.cfg_path.write_text(config.to_toml(self.cfg))
        self.probe = CuptiProbe(str(self.sock))
        self.probe.start()
        self.agent = Agent(self.cfg, probes=[Running(STEPS["cupti"], self.probe, Availability(True))],
                           notifier=Notifier({}))
        self.agent.start()
        self.thread = threading.Thread(target=self.agent.run, daemon=True)
        self.thread.start()
        self.sub = Subscriber(self.cfg.publisher.endpoint, topics=["health"])
        self.health: dict = {}

    def wait(self, what, seconds: float) -> dict:
        """The first health record for which ``what(record)`` holds."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            m = self.sub.receive(0.1)
            if m is not None and m.topic == "health":
                self.health = m.payload
                if what(m.payload):
                    return m.payload
        raise AssertionError(f"no such health record within {seconds} s; last: "
                             f"{ {k: v for k, v in self.health.items() if k.startswith('cupti')} }")

    def records(self) -> int:
        return int(self.health.get("probes", {}).get("cupti", {}).get("records", 0))

    def cli(self, *args) -> subprocess.CompletedProcess:
        # The commands' own waits for the agent (a health record, a reclaim request taken)
        # default to two windows + 1 s, 1.4 s here: generous ones for a loaded host (they
        # return as soon as the agent answers).
        wait = {"check": ["--agent-timeout", "30"], "cupti": ["--timeout", "30"]}.get(args[0], [])
        return subprocess.run([sys.executable, "-m", "ridgeline", *args, *wait, "--config", str(self.cfg_path)],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)

    def close(self):
        self.agent.request_stop()
        self.thread.join(60)
        self.agent.shutdown()
        self.sub.close()


@pytest.fixture
def host(tmp_path, request):
    h = Host(tmp_path, **getattr(request, "param", {}))
    yield h
    h.close()


def taken(pid):
    return lambda h: [t["pid"] for t in h.get("cupti_taken_over", [])] == [pid]


def _take_over(host: Host, app: StubApp, stop: bool = True) -> dict:
    """Our kernels arrive; torch.profiler starts (and, with ``stop``, stops without teardown)."""
    app("emit 5 0 100")
    host.wait(lambda h: h.get("probes", {}).get("cupti", {}).get("records", 0) >= 5, 60)
    # Into a buffer of ours that is still inside CUPTI when Kineto starts: held back from
    # our periodic flush (a record in flight) until after the takeover, so no flush can
    # return it to us between the two calls (the race a loaded CI host lost once). CUPTI
    # then completes it to Kineto's callback, which drops and leaks it.
    app("hold 1")
    app("emit 3 0 200")
    assert app("kineto_start")["rc"] == 0
    app("hold 0")
    app("emit 4 0 300")                 # Kineto's
    h = host.wait(taken(app.p.pid), 60)
    if stop:
        app("kineto_stop 0")            # kinds disabled, CUPTI not finalized: the library waits
    return h


def test_takeover_shows_in_health_check_and_metrics_and_the_operator_reclaim_ends_it(host):
    app = StubApp(host.sock, RIDGELINE_FLUSH_MS=100)
    try:
        h = _take_over(host, app)
        (t,) = h["cupti_taken_over"]
        assert h["cupti_processes_taken_over"] == 1
        assert "takeover:" in t["status"] and "paused" in t["status"]
        assert abs(t["since_unix_s"] - time.time()) < 30 and t["reclaims_requested"] == 0
        # reclaim_after_s = 0: nobody asks by itself, the process stays paused
        h = host.wait(lambda h: h["cupti_taken_over"] and h["cupti_taken_over"][0]["taken_over_s"] >= 1.5, 60)
        assert h["cupti_reclaims_requested"] == 0
        paused_records = host.records()

        r = host.cli("check", "--json")
        assert r.returncode == 1, r.stdout + r.stderr
        out = json.loads(r.stdout)
        assert out["ok"] is False and out["agent"]["reachable"] is True
        assert out["agent"]["cupti_processes_taken_over"] == 1
        assert [x["pid"] for x in out["agent"]["cupti_taken_over"]] == [app.p.pid]
        assert "takeover:" in out["agent"]["cupti_taken_over"][0]["status"]
        r = host.cli("check")
        assert r.returncode == 1 and "ridgeline: error: check: CUPTI of 1 served process" in r.stderr
        assert f"pid {app.p.pid}: CUPTI taken over by another tool since" in r.stdout
        assert f"ridgeline cupti reclaim --pid {app.p.pid}" in r.stdout

        text = httpx.get(f"http://127.0.0.1:{host.port}/metrics", timeout=30).text
        line = [x for x in text.splitlines() if x.startswith("ridgeline_agent_cupti_processes_taken_over{")]
        assert line and line[0].endswith(" 1.0"), line
        if PROMTOOL:
            p = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
            assert p.returncode == 0, p.stdout + p.stderr

        r = host.cli("cupti", "reclaim", "--pid", str(app.p.pid))
        assert r.returncode == 0, r.stderr
        assert f"asked pid(s) {app.p.pid} to reclaim CUPTI" in r.stdout
        host.wait(lambda h: h["cupti_taken_over"] == [], 60)
        assert host.records() == paused_records          # nothing came while paused
        app("emit 3 0 500")
        host.wait(lambda h: h["probes"]["cupti"]["records"] >= paused_records + 3, 60)
        text = httpx.get(f"http://127.0.0.1:{host.port}/metrics", timeout=30).text
        assert any(x.startswith("ridgeline_agent_cupti_processes_taken_over{") and x.endswith(" 0.0")
                   for x in text.splitlines())
        r = host.cli("check", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["agent"]["cupti_taken_over"] == []
        counters = app("counters")
    finally:
        app.close()
    assert counters["takeovers"] == 1 and counters["reclaims"] == 1


@pytest.mark.parametrize("host", [{"reclaim_after_s": 1.0}], indirect=True)
def test_the_reclaim_policy_brings_records_back_without_the_operator(host):
    app = StubApp(host.sock, RIDGELINE_FLUSH_MS=100)
    try:
        _take_over(host, app)
        paused_records = host.records()
        h = host.wait(lambda h: h["cupti_taken_over"] == [], 60)
        assert h["cupti_reclaims_requested"] == 1
        app("emit 3 0 600")
        host.wait(lambda h: h["probes"]["cupti"]["records"] >= paused_records + 3, 60)
        counters = app("counters")
    finally:
        app.close()
    assert counters["reclaims"] == 1


def test_check_without_a_running_agent_says_so(tmp_path):
    cfg = config.overlay(config.defaults(), {"publisher": {"endpoint": f"ipc://{tmp_path}/none.sock"},
                                             "probes": {"enabled": []}})
    (tmp_path / "a.toml").write_text(config.to_toml(cfg))
    r = subprocess.run([sys.executable, "-m", "ridgeline", "check", "--json", "--config", str(tmp_path / "a.toml")],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    agent = json.loads(r.stdout)["agent"]
    assert agent["reachable"] is False and "is `ridgeline agent` running?" in agent["reason"]


def test_reclaim_without_an_agent_is_a_runtime_failure_and_leaves_no_request(tmp_path):
    cfg = config.overlay(config.defaults(), {"agent": {"window_s": 0.1},
                                             "probes": {"cupti": {"socket": str(tmp_path / "c.sock")}}})
    (tmp_path / "a.toml").write_text(config.to_toml(cfg))
    r = subprocess.run([sys.executable, "-m", "ridgeline", "cupti", "reclaim", "--config", str(tmp_path / "a.toml")],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1 and "did not take" in r.stderr, r.stderr
    assert not (tmp_path / "cupti-reclaim.request").exists()
    r = subprocess.run([sys.executable, "-m", "ridgeline", "cupti", "reclaim", "--pid", "0"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "--pid" in r.stderr


def test_a_reclaim_while_torch_profiler_still_collects_leaves_its_buffers_to_it(host):
    # The operator's reclaim came too early: Kineto still has a buffer inside CUPTI, which
    # CUPTI then completes to Ridgeline's callback. Kineto owns it (the stand-in allocates
    # it with mmap, so a free() by anyone else aborts the process, as Kineto's own
    # delete of a freed buffer would); the library reads it and leaves it alone.
    app = StubApp(host.sock, RIDGELINE_FLUSH_MS=100)
    try:
        _take_over(host, app, stop=False)
        paused_records = host.records()
        app("hold 1")                     # a long kernel: Kineto's current buffer stays in CUPTI
        app("emit 2 0 900")
        r = host.cli("cupti", "reclaim")
        assert r.returncode == 0 and str(app.p.pid) in r.stdout, r.stderr
        host.wait(lambda h: h["cupti_taken_over"] == [], 60)
        app("hold 0")                     # CUPTI completes Kineto's buffer, now to Ridgeline
        host.wait(lambda h: h["probes"]["cupti"]["records"] >= paused_records + 2, 60)
        counters = app("counters")        # the served process is alive
        app("kineto_stop 0")
    finally:
        err = app.close()
    assert counters["reclaims"] == 1 and "free()" not in err and "double free" not in err
