"""Trace formats people have (issue 13.3): pre-1.10 Kineto, Chrome's JSON Array Format,
a folder of per-rank traces, Nsight Systems SQLite exports.

Every expected figure is computed here from the real third-party file with the standard
library (json, sqlite3), independently of the importers under test. Those files are not in
the project (tests/THIRD_PARTY.md says where they come from); absent, their tests skip.
"""
from __future__ import annotations

import gzip
import json
import shutil
import sqlite3

import pytest
from conftest import third_party

from ridgeline.agent.cli import main
from ridgeline.probes.errors import InputError
from ridgeline.probes.kineto import load_trace

# Third-party files, not kept in the project (tests/THIRD_PARTY.md); resolved by third_party()
# inside each test, which skips when the file is absent.
LEGACY = "kineto_legacy/kineto_tb_plugin_gpu_metrics_input.json"
NSYS = {"saxpy": "nsys/pipit_saxpy_mpi_cuda_perlmutter0.sqlite.gz",
        "cloverleaf": "nsys/pipit_cloverleaf_cuda_perlmutter.sqlite.gz"}


def run_json(capsys, *argv):
    code = main(["analyze", *map(str, argv), "--json"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    return json.loads(cap.out)


# --------------------------------------------------------------------------- pre-1.10 Kineto

def _legacy_events():
    return json.loads(third_party(LEGACY).read_text())["traceEvents"]


def test_legacy_kineto_counts_match_the_file():
    ev = _legacy_events()
    by = lambda cat: [e for e in ev if e.get("cat") == cat and e.get("ph") == "X"]  # noqa: E731
    t = load_trace(third_party(LEGACY))
    assert len(t.kernels) == len(by("Kernel")) == 30
    assert len(t.copies) == len(by("Memcpy")) + len(by("Memset"))
    assert len(t.api) == len(by("Runtime"))
    steps = [e for e in by("Operator") if e["name"].startswith("ProfilerStep#")]
    assert len(t.cpu_ops) == len(by("Operator")) - len(steps)
    assert len(t.ranges) == len(steps)
    assert int((t.kernels["end_ns"] - t.kernels["start_ns"]).sum()) == sum(e["dur"] for e in by("Kernel")) * 1000
    # "external id" (lower case) links kernels to operators; string tids became ints
    assert sorted(t.kernels["external_id"].tolist()) == sorted(e["args"]["external id"] for e in by("Kernel"))
    launching = {int(e["tid"]) for e in by("Runtime")}
    assert set(t.kernels["tid"].tolist()) <= launching | {-1} and (t.kernels["tid"] >= 0).all()
    assert t.meta["kineto_schema"].startswith("pre-1.10")
    assert t.devices[0].name == "Tesla V100-DGXS-32GB"


def test_legacy_kineto_analyzes(capsys):
    doc = run_json(capsys, third_party(LEGACY))
    assert doc["kernels"] == 30 and doc["steps"]


def test_gpu_like_events_that_import_nothing_name_the_schema(tmp_path, capsys):
    ev = [dict(e, ph="B") if e.get("cat") in ("Kernel", "Memcpy") else e for e in _legacy_events()]
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"schemaVersion": 1, "traceEvents": ev}))
    assert main(["analyze", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "schemaVersion 1" in err and "Kernel x30" in err


def test_unknown_gpu_categories_name_the_schema(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"schemaVersion": 7, "traceEvents": [
        {"ph": "X", "cat": "gpu_kernel_v9", "name": "k", "ts": 1, "dur": 1, "pid": 0, "tid": 1}]}))
    with pytest.raises(InputError, match=r"gpu_kernel_v9 x1.*schemaVersion 7"):
        load_trace(f)


# --------------------------------------------------------------------------- JSON Array Format

@pytest.mark.parametrize("closed", [True, False])
def test_json_array_format(tmp_path, closed):
    ev = _legacy_events()
    text = json.dumps(ev)
    f = tmp_path / "array.json"
    # the format allows the closing bracket to be missing (a tracer killed mid-write)
    f.write_text(text if closed else text[:-1] + ",\n")
    t = load_trace(f)
    assert len(t.kernels) == 30 and len(t.api) == sum(1 for e in ev if e.get("cat") == "Runtime")


def test_json_array_format_gzipped_current_schema(tmp_path, trace_path):
    src = trace_path("nvidia-inference/nanovllm_rtx4080laptop_decode_step0_fragment.json.gz")
    doc = json.loads(gzip.decompress(src.read_bytes()))
    f = tmp_path / "array.json.gz"
    f.write_bytes(gzip.compress(json.dumps(doc["traceEvents"]).encode()))
    a, b = load_trace(f), load_trace(src)
    assert len(a.kernels) == len(b.kernels) and (a.kernels["start_ns"] == b.kernels["start_ns"]).all()


# --------------------------------------------------------------------------- folders of ranks

def test_directory_of_rank_traces(tmp_path, trace_path, capsys):
    names = ["nvidia-inference/nanovllm_rtx4080laptop_decode_step0_fragment.json.gz",
             "nvidia-inference/nanovllm_rtx4080laptop_decode_step100_fragment.json.gz"]
    for i, n in enumerate(names):
        shutil.copy(trace_path(n), tmp_path / f"rank{i}.pt.trace.json.gz")
    (tmp_path / "notes.txt").write_text("not a trace")
    (tmp_path / "config.json").write_text('{"hidden_size": 1024}')     # other JSON: skipped, said
    doc = run_json(capsys, tmp_path)
    assert doc["directory"] == str(tmp_path)
    singles = [run_json(capsys, trace_path(n)) for n in names]
    assert [d["kernels"] for d in doc["ranks"]] == [d["kernels"] for d in singles]
    t = doc["together"]
    assert t["ranks"] == 2 and t["kernels"] == sum(d["kernels"] for d in singles)
    assert t["kernel_time_ns"] == sum(d["kernel_time_ns"] for d in singles)
    assert [r["rank"] for r in t["per_rank"]] == [0, 1]
    # two decode steps of one process, each trace declaring world size 1: summed, but not
    # ranked as one job (issue 24.3: unrelated traces were ranked with a "slowest rank")
    assert t["one_job"] is False and any("world size 1" in why for why in t["not_one_job"])
    assert t["slowest_rank"] is None
    assert main(["analyze", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "not one job" in err and "slowest rank:" not in out


def test_empty_directory_is_one_line(tmp_path, capsys):
    assert main(["analyze", str(tmp_path)]) == 2
    assert "without trace files" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"hidden_size": 1024}')
    assert main(["analyze", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "skipped" in err and err.strip().splitlines()[-1].endswith("is a trace")


# --------------------------------------------------------------------------- Nsight Systems

@pytest.fixture(params=sorted(NSYS))
def nsys_export(request, tmp_path):
    f = tmp_path / (request.param + ".sqlite")
    f.write_bytes(gzip.decompress(third_party(NSYS[request.param]).read_bytes()))
    return f


def test_nsys_export_matches_sqlite(nsys_export):
    from ridgeline.probes.nsys import load_trace as load_nsys
    t = load_nsys(nsys_export)
    c = sqlite3.connect(nsys_export)
    q = lambda sql: c.execute(sql).fetchone()[0]  # noqa: E731
    assert len(t.kernels) == q("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL") > 0
    assert int((t.kernels["end_ns"] - t.kernels["start_ns"]).sum()) == \
        q("SELECT sum(end - start) FROM CUPTI_ACTIVITY_KIND_KERNEL")
    memset = q("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMSET") \
        if c.execute("SELECT 1 FROM sqlite_master WHERE name = 'CUPTI_ACTIVITY_KIND_MEMSET'").fetchone() else 0
    assert len(t.copies) == q("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY") + memset
    assert int(t.copies["bytes"].sum()) == q("SELECT sum(bytes) FROM CUPTI_ACTIVITY_KIND_MEMCPY") + (
        q("SELECT coalesce(sum(bytes), 0) FROM CUPTI_ACTIVITY_KIND_MEMSET") if memset else 0)
    assert len(t.api) == q("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME")
    first = c.execute("SELECT s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s "
                      "ON s.id = k.demangledName ORDER BY k.start LIMIT 1").fetchone()[0]
    assert t.names[int(t.kernels["name_id"][0])] == first
    gpu = c.execute("SELECT name, smCount, totalMemory FROM TARGET_INFO_GPU ORDER BY id LIMIT 1").fetchone()
    assert (t.devices[0].name, t.devices[0].sm_count, t.devices[0].memory_total_bytes) == gpu
    nvtx = c.execute("SELECT count(*) FROM sqlite_master WHERE name = 'NVTX_EVENTS'").fetchone()[0]
    if nvtx:
        assert len(t.ranges) == q("SELECT count(*) FROM NVTX_EVENTS WHERE eventType IN (59, 60) AND end IS NOT NULL")
    # kernels carry the launching thread of the runtime call with their correlation id
    launch = dict(c.execute("SELECT correlationId, globalTid & 16777215 FROM CUPTI_ACTIVITY_KIND_RUNTIME"))
    k0 = t.kernels[0]
    assert int(k0["tid"]) == launch[int(k0["correlation_id"])]


def test_nsys_export_analyzes_with_its_gpu(nsys_export, capsys):
    doc = run_json(capsys, nsys_export)
    assert doc["kernels"] > 0 and doc["gpu"]["key"].startswith("a100")


def test_sqlite_without_nsys_tables(tmp_path, capsys):
    f = tmp_path / "other.sqlite"
    c = sqlite3.connect(f)
    c.execute("CREATE TABLE t (x)")
    c.commit()
    c.close()
    assert main(["analyze", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "without Nsight Systems CUDA tables" in err


def test_nsys_wrong_types_are_dropped_and_counted(nsys_export, capsys):
    from ridgeline.probes.nsys import load_trace as load_nsys
    c = sqlite3.connect(nsys_export)
    n = c.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()[0]
    c.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = 'soon' WHERE rowid = "
              "(SELECT min(rowid) FROM CUPTI_ACTIVITY_KIND_KERNEL)")
    c.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = start - 5 WHERE rowid = "
              "(SELECT max(rowid) FROM CUPTI_ACTIVITY_KIND_KERNEL)")
    c.commit()
    c.close()
    t = load_nsys(nsys_export)
    assert len(t.kernels) == n - 2
    assert t.meta["rejected_events"]["kernels"] == {"ts or dur not a number within +-2^62 ns": 1,
                                                   "negative duration": 1}


def test_nsys_budget_is_charged_before_reading(nsys_export):
    from ridgeline.probes.budget import EventBudget
    from ridgeline.probes.nsys import load_trace as load_nsys
    with pytest.raises(InputError, match="--max-memory"):
        load_nsys(nsys_export, budget=EventBudget(160 << 20, "x"))
