"""CUPTI records of every supported CUDA release decode field by field through the agent.

For each real header set (nvidia-cuda-cupti wheels of CUDA 12.4, 12.8, 13.0 and the newest
13.x; downloaded into ~/.cache/ridgeline-cupti when missing) tests/support/cupti_header_records.c
is compiled against the headers with the struct versions that release's libcupti writes
(the newest of each kind the headers define) and fills real records through the header's
own types. The bytes then go, as libridgeline_cupti.so sends them, over the real socket to
a started CuptiProbe, and every field Ridgeline reads is compared with what was written.
No offset is typed here: the layout comes from the header, the expected values from the
input. Kernel names are the mangled names CUPTI reports.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from support import cupti_records as R

from ridgeline.probes.cupti import layouts as L
from ridgeline.probes.cupti.probe import CuptiProbe
from ridgeline.probes.events import MISSING

LABELS = list(R.HEADER_SETS)


@pytest.fixture(scope="module", params=LABELS)
def header_set(request, tmp_path_factory):
    return R.build_header_set(request.param, tmp_path_factory.mktemp(f"hdr-{request.param}"))


def _records(rng, n, names):
    """Input lines for the C program and the values they carry (the expected decode)."""
    ptrs = list(names)
    t0 = 1_764_000_000_000_000_000
    k = {"start": t0 + np.cumsum(rng.integers(1_000, 50_000, n)).astype(np.uint64)}
    k["end"] = k["start"] + rng.integers(1, 2_000_000, n).astype(np.uint64)
    cols = {"device": (0, 8), "context": (1, 5), "stream": (1, 1 << 20), "gx": (1, 1 << 16), "gy": (1, 64),
            "gz": (1, 8), "bx": (1, 1025), "by": (1, 4), "bz": (1, 2), "regs": (16, 256), "sshm": (0, 48 << 10),
            "dshm": (0, 200 << 10)}
    for c, (lo, hi) in cols.items():
        k[c] = rng.integers(lo, hi, n)
    k["corr"] = np.arange(100, 100 + n)
    k["name"] = np.array(ptrs)[rng.integers(0, len(ptrs), n)]
    in_graph = rng.random(n) < 0.5
    k["gnode"] = np.where(in_graph, rng.integers(1, 1 << 40, n), 0)
    k["graph"] = np.where(in_graph, rng.integers(1, 1 << 31, n), 0)
    lines = [f"K {k['start'][i]} {k['end'][i]} {k['device'][i]} {k['context'][i]} {k['stream'][i]} {k['gx'][i]} "
             f"{k['gy'][i]} {k['gz'][i]} {k['bx'][i]} {k['by'][i]} {k['bz'][i]} {k['regs'][i]} {k['sshm'][i]} "
             f"{k['dshm'][i]} {k['corr'][i]} {k['name'][i]} {k['gnode'][i]} {k['graph'][i]}" for i in range(n)]
    # one launch API record per kernel (runtime, cudaLaunchKernel), 1-5 us before it
    api_start = k["start"] - rng.integers(1_000, 5_000, n).astype(np.uint64)
    tid = rng.integers(1000, 1010, n)
    lines += [f"A 5 {R.CBID_CUDA_LAUNCH_KERNEL} {api_start[i]} {api_start[i] + 500} {os.getpid()} {tid[i]} "
              f"{k['corr'][i]}" for i in range(n)]
    lines += [f"X 5 {900_000 + i} {k['corr'][i]}" for i in range(n)]
    m = max(2, n // 8)
    c = {"copykind": rng.choice([1, 2, 8, 10], m), "bytes": rng.integers(1, 1 << 40, m),
         "start": t0 + rng.integers(0, 10**9, m).astype(np.uint64), "device": rng.integers(0, 8, m),
         "stream": rng.integers(1, 100, m), "corr": np.arange(10_000, 10_000 + m),
         "graph": rng.integers(0, 50, m)}
    c["end"] = c["start"] + rng.integers(1, 10**6, m).astype(np.uint64)
    lines += [f"C {c['copykind'][i]} {c['bytes'][i]} {c['start'][i]} {c['end'][i]} {c['device'][i]} 1 "
              f"{c['stream'][i]} {c['corr'][i]} 0 {c['graph'][i]}" for i in range(m)]
    s = {"bytes": rng.integers(1, 1 << 30, m), "start": t0 + rng.integers(0, 10**9, m).astype(np.uint64),
         "device": rng.integers(0, 8, m), "stream": rng.integers(1, 100, m), "corr": np.arange(20_000, 20_000 + m)}
    s["end"] = s["start"] + 777
    lines += [f"S 0 {s['bytes'][i]} {s['start'][i]} {s['end'][i]} {s['device'][i]} 1 {s['stream'][i]} "
              f"{s['corr'][i]} 0 0" for i in range(m)]
    return lines, k, api_start, tid, c, s


def _send_and_poll(tmp_path, sections, names, api_version, n_kernels):
    probe = CuptiProbe(str(tmp_path / "cupti.sock"))
    probe.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(probe.socket_path)
            c.sendall(R.hello_frame(cupti_version=api_version)
                      + R.batch_frame(sections, names, cupti_version=api_version))
            got = R.poll_until(probe, lambda g: sum(len(x["trace"].kernels) for x in g if "trace" in x) >= n_kernels,
                               timeout_s=20)
        counters = probe.counters()
    finally:
        probe.stop()
    traces = [x for x in got if "trace" in x]
    assert len(traces) == 1, (got, counters)
    return traces[0], counters


def test_records_of_this_release_decode_field_by_field(header_set, tmp_path):
    rng = np.random.default_rng(sum(map(ord, header_set.label)))
    names = {0x7F00_0000_1000 + 0x100 * i: m for i, (m, *_) in enumerate(R.MANGLED_KERNELS)}
    lines, k, api_start, tid, c, s = _records(rng, 300, names)
    sections, api_version = header_set.write(lines, tmp_path)
    sizes = {kind: size for kind, size, _ in sections}
    out, counters = _send_and_poll(tmp_path, sections, names, api_version, 300)
    t, lat = out["trace"], out["launch_latency_ns"]
    meta = t.meta["processes"][os.getpid()]
    assert meta["cupti_version"] == api_version
    assert all("fixed offsets" in meta["layouts"][kind] for kind in sizes), meta["layouts"]
    assert counters["undecodable_records"] == 0 and counters["rejected_records"] == 0, counters

    kr = t.kernels
    order = np.argsort(kr["correlation_id"])
    kr, lat = kr[order], lat[order]
    assert len(kr) == 300
    for ours, theirs in [("start_ns", "start"), ("end_ns", "end"), ("device", "device"), ("context", "context"),
                         ("stream", "stream"), ("grid_x", "gx"), ("grid_y", "gy"), ("grid_z", "gz"),
                         ("block_x", "bx"), ("block_y", "by"), ("block_z", "bz"), ("registers", "regs"),
                         ("correlation_id", "corr")]:
        np.testing.assert_array_equal(kr[ours], k[theirs].astype(np.int64), err_msg=f"{header_set.label}: {ours}")
    np.testing.assert_array_equal(kr["shared_mem_bytes"], k["sshm"] + k["dshm"])
    np.testing.assert_array_equal(kr["graph_id"], np.where(k["graph"] == 0, MISSING, k["graph"]))
    np.testing.assert_array_equal(kr["graph_node_id"], np.where(k["gnode"] == 0, MISSING, k["gnode"]))
    np.testing.assert_array_equal(kr["tid"], tid)                                  # joined with the API record
    np.testing.assert_array_equal(lat, (k["start"] - api_start).astype(np.int64))
    np.testing.assert_array_equal(kr["external_id"], 900_000 + np.arange(300))     # EXTERNAL_CORRELATION
    assert (kr["pid"] == os.getpid()).all()
    # names: demangled, the mangled spelling kept next to it
    got_names = t.names.names_of(kr["name_id"])
    mangled = t.meta["mangled_names"]
    for i in range(300):
        assert mangled[int(kr["name_id"][i])] == names[int(k["name"][i])]
        assert not got_names[i].startswith("_Z")

    cp = t.copies
    mc = cp[np.isin(cp["correlation_id"], c["corr"])]
    mc = mc[np.argsort(mc["correlation_id"])]
    assert len(mc) == len(c["corr"])
    for ours, theirs in [("start_ns", "start"), ("end_ns", "end"), ("device", "device"), ("stream", "stream"),
                         ("bytes", "bytes"), ("direction", "copykind")]:
        np.testing.assert_array_equal(mc[ours], c[theirs].astype(mc[ours].dtype), err_msg=f"memcpy {ours}")
    np.testing.assert_array_equal(mc["graph_id"], np.where(c["graph"] == 0, MISSING, c["graph"]))
    ms = cp[np.isin(cp["correlation_id"], s["corr"])]
    ms = ms[np.argsort(ms["correlation_id"])]
    assert len(ms) == len(s["corr"])
    for ours, theirs in [("start_ns", "start"), ("end_ns", "end"), ("device", "device"), ("stream", "stream"),
                         ("bytes", "bytes")]:
        np.testing.assert_array_equal(ms[ours], s[theirs].astype(ms[ours].dtype), err_msg=f"memset {ours}")
    api = t.api[np.argsort(t.api["correlation_id"])]
    np.testing.assert_array_equal(api["start_ns"], api_start.astype(np.int64))
    np.testing.assert_array_equal(api["tid"], tid)
    assert t.names.names_of(api["name_id"][:1]) == ["cudaLaunchKernel_v7000"]


def test_kernel_record_sizes_differ_between_releases(tmp_path_factory):
    """The point of decoding by kind: the releases' kernel records do not share one size."""
    sizes = {}
    for label in LABELS:
        hs = R.build_header_set(label, tmp_path_factory.mktemp(f"sz-{label}"))
        secs, _ = hs.write([f"K 1 2 0 1 1 1 1 1 1 1 1 1 0 0 {i} 0 0 0" for i in range(3)],
                           tmp_path_factory.mktemp("o"))
        sizes[label] = (hs.structs["Kernel"], secs[0][1])
    assert len({size for _, size in sizes.values()}) >= 3, sizes


def test_out_of_range_values_written_by_the_header_are_rejected_and_counted(tmp_path):
    """Issue 14 item 7: start/end near 2**64, device 0xFFFFFFFF, reversed intervals: each
    record is rejected and counted, the good ones pass, and nothing turns negative."""
    hs = R.build_header_set("13.0", tmp_path)
    t0 = 1_764_000_000_000_000_000
    good = [f"K {t0 + i * 10_000} {t0 + i * 10_000 + 5_000} {i % 2} 1 7 1 1 1 128 1 1 32 0 0 {i} 0 0 0"
            for i in range(5)]
    bad = [f"K {2**64 - 10} {2**64 - 1} 0 1 7 1 1 1 128 1 1 32 0 0 100 0 0 0",       # beyond int64
           f"K {t0} {2**64 - 1} 0 1 7 1 1 1 128 1 1 32 0 0 101 0 0 0",               # end beyond int64
           f"K {t0} {t0 + 1000} {2**32 - 1} 1 7 1 1 1 128 1 1 32 0 0 102 0 0 0",    # device 0xFFFFFFFF
           f"K {t0 + 5000} {t0} 0 1 7 1 1 1 128 1 1 32 0 0 103 0 0 0",               # ends before it starts
           "K 0 0 0 1 7 1 1 1 128 1 1 32 0 0 104 0 0 0",                            # no timestamps
           f"C 1 {2**63 + 5} {t0} {t0 + 10} 0 1 7 105 0 0"]                          # bytes beyond int64
    sections, api = hs.write(good + bad, tmp_path)
    out, counters = _send_and_poll(tmp_path, sections, {}, api, 5)
    k = out["trace"].kernels
    assert len(k) == 5 and (k["start_ns"] > 0).all() and (k["end_ns"] >= k["start_ns"]).all()
    assert set(k["device"].tolist()) == {0, 1}
    assert len(out["trace"].copies) == 0
    assert counters["rejected_records"] == 6
    assert counters["rejected_timestamps"] == 4 and counters["rejected_device"] == 1 and counters["rejected_bytes"] == 1
    assert counters["errors"] >= 6


def test_mangled_names_are_demangled_as_cxxfilt_does_and_reach_their_signature():
    """The names CUPTI reports, demangled by the decoder, against binutils' c++filt, and
    through the signature table to the phase class each belongs to."""
    from ridgeline.aggregator import signatures as S
    from ridgeline.probes.cupti.decode import ProcessDecoder
    cxxfilt = shutil.which("c++filt")
    d = ProcessDecoder(1)
    d.add_names({0x1000 + i: m for i, (m, *_) in enumerate(R.MANGLED_KERNELS)})
    ids = d.name_ids(np.array([0x1000 + i for i in range(len(R.MANGLED_KERNELS))], np.uint64))
    sigs = S.load_signatures()
    got = S.match_name_ids(d.names, ids, sigs)
    from ridgeline.probes.events import NameTable
    raw = S.match_name_ids(NameTable(m for m, *_ in R.MANGLED_KERNELS), np.arange(len(R.MANGLED_KERNELS)), sigs)
    for (mangled, sig_id, phase, missed_raw), i, g, r in zip(R.MANGLED_KERNELS, ids, got, raw):
        name = d.names[int(i)]
        if cxxfilt:
            want = subprocess.run([cxxfilt, mangled], capture_output=True, text=True, check=True).stdout.strip()
            assert name == want
        assert name.startswith("void ") and d.mangled[int(i)] == mangled
        assert (sigs[g].id if g >= 0 else None) == sig_id, name
        if g >= 0:
            assert sigs[g].phase == phase
        if missed_raw:
            assert r < 0 or sigs[r].id != sig_id      # the mangled spelling alone would miss it
    if cxxfilt is None:
        pytest.skip("binutils c++filt not installed: demangled names not compared with it (signatures were)")


def test_names_are_demangled_once_and_hostile_names_cost_nothing():
    from ridgeline.probes.cupti import decode
    calls = []
    real = decode.demangle_many
    try:
        decode.demangle_many = lambda names: calls.extend(names) or real(names)
        d = decode.ProcessDecoder(1)
        m = R.MANGLED_KERNELS[0][0]
        d.add_names({1: m})
        d.add_names({2: m, 3: "triton_poi_fused_add_0"})     # same name under another pointer (a reconnect)
        assert calls == [m, "triton_poi_fused_add_0"]
    finally:
        decode.demangle_many = real
    # deeply nested or cut names (the library cuts at 4096 bytes): in a child process, so
    # that a demangler crash (stack overflow) would show as a failure, not kill pytest
    code = ("import sys; from ridgeline.probes.cupti.demangle import demangle\n"
            "m = sys.argv[1]\n"
            "for h in ('_Z' + 'P' * 4094 + 'i', m[:60], '_Z' + 'N' * 2000 + 'E' * 2000, '_Z' + 'A1_' * 1364,\n"
            "          '_ZN' + '1a' * 2046 + 'E', '_Z\\udcff', 'not mangled'):\n"
            "    out = demangle(h)\n"
            "    assert isinstance(out, str) and out, h[:20]\n"
            "print('ok', demangle(m[:60]) == m[:60])\n")
    r = subprocess.run([sys.executable, "-c", code, m], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["ok", "True"], r.stderr[-500:]


def test_graph_level_records_become_one_row_per_graph_launch(header_set, tmp_path):
    """Graph-level mode (RIDGELINE_GRAPH_LEVEL=1): CUpti_ActivityGraphTrace2 records, laid
    out by each release's header, become one kernel-table row per launch named after the
    graph, joined to the cudaGraphLaunch API record."""
    t0 = 1_764_000_000_000_000_000
    lines = [f"G {t0 + i * 100_000} {t0 + i * 100_000 + 40_000} {i % 2} {7 + i % 3} 1 13 {500 + i}" for i in range(9)]
    lines += [f"A 5 {R.CBID_CUDA_GRAPH_LAUNCH} {t0 + i * 100_000 - 3_000} {t0 + i * 100_000 - 1_000} {os.getpid()} "
              f"{4242} {500 + i}" for i in range(9)]
    sections, api = header_set.write(lines, tmp_path)
    out, counters = _send_and_poll(tmp_path, sections, {}, api, 9)
    k = out["trace"].kernels
    k = k[np.argsort(k["correlation_id"])]
    assert len(k) == 9 and counters["undecodable_records"] == 0
    np.testing.assert_array_equal(k["start_ns"], t0 + np.arange(9) * 100_000)
    np.testing.assert_array_equal(k["end_ns"] - k["start_ns"], 40_000)
    np.testing.assert_array_equal(k["graph_id"], 7 + np.arange(9) % 3)
    assert (k["graph_node_id"] == MISSING).all() and (k["stream"] == 13).all()
    np.testing.assert_array_equal(k["device"], np.arange(9) % 2)
    assert out["trace"].names.names_of(k["name_id"][:3]) == ["CUDA graph 7", "CUDA graph 8", "CUDA graph 9"]
    assert (k["tid"] == 4242).all()


def _doubling_name(levels: int) -> str:
    """An Itanium name whose demangled form doubles with each level (``b<X, X>`` where X
    is a back-reference to the previous level): 8 bytes per level, 2**levels output."""
    def sub(i):
        if i == 0:
            return "S_"
        digits, j, r = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", i - 1, ""
        while True:
            r, j = digits[j % 36] + r, j // 36
            if j == 0:
                return "S" + r + "_"
    x = sub(1) + "I1a" + sub(2) + "E"           # S_ = f, S0_ = b, S1_ = a, S2_ = b<a, a>
    for k in range(2, levels):
        x = sub(1) + "I" + x + sub(k + 1) + "E"
    return "_Z1fI1bI" + x + sub(levels + 1) + "EEvv"


def test_demangling_bombs_cost_bounded_memory_and_time_and_are_counted():
    """A hostile peer's names whose demangled form grows exponentially (a 201-byte name
    gives 109 MB in-process, a 329-byte one 2**40 bytes: the agent would allocate until
    killed) stay mangled and are counted; the agent's memory does not move, real names
    around them are still demangled, and after two deadlines the process's names are no
    longer demangled at all. In a child process so that a failure is a failure, not a
    hung or OOM-killed pytest."""
    assert _doubling_name(3).startswith("_Z")
    from ridgeline.probes.cupti.demangle import demangle
    assert demangle(_doubling_name(3)) == "void f<b<b<b<a, a>, b<a, a> >, b<b<a, a>, b<a, a> > > >()"
    # The child's own high-water mark (VmHWM starts anew at exec; ru_maxrss would carry the
    # RSS of this pytest process, forked for the preexec_fn, into the child).
    code = ("import json, resource, sys\n"
            "def hwm_kib():\n"
            "    for line in open('/proc/self/status'):\n"
            "        if line.startswith('VmHWM:'):\n"
            "            return int(line.split()[1])\n"
            "from ridgeline.probes.cupti.decode import ProcessDecoder\n"
            "bombs, real = json.loads(sys.argv[1]), sys.argv[2]\n"
            "d = ProcessDecoder(1)\n"
            "d.add_names({1: bombs[0], 2: real, 3: bombs[1]})\n"
            "d.add_names({4: bombs[2], 5: real + 'x'})\n"
            "d.add_names({6: bombs[3]})\n"
            "print(json.dumps({'names': [d.names[i] for i in range(len(d.names))], 'counters': d.counters,\n"
            "                  'rss_kib': hwm_kib()}))\n")
    import json
    bombs = [_doubling_name(24), _doubling_name(40), _doubling_name(41), _doubling_name(42)]
    real = R.MANGLED_KERNELS[1][0]
    import resource

    def limit():        # without the bound the child would take the machine's memory, not only time
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    try:
        r = subprocess.run([sys.executable, "-c", code, json.dumps(bombs), real], capture_output=True, text=True,
                           timeout=60, preexec_fn=limit, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        pytest.fail("demangling hostile names ran past 60 s")
    assert r.returncode == 0, r.stderr[-800:]
    out = json.loads(r.stdout)
    names, c = out["names"], out["counters"]
    assert names[0] == bombs[0] and names[2] == bombs[1] and names[3] == bombs[2] and names[5] == bombs[3]
    # Whether a bomb ends at its deadline or at the worker's memory limit depends on how
    # fast this host is; either way it stays mangled, is counted, and costs the agent nothing.
    assert names[1] in (real, "") or names[1].startswith("void vllm::paged_attention_v2_kernel<unsigned short")
    # A bomb that ends at the answer cap or its deadline is counted; one the worker runs out
    # of memory on is reported as "not a mangled name" and left as it is (not counted).
    assert c["names_not_demangled"] >= 1
    if c["demangle_deadlines"] >= 2:            # two deadlines: later names stay mangled (next test)
        assert c["demangling_stopped"] == 1
    else:
        assert c.get("demangling_stopped", 0) == 0
    assert out["rss_kib"] < 200 << 10            # the 109 MB answer never reached this process


def test_two_deadlines_stop_demangling_for_that_process():
    """Deterministically (every call misses a zero deadline): after two deadlines a
    process's names are no longer sent to the demangler at all, and each is counted."""
    code = ("import json, sys\n"
            "import ridgeline.probes.cupti.demangle as dm\n"
            "dm.DEADLINE_BASE_S = dm.DEADLINE_PER_NAME_S = 0.0\n"
            "from ridgeline.probes.cupti.decode import ProcessDecoder\n"
            "real = sys.argv[1]\n"
            "d = ProcessDecoder(1)\n"
            "for i, suffix in enumerate(('', 'x', 'y')):\n"
            "    d.add_names({i + 1: real + suffix})\n"
            "print(json.dumps({'names': [d.names[i] for i in range(len(d.names))], 'counters': d.counters}))\n")
    real = R.MANGLED_KERNELS[1][0]
    r = subprocess.run([sys.executable, "-c", code, real], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-800:]
    import json
    out = json.loads(r.stdout)
    assert out["names"] == [real, real + "x", real + "y"]
    c = out["counters"]
    assert c["names_not_demangled"] == 3 and c["demangle_deadlines"] == 2 and c["demangling_stopped"] == 1


def test_enum_values_the_decoder_uses_are_the_headers(header_set, tmp_path):
    """Kind numbers, marker flags and object kinds, compiled against each real header set:
    MARKER_OBJECT_THREAD is CUPTI_ACTIVITY_OBJECT_THREAD (2 in every release; 1 is PROCESS)."""
    want = {"CUPTI_ACTIVITY_OBJECT_PROCESS": L.MARKER_OBJECT_PROCESS,
            "CUPTI_ACTIVITY_OBJECT_THREAD": L.MARKER_OBJECT_THREAD,
            "CUPTI_ACTIVITY_FLAG_MARKER_INSTANTANEOUS": L.MARKER_FLAG_INSTANTANEOUS,
            "CUPTI_ACTIVITY_FLAG_MARKER_START": L.MARKER_FLAG_START,
            "CUPTI_ACTIVITY_FLAG_MARKER_END": L.MARKER_FLAG_END,
            "CUPTI_ACTIVITY_KIND_MEMCPY": L.KIND_MEMCPY, "CUPTI_ACTIVITY_KIND_MEMSET": L.KIND_MEMSET,
            "CUPTI_ACTIVITY_KIND_KERNEL": L.KIND_KERNEL, "CUPTI_ACTIVITY_KIND_DRIVER": L.KIND_DRIVER,
            "CUPTI_ACTIVITY_KIND_RUNTIME": L.KIND_RUNTIME,
            "CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL": L.KIND_CONCURRENT_KERNEL,
            "CUPTI_ACTIVITY_KIND_MARKER": L.KIND_MARKER, "CUPTI_ACTIVITY_KIND_MARKER_DATA": L.KIND_MARKER_DATA,
            "CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION": L.KIND_EXTERNAL_CORRELATION,
            "CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API": L.KIND_INTERNAL_LAUNCH_API,
            "CUPTI_ACTIVITY_KIND_GRAPH_TRACE": L.KIND_GRAPH_TRACE}
    src = tmp_path / "enums.c"
    src.write_text("#include <stdio.h>\n#include <cupti_activity.h>\nint main(void) {\n"
                   + "".join(f'printf("{n} %lld\\n", (long long){n});\n' for n in want) + "return 0; }\n")
    exe = tmp_path / "enums"
    subprocess.run(["cc", f"-I{header_set.include}", f"-I{R.COMPAT_INCLUDE}", "-o", str(exe), str(src)],
                   check=True, capture_output=True, timeout=120)
    got = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                       check=True).stdout.splitlines())
    assert {n: int(v) for n, v in got.items()} == want, header_set.label


def test_nvtx_ranges_carry_the_thread_each_header_writes(header_set, tmp_path):
    """Push/pop ranges as CUPTI writes them (CUpti_ActivityMarker2 with objectKind
    CUPTI_ACTIVITY_OBJECT_THREAD, filled through the release's own header) decode with the
    thread id written, not -1 (the range-based step mapping needs it)."""
    t0 = 1_764_000_000_000_000_000
    start, end = L.MARKER_FLAG_START, L.MARKER_FLAG_END
    names = {0x7F00_0000_2000: "prefill", 0x7F00_0000_2100: "decode", 0x7F00_0000_3000: "vllm"}
    mangled = {0x7F00_0000_1000: R.MANGLED_KERNELS[0][0]}
    lines = [f"M {start} {t0 + 10} 1 {os.getpid()} 5001 {0x7F00_0000_2000} {0x7F00_0000_3000}",
             f"M {start} {t0 + 20} 2 {os.getpid()} 5002 {0x7F00_0000_2100} {0x7F00_0000_3000}",
             f"M {end} {t0 + 900} 1 {os.getpid()} 5001 0 0",
             f"M {end} {t0 + 950} 2 {os.getpid()} 5002 0 0",
             f"K {t0 + 100} {t0 + 200} 0 1 7 1 1 1 128 1 1 32 0 0 77 {0x7F00_0000_1000} 0 0"]
    sections, api = header_set.write(lines, tmp_path)
    out, counters = _send_and_poll(tmp_path, sections, {**names, **mangled}, api, 1)
    r = out["trace"].ranges
    r = r[np.argsort(r["start_ns"])]
    assert len(r) == 2, (r, counters)
    assert list(r["tid"]) == [5001, 5002], header_set.label
    assert out["trace"].names.names_of(r["name_id"]) == ["prefill", "decode"]
    np.testing.assert_array_equal(r["end_ns"] - r["start_ns"], [890, 930])


def _header_cbid(include, domain: str, name: str) -> int:
    text = (include / f"cupti_{domain}_cbid.h").read_text()
    import re
    return int(re.search(rf"CUPTI_{domain.upper()}_TRACE_CBID_{name}\s*=\s*(\d+)", text).group(1))


def test_graph_replay_launch_latency_is_the_first_node_only(header_set, tmp_path):
    """Node-level CUDA graphs: every node of a replay carries the cudaGraphLaunch's
    correlation id. Only the first node's start minus the launch is a launch latency; the
    other nodes keep their thread but no latency (they are node offsets)."""
    t0 = 1_764_000_000_000_000_000
    gl = _header_cbid(header_set.include, "runtime", "cudaGraphLaunch_v10000")
    lk = _header_cbid(header_set.include, "runtime", "cudaLaunchKernel_v7000")
    name = 0x7F00_0000_1000
    lines = []
    for rep in range(3):                         # 3 replays of a 4-node graph, nodes written out of order
        base = t0 + rep * 1_000_000
        for node in (2, 0, 3, 1):
            s = base + 10_000 + node * 20_000
            lines.append(f"K {s} {s + 15_000} 0 1 7 1 1 1 128 1 1 32 0 0 {600 + rep} {name} {node + 1} 9")
        lines.append(f"A 5 {gl} {base} {base + 2_000} {os.getpid()} 4242 {600 + rep}")
    lines.append(f"K {t0 + 5_000_000} {t0 + 5_001_000} 0 1 7 1 1 1 128 1 1 32 0 0 700 {name} 0 0")   # eager
    lines.append(f"A 5 {lk} {t0 + 4_996_000} {t0 + 4_997_000} {os.getpid()} 4242 700")
    sections, api_version = header_set.write(lines, tmp_path)
    probe = CuptiProbe(str(tmp_path / "cupti.sock"))
    probe.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(probe.socket_path)
            cbids = ((1, lk, 1, b"cudaLaunchKernel_v7000"), (1, gl, 2, b"cudaGraphLaunch_v10000"))
            c.sendall(R.hello_frame(cupti_version=api_version, cbids=cbids)
                      + R.batch_frame(sections, {name: R.MANGLED_KERNELS[0][0]}, cupti_version=api_version))
            got = R.poll_until(probe, lambda g: sum(len(x["trace"].kernels) for x in g if "trace" in x) >= 13,
                               timeout_s=20)
    finally:
        probe.stop()
    x = next(x for x in got if "trace" in x)
    k, lat = x["trace"].kernels, x["launch_latency_ns"]
    assert len(k) == 13 and (k["tid"] == 4242).all()
    for rep in range(3):
        sel = np.flatnonzero(k["correlation_id"] == 600 + rep)
        first = sel[np.argmin(k["start_ns"][sel])]
        assert lat[first] == 10_000, header_set.label
        assert (lat[sel[sel != first]] == MISSING).all(), lat[sel]
    assert lat[np.flatnonzero(k["correlation_id"] == 700)[0]] == 4_000
