"""probes.cupti.decode and layouts in-process: versions, joins across polls, markers, names."""
from __future__ import annotations

import numpy as np

import cupti_records as R
from ridgeline.probes.cupti import layouts as L
from ridgeline.probes.cupti.decode import ProcessDecoder
from ridgeline.probes.cupti.protocol import BATCH_DTYPE, Batch, Hello, Section
from ridgeline.probes.events import API_GRAPH_LAUNCH, API_LAUNCH, MISSING


def batch(sections, names=None, version=130500) -> Batch:
    h = np.zeros(1, BATCH_DTYPE)[0]
    h["cupti_version"] = version
    h["records"] = sum(len(a) for _, a in sections)
    return Batch(h, names or {}, [Section(k, a.dtype.itemsize, len(a), memoryview(a.tobytes())) for k, a in sections])


def hello() -> Hello:
    return Hello(1, 130500, 130500, 0, 0, 1, "t", "", {}, {(1, 211): (API_LAUNCH, "cudaLaunchKernel_v7000"),
                                                            (1, 311): (API_GRAPH_LAUNCH, "cudaGraphLaunch_v10000")})


def test_layouts_follow_record_size_and_version():
    from cupti import cupti as C
    assert L.layout_for(10, 248, 130500)[0] is C.activity_kernel13_dtype
    assert L.layout_for(10, 208, 28)[0] is C.activity_kernel9_dtype          # a CUDA 12 libcupti
    assert L.layout_for(1, 96, 28)[0] is C.activity_memcpy6_dtype
    assert L.layout_for(2, 88, 28)[0] is C.activity_memset4_dtype
    assert L.layout_for(10, 200, 130500)[0] is None


def test_cuda12_kernel9_records_decode_with_their_layout():
    from cupti import cupti as C
    b = R.make_buffer(50, seed=4)
    k9 = np.zeros(50, C.activity_kernel9_dtype)
    for f in ("kind", "start", "end", "device_id", "stream_id", "correlation_id", "grid_x", "block_x",
              "registers_per_thread", "graph_id", "name"):
        k9[f] = b.kernels[f]
    d = ProcessDecoder(1)
    d.set_hello(hello())
    d.add_batch(batch([(10, k9)], b.names, version=28))
    t, _ = d.take()
    np.testing.assert_array_equal(t.kernels["start_ns"], b.kernels["start"].astype(np.int64))
    np.testing.assert_array_equal(t.kernels["grid_x"], b.kernels["grid_x"])
    assert t.meta["layouts"][10] == "cupti-python activity_kernel9_dtype"
    assert t.names.names_of(t.kernels["name_id"]) == [b.names[p] for p in b.kernels["name"].tolist()]


def test_api_record_arriving_before_its_kernel_joins_in_a_later_poll():
    b = R.make_buffer(20, seed=5, with_markers=False)
    d = ProcessDecoder(1)
    d.set_hello(hello())
    d.add_batch(batch([(5, b.api)], b.names))      # the thread's API buffer comes first
    t1, _ = d.take()
    assert len(t1.kernels) == 0 and len(t1.api) == 20
    d.add_batch(batch([(10, b.kernels)]))          # kernels in a later buffer, a later poll
    t2, lat = d.take()
    np.testing.assert_array_equal(t2.kernels["tid"], b.api["thread_id"])
    np.testing.assert_array_equal(lat, (b.kernels["start"] - b.api["start"]).astype(np.int64))
    d.add_batch(batch([(10, b.kernels[:1])]))      # joined launch records are not kept forever
    t3, lat3 = d.take()
    assert t3.kernels["tid"][0] == MISSING and lat3[0] == MISSING
    assert d.counters["unjoined_kernels"] == 1


def test_markers_open_in_one_poll_close_in_the_next_and_unknown_names():
    b = R.make_buffer(4, seed=6)
    m = b.markers
    d = ProcessDecoder(1)
    d.add_batch(batch([(12, m[:2])], b.names))
    t1, _ = d.take()
    assert len(t1.ranges) == 0
    d.add_batch(batch([(12, m[2:])]))
    t2, _ = d.take()
    assert t2.names.names_of(t2.ranges["name_id"]) == ["step[DECODE bs=8]", "layer"]
    k = b.kernels.copy()
    k["name"] = 0x1234          # a pointer whose name never came
    d.add_batch(batch([(10, k)]))
    t3, _ = d.take()
    assert (t3.kernels["name_id"] == MISSING).all() and d.counters["unresolved_names"] == 4


def test_unknown_kind_is_counted_not_misread():
    d = ProcessDecoder(1)
    junk = np.zeros(3, [("kind", "<i4"), ("x", "<i4")])
    d.add_batch(batch([(37, junk)]))
    assert d.counters["undecodable_records"] == 3 and not d.pending()
