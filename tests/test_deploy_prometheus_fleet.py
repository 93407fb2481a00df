"""Prometheus' own fleet path, on loopback with real binaries (docs/metrics.md, "Fleet").

Two Ridgeline agents (hosts ``sim-a`` and ``sim-b``) watch one simulated vLLM server in
the KV-capacity regime (as tests/test_deploy_prometheus.py). Each is scraped by its own
Prometheus in **agent mode** (``--enable-feature=agent``: Prometheus 2.x's spelling of 3.x's
``--agent``), in cluster ``east`` and ``west`` (``external_labels``), which remote-write to
a central Prometheus with ``--web.enable-remote-write-receiver`` and the rules loaded
(deploy/prometheus/ridgeline-rules.yml and ridgeline-fleet-rules.yml). On the central one,
through its HTTP API: every dashboard query, every recording rule of both files (by name
and by expression), every series an alert reads, the fleet rules per model and per cluster
for both clusters, and the absent-on-the-simulator series still absent. The agents keep
no queryable store (their query API refuses), so everything seen came by remote write.

Binaries: Debian's ``prometheus`` package (scripts/setup.sh installs it); without them the
test skips with that reason.
"""
from __future__ import annotations

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
FLEET_RULES = ROOT / "deploy" / "prometheus" / "ridgeline-fleet-rules.yml"
FLEET_RULE_TESTS = ROOT / "deploy" / "prometheus" / "ridgeline-fleet-rules.test.yml"
AGENT_EXAMPLE = ROOT / "deploy" / "prometheus" / "prometheus-agent.yml"
CLUSTERS = {"east": "sim-a", "west": "sim-b"}


def agent_mode_config(example: str, cluster: str, target: str, central: str) -> str:
    """The shipped example (deploy/prometheus/prometheus-agent.yml) with this test's
    cluster, target and central URL put in, and 1 s intervals; nothing else changed."""
    text = example.replace("cluster: gpu-east-1", f"cluster: {cluster}")
    text = text.replace('targets: ["gpu-node-1:9464", "gpu-node-2:9464"]', f'targets: ["{target}"]')
    text = text.replace("http://prometheus-central:9090/api/v1/write", f"{central}/api/v1/write")
    text = text.replace("scrape_interval: 15s", "scrape_interval: 1s")
    text = text.replace("max_samples_per_send: 2000", "max_samples_per_send: 2000\n      batch_send_deadline: 1s")
    assert text.count(cluster) == 1 and target in text and central in text and "batch_send_deadline" in text
    return text


@needs_promtool
def test_promtool_checks_and_unit_tests_the_fleet_rules():
    r = subprocess.run([PROMTOOL, "check", "rules", str(FLEET_RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS: 16 rules found" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([PROMTOOL, "test", "rules", FLEET_RULE_TESTS.name], capture_output=True, text=True,
                       timeout=120, cwd=FLEET_RULE_TESTS.parent)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


@needs_promtool
def test_the_agent_example_is_a_valid_agent_mode_config():
    r = subprocess.run([PROMTOOL, "check", "config", "--agent", str(AGENT_EXAMPLE)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_prometheus
def test_agent_mode_remote_writes_to_central_where_dashboard_rules_and_fleet_rules_work(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    py = [sys.executable, "-m", "ridgeline"]
    procs: list[subprocess.Popen] = []
    try:
        sim, sim_port = start_simulator(tmp_path, env, procs)

        def ridgeline_agent(host: str, probes: list[str]):
            def command(port):
                cfg = tmp_path / f"{host}.toml"
                cfg.write_text(agent_toml(host, port, probes, sim.pid, sim_port))
                return py + ["agent", "--config", str(cfg)]
            return start_on_free_port(command, serves_metrics, tmp_path / f"{host}.log", env, procs)

        # sim-a has the scheduling probe (the dashboard's launch-thread panel); sim-b not,
        # which keeps the CPU cost of the test down.
        agents = {"sim-a": ridgeline_agent("sim-a", ["sched", "simulator", "engine"]),
                  "sim-b": ridgeline_agent("sim-b", ["simulator", "engine"])}

        (tmp_path / "central.yml").write_text(f"""
global:
  evaluation_interval: 1s
rule_files: ["{RULES}", "{FLEET_RULES}"]
""")
        central, central_port = start_on_free_port(
            lambda port: [PROMETHEUS, f"--config.file={tmp_path / 'central.yml'}", "--web.enable-remote-write-receiver",
                          f"--storage.tsdb.path={tmp_path / 'central-tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
            lambda port: http_get(f"http://127.0.0.1:{port}/-/ready").startswith(b"Prometheus Server is Ready"),
            tmp_path / "central.log", env, procs)
        central_url = f"http://127.0.0.1:{central_port}"
        prom_agents = {}
        example = AGENT_EXAMPLE.read_text()
        for cluster, host in CLUSTERS.items():
            cfg = tmp_path / f"agent-{cluster}.yml"
            cfg.write_text(agent_mode_config(example, cluster, f"127.0.0.1:{agents[host][1]}", central_url))
            lint = subprocess.run([PROMTOOL, "check", "config", "--agent", str(cfg)],
                                  capture_output=True, text=True, timeout=60)
            assert lint.returncode == 0, lint.stdout + lint.stderr
            prom_agents[cluster] = start_on_free_port(
                lambda port, cfg=cfg, cluster=cluster: [
                    PROMETHEUS, "--enable-feature=agent", f"--config.file={cfg}",
                    f"--storage.agent.path={tmp_path / ('wal-' + cluster)}", f"--web.listen-address=127.0.0.1:{port}"],
                lambda port: http_get(f"http://127.0.0.1:{port}/-/ready").startswith(b"Prometheus Agent is Ready"),
                tmp_path / f"agent-{cluster}.log", env, procs)
        api = f"{central_url}/api/v1"

        def query(expr):
            r = api_get(api, "query", query=expr).json()
            assert r["status"] == "success", (expr, r)
            return r["data"]["result"]

        # The agents are in agent mode: no local queries, so the data below came by remote write.
        for cluster, (_, port) in prom_agents.items():
            r = api_get(f"http://127.0.0.1:{port}/api/v1", "query", query="up")
            assert r.status_code == 422 and "unavailable with Prometheus Agent" in r.text, (cluster, r.text[:300])

        checks = [(f"dashboard: {t} #{i}", concrete(e)) for i, (t, e) in enumerate(dashboard_queries())
                  if not any(n in e for n in ABSENT_ON_SIMULATOR)]
        absent = [(f"dashboard: {t}", concrete(e)) for t, e in dashboard_queries()
                  if any(n in e for n in ABSENT_ON_SIMULATOR)]
        deadline = time.monotonic() + 60
        groups = []
        while not groups and time.monotonic() < deadline:
            groups = api_get(api, "rules").json().get("data", {}).get("groups", [])
            if not groups:
                time.sleep(1)
        assert sum(len(g["rules"]) for g in groups) == 22 + 16, [g["name"] for g in groups]
        more, more_absent, recorded = rule_checks(groups)
        checks, absent = checks + more, absent + more_absent
        checks.append(("alert RidgelineSeriesOverBudget reads scrape_samples_scraped",
                       'scrape_samples_scraped{job=~"ridgeline.*"}'))
        # The fleet rules per cluster and per model, for both clusters.
        fleet = [n for n in recorded if n.startswith(("cluster:", "cluster_model:"))]
        assert len(fleet) == 15, fleet
        for name in fleet:
            for cluster in CLUSTERS:
                checks.append((f"fleet {name} in {cluster}", f'{name}{{cluster="{cluster}"}}'))
        missing: dict[str, str] = {}
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            missing = {what: expr for what, expr in checks if not query(expr)}
            if not missing:
                break
            dead = [name for name, p in [("simulator", sim), ("central", central)]
                    + [(h, a[0]) for h, a in agents.items()] + [(c, a[0]) for c, a in prom_agents.items()]
                    if p.poll() is not None]
            assert not dead, (dead, (tmp_path / "central.log").read_text()[-2000:])
            time.sleep(3)
        print(f"{len(checks)} checks on the central Prometheus; missing {len(missing)}")
        assert not missing, (missing, (tmp_path / "agent-east.log").read_text()[-2000:])
        assert all(not query(expr) for _, expr in absent), [e for _, e in absent if query(e)]

        # Every rule of both files evaluates on the central server without error (the
        # alerts included, firing or not).
        ruled = [(r["name"], r.get("health"), r.get("lastError", ""))
                 for g in api_get(api, "rules").json()["data"]["groups"] for r in g["rules"]]
        assert len(ruled) == 38 and all(h == "ok" and not e for _, h, e in ruled), \
            [x for x in ruled if x[1] != "ok" or x[2]]
        # Every Ridgeline series arrived with its cluster, and each host in its own.
        assert not query('count({__name__=~"ridgeline_.+", cluster=""})')
        hosts = {(s["metric"]["cluster"], s["metric"]["Hostname"]) for s in query("ridgeline_build_info")}
        assert hosts == {(c, h) for c, h in CLUSTERS.items()}, hosts
        # The per-model rules name the simulated server's model, once per cluster.
        per_model = query("cluster_model:ridgeline_engine_running_requests:sum")
        assert sorted((s["metric"]["cluster"], s["metric"]["model_name"]) for s in per_model) == \
            sorted((c, per_model[0]["metric"]["model_name"]) for c in CLUSTERS), per_model
        assert per_model[0]["metric"]["model_name"]
        up = {s["metric"]["cluster"]: float(s["value"][1]) for s in query("cluster:ridgeline_agents_up:sum")}
        assert up == {"east": 1.0, "west": 1.0}, up
        samples = {s["metric"]["cluster"]: float(s["value"][1]) for s in query("cluster:ridgeline_scrape_samples:max")}
        print("series per host (scrape_samples_scraped):", samples)
        assert all(0 < n <= 5000 for n in samples.values()), samples
        # The agents sent, and nothing they sent was refused by the receiver.
        for cluster, (_, port) in prom_agents.items():
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            sent = sum(float(v) for v in re.findall(r"^prometheus_remote_storage_samples_total\{.*\} (\S+)$", text, re.M))
            failed = sum(float(v) for v in
                         re.findall(r"^prometheus_remote_storage_samples_failed_total\{.*\} (\S+)$", text, re.M))
            # Remote-write cost per sample (snappy-compressed protobuf on the wire), for sizing
            # a fleet's ingest from the per-host series budget (docs/metrics.md).
            sent_bytes = sum(float(v) for v in
                             re.findall(r"^prometheus_remote_storage_bytes_total\{.*\} (\S+)$", text, re.M))
            print(cluster, "samples sent", sent, "failed", failed, "bytes", sent_bytes,
                  f"({sent_bytes / max(sent, 1):.2f} bytes/sample)")
            assert sent > 0 and failed == 0 and sent_bytes > 0, (cluster, sent, failed, sent_bytes)
        # The dashboard's phase series came from both clusters (its $host variable spans both).
        hosts_seen = query("count by (cluster, Hostname) (ridgeline_phase_time_share_ratio)")
        assert {s["metric"]["cluster"] for s in hosts_seen} == set(CLUSTERS), hosts_seen
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT if p is sim else signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
