"""SchedProbe lifecycle without loading anything: poll before start, idempotent stop, layout checks,
and the native slot free (probes/sched_native) on a table in plain memory."""
from __future__ import annotations

import numpy as np
import pytest

from ridgeline.probes import btf
from ridgeline.probes.sched import SchedProbe, raw_layout_problem


def test_lifecycle_without_start():
    p = SchedProbe(pids=[1])
    assert p.poll() is None
    p.stop()
    p.stop()
    c = p.counters()
    assert c == {"records": 0, "drops": 0, "errors": 0}
    p.add_target(2)              # before start: remembered for start()
    assert p._initial == [1, 2]


def test_raw_layout_check_reports_a_mismatch():
    types = [None,
             (btf.KIND_INT, "int", 4, None)]
    assert "not in BTF" in raw_layout_problem(types)


def _free(slot_task, rows, slots, tasks, tids):
    from ridgeline.probes.sched import THREAD_DTYPE, slot_library
    slots, tasks, tids = (np.ascontiguousarray(a, t) for a, t in ((slots, np.int64), (tasks, np.uint64),
                                                                     (tids, np.uint32)))
    freed = np.zeros(len(slots), np.uint8)
    n = slot_library().rl_sched_free(slot_task.ctypes.data, rows.ctypes.data, THREAD_DTYPE.itemsize, len(slot_task),
                                     slots.ctypes.data, tasks.ctypes.data, tids.ctypes.data, len(slots),
                                     freed.ctypes.data)
    return n, freed.view(bool)


def test_slot_free_takes_only_a_slot_that_still_holds_the_task_and_tid_read():
    """rl_sched_free (probes/sched_native) on a table laid out as sched_bpf.c's: slot 1 still
    holds what was read and is freed (tid cleared, ev_type kept); slot 2 holds another task
    now, slot 3 the same task address with another thread's tid (a new task at a reused
    address), slot 4 a row being filled (tid 0): all left alone; out-of-range slots skipped."""
    from ridgeline.probes.sched import THREAD_DTYPE
    slot_task = np.zeros(8, np.uint64)
    rows = np.zeros(8, THREAD_DTYPE)
    a, b = 0xFFFF888100002C00, 0xFFFF888100005800
    slot_task[1:5] = [a, b, a, a]
    rows["tid"][1:5] = [10, 11, 12, 0]
    rows["ev_type"][1] = 1
    n, freed = _free(slot_task, rows, [1, 2, 3, 4, -1, 8], [a, a, a, a, a, a], [10, 11, 10, 10, 10, 10])
    assert n == 1 and list(freed) == [True, False, False, False, False, False]
    assert list(slot_task[1:5]) == [0, b, a, a]
    assert list(rows["tid"][1:5]) == [0, 11, 12, 0] and rows["ev_type"][1] == 1
    n, freed = _free(slot_task, rows, [1], [a], [10])     # freed already: not again
    assert n == 0 and not freed.any()


def test_a_missing_slot_library_is_one_line_that_says_what_to_build(monkeypatch, tmp_path):
    from ridgeline.probes import sched
    monkeypatch.setenv("RIDGELINE_SCHED_LIB", str(tmp_path / "libridgeline_sched.so"))
    sched.slot_library.cache_clear()
    try:
        with pytest.raises(sched.SlotLibraryMissing, match=r"scheduling slot library .* is missing: run `make -C "
                                                            r".*sched_native`"):
            sched.slot_library()
        avail = sched.SchedProbe().check()
        assert not avail.ok
        if "slot library" in avail.reason:       # where eBPF itself is available, the library is named
            assert "sched_native" in avail.reason and avail.hint
    finally:
        monkeypatch.undo()
        sched.slot_library.cache_clear()
