"""deploy/grafana/ridgeline-dashboard.json against Grafana's dashboard JSON schema.

No Grafana server can be installed from the registries this project uses (Grafana is
AGPL and not packaged in Debian), so the dashboard is not loaded into a running Grafana.
Instead it is validated against the JSON Schema that Grafana's code generator emits for
the dashboard kind (grafana/grafana-foundation-sdk ``jsonschema/dashboard.jsonschema.json``,
provenance in ``../shared/grafana/PROVENANCE.md``), and its queries are run against a real
Prometheus in tests/test_deploy_prometheus.py.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema not installed (pip install -e .[test])")

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("RIDGELINE_SHARED", ROOT.parent / "shared"))
SCHEMA = SHARED / "grafana" / "dashboard.jsonschema.json"
DASHBOARD = ROOT / "deploy" / "grafana" / "ridgeline-dashboard.json"


def schema() -> dict:
    if not SCHEMA.exists():
        pytest.skip(f"Grafana dashboard schema not present: {SCHEMA} (see ../shared/grafana/PROVENANCE.md)")
    return json.loads(SCHEMA.read_text())


def test_dashboard_validates_against_grafanas_schema():
    s = schema()
    d = json.loads(DASHBOARD.read_text())
    errors = sorted(jsonschema.Draft7Validator(s).iter_errors(d), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:20])


def test_schema_rejects_a_broken_dashboard():
    """The check can fail: a panel wider than the grid and a misspelt variable type are caught."""
    s = schema()
    d = json.loads(DASHBOARD.read_text())
    d["panels"][1]["gridPos"]["w"] = 30
    d["templating"]["list"][1]["type"] = "qurey"
    errors = list(jsonschema.Draft7Validator(s).iter_errors(d))
    assert len(errors) >= 2


def test_panels_and_variables():
    d = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in d["templating"]["list"]]
    assert names == ["datasource", "host", "gpu", "pid"]
    titles = {p["title"] for p in d["panels"] if p["type"] != "row"}
    for needed in ("Phase time share", "Achieved memory bandwidth vs ceiling", "Achieved FLOP/s vs ceiling",
                   "Roofline position over time", "Verdict timeline", "KV usage vs 85% watermark",
                   "Preemptions and recovery time", "Segmented latency: queue / prefill / decode beside TTFT",
                   "Launch-thread scheduling", "Agent cost and drops",
                   "Collection health: CUPTI takeover, socket refusals, engine scrapes"):
        assert needed in titles, needed
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        if p["type"] == "row":
            continue
        for t in p["targets"]:
            if "ridgeline_phase" in t["expr"] or "ridgeline_gpu" in t["expr"]:
                assert '$host' in t["expr"] and '$gpu' in t["expr"] and '$pid' in t["expr"], t["expr"]
