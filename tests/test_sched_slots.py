"""The scheduling probe's slot table (probes/sched_bpf.c): exits free slots, and it is bounded.

Real kernel runs (root + eBPF): a target process creates 1,000 short-lived threads, 50 at a
time, and a target keeps 100 threads alive at once under a probe sized for 64. What is
checked is the table itself (the mmapped ``slot_task`` array and the ``live`` counters) and
what the windows report, against the thread ids the workload prints for itself.
"""
from __future__ import annotations

import ctypes as ct
import os
import select
import subprocess
import sys
import time

import numpy as np
import pytest
from support.sched_probe import started_sched_probe

pytestmark = pytest.mark.ebpf

CHURN = r"""
import os, sys, threading, time
batches, per = int(sys.argv[1]), int(sys.argv[2])
sys.stdout.write("READY %d\n" % os.getpid()); sys.stdout.flush(); sys.stdin.readline()
tids, lock = [], threading.Lock()
def work():
    with lock:
        tids.append(threading.get_native_id())
    for _ in range(3):
        time.sleep(0.001)
for _ in range(batches):
    ts = [threading.Thread(target=work) for _ in range(per)]
    for t in ts: t.start()
    for t in ts: t.join()
sys.stdout.write("DONE " + " ".join(map(str, tids)) + "\n"); sys.stdout.flush()
sys.stdin.readline()
"""

HOLD = r"""
import os, sys, threading, time
n = int(sys.argv[1])
stop = threading.Event()
def work():
    while not stop.is_set():
        time.sleep(0.005)
ts = [threading.Thread(target=work) for _ in range(n)]
for t in ts: t.start()
sys.stdout.write("UP %d\n" % os.getpid()); sys.stdout.flush()
sys.stdin.readline(); stop.set()
for t in ts: t.join()
"""


def _live(p) -> int:
    claimed, freed_bpf, freed_user = (int(p._live[ct.c_int(i)].value) for i in range(3))
    return claimed - freed_bpf - freed_user


def _occupied(p, tgid=None) -> int:
    if tgid is None:
        return int(np.count_nonzero(p._slot_task.copy()))
    _, _, rows = p._read()
    return int((rows["tgid"] == tgid).sum())


@pytest.fixture
def probe():
    with started_sched_probe() as p:
        yield p


def test_exited_threads_free_their_slots(probe):
    batches, per = 20, 50
    w = subprocess.Popen([sys.executable, "-c", CHURN, str(batches), str(per)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(w.stdout.readline().split()[1])
        probe.add_target(pid)
        probe.poll()
        lost0 = probe.counters()["events_lost"]
        w.stdin.write("go\n"); w.stdin.flush()
        exited: list[int] = []
        peak = 0
        line = ""
        while not line:
            if select.select([w.stdout], [], [], 0.05)[0]:
                line = w.stdout.readline()
            win = probe.poll()
            exited += [int(r["tid"]) for r in win["threads"] if r["exited"]]
            peak = max(peak, _occupied(probe, pid))
            # task_struct addresses are reused at once by the churn: never two slots for one task
            held = probe._slot_task.copy()
            held = held[held != 0]
            assert len(np.unique(held)) == len(held)
        time.sleep(0.05)
        win = probe.poll()
        exited += [int(r["tid"]) for r in win["threads"] if r["exited"]]
        tids = [int(t) for t in line.split()[1:]]
        assert len(tids) == batches * per
        c = probe.counters()
        assert c["events_lost"] == lost0, "ring buffer overflowed: exits were not all seen"
        assert c["threads_lost"] == 0
        # every worker thread was tracked and reported exited exactly once
        assert sorted(t for t in exited if t in set(tids)) == sorted(tids)
        # no growth: at most a batch (+ the main thread) held slots at any poll; after the last
        # exit only the main thread's slot is left, and the table's count agrees with its slots
        assert peak <= per + 2, peak
        assert _occupied(probe, pid) <= 1
        assert _live(probe) == _occupied(probe)
    finally:
        if w.poll() is None:
            w.stdin.write("x\n"); w.stdin.flush()
            w.wait(timeout=10)
        probe.remove_target(pid) if "pid" in locals() else None
    assert _occupied(probe) == 0 and _live(probe) == 0, "removing the target left slots behind"


FAST_CHURN = r"""
import os, sys, threading, time
sys.stdout.write("READY %d\n" % os.getpid()); sys.stdout.flush(); sys.stdin.readline()
end = time.time() + float(sys.argv[1])
while time.time() < end:
    ts = [threading.Thread(target=lambda: None) for _ in range(64)]
    for t in ts: t.start()
    for t in ts: t.join()
sys.stdout.write("DONE\n"); sys.stdout.flush()
sys.stdin.readline()
"""


def test_fast_churn_with_polls_never_wraps_the_live_count(probe):
    """Threads that exit at once (an empty body), in four processes, polled as fast as the
    agent can: the poll used to free the slots of threads marked exiting that /proc no longer
    showed, which their last switch frees on the BPF side too; each such slot was counted
    freed twice, the unsigned live count drifted below the slots held and wrapped within a
    few thousand polls, and from then on every new thread was refused (threads_lost grew by
    ~70k per 1,000 polls: found by review, reproduced before the fix)."""
    ws = [subprocess.Popen([sys.executable, "-c", FAST_CHURN, "4"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True) for _ in range(4)]
    pids = []
    try:
        pids = [int(w.stdout.readline().split()[1]) for w in ws]
        for pid in pids:
            probe.add_target(pid)
        probe.poll()
        for w in ws:
            w.stdin.write("go\n"); w.stdin.flush()
        done, polls = 0, 0
        while done < len(ws):
            for w in ws:
                if select.select([w.stdout], [], [], 0)[0]:
                    w.stdout.readline()
                    done += 1
            probe.poll()
            polls += 1
        for _ in range(16):
            probe.poll()
        assert polls > 500
        c = probe.counters()
        # (live's three counters are read one by one: only a quiet table's count is exact)
        assert c["threads_lost"] == 0, (c, polls)
        assert _live(probe) == _occupied(probe)
    finally:
        for w in ws:
            if w.poll() is None:
                w.stdin.write("x\n"); w.stdin.flush()
                w.wait(timeout=10)
        for pid in pids:
            probe.remove_target(pid)
    assert _occupied(probe) == 0 and _live(probe) == 0


def test_max_threads_bounds_the_table_and_counts_the_rest():
    from ridgeline.probes.sched import SchedProbe
    cap = 64
    p = SchedProbe(discover=False, seed_s=30.0, max_threads=cap)
    p.start()
    w = subprocess.Popen([sys.executable, "-c", HOLD, "100"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(w.stdout.readline().split()[1])
        p.add_target(pid)               # the threads are met at their next switch-out (sleeping 5 ms)
        time.sleep(0.5)
        win = p.poll()
        c = p.counters()
        slack = os.cpu_count() or 1      # claims racing on other CPUs at the cap
        assert cap <= _occupied(p) <= cap + slack
        assert len(win["threads"]) <= cap + slack
        assert c["threads_lost"] > 0 and c["drops"] >= c["threads_lost"]
    finally:
        w.stdin.write("x\n"); w.stdin.flush()
        w.wait(timeout=10)
        time.sleep(0.05)
        p.poll()
        p.remove_target(pid) if "pid" in locals() else None
        assert _occupied(p) == 0 and _live(p) == 0
        p.stop()
