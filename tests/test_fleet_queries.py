"""docs/fleet.md's queries, run verbatim by real DuckDB (and the ClickHouse ones by
ClickHouse's engine, chDB) over the Parquet recordings of
several simulated hosts, their results checked against the figures of the agent's own
windows (what each host's WindowBuilder folded, kept by tests/support/fleet_synth.py).

The TP group is the rank-0 trace of a real vLLM TP8 run (AMD-AGI/TraceLens, in
../shared/traces; see its PROVENANCE.md) replayed as 4 ranks, one of them late at every
all-reduce: the collective kernels' names and order are the real run's."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyarrow", reason="pyarrow (the ridgeline[parquet] extra) is not installed")
duckdb = pytest.importorskip("duckdb", reason="duckdb (a test extra) is not installed")

from conftest import TRACES  # noqa: E402

from ridgeline.agent import parquet_recording as pqr  # noqa: E402
from ridgeline.agent.cli import main  # noqa: E402

pytestmark = pytest.mark.long   # minutes: started first under xdist (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
TP8 = TRACES / "nvidia-inference" / "tracelens_b200_vllm_gptoss_tp8_prefill888.json.gz"
LATE_NS = 60_000                 # rank 2's lateness at each collective
WINDOWS, WINDOW_S = 18, 300.0
HOUR_NS = 3600 * 1_000_000_000


def queries(engine: str = "query") -> dict[str, str]:
    text = (ROOT / "docs" / "fleet.md").read_text()
    return dict(re.findall(r"<!-- " + engine + r": (\w+) -->\n```sql\n(.*?)```", text, flags=re.S))


def run(con, name: str, fleet: Path):
    res = con.sql(queries()[name].replace("FLEET", str(fleet)))
    cols = res.columns
    return [dict(zip(cols, row)) for row in res.fetchall()]


def run_clickhouse(name: str, fleet: Path) -> list[dict]:
    """The ClickHouse block of docs/fleet.md, run by ClickHouse's engine (chDB)."""
    import json
    chdb = pytest.importorskip("chdb", reason="chdb (ClickHouse in-process, a test extra) is not installed")
    out = chdb.query(queries("clickhouse")[name].replace("FLEET", str(fleet)), "JSONEachRow")
    return [json.loads(line) for line in str(out).splitlines() if line.strip()]


def _qwen_source(base: Path):
    from ridgeline.probes.kineto import load_trace
    p = base / "ridgeline-sim2-qwen3.json.gz"
    if not p.exists():
        subprocess.run([sys.executable, "-m", "ridgeline", "simulate", "--duration", "2", "--rate", "30",
                        "--model", "qwen3-0.6b", "--seed", "2", "--trace", str(p)], check=True,
                       capture_output=True)
    return load_trace(p)


def _tp_group(fleet: Path) -> int:
    """4 ranks of the real trace's kernels on one host; rank 2 starts every collective
    LATE_NS late and every rank's collective ends when it arrives (they wait in it)."""
    from ridgeline.probes.events import Trace
    from ridgeline.probes.kineto import load_trace
    t = load_trace(TP8)
    names = t.names.names_of(t.kernels["name_id"])
    coll = np.array(["all_reduce_kernel" in n or n.startswith("ncclDevKernel") for n in names])
    parts = []
    for rank in range(4):
        k = t.kernels.copy()
        k["device"] = rank
        k["end_ns"][coll] += LATE_NS
        if rank == 2:
            k["start_ns"][coll] += LATE_NS
        parts.append(k)
    tr = Trace(kernels=np.concatenate(parts), names=t.names, devices=t.devices, meta={"source": "kineto"})
    with pqr.ParquetRecordingWriter(fleet, recording="tp8-replay") as w:
        w.add_message("events", 0, "tp-host", 0, 1_796_119_200 * 10**9, tr)
    return int(coll.sum())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from support.fleet_synth import write_host
    from support.recording_synth import simulated_trace
    base = tmp_path_factory.getbasetemp()
    llama = simulated_trace(base / "ridgeline-sim10.json.gz")
    qwen = _qwen_source(base)
    d = tmp_path_factory.mktemp("fleet")
    out = d / "fleet"
    hosts = {}
    for host, src, model, slowed in (("gpu-a", llama, "llama-3-8b", None), ("gpu-b", llama, "llama-3-8b", 6),
                                     ("gpu-c", qwen, "qwen3-0.6b", 15)):
        rec = d / f"{host}.rlrec"
        hosts[host] = dict(write_host(rec, src, host, model, windows=WINDOWS, window_s=WINDOW_S,
                                      slowed_from=slowed, events_s=0.2), model=model)
        assert main(["export", str(rec), "-o", str(out)]) == 0
    collectives = _tp_group(out) if TP8.exists() else None
    return {"dir": out, "hosts": hosts, "collectives": collectives}


def test_decode_below_half_peak(fleet):
    rows = run(duckdb.connect(), "decode_below_half_peak", fleet["dir"])
    # the same figure from each host's own windows
    want = {}
    now = max(w.end_ns for h in fleet["hosts"].values() for w in h["windows"])
    for host, h in fleet["hosts"].items():
        dec = [(w.end_ns, w.gpus[0].phases["decode"]) for w in h["windows"]
               if "decode" in w.gpus[0].phases]
        peak = max(p.achieved_bytes_per_s for _, p in dec)
        recent = [p for end, p in dec if end > now - HOUR_NS]
        last = sum(p.bytes for p in recent) / (sum(p.work_busy_ns for p in recent) / 1e9)
        want[host] = last / peak
    print("\nquery 1:", rows, "\nof peak per host, from the windows:", want)
    assert [(r["host"], r["gpu"]) for r in rows] == [("gpu-b", 0)]
    assert rows[0]["of_peak_ratio"] == pytest.approx(want["gpu-b"], rel=1e-9)
    assert want["gpu-b"] < 0.4 and 0.5 < want["gpu-c"] < 0.9 and want["gpu-a"] > 0.8
    ch = run_clickhouse("decode_below_half_peak", fleet["dir"])
    assert [(r["host"], r["gpu"]) for r in ch] == [("gpu-b", 0)]
    assert ch[0]["of_peak_ratio"] == pytest.approx(want["gpu-b"], rel=1e-9)


def test_face_share_per_model(fleet):
    rows = run(duckdb.connect(), "face_share_per_model", fleet["dir"])
    want: dict = {}
    for h in fleet["hosts"].values():
        for w in h["windows"]:
            for v in w.verdict or []:
                if v.get("verdict") and v.get("device") is not None:
                    key = (h["model"], v.get("face") or "none")
                    want[key] = want.get(key, 0) + w.duration_ns
    print("\nquery 3:", [(r["model"], r["face"], round(r["share_of_time_ratio"], 4)) for r in rows])
    assert {(r["model"], r["face"]): r["bound_ns"] for r in rows} == want
    for model in {m for m, _ in want}:
        total = sum(v for (m, _), v in want.items() if m == model)
        got = {r["face"]: r["share_of_time_ratio"] for r in rows if r["model"] == model}
        assert got == pytest.approx({f: v / total for (m, f), v in want.items() if m == model})
        assert sum(got.values()) == pytest.approx(1.0)
    assert {m for m, _ in want} == {"llama-3-8b", "qwen3-0.6b"}
    ch = run_clickhouse("face_share_per_model", fleet["dir"])
    assert {(r["model"], r["face_or_none"]): r["share_of_time_ratio"] for r in ch} == pytest.approx(
        {(r["model"], r["face"]): r["share_of_time_ratio"] for r in rows})


def test_slowest_requests_query_binds_to_the_reserved_schema(fleet, tmp_path):
    """No recording has requests yet (docs/fleet.md says so): the query is checked
    against a file of the reserved schema, so every column it names exists with the
    type it uses (the culprits list unnests to its struct)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    d = tmp_path / "f"
    (d / "requests" / "host=h" / "hour=2026-12-01-10").mkdir(parents=True)
    schema = pqr.arrow_schema("requests")
    rows = [{"recording": "r", "frame": 1, "request_id": f"req-{i}", "e2e_ns": 1000 * i,
             "culprits": [{"request_id": "big", "kind": "prefill_chunk", "added_ns": 10 * i, "tokens": 4000}]
             if i % 2 else []} for i in range(12)]
    table = pa.Table.from_pylist([{c.name: r.get(c.name) for c in schema} for r in rows], schema=schema)
    pq.write_table(table, d / "requests" / "host=h" / "hour=2026-12-01-10" / "part-r-000000.parquet")
    got = run(duckdb.connect(), "slowest_requests", d)
    assert [r["request_id"] for r in got][:3] == ["req-11", "req-10", "req-9"]
    assert len({r["request_id"] for r in got}) == 10
    assert got[0]["culprit_request_id"] == "big" and got[0]["culprit_added_ns"] == 110
    assert got[1]["culprit_request_id"] is None


@pytest.mark.skipif(not TP8.exists(), reason=f"real TP8 trace absent: {TP8}")
def test_straggler_per_tp_group(fleet):
    rows = run(duckdb.connect(), "straggler_per_tp_group", fleet["dir"])
    print("\nquery 4:", rows)
    assert len(rows) == 1
    r = rows[0]
    assert (r["host"], r["straggler_gpu"]) == ("tp-host", 2)
    assert r["collectives_last"] == r["collectives"] == fleet["collectives"] > 50
    assert r["mean_late_ns"] == pytest.approx(LATE_NS)
    ch = run_clickhouse("straggler_per_tp_group", fleet["dir"])
    assert [(c["host"], c["straggler_gpu"], c["collectives_last"], c["collectives"]) for c in ch] == \
        [("tp-host", 2, r["collectives_last"], r["collectives"])]
    assert ch[0]["mean_late_ns"] == pytest.approx(LATE_NS)
