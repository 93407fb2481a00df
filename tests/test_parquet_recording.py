"""Parquet recordings (agent/parquet_recording.py, docs/parquet-schema.md): the files a
real Parquet reader (pyarrow, and DuckDB in test_fleet_queries.py) sees, and ``ridgeline
analyze DIR`` giving the same document as the ``.rlrec`` of the same run.

The recordings are the simulator's stream written with the real wire encoder
(tests/support/recording_synth.py, tests/support/fleet_synth.py: the agent's own WindowBuilder windows)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow", reason="pyarrow (the ridgeline[parquet] extra) is not installed")
import pyarrow.parquet as pq  # noqa: E402

from ridgeline.agent import parquet_recording as pqr  # noqa: E402
from ridgeline.agent.cli import main  # noqa: E402

pytestmark = pytest.mark.long   # minutes: started first under xdist (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sim_source(tmp_path_factory):
    from support.recording_synth import simulated_trace
    # one simulation per session, shared with test_fleet_queries.py
    return simulated_trace(tmp_path_factory.getbasetemp() / "ridgeline-sim10.json.gz")


def _analyze(capsys, *paths) -> object:
    capsys.readouterr()
    assert main(["analyze", "--json", *map(str, paths)]) == 0
    return json.loads(capsys.readouterr().out)


def _export(capsys, rec, out, rid=None) -> str:
    assert main(["export", str(rec), "-o", str(out)] + (["--recording-id", rid] if rid else [])) == 0
    return capsys.readouterr().err


def _without_trace(doc):
    d = dict(doc)
    d.pop("trace")
    return d


def test_schema_document_lists_every_column_and_type():
    """docs/parquet-schema.md is the schema: every table, column and type, in order."""
    text = (ROOT / "docs" / "parquet-schema.md").read_text()
    sections = re.split(r"^### `(\w+)`.*$", text, flags=re.M)
    documented = {sections[i]: sections[i + 1] for i in range(1, len(sections), 2)}
    words = {"dict": "string (dictionary)", "string": "string", "culprits": "list<struct>"}
    assert set(documented) == set(pqr.TABLES) | set(pqr.RESERVED_TABLES)
    for table, cols in list(pqr.TABLES.items()) + list(pqr.RESERVED_TABLES.items()):
        rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", documented[table], flags=re.M)
        assert [(c, t.strip()) for c, t in rows] == [(c, words.get(t, t)) for c, t in cols], table
        part = "host, gpu, hour" if table in pqr.GPU_TABLES else "host, hour"
        assert f"Partitions: {part}." in documented[table]
    # units: every time is _ns, every size _bytes, every rate _per_s (names without a unit
    # suffix are counts, ids, names or codes: listed so a new column must be judged)
    unitless = {"recording", "frame", "device", "stream", "context", "correlation_id", "external_id", "grid_x",
                "grid_y", "grid_z", "block_x", "block_y", "block_z", "registers", "name", "graph_id",
                "graph_node_id", "pid", "tid", "kind", "direction", "cbid", "domain", "category", "input_dims",
                "input_types", "is_causal", "model", "gpu_name", "source", "kernels", "idle_gaps", "launches",
                "syncs", "phase", "steps", "flops", "verdict", "work_source", "face", "record_json", "topic",
                "seq", "meta_json", "sm_count", "compute_capability", "request_id", "engine", "prefill_chunks",
                "decode_steps", "recompute_steps", "dragged_source", "preemptions", "prompt_tokens", "completion_tokens",
                "culprits", "kv_full_while_queued", "arithmetic_intensity", "bytes", "events"}
    for cols in list(pqr.TABLES.values()) + list(pqr.RESERVED_TABLES.values()):
        for c, _ in cols:
            assert c in unitless or re.search(r"(_ns|_bytes|_per_s|_pct|_ratio)$|^pct_of_|^ns_per_", c), c


def test_export_writes_hive_partitions_with_the_schema(tmp_path, sim_source, capsys):
    from support.fleet_synth import write_host

    from ridgeline.agent.recording import load_recording
    rec = tmp_path / "host-a.rlrec"
    info = write_host(rec, sim_source, "host-a", "llama-3-8b", windows=14, events_s=0.2)
    out = tmp_path / "pq"
    _export(capsys, rec, out)
    assert json.loads((out / pqr.MANIFEST).read_text())["schema_version"] == pqr.SCHEMA_VERSION
    files = sorted(out.rglob("*.parquet"))
    assert files and not list(out.rglob(".*.tmp"))
    hours = set()
    for f in files:
        rel = f.relative_to(out).parts
        table = rel[0]
        want = (["host=host-a", "gpu=0"] if table in pqr.GPU_TABLES else ["host=host-a"])
        assert list(rel[1:len(want) + 1]) == want, rel
        assert rel[len(want) + 1].startswith("hour=")
        hours.add(rel[len(want) + 1])
        pf = pq.ParquetFile(f)
        assert pf.schema_arrow.equals(pqr.arrow_schema(table), check_metadata=False), (table, pf.schema_arrow)
        assert pf.schema_arrow.metadata[b"ridgeline.schema_version"] == b"1"
        # names dictionary-encoded in the Parquet file itself (dictionary pages)
        meta = pf.metadata.row_group(0)
        for j in range(meta.num_columns):
            col = meta.column(j)
            if col.path_in_schema in ("name", "phase", "topic", "verdict"):
                assert col.dictionary_page_offset is not None, (table, col.path_in_schema)
    # 14 windows of 5 min from 10:00 UTC: two hours of wall clock
    assert hours == {"hour=2026-12-01-10", "hour=2026-12-01-11"}
    # every event of the recording is in the tables, with its names
    r = load_recording(rec)
    k = pq.ParquetDataset(out / "kernels").read()
    assert k.num_rows == len(r.trace.kernels)
    assert sorted(k.column("name").to_pylist()) == sorted(r.trace.names.names_of(r.trace.kernels["name_id"]))
    w = pq.ParquetDataset(out / "window_phases").read().to_pylist()
    assert len({x["frame"] for x in w}) == 14
    dec = [x for x in w if x["phase"] == "decode"]
    want = [g.phases["decode"].achieved_bytes_per_s for win in info["windows"] for g in win.gpus
            if "decode" in g.phases]
    assert sorted(x["achieved_bytes_per_s"] for x in dec) == pytest.approx(sorted(want))
    c = pq.ParquetDataset(out / "copies").read()
    assert set(c.column("direction").to_pylist()) <= set(pqr.COPY_DIRECTION_NAMES.values())


def test_analyze_folder_gives_the_recordings_figures(tmp_path, sim_source, capsys):
    """A restart (sequence numbers back to 0) and lost events messages: the folder is cut
    into the same segments, and every figure of the document is the .rlrec's."""
    from support.recording_synth import write_recording
    rec = tmp_path / "run.rlrec"
    write_recording(rec, sim_source, minutes=0.2, restart_at_s=5, restart_downtime_s=7, lost_at_s=8,
                    lost_batches=2)
    out = tmp_path / "pq"
    _export(capsys, rec, out)
    a = _analyze(capsys, rec)
    b = _analyze(capsys, out)
    assert b["trace"] == f"{out} (host=gpu-host, recording=run)"
    assert a["recording"]["restarts"] == 1 and a["recording"]["gaps"] == {"events": 2}
    assert a["recording"]["downtime_ns"] > 0 and a["kernels"] > 100_000
    assert _without_trace(b) == _without_trace(a)


def test_analyze_folder_of_two_hosts_answers_each_as_its_recording(tmp_path, sim_source, capsys):
    """Two hosts' recordings in one folder (the fleet layout): one document each, equal to
    its .rlrec's, including the answer taken from the last window's verdict."""
    from support.fleet_synth import write_host
    out = tmp_path / "fleet"
    recs = {}
    for host, slowed in (("host-a", None), ("host-b", 1)):
        recs[host] = tmp_path / f"{host}.rlrec"
        write_host(recs[host], sim_source, host, "llama-3-8b", windows=3, events_s=0.3, slowed_from=slowed)
        _export(capsys, recs[host], out)
    docs = _analyze(capsys, out)
    assert [d["trace"] for d in docs] == [f"{out} (host=host-a, recording=host-a)",
                                          f"{out} (host=host-b, recording=host-b)"]
    for d, host in zip(docs, ("host-a", "host-b")):
        a = _analyze(capsys, recs[host])
        assert a["answer"] and a["answer"][0]["verdict"]
        assert _without_trace(d) == _without_trace(a)
    assert docs[0]["phases"]["decode"]["achieved_bytes_per_s"] > 2 * docs[1]["phases"]["decode"]["achieved_bytes_per_s"]


def test_bad_inputs_are_one_line_and_exit_2(tmp_path, capsys):
    not_rec = tmp_path / "x.rlrec"
    not_rec.write_bytes(b"not a recording")
    assert main(["export", str(not_rec), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a ridgeline recording" in err
    assert main(["export", str(tmp_path / "missing.rlrec"), "-o", str(tmp_path / "o")]) == 2
    assert "no such recording" in capsys.readouterr().err
    d = tmp_path / "future"
    d.mkdir()
    (d / pqr.MANIFEST).write_text(json.dumps({"format": pqr.FORMAT, "schema_version": 99}))
    assert main(["analyze", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "schema version 99" in err
    (d / pqr.MANIFEST).write_text("{")
    assert main(["analyze", str(d)]) == 2
    assert "unreadable" in capsys.readouterr().err


def test_host_names_are_partition_safe():
    assert pqr.host_dir("gpu-07.example") == "gpu-07.example"
    assert pqr.host_dir("a/b=c d") == "a%2Fb%3Dc%20d"
    assert pqr.host_dir("") == "unknown"


def test_record_format_parquet_from_a_live_agent(tmp_path, trace_path, capsys):
    """``ridgeline record --format parquet`` against the real agent replaying a real
    trace: the folder holds the stream's windows and events, and analyze reads it."""
    import subprocess
    import sys

    from support.agent_process import TRACE, start_agent, stop, write_config
    cfg, ep = write_config(tmp_path, trace_path(TRACE), events=True)
    a = start_agent(cfg)
    out = tmp_path / "live"
    try:
        rec = subprocess.run([sys.executable, "-m", "ridgeline", "record", "--format", "parquet", "-o", str(out),
                              "--endpoint", ep, "--duration", "5"], capture_output=True, text=True, timeout=90)
        # kept up with the stream: no message lost to the subscriber's queue
        assert rec.returncode == 0 and "messages" in rec.stderr and "missing" not in rec.stderr, rec.stderr
    finally:
        assert stop(a) == 0
    msgs = pq.ParquetDataset(out / "messages").read().to_pylist()
    topics = [m["topic"] for m in msgs]
    assert topics.count("window") >= 1 and topics.count("events") >= 2
    k = pq.ParquetDataset(out / "kernels").read()
    assert k.num_rows > 100 and "" not in set(k.column("name").to_pylist()[:50])
    assert set(k.column("frame").to_pylist()) <= {m["frame"] for m in msgs if m["topic"] == "events"}
    assert pq.ParquetDataset(out / "windows").read().num_rows >= 1
    doc = _analyze(capsys, out)
    assert doc["kernels"] == k.num_rows and doc["recording"]["messages"]["window"] == topics.count("window")


def test_a_small_memory_budget_reads_in_chunks_and_cuts_the_same_segments(tmp_path, sim_source, capsys):
    """Events are read a chunk of frames at a time within the budget; segments are cut
    by size exactly where the .rlrec's are."""
    from support.fleet_synth import write_host

    from ridgeline.agent.recording import iter_segments as rlrec_segments
    rec = tmp_path / "h.rlrec"
    write_host(rec, sim_source, "h", "llama-3-8b", windows=5, window_s=1.0, events_s=1.0)
    _export(capsys, rec, tmp_path / "pq")
    budget = (160 << 20) + (40 << 20)         # probes.budget.BASE_BYTES + room for ~1 batch per segment
    want = [(s.index, s.started_by, s.batches, len(s.trace.kernels)) for s in rlrec_segments(rec, budget)]
    got = [(s.index, s.started_by, s.batches, len(s.trace.kernels))
           for s in pqr.iter_segments(tmp_path / "pq", "h", "h", budget)]
    assert got == want and len(want) >= 3 and {s[1] for s in want[1:]} == {"size"}


def _kernels(devices, names, name_ids, start_ns):
    import numpy as np

    from ridgeline.probes.events import KERNEL_DTYPE, NameTable, Trace
    k = np.zeros(len(devices), KERNEL_DTYPE)
    k["device"], k["name_id"], k["start_ns"] = devices, name_ids, start_ns
    k["end_ns"] = k["start_ns"] + 10
    k["pid"] = k["tid"] = k["external_id"] = k["graph_id"] = -1
    return Trace(kernels=k, names=NameTable(names))


@pytest.mark.parametrize("via", ["rows", "columns"])
def test_batches_of_several_gpus_and_name_tables_keep_their_rows_across_row_groups(tmp_path, monkeypatch, via):
    """The writer holds batches and writes a row group at a time (structured rows through
    reused column buffers; decoded envelopes' columns as they are): with groups of 3 rows,
    batches of two GPUs interleaved and each batch with its own name table, every GPU's
    file holds its rows in recorded order, with their names, frames and receive times."""
    from ridgeline.aggregator import wire
    from ridgeline.probes.events import Trace
    monkeypatch.setattr(pqr, "ROW_GROUP_ROWS", 3)
    batches = [_kernels([0, 1, 0, 1, 0], ["a", "b", "c"], [0, 1, 2, -1, 0], [10, 11, 12, 13, 14]),
               _kernels([1, 1, 0, 1], ["x", "c", "a"], [0, 1, 2, 0], [20, 21, 22, 23]),
               _kernels([0, 0], ["z"], [0, 5], [30, 31])]      # 5: a name the table lacks: null
    with pqr.ParquetRecordingWriter(tmp_path / "rec", recording="r") as w:
        for i, b in enumerate(batches):
            if via == "rows":
                w.add_message("events", i, "h", 100 + i, 1_796_119_200 * 10**9 + i, b)
            else:
                # the wire ships the names a batch uses: an id past its table goes as -1 (null)
                k = b.kernels.copy()
                k["name_id"][k["name_id"] >= len(b.names)] = -1
                blob = wire.encode_event_batch(Trace(kernels=k, names=b.names))
                w.write(wire.encode_envelope("events", i, blob, "h", 100 + i), 1_796_119_200 * 10**9 + i)
    want = {}
    for frame, b in enumerate(batches):
        for d, n, s in zip(b.kernels["device"], b.kernels["name_id"], b.kernels["start_ns"]):
            name = b.names[int(n)] if 0 <= n < len(b.names) else None
            want.setdefault(int(d), []).append((frame, 1_796_119_200 * 10**9 + frame, int(s), name))
    for d, rows in want.items():
        (f,) = (tmp_path / "rec" / "kernels" / "host=h" / f"gpu={d}").glob("hour=*/*.parquet")
        pf = pq.ParquetFile(f)
        assert pf.metadata.num_row_groups == -(-len(rows) // 3), d
        t = pf.read()
        assert list(zip(*(t.column(c).to_pylist() for c in ("frame", "recv_ns", "start_ns", "name")))) == rows, d
        assert t.column("device").to_pylist() == [d] * len(rows)
        assert not t.schema.field("start_ns").nullable and t.schema.field("name").nullable
    # and read back as the stream's batches: the same events, GPU by GPU
    got = [p() for *_, p in pqr.iter_messages(tmp_path / "rec", "h", "r")]
    assert [len(t.kernels) for t in got] == [5, 4, 2]
    assert [got[1].names[int(i)] for i in got[1].kernels["name_id"]] == ["x", "c", "a", "x"]
    assert got[2].kernels["name_id"][1] == -1 and list(got[0].kernels["start_ns"]) == [10, 11, 12, 13, 14]


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_compression_is_a_setting_and_reads_back_the_same(tmp_path, compression):
    b = _kernels([0, 0, 0], ["a", "b"], [0, 1, 1], [1, 2, 3])
    with pqr.ParquetRecordingWriter(tmp_path / "rec", recording="r", compression=compression) as w:
        w.add_message("events", 0, "h", 1, 1_796_119_200 * 10**9, b)
    (f,) = (tmp_path / "rec" / "kernels").rglob("*.parquet")
    assert pq.ParquetFile(f).metadata.row_group(0).column(0).compression.lower().startswith(compression)
    assert pq.read_table(f).column("name").to_pylist() == ["a", "b", "b"]


def test_an_unknown_compression_is_refused(tmp_path):
    from ridgeline.probes.errors import InputError
    with pytest.raises(InputError, match="compression 'brotli9'"):
        pqr.ParquetRecordingWriter(tmp_path / "rec", compression="brotli9")


def test_reserved_requests_table_holds_every_story_number():
    """The reserved `requests` table is RequestStory's fields: a field added to the story
    (paused_ns came with preemption pauses) must be appended here too. trace_id and the
    pause list stay out: the trace id joins spans, not fleet queries, and the pauses are
    summed in paused_ns."""
    from ridgeline.aggregator.request_join import RequestStory
    cols = {c for c, _ in pqr.RESERVED_TABLES["requests"]}
    missing = [f for f in RequestStory.__struct_fields__ if f not in cols and f not in ("trace_id", "pauses")]
    assert missing == []
    assert "paused_ns" in cols


def test_files_from_envelopes_hold_the_rows_of_files_from_the_agents_batches(tmp_path, sim_source, monkeypatch):
    """The envelope path (decoded into columns, given to Arrow without a copy: the sink's
    path) and the batch path (the agent's structured rows) write the same rows, column
    by column, on 3 s of the simulator's stream in one stateful wire stream, with row
    groups cut inside batches."""
    from support.recording_synth import _KINDS, _slices

    from ridgeline.aggregator import wire
    from ridgeline.probes.events import Trace
    monkeypatch.setattr(pqr, "ROW_GROUP_ROWS", 10_000)
    t0 = min(int(getattr(sim_source, k)["start_ns"].min()) for k in _KINDS if len(getattr(sim_source, k)))
    batches = [Trace(names=sim_source.names, devices=sim_source.devices, meta={"source": "simulated"}, **parts)
               for _, parts in _slices(sim_source, t0)][:3]
    enc = wire.EventBatchEncoder(full_every=2)
    recv = [1_796_119_200 * 10**9 + i * 10**9 for i in range(len(batches))]
    envs = [wire.encode_envelope("events", i, enc.encode(b), "h", recv[i]) for i, b in enumerate(batches)]
    with pqr.ParquetRecordingWriter(tmp_path / "rows", recording="r") as w:
        for i, b in enumerate(batches):
            w.add_message("events", i, "h", recv[i], recv[i], b)
    with pqr.ParquetRecordingWriter(tmp_path / "cols", recording="r") as w:
        for i, e in enumerate(envs):
            w.write(e, recv[i])
    tables = 0
    for f in sorted((tmp_path / "rows").rglob("*.parquet")):
        rel = f.relative_to(tmp_path / "rows")
        a, b = pq.read_table(f), pq.read_table(tmp_path / "cols" / rel)
        assert a.schema == b.schema, rel
        for c in a.column_names:
            assert a.column(c).to_pylist() == b.column(c).to_pylist(), (rel, c)
        tables += rel.parts[0] in pqr.EVENT_DTYPES and a.num_rows > 0
    assert tables >= 3
    assert sorted(p.relative_to(tmp_path / "rows") for p in (tmp_path / "rows").rglob("*.parquet")) == \
        sorted(p.relative_to(tmp_path / "cols") for p in (tmp_path / "cols").rglob("*.parquet"))
