import numpy as np

from ridgeline.probes import events


def test_empty_sets_missing_on_integer_fields():
    k = events.empty(events.KERNEL_DTYPE, 3)
    assert (k["correlation_id"] == -1).all()
    assert (k["name_id"] == -1).all()
    c = events.empty(events.COPY_DTYPE, 2)
    assert (c["direction"] == 0).all()  # unsigned enum: COPY_UNKNOWN


def test_name_table_interning_and_matching():
    t = events.NameTable()
    a = t.intern("flash_fwd_kernel")
    b = t.intern("gemvx")
    assert t.intern("flash_fwd_kernel") == a
    assert t[b] == "gemvx"
    assert t.lookup("nope") == events.MISSING
    ids = t.ids_matching(r"flash")
    assert ids.tolist() == [a]
    k = events.empty(events.KERNEL_DTYPE, 3)
    k["name_id"] = [a, b, a]
    assert np.isin(k["name_id"], ids).sum() == 2


def test_trace_sorted_orders_by_start():
    k = events.empty(events.KERNEL_DTYPE, 3)
    k["start_ns"] = [30, 10, 20]
    t = events.Trace(kernels=k).sorted()
    assert t.kernels["start_ns"].tolist() == [10, 20, 30]
