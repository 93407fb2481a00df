"""The demangler's time budget (issue 18.2), per process and per user, whatever each call's
outcome, kept across reconnects, and spent in the probe's pump thread, not in poll().

Before: only deadlines were counted (per decoder, so a reconnect reset them), and every
batch's new names went through ``demangle_many`` inside ``poll()`` on the agent's main loop;
names taking just under the deadline, or whose answers pass the length cap, were demangled
for every batch (a 42 s stall). Each test below fails on that code.

The demangler is replaced by a fake that advances a fake clock (no timing in the tests).
"""
from __future__ import annotations

import threading
import time

import pytest
from support import cupti_records as R

from ridgeline.probes.cupti import probe as probe_mod
from ridgeline.probes.cupti import protocol as P
from ridgeline.probes.cupti.peer_time_budget import PID_BURST_S, UID_BURST_S, PeerTimeBudget
from ridgeline.probes.cupti.probe import CuptiProbe
from ridgeline.probes.cupti.server import Message

HDR = P.FRAME_DTYPE.itemsize
REAL = R.MANGLED_KERNELS[1][0]


def _hello(pid, uid, conn):
    return Message("hello", conn, pid, P.parse_hello(memoryview(R.hello_frame(pid=pid))[HDR:]), 0, uid)


def _batch(pid, conn, names):
    return Message("batch", conn, pid, P.parse_batch(memoryview(R.batch_frame([], names, pid=pid))[HDR:]), 0)


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def monotonic(self):
        return self.t

    def time_ns(self):
        # the decoder checks CPU timestamps against its receive time (issue 17.1): the real clock
        return time.time_ns()


@pytest.fixture
def fake(monkeypatch):
    """A demangler costing 0.5 s of the fake clock per call, every call "ok"."""
    clock = _Clock()
    calls = []

    def demangle_many(raw, timeout_s=None):
        calls.append(list(raw))
        clock.t += 0.5
        return [f"demangled {r}" for r in raw], {"too_long": 0, "deadline": 0}
    monkeypatch.setattr(probe_mod, "demangle_many", demangle_many)
    monkeypatch.setattr(probe_mod, "time", clock)
    p = CuptiProbe("/nonexistent/c.sock")
    p.demangle_budget = PeerTimeBudget(pid_refill_per_s=0, uid_refill_per_s=0, clock=clock.monotonic)
    return p, calls, clock


def test_calls_that_end_ok_are_charged_and_stop_at_the_pid_budget(fake):
    p, calls, _ = fake
    p.ingest([_hello(101, 1000, 1)])
    for i in range(12):
        p.ingest([_batch(101, 1, {i + 1: f"{REAL}{i}"})])
    n_ok = int(PID_BURST_S / 0.5 + 0.999)
    assert len(calls) == n_ok                       # then no more calls: the pid's 2 s are spent
    c = p.counters()
    assert c["demangle_budget_spent"] == 12 - n_ok and c["names_not_demangled"] == 12 - n_ok
    assert c["demangle_budget_refused_calls"] == 12 - n_ok
    assert c["demangle_seconds"] == pytest.approx(0.5 * n_ok)
    names = [p.decoders[101].names[i] for i in range(len(p.decoders[101].names))]
    assert names[-1] == f"{REAL}11"                 # kept mangled, as it came


def test_a_reconnect_does_not_reset_the_budget(fake):
    p, calls, _ = fake
    p.ingest([_hello(102, 1000, 1)])
    for i in range(8):
        p.ingest([_batch(102, 1, {i + 1: f"{REAL}a{i}"})])
    spent = len(calls)
    p.ingest([Message("closed", 1, 102, "eof")])
    p.collect()                                     # the decoder is released
    assert 102 not in p.decoders
    p.ingest([_hello(102, 1000, 2), _batch(102, 2, {1: f"{REAL}again"})])
    assert len(calls) == spent                      # the new connection starts where the old ended


def test_one_user_is_bounded_across_its_processes_and_others_are_not(fake):
    p, calls, _ = fake
    for k, pid in enumerate(range(200, 210)):       # one uid, ten processes, one new name each batch
        p.ingest([_hello(pid, 1000, 10 + k)])
        for i in range(3):
            p.ingest([_batch(pid, 10 + k, {i + 1: f"{REAL}{pid}_{i}"})])
    assert len(calls) == int(UID_BURST_S / 0.5 + 0.999)   # the uid's 5 s, not 10 x 2 s
    before = len(calls)
    p.ingest([_hello(300, 2000, 99), _batch(300, 99, {1: f"{REAL}other"})])
    assert len(calls) == before + 1                 # another user's process is still demangled
    d = p.decoders[300]
    assert d.names[len(d.names) - 1] == f"demangled {REAL}other"


def test_the_budget_refills_slowly():
    clock = _Clock()
    b = PeerTimeBudget(clock=clock.monotonic)
    b.charge(1, 7, PID_BURST_S + 0.1)
    assert not b.allowed(1, 7)
    clock.t += 0.2 / (PID_BURST_S / 3600)          # 0.2 s back after 6 minutes
    assert b.allowed(1, 7)
    assert b.left(1, 7)[0] == pytest.approx(0.1)


def test_demangling_runs_in_the_pump_thread_and_poll_does_not_wait_for_it(tmp_path, monkeypatch):
    """A demangler call that does not return (held by an event): ``poll()`` still returns,
    at once, with what was decoded; the batch is handed on once the call ends. The old
    probe demangled inside ``poll()``, which then waited for the call."""
    release, entered = threading.Event(), threading.Event()

    def slow(raw, timeout_s=None):
        entered.set()
        release.wait(30)
        return list(raw), {"too_long": 0, "deadline": 0}
    monkeypatch.setattr(probe_mod, "demangle_many", slow)
    import socket
    p = CuptiProbe(str(tmp_path / "c.sock"))
    p.start()
    try:
        b = R.make_buffer(4, seed=3, with_markers=False)
        s = socket.socket(socket.AF_UNIX)
        s.connect(p.socket_path)
        s.sendall(R.hello_frame() + R.batch_frame([(10, R.KERNEL.itemsize, b.kernels.tobytes())],
                                                  {k: REAL + str(k) for k in b.names}))
        done = {}

        def polling():
            end = time.monotonic() + 20
            while not entered.is_set() and time.monotonic() < end:
                p.poll()
                time.sleep(0.02)
            t0 = time.monotonic()
            done["out"] = p.poll()
            done["s"] = time.monotonic() - t0
        t = threading.Thread(target=polling, daemon=True)
        t.start()
        t.join(25)
        assert entered.is_set(), "the demangler was never called"
        assert not t.is_alive(), "poll() waited for the demangler"
        assert "trace" not in done["out"]
        release.set()
        got = R.poll_until(p, lambda g: any("trace" in x for x in g))
        assert sum(len(x["trace"].kernels) for x in got if "trace" in x) == 4
        s.close()
    finally:
        release.set()
        p.stop()
