"""deploy/prometheus rules and deploy/grafana dashboard, checked by Prometheus itself.

* ``promtool check rules`` and ``promtool test rules`` (series written in
  deploy/prometheus/ridgeline-rules.test.yml);
* a real Prometheus server (Debian's ``prometheus`` package) scrapes the agent running on
  the simulator (KV-capacity regime: arrivals ramp past the KV pool, then fall back),
  evaluates the rules, and every dashboard query, every recording rule and every metric
  an alert reads returns data through its HTTP API.

Both binaries come from Debian's ``prometheus`` package (scripts/setup.sh installs it);
without them the tests skip with that reason.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "ridgeline-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "ridgeline-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "ridgeline-dashboard.json"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not on PATH: install Debian's 'prometheus' package (scripts/setup.sh does)")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="prometheus server not on PATH: install Debian's 'prometheus' package (scripts/setup.sh does)")


@needs_promtool
def test_promtool_check_rules():
    r = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    print(r.stdout, r.stderr)
    assert r.returncode == 0 and "SUCCESS: 22 rules found" in r.stdout, r.stdout + r.stderr


@needs_promtool
def test_promtool_test_rules():
    r = subprocess.run([PROMTOOL, "test", "rules", RULE_TESTS.name], capture_output=True, text=True, timeout=120,
                       cwd=RULE_TESTS.parent)
    print(r.stdout, r.stderr)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


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


def literal_exposition() -> str:
    """/metrics for a literal window: vLLM + SGLang endpoints (a preemption episode open),
    NVML, threads, and an agent section with a CUPTI takeover, socket refusals, engine
    scrape failures and lost batches (the series the collection-health rules read)."""
    from test_agent_prometheus import engine_section, exposition, thread, window
    w = window([thread(8, 5, launches=3)], engine=engine_section())
    w["agent"].update(cupti_processes_taken_over=1, dropped_records=1, dropped_batches=2,
                      cupti_taken_over_by_uid={"1000": 1})
    w["agent"]["probes"]["engine"] = {"drops": 0, "errors": 3, "scrape_failures": {"too_large": 3, "timeout": 0}}
    return exposition([w])


def exposed_names(text: str) -> set[str]:
    return set(re.findall(r"^([a-z_:]+)[{ ]", text, re.M))


def test_dashboard_queries_only_use_exposed_or_recorded_names():
    """Without a Prometheus server: every name a panel reads is a recording rule or a family
    the collector exposes for a literal window (vLLM + SGLang endpoints, NVML, threads)."""
    recorded = set(re.findall(r"^\s*- record: (\S+)$", RULES.read_text(), re.M))
    assert len(recorded) == 10
    exposed = exposed_names(literal_exposition())
    for title, expr in dashboard_queries():
        for name in re.findall(r"\b(ridgeline[:_][a-z0-9_:]+)", expr):
            if name in ("ridgeline_engine_swapped_requests", "ridgeline_engine_external_prefix_cache_hit_ratio",
                        "ridgeline_engine_preemption_recovery_seconds", "ridgeline_engine_prompt_tokens_cached_ratio"):
                continue   # V0 / KV-connector / recovered-episode figures: test_engine_metrics, test_preemption_episodes
            assert name in recorded or name in exposed or f"{name}_bucket" in exposed, (title, name)


def test_rules_read_only_series_the_agent_exposes():
    """No rule reads an invented series: every ridgeline_* name in the rules file is a
    recording rule or a family the collector exposes (the literal window above), and the
    new collection-health rules read the families they were written for."""
    rules = RULES.read_text()
    recorded = set(re.findall(r"^\s*- record: (\S+)$", rules, re.M))
    exposed = exposed_names(literal_exposition())
    exprs = re.findall(r"^\s*expr: (?:\|\n((?:\s{10}.*\n)+)|(.*)$)", rules, re.M)
    assert len(exprs) == 22
    read = {n for block, line in exprs for n in re.findall(r"\b(ridgeline[:_][a-z0-9_:]+)", block or line)}
    assert read <= recorded | exposed, sorted(read - recorded - exposed)
    for name in ("ridgeline_agent_cupti_processes_taken_over_by_user", "ridgeline_agent_cupti_refused_connections_total",
                 "ridgeline_agent_engine_scrape_failures_total", "ridgeline_engine_preemption_episode_elapsed_seconds",
                 "ridgeline_agent_dropped_batches_total", "ridgeline_agent_window_dropped_events_total",
                 "ridgeline_agent_window_fold_errors_total"):
        assert name in read, name


def test_collection_health_rules_label_values_exist():
    """The label values the rules select on are the ones the agent writes: refusal reasons
    (agent/prometheus.py) and scrape-failure kinds (probes/engine.py FAILURE_KINDS)."""
    from ridgeline.probes.engine import FAILURE_KINDS
    text = literal_exposition()
    reasons = set(re.findall(r'^ridgeline_agent_cupti_refused_connections_total\{.*reason="(\w+)"', text, re.M))
    assert reasons == {"limit", "per_user", "peer_identity"}
    rules = RULES.read_text()
    assert 'reason=~"limit|per_user"' in rules and 'reason="peer_identity"' in rules
    for kind in re.findall(r'eq \$labels\.kind \\"(\w+)\\"', rules):
        assert kind in FAILURE_KINDS, kind


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@needs_prometheus
def test_real_prometheus_scrapes_agent_on_simulator(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    py = [sys.executable, "-m", "ridgeline"]
    procs: list[subprocess.Popen] = []
    # KV-capacity regime (as tests/test_simulator_regimes): 4 GB pool, 1k-token prompts,
    # 512-token outputs; 2 req/s, then 16 req/s (past the pool), then 1 req/s; 4x real time.
    (tmp_path / "rate.csv").write_text("10,2\n10,16\n600,1\n")
    sim = subprocess.Popen(py + ["simulate", "--serve-metrics", "0", "--recorded-rate", str(tmp_path / "rate.csv"),
                                 "--kv-cache-gb", "4", "--prompt-mean", "1024", "--output-mean", "512",
                                 "--output-max", "2048", "--seed", "3", "--speed", "4"],
                           stdout=subprocess.PIPE, stderr=open(tmp_path / "sim.log", "w"), text=True, env=env)
    procs.append(sim)
    try:
        line = first_line_with(sim, "metrics on http://127.0.0.1:", 60)
        assert line, (tmp_path / "sim.log").read_text()
        sim_port = int(line.rsplit(":", 1)[1].split("/")[0])
        agent_port = None

        def agent_config(port):
            (tmp_path / "agent.toml").write_text(f"""
[agent]
window_s = 1.0
host = "sim-host"
[analysis]
model = "llama-3-8b"
[publisher]
endpoint = "tcp://127.0.0.1:{free_port()}"
[prometheus]
listen = "127.0.0.1:{port}"
[probes]
enabled = ["sched", "simulator", "engine"]
pids = [{sim.pid}]
[probes.engine]
url = "http://127.0.0.1:{sim_port}/metrics"
interval_s = 1.0
[probes.simulator]
gpu = "h100"
model = "llama-3-8b"
rate_per_s = 2.0
pid = {sim.pid}
""")
            return py + ["agent", "--config", str(tmp_path / "agent.toml")]

        agent, agent_port = start_on_free_port(
            agent_config, lambda port: b"ridgeline_build_info" in http_get(f"http://127.0.0.1:{port}/metrics"),
            tmp_path / "agent.log", env, procs)
        (tmp_path / "prometheus.yml").write_text(f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: ridgeline
    static_configs: [{{targets: ["127.0.0.1:{agent_port}"]}}]
""")
        prom, prom_port = start_on_free_port(
            lambda port: [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                          f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
            lambda port: http_get(f"http://127.0.0.1:{port}/-/ready").startswith(b"Prometheus Server is Ready"),
            tmp_path / "prometheus.log", env, procs)
        api = f"http://127.0.0.1:{prom_port}/api/v1"

        def api_get(path, **params):
            """The API's JSON answer; a server still starting answers 503 (its rule manager
            or query engine not ready yet), which is waited out for 60 s, not failed on."""
            deadline = time.monotonic() + 60
            while True:
                try:
                    r = httpx.get(f"{api}/{path}", params=params, timeout=10)
                    if r.status_code != 503:
                        return r.json()
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"Prometheus API {path} unavailable for 60 s"
                time.sleep(1)

        def query(expr):
            r = api_get("query", query=expr)
            assert r["status"] == "success", (expr, r)
            return r["data"]["result"]

        checks = [(f"dashboard: {t} #{i}", concrete(e)) for i, (t, e) in enumerate(dashboard_queries())
                  if not any(n in e for n in ABSENT_ON_SIMULATOR)]
        absent = [(f"dashboard: {t}", concrete(e)) for t, e in dashboard_queries()
                  if any(n in e for n in ABSENT_ON_SIMULATOR)]
        assert len(absent) == len(ABSENT_ON_SIMULATOR)
        # The rules as the server loaded them (its own parse of the file).
        deadline = time.monotonic() + 60
        groups = []
        while not groups and time.monotonic() < deadline:
            groups = api_get("rules").get("data", {}).get("groups", [])
            if not groups:
                time.sleep(1)
        assert sum(len(g["rules"]) for g in groups) == 22, groups
        for g in groups:
            for r in g["rules"]:
                if r["type"] == "recording":
                    checks.append((f"record {r['name']}", r["name"]))
                    checks.append((f"record expr {r['name']}", r["query"]))
                else:
                    for name in selectors(r["query"]):
                        if name in ABSENT_WITHOUT_CUPTI:
                            absent.append((f"alert {r['name']} reads {name}", name))
                        else:
                            # Seen during the run: the episode's elapsed time exists only while
                            # an episode is open, its recovery time only after it closed.
                            checks.append((f"alert {r['name']} reads {name}", f"max_over_time({name}[10m])"))
        # Decode's KV-cache reads from the engine's estimate reach the GPU series only when the
        # engine endpoint carries the served process's pid (the URL-configured one included).
        checks.append(("decode KV reads from the engine estimate",
                       'max_over_time(ridgeline_phase_kv_read_bytes_per_second{phase="decode"}[1m])'))
        assert len({w for w, _ in checks}) == len(checks)
        missing: dict[str, str] = {}
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            missing = {what: expr for what, expr in checks if not query(expr)}
            if not missing:
                break
            dead = [name for name, p in (("simulator", sim), ("agent", agent), ("prometheus", prom))
                    if p.poll() is not None]
            assert not dead, (dead, (tmp_path / "agent.log").read_text()[-3000:])
            time.sleep(3)
        report = {what: len(query(expr)) for what, expr in checks}
        out = Path(os.environ.get("RIDGELINE_PROM_REPORT", tmp_path))
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=1))
        samples = {expr: query(expr)[:2] for _, expr in checks}
        (out / "samples.json").write_text(json.dumps(samples, indent=1))
        print(json.dumps(report, indent=1))
        print("targets:", httpx.get(f"{api}/targets", timeout=10).json()["data"]["activeTargets"][0]["health"])
        names = httpx.get(f"{api}/label/__name__/values", timeout=10).json()["data"]
        print("scraped names:", len(names), [n for n in names if n.startswith("ridgeline")])
        print("alerts:", [(a["labels"]["alertname"], a["state"]) for a in
                          httpx.get(f"{api}/alerts", timeout=10).json()["data"]["alerts"]])
        print("recovery:", query("ridgeline_engine_preemption_recovery_seconds"))
        assert not missing, (missing, (tmp_path / "agent.log").read_text()[-3000:])
        # The live exposition itself passes Prometheus' linter.
        live = httpx.get(f"http://127.0.0.1:{agent_port}/metrics", timeout=10).text
        (out / "agent-metrics.txt").write_text(live)
        lint = subprocess.run([PROMTOOL, "check", "metrics"], input=live, capture_output=True, text=True, timeout=60)
        assert lint.returncode == 0, lint.stdout + lint.stderr
        assert all(not query(expr) for _, expr in absent), [e for _, e in absent if query(e)]
        info = query('ridgeline_engine_info{engine="vllm"}')
        assert info and info[0]["metric"].get("kv_eviction_source", "") == "" and info[0]["metric"]["simulated"] == "true"
        # Every engine endpoint (the URL the agent was given, and the simulator probe's own)
        # carries the served process, so engine and phase series join on (Hostname, pid).
        assert sorted(i["metric"].get("pid", "") for i in info) == [str(sim.pid)] * len(info), info
        joined = query("ridgeline_engine_kv_usage_ratio * on (Hostname, pid) group_left() "
                       "max by (Hostname, pid) (ridgeline_phase_time_share_ratio)")
        assert len(joined) == len(info), joined
        assert info[0]["metric"]["work_estimate_source"] == "engine_estimate"
        # The KV-capacity regime opened a preemption episode that recovered, with a finite time.
        rec = query("max(ridgeline_engine_preemption_recovery_seconds)")
        assert rec and 0 < float(rec[0]["value"][1]) < 600, rec
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT if p is sim else signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
