"""Prometheus' own tools and server started for a test (Debian's `prometheus` package,
which scripts/setup.sh installs), the agent on the simulator in front of them, and what the
rules and the dashboard read (tests/test_deploy_prometheus*.py).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support.net import free_port

ROOT = Path(__file__).resolve().parents[2]


RULES = ROOT / "deploy" / "prometheus" / "ridgeline-rules.yml"


DASHBOARD = ROOT / "deploy" / "grafana" / "ridgeline-dashboard.json"


PROMTOOL = shutil.which("promtool")


PROMETHEUS = shutil.which("prometheus")


needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not on PATH: install Debian's 'prometheus' package (scripts/setup.sh does)")


needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="prometheus server not on PATH: install Debian's 'prometheus' package (scripts/setup.sh does)")


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target and template variable of the dashboard."""
    d = json.loads(DASHBOARD.read_text())
    out = [(p["title"], t["expr"]) for p in d["panels"] for t in p.get("targets", [])]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v["query"])
            out.append((f"variable {v['name']}", m.group(1)))
    return out


def concrete(expr: str) -> str:
    """Grafana's variables replaced as Grafana would with 'All' selected."""
    return (expr.replace("$__rate_interval", "15s").replace('=~"$host"', '=~".*"')
            .replace('=~"$gpu"', '=~".*"').replace('=~"$pid"', '=~".*"'))


# Series a vLLM V1 server without a KV connector does not export, so the agent must not
# expose them either (unknown, never a made-up figure): the real-server test checks they
# stay absent while everything else returns data.
ABSENT_ON_VLLM_V1 = {
    "ridgeline_engine_swapped_requests": "num_requests_swapped is vLLM V0 only",
    "ridgeline_engine_kv_evicted_tokens_per_second": "vLLM exports no eviction counter (SGLang evicted_tokens_total)",
    "ridgeline_engine_external_prefix_cache_hit_ratio": "no KV connector (LMCache/NIXL) on the simulated server",
}


# Series the agent exposes only where the cupti probe runs (the simulator test has none):
# they must stay absent there, never a made-up zero.
ABSENT_WITHOUT_CUPTI = {
    "ridgeline_agent_cupti_processes_taken_over": "absent when the cupti probe does not run",
    "ridgeline_agent_cupti_processes_taken_over_by_user": "absent when the cupti probe does not run",
    "ridgeline_agent_cupti_refused_connections_total": "the CUPTI socket's counters, absent without the probe",
}


ABSENT_ON_SIMULATOR = {**ABSENT_ON_VLLM_V1, **ABSENT_WITHOUT_CUPTI}


def first_line_with(proc: subprocess.Popen, text: str, timeout_s: float) -> str | None:
    """The first line of ``proc``'s stdout containing ``text``, read on a thread so a
    silent or hung process cannot block the test past ``timeout_s``."""
    import queue
    import threading
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in iter(proc.stdout.readline, "")] and None,
                     daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                return None
            continue
        if text in line:
            return line
    return None


def http_get(url: str) -> bytes:
    try:
        r = httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return b""
    return r.content if r.status_code == 200 else b""


def start_on_free_port(command, ready, log: Path, env: dict, procs: list, tries: int = 3, timeout_s: float = 60):
    """Start ``command(port)`` on a port found free; ``ready(port)`` says it serves. A port
    taken in between by another test (the process exits, or someone else answers) is
    retried on a new one. Returns (process, port); every process started is in ``procs``."""
    for _ in range(tries):
        port = free_port()
        p = subprocess.Popen(command(port), stdout=open(log, "a"), stderr=subprocess.STDOUT, env=env)
        procs.append(p)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and p.poll() is None:
            if ready(port):
                return p, port
            time.sleep(0.3)
        if p.poll() is None:
            p.kill()
            p.wait()
    raise AssertionError(f"{command(0)[0]} did not come up in {tries} tries: {log.read_text()[-3000:]}")


def selectors(expr: str) -> list[str]:
    """Metric names an expression reads."""
    return sorted(set(re.findall(r"\b((?:ridgeline|up)[a-z0-9_:]*)\b(?=\s*[\[{)]|\s*$|\s*[<>=!])", expr)))


def start_simulator(tmp_path: Path, env: dict, procs: list) -> tuple[subprocess.Popen, int]:
    """`ridgeline simulate` serving vLLM's /metrics in the KV-capacity regime (as
    tests/test_simulator_regimes): 4 GB pool, 1k-token prompts, 512-token outputs; 2 req/s,
    then 16 req/s (past the pool), then 1 req/s; 4x real time. Returns (process, port)."""
    (tmp_path / "rate.csv").write_text("10,2\n10,16\n600,1\n")
    sim = subprocess.Popen([sys.executable, "-m", "ridgeline", "simulate", "--serve-metrics", "0",
                            "--recorded-rate", str(tmp_path / "rate.csv"), "--kv-cache-gb", "4", "--prompt-mean",
                            "1024", "--output-mean", "512", "--output-max", "2048", "--seed", "3", "--speed", "4"],
                           stdout=subprocess.PIPE, stderr=open(tmp_path / "sim.log", "w"), text=True, env=env)
    procs.append(sim)
    line = first_line_with(sim, "metrics on http://127.0.0.1:", 60)
    assert line, (tmp_path / "sim.log").read_text()
    return sim, int(line.rsplit(":", 1)[1].split("/")[0])


def agent_toml(host: str, metrics_port: int, probes: list[str], sim_pid: int, sim_port: int) -> str:
    """An agent config on the simulator: its engine endpoint scraped, /metrics on ``metrics_port``."""
    return f"""
[agent]
window_s = 1.0
host = "{host}"
[analysis]
model = "llama-3-8b"
[publisher]
endpoint = "tcp://127.0.0.1:{free_port()}"
[prometheus]
listen = "127.0.0.1:{metrics_port}"
[probes]
enabled = {json.dumps(probes)}
pids = [{sim_pid}]
[probes.engine]
url = "http://127.0.0.1:{sim_port}/metrics"
interval_s = 1.0
[probes.simulator]
gpu = "h100"
model = "llama-3-8b"
rate_per_s = 2.0
pid = {sim_pid}
"""


def serves_metrics(port: int) -> bool:
    return b"ridgeline_build_info" in http_get(f"http://127.0.0.1:{port}/metrics")


def api_get(base: str, path: str, **params) -> httpx.Response:
    """Prometheus' API answer; a server still starting answers 503 (its rule manager or
    query engine not ready yet), which is waited out for 60 s, not failed on."""
    deadline = time.monotonic() + 60
    while True:
        try:
            r = httpx.get(f"{base}/{path}", params=params, timeout=10)
            if r.status_code != 503:
                return r
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"Prometheus API {path} unavailable for 60 s"
        time.sleep(1)


def rule_checks(groups: list) -> tuple[list, list, list]:
    """From the rule groups a server loaded (its own parse of the files): (checks, absent,
    recorded): each recording rule's series and expression must return data; each series an
    alert reads must have existed within 10 minutes (an episode's elapsed time exists only
    while one is open, its recovery time only after it closed), or stay absent where only
    the cupti probe exposes it; ``recorded`` names the recording rules."""
    checks, absent, recorded = [], [], []
    for g in groups:
        for r in g["rules"]:
            if r["type"] == "recording":
                recorded.append(r["name"])
                checks.append((f"record {r['name']}", r["name"]))
                checks.append((f"record expr {r['name']}", r["query"]))
            else:
                for name in selectors(r["query"]):
                    if name in ABSENT_WITHOUT_CUPTI:
                        absent.append((f"alert {r['name']} reads {name}", name))
                    else:
                        checks.append((f"alert {r['name']} reads {name}", f"max_over_time({name}[10m])"))
    return checks, absent, recorded
