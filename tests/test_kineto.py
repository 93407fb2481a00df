"""probes.kineto against the real shared traces, checked against a plain json parse."""
from __future__ import annotations

import gzip
import json
from collections import Counter
from decimal import Decimal

import numpy as np
import pytest
from support.kineto_traces import TRACES, same_events

from ridgeline.probes import events as ev
from ridgeline.probes.errors import InputError
from ridgeline.probes.kineto import load_trace
from ridgeline.probes.kineto_records import api_category, copy_direction
from ridgeline.probes.trace_joins import kernel_cpu_op_index

H100 = TRACES[3]
NANO0 = TRACES[0]
A100 = TRACES[5]


def _plain(path):
    with gzip.open(path, "rt") as f:
        return json.load(f)


def _ns(us) -> int:
    """Exact ns of the decimal literal Kineto wrote (repr round-trips the literal)."""
    return int((Decimal(repr(us)) * 1000).to_integral_value())


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def get(name, trace_path):
        if name not in cache:
            p = trace_path(name)
            cache[name] = (load_trace(p), _plain(p))
        return cache[name]
    return get


@pytest.mark.parametrize("name", TRACES)
def test_counts_per_category_match_json(name, trace_path, loaded):
    trace, doc = loaded(name, trace_path)
    c = Counter(e.get("cat") for e in doc["traceEvents"] if e.get("ph") == "X")
    assert len(trace.kernels) == c["kernel"]
    assert int((trace.copies["kind"] == ev.COPY_KIND_MEMCPY).sum()) == c["gpu_memcpy"]
    assert int((trace.copies["kind"] == ev.COPY_KIND_MEMSET).sum()) == c["gpu_memset"]
    assert int((trace.api["domain"] == ev.API_DOMAIN_RUNTIME).sum()) == c["cuda_runtime"]
    assert int((trace.api["domain"] == ev.API_DOMAIN_DRIVER).sum()) == c["cuda_driver"]
    assert len(trace.cpu_ops) == c["cpu_op"]
    cpu_ranges = trace.ranges[trace.ranges["device"] < 0]
    gpu_ranges = trace.ranges[(trace.ranges["device"] >= 0) & (trace.ranges["kind"] != ev.RANGE_CUDA_SYNC)]
    assert len(cpu_ranges) == c["user_annotation"]
    assert len(gpu_ranges) == c["gpu_user_annotation"]
    assert int((trace.ranges["kind"] == ev.RANGE_CUDA_SYNC).sum()) == c["cuda_sync"]
    all_cats = Counter(e.get("cat") if isinstance(e.get("cat"), str) else "<none>" for e in doc["traceEvents"])
    assert trace.meta["event_counts"] == dict(all_cats)
    # every kernel sorted or not, times are consistent
    assert (trace.kernels["end_ns"] >= trace.kernels["start_ns"]).all()
    assert trace.devices and trace.devices[0].name == doc["deviceProperties"][0]["name"]
    assert trace.devices[0].sm_count == doc["deviceProperties"][0]["numSms"]


@pytest.mark.parametrize("name", TRACES)
def test_every_kernel_field_matches_json(name, trace_path, loaded):
    trace, doc = loaded(name, trace_path)
    kern = [e for e in doc["traceEvents"] if e.get("cat") == "kernel" and e.get("ph") == "X"]
    k = trace.kernels
    assert k["start_ns"].tolist() == [_ns(e["ts"]) for e in kern]
    assert (k["end_ns"] - k["start_ns"]).tolist() == [_ns(e["dur"]) for e in kern]
    assert trace.names.names_of(k["name_id"]) == [e["name"] for e in kern]
    for col, key in (("correlation_id", "correlation"), ("stream", "stream"), ("device", "device"),
                     ("registers", "registers per thread"), ("shared_mem_bytes", "shared memory"),
                     ("external_id", "External id")):
        assert k[col].tolist() == [e["args"].get(key, -1) for e in kern], col
    assert np.stack([k["grid_x"], k["grid_y"], k["grid_z"]], 1).tolist() == [e["args"]["grid"] for e in kern]
    assert np.stack([k["block_x"], k["block_y"], k["block_z"]], 1).tolist() == [e["args"]["block"] for e in kern]


def test_h100_specific_events_exact(trace_path, loaded):
    trace, doc = loaded(H100, trace_path)
    # the first kernel of the file, field by field (values read from the JSON by hand)
    k0 = trace.kernels[0]
    assert k0["start_ns"] == 1428625731622250
    assert k0["end_ns"] - k0["start_ns"] == 18112
    assert (k0["grid_x"], k0["grid_y"], k0["grid_z"]) == (17888, 1, 1)
    assert k0["correlation_id"] == 675771 and k0["stream"] == 7 and k0["registers"] == 16
    assert trace.names[k0["name_id"]].startswith("void at::native::vectorized_elementwise_kernel<4")
    # this kernel is the tail of the previous step: no launching API record in the file
    assert k0["tid"] == -1 and k0["pid"] == -1
    # memsets: 241, bytes exact, direction unknown
    sets = trace.copies[trace.copies["kind"] == ev.COPY_KIND_MEMSET]
    js = [e for e in doc["traceEvents"] if e.get("cat") == "gpu_memset"]
    assert sets["bytes"].tolist() == [e["args"]["bytes"] for e in js]
    assert (sets["direction"] == ev.COPY_UNKNOWN).all()
    # the one DtoH copy
    cp = trace.copies[trace.copies["kind"] == ev.COPY_KIND_MEMCPY]
    assert cp["direction"].tolist() == [ev.COPY_DTOH] and cp["bytes"].tolist() == [1]
    # ProfilerStep#6 on both timelines
    steps = trace.ranges[trace.ranges["kind"] == ev.RANGE_PROFILER_STEP]
    assert sorted(steps["device"].tolist()) == [-1, 0]
    cpu_step = steps[steps["device"] == -1][0]
    assert cpu_step["start_ns"] == 1428625731896179 and cpu_step["end_ns"] - cpu_step["start_ns"] == 47151395
    assert cpu_step["pid"] == 25286 and cpu_step["external_id"] == 18433
    assert trace.meta["cupti_version"] == 22 and trace.meta["base_time_ns"] == 1751410836000000000
    assert trace.devices[0].compute_capability == "9.0"
    assert trace.devices[0].memory_total_bytes == 85018279936


def test_h100_metadata_never_copied(trace_path, loaded):
    trace, doc = loaded(H100, trace_path)
    assert "metadata" in doc  # the file has it (with an env block)...
    text = repr(trace.meta) + repr([d.properties for d in trace.devices])
    assert "HF_TOKEN" not in text and "env" not in trace.meta and "metadata" not in trace.meta


def test_cpu_op_shapes_and_link(trace_path, loaded):
    trace, doc = loaded(NANO0, trace_path)
    ops = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"]
    c = trace.cpu_ops
    assert c["external_id"].tolist() == [e["args"]["External id"] for e in ops]
    dims = [json.loads(trace.names[i]) if i >= 0 else None for i in c["input_dims_id"].tolist()]
    assert dims == [e["args"].get("Input Dims") for e in ops]
    types = [json.loads(trace.names[i]) if i >= 0 else None for i in c["input_types_id"].tolist()]
    assert types == [e["args"].get("Input type") for e in ops]
    # kernel -> op by External id: the cutlass GEMM was launched by aten::mm
    idx = kernel_cpu_op_index(trace)
    by_ext = {e["args"]["External id"]: i for i, e in enumerate(ops)}
    kern = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    expect = [by_ext.get(e["args"].get("External id"), -1) for e in kern]
    assert idx.tolist() == expect
    assert (idx >= 0).sum() == 14
    gemm = next(i for i, e in enumerate(kern) if "cutlass" in e["name"])
    assert trace.names[c["name_id"][idx[gemm]]] == "aten::mm"


def test_old_kineto_links_ops_by_containment(trace_path, loaded):
    # HTA's A100 trace: External id of API records equals the correlation id, so the op
    # is the innermost cpu_op enclosing the launch call on the same thread.
    trace, doc = loaded(A100, trace_path)
    idx = kernel_cpu_op_index(trace)
    ops, k = trace.cpu_ops, trace.kernels
    has = np.flatnonzero(idx >= 0)
    assert len(has) > 5000
    order = np.argsort(trace.api["correlation_id"])
    api = trace.api[order][np.searchsorted(trace.api["correlation_id"][order], k["correlation_id"][has])]
    op = ops[idx[has]]
    assert (op["start_ns"] <= api["start_ns"]).all() and (op["end_ns"] >= api["start_ns"]).all()
    assert (op["tid"] == api["tid"]).all()
    # innermost: no other op on that thread nested inside the chosen one contains the call
    i = 0
    j = has[i]
    inner = ops[(ops["tid"] == op[i]["tid"]) & (ops["start_ns"] > op[i]["start_ns"])
                & (ops["end_ns"] < op[i]["end_ns"]) & (ops["start_ns"] <= api[i]["start_ns"])
                & (ops["end_ns"] >= api[i]["start_ns"])]
    assert len(inner) == 0, j


@pytest.mark.parametrize("name", TRACES)
def test_launch_thread_join(name, trace_path, loaded):
    trace, doc = loaded(name, trace_path)
    api = {e["args"]["correlation"]: (e["pid"], e["tid"]) for e in doc["traceEvents"]
           if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kern = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    expect = [api.get(e["args"]["correlation"], (-1, -1)) for e in kern]
    got = list(zip(trace.kernels["pid"].tolist(), trace.kernels["tid"].tolist()))
    assert got == expect


def test_h100_join_counts(trace_path, loaded):
    trace, _ = loaded(H100, trace_path)
    # PROVENANCE: 436 of the 1465 kernels have no launching runtime event in the file
    assert int((trace.kernels["tid"] >= 0).sum()) == 1465 - 436
    assert set(trace.kernels["tid"][trace.kernels["tid"] >= 0].tolist()) == {25286}


def test_api_categories(trace_path, loaded):
    trace, _ = loaded(A100, trace_path)
    names = trace.names
    cat = {names[i]: c for i, c in zip(trace.api["name_id"].tolist(), trace.api["category"].tolist())}
    assert cat["cudaLaunchKernel"] == ev.API_LAUNCH
    assert cat["cudaGraphLaunch"] == ev.API_GRAPH_LAUNCH
    assert cat["cudaMemcpyAsync"] == ev.API_MEMCPY
    assert cat["cudaStreamSynchronize"] == ev.API_SYNC
    assert api_category("cuLaunchKernelEx") == ev.API_LAUNCH
    assert api_category("cudaMemsetAsync") == ev.API_MEMSET
    assert api_category("cudaEventRecord") == ev.API_OTHER
    # HIP (ROCm Kineto traces, e.g. the TraceLens MI300X ones): launch calls were "other".
    for name, c in (("hipLaunchKernel", ev.API_LAUNCH), ("hipModuleLaunchKernel", ev.API_LAUNCH),
                    ("hipExtModuleLaunchKernel", ev.API_LAUNCH), ("hipGraphLaunch", ev.API_GRAPH_LAUNCH),
                    ("hipMemcpyAsync", ev.API_MEMCPY), ("hipMemsetAsync", ev.API_MEMSET),
                    ("hipStreamSynchronize", ev.API_SYNC), ("hipEventRecord", ev.API_OTHER)):
        assert api_category(name) == c, name
    assert copy_direction("Memcpy HtoD (Pinned -> Device)") == ev.COPY_HTOD
    assert copy_direction("Memcpy DtoD (Device -> Device)") == ev.COPY_DTOD
    assert copy_direction("Memcpy PtoP (Device -> Device)") == ev.COPY_PTOP
    assert copy_direction("Memset (Device)") == ev.COPY_UNKNOWN


def test_meta_rank_and_world(trace_path, loaded):
    trace, _ = loaded(A100, trace_path)
    assert trace.meta["rank"] == 0 and trace.meta["world_size"] == 16
    assert trace.meta["source_path"].endswith("hta_a100_rank0_training.json.gz")
    trace, _ = loaded(TRACES[2], trace_path)
    assert trace.meta["world_size"] == 8 and trace.meta["cupti_version"] == 28


def test_plain_json_equals_gzip(tmp_path, trace_path, loaded):
    trace, _ = loaded(NANO0, trace_path)
    p = tmp_path / "plain.json"
    p.write_bytes(gzip.open(trace_path(NANO0)).read())
    t2 = load_trace(p)
    for kind in ("kernels", "copies", "api", "ranges", "cpu_ops"):
        assert np.array_equal(getattr(trace, kind), getattr(t2, kind)), kind
    assert list(trace.names) == list(t2.names)


# ----------------------------------------------------------------- errors

def _err(path) -> str:
    with pytest.raises(InputError) as ei:
        load_trace(path)
    msg = str(ei.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_missing_file(tmp_path):
    assert "no such file" in _err(tmp_path / "nope.json")


def test_truncated_gzip(tmp_path, trace_path):
    raw = trace_path(NANO0).read_bytes()
    p = tmp_path / "cut.json.gz"
    p.write_bytes(raw[: len(raw) // 2])
    assert "truncated gzip" in _err(p)


def test_truncated_json(tmp_path, trace_path):
    raw = gzip.open(trace_path(NANO0)).read()
    for cut in (len(raw) // 2, len(raw) - 3, 40):
        p = tmp_path / f"cut{cut}.json"
        p.write_bytes(raw[:cut])
        assert "truncated JSON" in _err(p)
    # and gzipped, complete gzip stream of an incomplete document
    p = tmp_path / "cutdoc.json.gz"
    p.write_bytes(gzip.compress(raw[: len(raw) // 3]))
    assert "truncated JSON" in _err(p)


def test_not_json(tmp_path):
    p = tmp_path / "notes.json"
    p.write_text("this is not a trace\n")
    assert "not valid JSON" in _err(p)
    p = tmp_path / "empty.json"
    p.write_bytes(b"")
    assert "empty" in _err(p)


def test_json_without_trace_events(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"hidden_size": 1024, "events": []}))
    assert "no traceEvents" in _err(p) or "without a traceEvents" in _err(p)
    p = tmp_path / "list.json"
    p.write_text("[1, 2, 3]")
    _err(p)


def test_directory(tmp_path):
    assert "directory" in _err(tmp_path)


def test_small_literal_trace(tmp_path):
    """Escapes, brackets inside strings, ints and floats, nested args: exact fields."""
    doc = {"traceEvents": [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 11, "tid": 12,
         "ts": 100, "dur": 3, "args": {"cbid": 211, "correlation": 5, "External id": 9}},
        {"ph": "X", "cat": "kernel", "name": "k<\"q\"> {[", "pid": 0, "tid": 7, "ts": 101.5, "dur": 0.001,
         "args": {"device": 0, "stream": 7, "correlation": 5, "External id": 9, "grid": [2, 3, 4],
                  "block": [128, 1, 1], "registers per thread": 32, "shared memory": 1024}},
        {"ph": "X", "cat": "python_function", "name": "x\\\\", "pid": 11, "tid": 12, "ts": 1, "dur": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 11, "tid": 12, "ts": 99, "dur": 10,
         "args": {"External id": 9, "Input Dims": [[4, 8], [8, 16]], "Input type": ["c10::BFloat16", "long int"]}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "pid": 0, "tid": 7,
         "ts": 200, "dur": 1.25, "args": {"device": 0, "stream": 7, "correlation": 6, "bytes": 4096}},
    ], "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "numSms": 132,
                             "computeMajor": 9, "computeMinor": 0, "totalGlobalMem": 85018279936}],
        "metadata": {"env": {"HF_TOKEN": "secret"}}}
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    t = load_trace(p)
    k = t.kernels[0]
    assert t.names[k["name_id"]] == 'k<"q"> {['
    assert (k["start_ns"], k["end_ns"]) == (101500, 101501)
    assert (k["grid_x"], k["grid_y"], k["grid_z"], k["block_x"]) == (2, 3, 4, 128)
    assert (k["pid"], k["tid"], k["registers"], k["shared_mem_bytes"]) == (11, 12, 32, 1024)
    assert kernel_cpu_op_index(t).tolist() == [0]
    assert json.loads(t.names[t.cpu_ops[0]["input_dims_id"]]) == [[4, 8], [8, 16]]
    assert json.loads(t.names[t.cpu_ops[0]["input_types_id"]]) == ["c10::BFloat16", "long int"]
    c = t.copies[0]
    assert (c["direction"], c["bytes"], c["end_ns"] - c["start_ns"]) == (ev.COPY_DTOH, 4096, 1250)
    assert t.meta["event_counts"]["python_function"] == 1
    assert "secret" not in repr(t.meta)


# ----------------------------------------------------------------- streaming vs reference


@pytest.mark.parametrize("name", TRACES)
def test_streaming_equals_whole_document_parse(name, trace_path, loaded):
    from ridgeline.probes.kineto_dicts import load_trace_via_dicts
    trace, _ = loaded(name, trace_path)
    same_events(trace, load_trace_via_dicts(trace_path(name)))


@pytest.mark.parametrize("name,chunk", [(NANO0, 4096), (NANO0, 65536), (TRACES[2], 1 << 20)])
def test_chunk_boundaries_do_not_matter(name, chunk, trace_path, loaded):
    trace, _ = loaded(name, trace_path)
    same_events(trace, load_trace(trace_path(name), chunk_bytes=chunk))


def test_odd_formatting_goes_through_slow_path_exactly(tmp_path):
    """Whitespace before ':', exponents, 19-digit ids, escaped backslashes, a 'cat' key
    nested in args, an event bigger than the chunk: same result as the reference."""
    from ridgeline.probes.kineto_dicts import load_trace_via_dicts
    big_name = "k" * 10000
    text = """{"traceEvents" : [
      {"ph" : "X", "cat" : "kernel", "name" : "a\\\\\\"b", "pid": 0, "tid": 7, "ts" : 1e3, "dur": 2.5,
       "args": {"correlation" : 1234567890123456789, "grid": [1,2,3], "block": [4, 5, 6], "cat": "cpu_op"}},
      {"ph": "X", "cat": "kernel", "name": "%s", "pid": 0, "tid": 7, "ts": 10.0001, "dur": 0,
       "args": {"correlation": 7, "grid": [1, 2], "block": [1, 1, 1], "device": null}},
      {"ph": "i", "cat": "kernel", "name": "instant", "ts": 3},
      {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": "Spans", "tid": -1,
       "ts": 5, "dur": 1, "args": {"correlation": 7, "cbid": 211}},
      {"name": "no cat", "ph": "M", "pid": 1, "args": {"name": "x"}},
      7
    ], "deviceProperties": []}""" % big_name
    p = tmp_path / "odd.json"
    p.write_text(text)
    ref = load_trace_via_dicts(p)
    for chunk in (64, 1 << 20):
        got = load_trace(p, chunk_bytes=chunk)
        same_events(got, ref)
    assert len(ref.kernels) == 2 and ref.kernels["start_ns"][0] == 1000000
    assert ref.names[ref.kernels["name_id"][0]] == 'a\\"b'
    assert ref.kernels["correlation_id"][0] == 1234567890123456789
    assert ref.kernels["grid_x"][1] == -1          # malformed grid: not guessed
    assert ref.meta["event_counts"] == {"<none>": 1, "cuda_runtime": 1, "kernel": 3}


def test_two_process_read_equals_one(tmp_path, trace_path, loaded):
    trace, _ = loaded(TRACES[2], trace_path)
    p = tmp_path / "b200.json"
    p.write_bytes(gzip.open(trace_path(TRACES[2])).read())
    from pathlib import Path

    from ridgeline.probes import kineto_scan
    assert kineto_scan.load_two(Path(p), 1 << 20) is not None   # really took two parts
    same_events(trace, load_trace(p, chunk_bytes=1 << 20, parallel=True))


def test_two_process_read_of_bad_files_still_errors(tmp_path, trace_path):
    raw = gzip.open(trace_path(TRACES[2])).read()
    p = tmp_path / "cut.json"
    p.write_bytes(raw[: len(raw) * 3 // 4])
    with pytest.raises(InputError, match="truncated JSON"):
        load_trace(p, parallel=True)
    # a middle that falls inside one huge event: the split is refused, one reader does it
    doc = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1,
                            "args": {"pad": [{"ph": "x"}] * 20000, "correlation": 1}},
                           {"ph": "X", "cat": "kernel", "name": "k2", "ts": 2, "dur": 1, "args": {}}]}
    p2 = tmp_path / "one_big_event.json"
    p2.write_text(json.dumps(doc))
    t = load_trace(p2, chunk_bytes=4096, parallel=True)
    assert len(t.kernels) == 2 and t.kernels["correlation_id"].tolist() == [1, -1]


@pytest.mark.parametrize("kind", ["missing", "truncated_gz", "not_json", "no_events"])
def test_cli_analyze_bad_file_exit_2_one_line(kind, tmp_path, trace_path, capsys):
    pytest.importorskip("ridgeline.agent.commands.analyze")
    from ridgeline.agent.cli import main
    p = tmp_path / f"{kind}.json"
    if kind == "truncated_gz":
        p = tmp_path / "cut.json.gz"
        raw = trace_path(NANO0).read_bytes()
        p.write_bytes(raw[: len(raw) // 3])
    elif kind == "not_json":
        p.write_text("hello")
    elif kind == "no_events":
        p.write_text('{"schemaVersion": 1}')
    code = main(["analyze", str(p)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("ridgeline: error: ") and p.name in err[0]
    assert "Traceback" not in err[0]
