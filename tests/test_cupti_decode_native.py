"""probes/cupti/decode_native.py (libridgeline_cupti_decode.so) against its numpy reference.

The same batches go through ProcessDecoder(reference=True) (decode.py's numpy passes) and
ProcessDecoder() (the C passes); everything handed on must be byte-identical: the Trace
arrays, the launch latency, the names, the counters, the carries kept for the next poll.
Inputs: records laid out by the real CUPTI headers of each supported release
(tests/support/cupti_header_records.c compiled against the nvidia-cuda-cupti wheels), every
kernel struct version cupti-python defines, make_buffer's batches, and adversarial records
(out-of-range values, names missing, repeated and sparse correlation ids, unknown kinds,
sections too short for their kind, random bytes).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from support import cupti_records as R

from ridgeline.probes.cupti import decode_native as N
from ridgeline.probes.cupti import layouts as L
from ridgeline.probes.cupti.decode import MAX_DURATION_NS, MAX_TIMESTAMP_NS, ProcessDecoder
from ridgeline.probes.cupti.protocol import BATCH_DTYPE, Batch, Hello, Section
from ridgeline.probes.events import API_GRAPH_LAUNCH, API_LAUNCH, API_SYNC

T0 = 1_764_000_000_000_000_000


def _batch(sections, names=None, version=130500) -> Batch:
    """sections: [(kind, record_size, bytes)] or [(kind, array)]."""
    secs = []
    for s in sections:
        kind, size, data = (s[0], s[1].dtype.itemsize, s[1].tobytes()) if len(s) == 2 else s
        secs.append(Section(kind, size, len(data) // size, memoryview(data)))
    h = np.zeros(1, BATCH_DTYPE)[0]
    h["cupti_version"] = version
    h["records"] = sum(s.count for s in secs)
    return Batch(h, dict(names or {}), secs)


def _hello(cbids=None) -> Hello:
    cbids = cbids or {(1, R.CBID_CUDA_LAUNCH_KERNEL): (API_LAUNCH, "cudaLaunchKernel_v7000"),
                      (1, R.CBID_CUDA_GRAPH_LAUNCH): (API_GRAPH_LAUNCH, "cudaGraphLaunch_v10000"),
                      (1, R.CBID_CUDA_STREAM_SYNC): (API_SYNC, "cudaStreamSynchronize_v3020"),
                      (2, 307): (API_LAUNCH, "cuLaunchKernel")}
    return Hello(1, 130500, 130500, 0, 0, 1, "t", "", {}, cbids)


def _run(polls, native: bool, hello: Hello | None, received_ns: int | None):
    """Decode ``polls`` (a list of lists of batches; take() after each list) with one decoder."""
    d = ProcessDecoder(7, reference=not native)
    if hello is not None:
        d.set_hello(hello)
    out = []
    for batches in polls:
        for b in batches:
            d.add_batch(b, received_ns=received_ns)
        out.append(d.take())
    return d, out


def _same(polls, hello: Hello | None = None, received_ns: int | None = None) -> list:
    """Both decoders on the same polls; asserts every output and all state agree."""
    ref, got_ref = _run(polls, False, hello, received_ns)
    nat, got_nat = _run(polls, True, hello, received_ns)
    assert nat.native and not ref.native
    for i, ((tr, lr), (tn, ln)) in enumerate(zip(got_ref, got_nat)):
        for f in ("kernels", "copies", "api", "ranges"):
            a, b = getattr(tr, f), getattr(tn, f)
            assert a.dtype == b.dtype and len(a) == len(b), (i, f, len(a), len(b))
            assert a.tobytes() == b.tobytes(), (i, f, _first_diff(a, b))
        assert lr.dtype == ln.dtype and lr.tobytes() == ln.tobytes(), (i, "latency")
        assert tr.meta == tn.meta, i
    assert [ref.names[j] for j in range(len(ref.names))] == [nat.names[j] for j in range(len(nat.names))]
    assert ref.counters == nat.counters
    assert ref._api_carry.tobytes() == nat._api_carry.tobytes()
    assert ref._ext_carry.tobytes() == nat._ext_carry.tobytes()
    return got_nat


def _first_diff(a, b):
    for f in a.dtype.names:
        bad = np.flatnonzero(a[f] != b[f])
        if len(bad):
            return f, int(bad[0]), a[f][bad[0]], b[f][bad[0]]
    return None


def test_the_library_is_built_and_its_constants_are_decode_pys():
    from ridgeline.probes.cupti.protocol import MAX_DEVICE_ID
    assert N.constants() == (MAX_TIMESTAMP_NS, MAX_DURATION_NS, MAX_DEVICE_ID, -1, API_GRAPH_LAUNCH)
    with pytest.raises(N.DecodeLibraryMissing, match="other limits"):
        N.check((MAX_TIMESTAMP_NS, MAX_DURATION_NS + 1, MAX_DEVICE_ID, -1, API_GRAPH_LAUNCH))
    assert N.kernel_offsets(L.layout_for(10, R.KERNEL.itemsize)[0]) is not None
    assert N.api_offsets(L.layout_for(5, R.API.itemsize)[0]) is not None


def test_make_buffer_batches_interleaved_and_not_across_polls():
    polls = []
    for p in range(4):
        bs = []
        for j in range(3):
            b = R.make_buffer(500, seed=10 * p + j, corr0=1 + 1500 * (3 * p + j), interleave=False)
            bs.append(_batch([(10, b.kernels), (5, b.api), (39, b.extcorr), (1, b.copies), (2, b.memsets),
                              (12, b.markers)], b.names))
        polls.append(bs)
    got = _same(polls, _hello())
    assert sum(len(t.kernels) for t, _ in got) == 6000
    assert all((t.kernels["tid"] >= 0).all() for t, _ in got)


def test_api_before_its_kernels_joins_from_the_carry():
    b = R.make_buffer(300, seed=3, with_markers=False)
    polls = [[_batch([(5, b.api), (39, b.extcorr[:100])], b.names)],
             [_batch([(10, b.kernels[:150]), (39, b.extcorr[100:])])],
             [_batch([(10, b.kernels[150:]), (1, b.copies)])],
             [_batch([(10, b.kernels[:5])])]]                      # joined launches are not kept
    got = _same(polls, _hello())
    assert (got[1][0].kernels["tid"] >= 0).all() and (got[3][0].kernels["tid"] == -1).all()


@pytest.mark.parametrize("seed", range(6))
def test_adversarial_values(seed):
    rng = np.random.default_rng(seed)
    n = 2000
    b = R.make_buffer(n, seed=seed, with_markers=False)
    k, a, e = b.kernels.copy(), b.api.copy(), b.extcorr.copy()
    pick = lambda frac: rng.random(n) < frac  # noqa: E731
    # timestamps: zero, reversed, past int64, longer than a day, at the edges
    k["start"][pick(0.05)] = 0
    m = pick(0.05)
    k["end"][m] = k["start"][m] - 1
    k["end"][pick(0.03)] = np.uint64(MAX_TIMESTAMP_NS) + np.uint64(1)
    m = pick(0.03)
    k["end"][m] = k["start"][m] + np.uint64(MAX_DURATION_NS + 1)
    m = pick(0.03)
    k["end"][m] = k["start"][m] + np.uint64(MAX_DURATION_NS)
    k["device_id"][pick(0.05)] = rng.choice([1023, 1024, 2**32 - 1])
    k["context_id"][pick(0.1)] = rng.choice([2**31 - 1, 2**31, 2**32 - 1])
    k["static_shared_memory"][pick(0.1)] = 2**31 - 1           # the int32 sum wraps, as numpy's
    k["dynamic_shared_memory"][pick(0.1)] = rng.integers(-2**31, 2**31 - 1)
    k["registers_per_thread"][pick(0.05)] = 65535
    k["graph_id"][pick(0.1)] = 2**32 - 1
    k["graph_node_id"][pick(0.1)] = np.array([2**63, 2**64 - 1, 2**63 - 1], np.uint64)[rng.integers(0, 3)]
    k["name"][pick(0.1)] = 0                                   # NULL name
    k["name"][pick(0.1)] = 0x1234                              # a pointer whose name never came
    k["name"][pick(0.05)] = -1
    k["grid_x"][pick(0.05)] = -5
    k["correlation_id"][pick(0.05)] = rng.integers(1, 50, n)[0]   # repeated ids: the last wins
    # API records: clock disagreements, unknown callback ids, a thread id past int32
    a["start"][pick(0.05)] = 12_490_403_226_381
    a["start"][pick(0.02)] = 0
    a["cbid"][pick(0.1)] = rng.choice([0, 212, 4095, 4096, 2**32 - 1])
    a["cbid"][pick(0.1)] = R.CBID_CUDA_STREAM_SYNC
    a["thread_id"][pick(0.05)] = 2**32 - 1
    a["correlation_id"][pick(0.05)] = rng.integers(1, 50, n)[0]
    e["correlation_id"][pick(0.05)] = rng.integers(1, 50, n)[0]
    now = int(b.api["start"].max()) + 1_000
    a["start"][pick(0.02)] = now + 3_000_000_000                # ahead of the agent's receive time
    drv = a[:200].copy()
    drv["kind"] = 4
    drv["cbid"] = 307
    polls = [[_batch([(10, k[:1000]), (5, a), (39, e)], b.names), _batch([(4, drv)])],
             [_batch([(10, k[1000:]), (1, b.copies), (2, b.memsets)])]]
    for received in (None, now):
        _same(polls, _hello(), received)
    _same(polls, None, now)                                     # no HELLO: no callback tables


def test_sparse_correlation_ids_use_the_hashed_index_and_agree():
    b = R.make_buffer(3000, seed=9, with_markers=False)
    k, a, e = b.kernels.copy(), b.api.copy(), b.extcorr.copy()
    ids = np.random.default_rng(9).choice(2**32 - 1, 3000, replace=False).astype(np.uint32)
    k["correlation_id"], a["correlation_id"], e["correlation_id"] = ids, ids, ids
    a["correlation_id"][::7] = 1                               # a repeated id among sparse ones: the last wins
    e["correlation_id"][::5] = 2
    k["correlation_id"][:2] = (1, 2)
    _same([[_batch([(10, k), (5, a[::-1].copy()), (39, e)], b.names)]], _hello())


def test_graph_replays_keep_the_first_nodes_latency_only():
    b = R.make_buffer(400, seed=12, with_markers=False)
    k, a = b.kernels.copy(), b.api.copy()
    k["correlation_id"] = 1 + np.arange(400) // 8               # 8 nodes per cudaGraphLaunch
    k["start"] = k["start"][np.random.default_rng(1).permutation(400)]
    k["end"] = k["start"] + 1000
    a = a[:50].copy()
    a["correlation_id"] = 1 + np.arange(50)
    a["cbid"] = R.CBID_CUDA_GRAPH_LAUNCH
    a["start"] = k["start"].min() - 10_000
    a["end"] = a["start"] + 500
    got = _same([[_batch([(10, k), (5, a)], b.names)]], _hello())
    assert (got[0][1] >= 0).sum() == 50


def test_unknown_kinds_short_records_and_empty_sections():
    b = R.make_buffer(50, seed=2, with_markers=False)
    k = b.kernels
    short = k.tobytes()[:R.KERNEL.itemsize - 8]
    polls = [[_batch([(37, 16, bytes(48)), (10, L.min_record_size(10) - 8, bytes(L.min_record_size(10) - 8))],
                     b.names),
              _batch([(10, R.KERNEL.itemsize, b""), (5, R.API.itemsize, b"")]),
              _batch([(3, k)]),                                        # KIND_KERNEL: the same layout
              _batch([(10, R.KERNEL.itemsize - 8, short)]),
              _batch([(48, b.api)])],                                  # INTERNAL_LAUNCH_API
             []]
    _same(polls, _hello())


def test_every_cupti_python_kernel_struct_version():
    """Each kernel struct version cupti-python generates from NVIDIA's headers (Kernel..Kernel13):
    its size is the stride, its fields at their offsets; both decoders agree."""
    from cupti import cupti as C
    b = R.make_buffer(300, seed=21, with_markers=False)
    done = 0
    for name in sorted(n for n in dir(C) if n.startswith("activity_kernel") and n.endswith("_dtype")):
        dt = getattr(C, name)
        if dt.itemsize < L.min_record_size(10) or "graph_id" not in (dt.names or ()):
            continue
        v = np.zeros(300, dt)
        for f in dt.names:
            if f in b.kernels.dtype.names and dt[f] == b.kernels.dtype[f]:
                v[f] = b.kernels[f]
        assert N.kernel_offsets(L.layout_for(10, dt.itemsize)[0]) is not None, name
        _same([[_batch([(10, v), (5, b.api), (39, b.extcorr)], b.names)]], _hello())
        done += 1
    assert done >= 4


@pytest.mark.parametrize("seed", range(4))
def test_random_bytes(seed):
    """Records of random bytes (half with plausible timestamps): whatever they hold, both agree."""
    rng = np.random.default_rng(100 + seed)
    b = R.make_buffer(8, seed=seed, with_markers=False)
    polls = []
    for size, kind, dt in ((R.KERNEL.itemsize, 10, R.KERNEL), (R.API.itemsize, 5, R.API), (256, 10, None)):
        raw = rng.integers(0, 256, size * 3000, dtype=np.uint8)
        if dt is not None:
            v = raw.view(dt)
            half = rng.random(3000) < 0.5
            v["start"][half] = T0 + rng.integers(0, 10**9, half.sum()).astype(np.uint64)
            v["end"][half] = v["start"][half] + rng.integers(0, 10**6, half.sum()).astype(np.uint64)
            if "device_id" in dt.names:
                v["device_id"][half] = rng.integers(0, 8, half.sum())
            v["correlation_id"] = rng.integers(0, 6000, 3000)
        polls.append([_batch([(kind, size, raw.tobytes())], b.names)])
    _same(polls, _hello(), T0 + 10**9)
    _same(polls, None, None)


def test_probe_output_is_identical(monkeypatch):
    """The whole CuptiProbe path (ingest + collect, names into the probe-wide table)."""
    from ridgeline.probes.cupti.probe import CuptiProbe
    from ridgeline.probes.cupti.server import Message

    def run():
        probe = CuptiProbe("/nonexistent/native.sock")
        probe.ingest([Message("hello", 1, 1, _hello())])
        out = []
        for p in range(3):
            b = R.make_buffer(700, seed=p, corr0=1 + 2000 * p)
            probe.ingest([Message("batch", 1, 1, _batch([(10, b.kernels), (5, b.api), (39, b.extcorr),
                                                          (1, b.copies), (12, b.markers)], b.names), 1)])
            out.append(probe.collect())
        return out, probe.counters()

    nat, c_nat = run()
    monkeypatch.setattr(N, "REFERENCE", True)
    ref, c_ref = run()
    timed = lambda c: {k: v for k, v in c.items() if not k.endswith("_seconds")}  # noqa: E731  (CPU time spent)
    assert timed(c_nat) == timed(c_ref)
    for a, b in zip(ref, nat):
        ta, tb = a["trace"], b["trace"]
        for f in ("kernels", "copies", "api", "ranges"):
            assert getattr(ta, f).tobytes() == getattr(tb, f).tobytes(), f
        assert a["launch_latency_ns"].tobytes() == b["launch_latency_ns"].tobytes()
        assert ta.names.names_of(ta.kernels["name_id"]) == tb.names.names_of(tb.kernels["name_id"])
        assert ta.meta == tb.meta


LABELS = list(R.HEADER_SETS)


@pytest.fixture(scope="module", params=LABELS)
def header_set(request, tmp_path_factory):
    return R.build_header_set(request.param, tmp_path_factory.mktemp(f"hdr-{request.param}"))


def test_records_of_each_header_set_decode_the_same(header_set, tmp_path):
    """Records written by C code compiled against each release's own headers (the struct
    versions that release's libcupti writes), with names, copies and joins."""
    rng = np.random.default_rng(sum(map(ord, header_set.label)))
    names = {0x7F00_0000_1000 + 0x100 * i: m for i, (m, *_) in enumerate(R.MANGLED_KERNELS)}
    n = 400
    ptrs = list(names)
    start = T0 + np.cumsum(rng.integers(1_000, 50_000, n))
    lines = []
    for i in range(n):
        s = int(start[i])
        e = s + int(rng.integers(1, 2_000_000)) if i % 37 else s - 1          # some reversed
        dev = int(rng.integers(0, 8)) if i % 41 else 5000                    # some past MAX_DEVICE_ID
        name = ptrs[i % len(ptrs)] if i % 13 else (0 if i % 2 else 0xDEAD)
        gnode, graph = (int(rng.integers(1, 1 << 40)), int(rng.integers(1, 1 << 31))) if i % 2 else (0, 0)
        lines.append(f"K {s} {e} {dev} 1 {int(rng.integers(1, 1 << 20))} {int(rng.integers(1, 1 << 16))} 2 1 "
                     f"{int(rng.integers(1, 1025))} 1 1 {int(rng.integers(16, 256))} {int(rng.integers(0, 48 << 10))} "
                     f"{int(rng.integers(0, 200 << 10))} {100 + i} {name} {gnode} {graph}")
    for i in range(n):
        if i % 9 == 0:
            continue                                   # kernels without their API record
        cb = R.CBID_CUDA_LAUNCH_KERNEL if i % 2 == 0 else R.CBID_CUDA_GRAPH_LAUNCH
        lines.append(f"A 5 {cb} {int(start[i]) - 3000} {int(start[i]) - 2500} {os.getpid()} {1000 + i % 5} {100 + i}")
    lines += [f"X 5 {900_000 + i} {100 + i}" for i in range(0, n, 2)]
    lines += [f"C 1 {4096 * (i + 1)} {int(start[i])} {int(start[i]) + 999} 0 1 7 {100 + n + i} 0 0" for i in range(20)]
    sections, api_version = header_set.write(lines, tmp_path)
    half = len(sections) // 2
    polls = [[_batch(sections[:half], names, api_version)], [_batch(sections[half:], {}, api_version)]]
    got = _same(polls, _hello(), int(start[-1]) + 10**9)
    assert sum(len(t.kernels) for t, _ in got) > 0 or half == 0
    one = _same([[_batch(sections, names, api_version)]], _hello(), int(start[-1]) + 10**9)
    t, lat = one[0]
    assert 300 < len(t.kernels) < n and (lat >= 0).sum() > 100


def test_missing_library_is_one_clear_line_and_the_probe_says_so(monkeypatch, tmp_path):
    """No fallback: without the library a decoder refuses to start, and CuptiProbe.check()
    reports the probe unavailable with what to build."""
    from ridgeline.probes.cupti.probe import CuptiProbe
    monkeypatch.setenv("RIDGELINE_CUPTI_DECODE_LIB", str(tmp_path / N.LIB_NAME))
    N.library.cache_clear()
    try:
        with pytest.raises(N.DecodeLibraryMissing) as exc:
            ProcessDecoder(1)
        msg = str(exc.value)
        assert "CUPTI decode library" in msg and str(tmp_path) in msg and "make -C" in msg and "\n" not in msg
        ProcessDecoder(1, reference=True)                  # the reference needs no library
        avail = CuptiProbe(str(tmp_path / "cupti.sock")).check()
        assert not avail.ok and "CUPTI decode library" in avail.reason
    finally:
        N.library.cache_clear()


def test_a_section_shorter_than_its_count_is_refused_as_numpy_refuses_it():
    """Sections built by hand (parse_batch checks the lengths of those from the wire) whose
    bytes fall short: never read past them."""
    b = R.make_buffer(20, seed=4, with_markers=False)
    for kind, arr in ((10, b.kernels), (5, b.api)):
        data = arr.tobytes()[:-8]
        h = np.zeros(1, BATCH_DTYPE)[0]
        h["records"] = len(arr)
        bad = Batch(h, {}, [Section(kind, arr.dtype.itemsize, len(arr), memoryview(data))])
        for reference in (True, False):
            with pytest.raises(ValueError):
                ProcessDecoder(1, reference=reference).add_batch(bad)


def test_join_index_memory_is_given_back_after_a_burst():
    d = ProcessDecoder(1)
    d.set_hello(_hello())
    b = R.make_buffer(100_000, seed=1, with_markers=False)
    k, a = b.kernels.copy(), b.api.copy()
    k["correlation_id"] = a["correlation_id"] = np.arange(100_000, dtype=np.uint32) * 40_000   # sparse: hashed
    d.add_batch(_batch([(10, k), (5, a)], b.names))
    d.take()
    assert len(d._scratch.arr) >= 400_000
    small = R.make_buffer(10, seed=2, with_markers=False)
    d.add_batch(_batch([(10, small.kernels), (5, small.api)], small.names))
    d.take()
    assert len(d._scratch.arr) < N.SCRATCH_KEPT
