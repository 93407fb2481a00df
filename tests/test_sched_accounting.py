"""Pure scheduling accounting (probes/sched_accounting.py), with literal thread records."""
from __future__ import annotations

import re

import numpy as np
import pytest

from ridgeline.probes import sched_accounting as sa
from ridgeline.probes.sched import BPF_SOURCE


def rec(tid=10, tgid=7, state=sa.S_UNKNOWN, ts=0, **kw):
    r = np.zeros((), dtype=sa.THREAD_DTYPE)
    r["tid"], r["tgid"], r["state"], r["ts"] = tid, tgid, state, ts
    r["comm"] = b"worker"
    for k, v in kw.items():
        r[k] = v
    return r


def arr(*rows):
    out = np.zeros(len(rows), dtype=sa.THREAD_DTYPE)
    for i, r in enumerate(rows):
        out[i] = r
    return out


def test_layout_matches_the_c_struct():
    src = BPF_SOURCE.read_text()
    body = src[src.index("struct thread_t {"):src.index("};", src.index("struct thread_t {"))]
    names = re.findall(r"^\s+(?:u8|u32|u64|char)\s+(\w+)", body, re.M)
    assert names == list(sa.THREAD_DTYPE.names)
    assert sa.THREAD_DTYPE.itemsize == 272


def test_open_interval_goes_to_the_current_state():
    rows = arr(rec(tid=1, state=sa.S_ONCPU, ts=1000, oncpu_ns=5),
               rec(tid=2, state=sa.S_RUNNABLE, ts=1000, preempted=1),
               rec(tid=3, state=sa.S_RUNNABLE, ts=1000),
               rec(tid=4, state=sa.S_BLOCKED, ts=400),
               rec(tid=5, state=sa.S_UNKNOWN, ts=0),
               rec(tid=6, state=sa.S_BLOCKED, ts=2000))           # stamped after the read
    e = sa.effective_totals(rows, now_ns=1500)
    assert list(e["oncpu_ns"]) == [505, 0, 0, 0, 0, 0]
    assert list(e["runq_ns"]) == [0, 500, 500, 0, 0, 0]
    assert list(e["runq_preempt_ns"]) == [0, 500, 0, 0, 0, 0]
    assert list(e["blocked_ns"]) == [0, 0, 0, 1100, 0, 0]
    assert list(rows["oncpu_ns"]) == [5, 0, 0, 0, 0, 0]           # input untouched


def test_window_rows_and_names():
    acct = sa.WindowAccountant()
    w1 = acct.window(arr(rec(state=sa.S_ONCPU, ts=100, oncpu_ns=50, nvcsw=2, nivcsw=1)), arr(), now_ns=200)
    assert w1.dtype == sa.WINDOW_DTYPE and len(w1) == 1
    r = w1[0]
    assert (int(r["on_cpu_ns"]), int(r["voluntary_switches"]), int(r["involuntary_switches"])) == (150, 2, 1)
    assert r["comm"] == b"worker"
    # next window: it switched out at 300 (closed 250 on CPU total) and is blocked since
    w2 = acct.window(arr(rec(state=sa.S_BLOCKED, ts=300, oncpu_ns=250, nvcsw=3, nivcsw=1)), arr(), now_ns=1000)
    r = w2[0]
    assert (int(r["on_cpu_ns"]), int(r["blocked_ns"]), int(r["voluntary_switches"])) == (100, 700, 1)
    # blocked all the next window: still a row, all of it blocked
    w3 = acct.window(arr(rec(state=sa.S_BLOCKED, ts=300, oncpu_ns=250, nvcsw=3, nivcsw=1)), arr(), now_ns=1500)
    assert int(w3[0]["blocked_ns"]) == 500 and int(w3[0]["on_cpu_ns"]) == 0


def test_gap_reclassification_keeps_totals_exact():
    """A blocked interval reported in window 1 turns out to have no wakeup (a gap): the
    kernel files the whole interval as unattributed; window 2 must not go negative."""
    acct = sa.WindowAccountant()
    acct.window(arr(rec(state=sa.S_BLOCKED, ts=0, nvcsw=1)), arr(), now_ns=1000)      # 1000 blocked (open)
    # at 1500 it switched in without a seen wakeup: unattributed 1500, on CPU since
    w = acct.window(arr(rec(state=sa.S_ONCPU, ts=1500, nvcsw=1, unattributed_ns=1500, gaps=1)), arr(), now_ns=2000)
    r = w[0]
    assert int(r["blocked_ns"]) == 0
    assert int(r["unattributed_ns"]) == 500      # 1500 minus the 1000 already reported as blocked
    assert int(r["on_cpu_ns"]) == 500
    assert int(r["gaps"]) == 1
    # over both windows: 1000 blocked + 500 unattributed + 500 on CPU = 2000 ns of life


def test_exit_record_closes_the_thread():
    acct = sa.WindowAccountant()
    acct.window(arr(rec(tid=5, state=sa.S_ONCPU, ts=0)), arr(), now_ns=100)
    ex = rec(tid=5, ev_type=sa.EV_EXIT, state=sa.S_BLOCKED, ts=180, oncpu_ns=180, nvcsw=1)
    w = acct.window(arr(), arr(ex), now_ns=1000)
    assert len(w) == 1 and bool(w[0]["exited"])
    assert int(w[0]["on_cpu_ns"]) == 80 and int(w[0]["blocked_ns"]) == 0   # nothing after its death
    assert len(acct.window(arr(), arr(), now_ns=2000)) == 0


def test_tid_reuse_by_another_process_is_a_new_thread():
    acct = sa.WindowAccountant()
    acct.window(arr(rec(tid=5, tgid=1, oncpu_ns=1000)), arr(), now_ns=10)
    w = acct.window(arr(rec(tid=5, tgid=2, oncpu_ns=30)), arr(), now_ns=20)
    assert int(w[0]["on_cpu_ns"]) == 30 and int(w[0]["tgid"]) == 2


def test_histograms():
    acct = sa.WindowAccountant()
    h = np.zeros(sa.RQ_SLOTS, np.uint32)
    h[3] = 4
    acct.window(arr(rec(tid=1, hist=h)), arr(), now_ns=1)
    h2 = h.copy(); h2[3] = 6; h2[12] = 1
    w = acct.window(arr(rec(tid=1, hist=h2), rec(tid=2, hist=h)), arr(), now_ns=2)
    by = sa.hist_by_tgid(w)
    assert list(by) == [7]
    assert by[7][3] == 2 + 4 and by[7][12] == 1
    assert sa.hist_rows(by[7]) == [{"lo_us": 4, "hi_us": 7, "count": 6}, {"lo_us": 2048, "hi_us": 4095, "count": 1}]
    assert sa.hist_slot_bounds_us(1) == (0, 1)


def test_decode_threads():
    rows = arr(rec(tid=3, oncpu_ns=9))
    assert sa.decode_threads(rows.tobytes())[0]["oncpu_ns"] == 9
    with pytest.raises(ValueError):
        sa.decode_threads(b"\0" * 100)
