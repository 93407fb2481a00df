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
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from support.prometheus_server import (
    ABSENT_ON_SIMULATOR,
    PROMETHEUS,
    PROMTOOL,
    RULES,
    agent_toml,
    api_get,
    concrete,
    dashboard_queries,
    http_get,
    needs_prometheus,
    needs_promtool,
    rule_checks,
    serves_metrics,
    start_on_free_port,
    start_simulator,
)

ROOT = Path(__file__).resolve().parent.parent
RULE_TESTS = ROOT / "deploy" / "prometheus" / "ridgeline-rules.test.yml"


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


def literal_exposition() -> str:
    """/metrics for a literal window: vLLM + SGLang endpoints (a preemption episode open),
    NVML, threads, and an agent section with a CUPTI takeover, socket refusals, engine
    scrape failures and lost batches (the series the collection-health rules read)."""
    from support.metrics_windows import engine_section, exposition, thread, window
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


@needs_prometheus
def test_real_prometheus_scrapes_agent_on_simulator(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    py = [sys.executable, "-m", "ridgeline"]
    procs: list[subprocess.Popen] = []
    try:
        sim, sim_port = start_simulator(tmp_path, env, procs)
        agent_port = None

        def agent_config(port):
            (tmp_path / "agent.toml").write_text(agent_toml("sim-host", port, ["sched", "simulator", "engine"],
                                                            sim.pid, sim_port))
            return py + ["agent", "--config", str(tmp_path / "agent.toml")]

        agent, agent_port = start_on_free_port(agent_config, serves_metrics, tmp_path / "agent.log", env, procs)
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

        def api_json(path, **params):
            return api_get(api, path, **params).json()

        def query(expr):
            r = api_json("query", query=expr)
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
            groups = api_json("rules").get("data", {}).get("groups", [])
            if not groups:
                time.sleep(1)
        assert sum(len(g["rules"]) for g in groups) == 22, groups
        more, more_absent, _ = rule_checks(groups)
        checks, absent = checks + more, absent + more_absent
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
