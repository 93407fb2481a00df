"""The agent's loop and the CUPTI probe's pump thread wake on readiness, not on timers
(issue 21.1): an idle agent with only readiness probes wakes for its window deadline, the
CUPTI pump thread for data and the server's own deadlines; data still reaches the loop at
once, windows still close on time whatever a probe does, a probe without a descriptor is
still polled every POLL_S, and SIGTERM still ends the loop at once (its handler writes the
loop's wake-up pipe: select() is retried after a signal, PEP 475).

Before this change the loop woke 20 times a second (POLL_S) and the pump thread 50 times
(its 20 ms interval); the bounds below are well under those rates and well over what the
new loop needs, so a loaded host does not make them flaky."""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from ridgeline.agent import config
from ridgeline.agent.daemon import POLL_S, Agent
from ridgeline.agent.registry import STEPS, Running
from ridgeline.probes.probe import Availability, Probe, drain_fd, poke, wake_pipe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


def cfg_for(tmp_path, window_s: float, run_for_s: float = 0.0):
    return config.overlay(config.defaults(), {
        "agent": {"window_s": window_s, "run_for_s": run_for_s},
        "publisher": {"endpoint": f"ipc://{tmp_path}/agent.sock"},
        "prometheus": {"enabled": False},
        "probes": {"enabled": []},
    })


class Quiet(Probe):
    """A readiness probe that never has data (an absent or stalled source): its
    descriptor never becomes readable."""
    name = "quiet"

    def __init__(self):
        super().__init__()
        self.polls = 0
        self.pipe = wake_pipe()

    def ready_fd(self):
        return self.pipe[0]

    def poll(self):
        self.polls += 1
        drain_fd(self.pipe[0])
        return None

    def stop(self):
        for fd in self.pipe:
            os.close(fd)


class Timed(Probe):
    """A probe without a descriptor: polled on the agent's timer."""
    name = "timed"

    def __init__(self):
        super().__init__()
        self.polls = 0

    def poll(self):
        self.polls += 1
        return None


def running(probe, step="cupti"):
    return Running(STEPS[step], probe, Availability(True))


def run_agent_for(agent: Agent, seconds: float) -> float:
    """Run the loop in this thread for ``seconds`` (stopped from another); its wall time."""
    t = threading.Timer(seconds, agent.request_stop)
    t.start()
    t0 = time.monotonic()
    try:
        agent.run()
    finally:
        t.cancel()
    return time.monotonic() - t0


def call_times(obj, name: str) -> list[float]:
    """The monotonic times of each call of ``obj.name`` from now on (the method wrapped)."""
    times: list[float] = []
    method = getattr(obj, name)

    def timed(*args, **kw):
        times.append(time.monotonic())
        return method(*args, **kw)
    setattr(obj, name, timed)
    return times


def test_an_idle_loop_wakes_for_its_deadlines_not_twenty_times_a_second(tmp_path):
    quiet = Quiet()
    a = Agent(cfg_for(tmp_path, window_s=1.0), probes=[running(quiet)])
    a.start()
    closes = call_times(a, "close_window")
    try:
        t0 = time.monotonic()
        wall = run_agent_for(a, 2.5)
    finally:
        a.shutdown()
    assert wall < 2.5 + 2.0                       # (generous: CI's loaded hosts)
    # two windows' deadlines and the stop: the timer loop woke 50 times in 2.5 s
    assert a.loop_wakeups <= 8, a.loop_wakeups
    # a probe that never has data does not hold a window: both closed on time
    assert len(closes) >= 3                       # two deadlines, the shutdown's flush
    # (within 0.9 s: a window held for a probe's data would close a whole window late or never)
    assert abs(closes[0] - t0 - 1.0) < 0.9 and abs(closes[1] - t0 - 2.0) < 0.9, [c - t0 for c in closes]
    assert quiet.polls <= 4                       # at window ends only: it never said it had data


def test_a_probe_without_a_descriptor_is_still_polled_every_poll_s(tmp_path):
    timed, quiet = Timed(), Quiet()
    a = Agent(cfg_for(tmp_path, window_s=5.0), probes=[running(timed, "nvml"), running(quiet)])
    a.start()
    try:
        wall = run_agent_for(a, 1.0)
    finally:
        a.shutdown()
    assert timed.polls >= 0.25 * wall / POLL_S, timed.polls
    assert quiet.polls <= 2, quiet.polls          # not polled on the timer: no data said


def test_a_ready_descriptor_wakes_the_loop_at_once(tmp_path):
    quiet = Quiet()
    a = Agent(cfg_for(tmp_path, window_s=10.0), probes=[running(quiet)])
    a.start()
    polled_at = call_times(quiet, "poll")
    poked = []

    def poke_later():
        time.sleep(0.5)
        poked.append(time.monotonic())
        poke(quiet.pipe[1])
    th = threading.Thread(target=poke_later)
    th.start()
    try:
        run_agent_for(a, 1.2)
    finally:
        th.join()
        a.shutdown()
    after = [t for t in polled_at if t >= poked[0]]
    assert after and after[0] - poked[0] < 2.0, (poked, polled_at)   # not at the 10 s deadline


def test_sigterm_ends_a_waiting_loop_at_once(tmp_path):
    quiet = Quiet()
    a = Agent(cfg_for(tmp_path, window_s=30.0), probes=[running(quiet)])
    a.start()
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    a.install_signal_handlers()
    sent = []

    def term_later():
        time.sleep(0.5)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)
    th = threading.Thread(target=term_later)
    th.start()
    try:
        a.run()
        ended = time.monotonic()
    finally:
        th.join()
        for s, h in old.items():
            signal.signal(s, h)
        a.shutdown()
    # the loop waited on a 30 s window deadline: without the wake-up pipe select() would
    # have been retried after the handler with what was left of it
    assert ended - sent[0] < 5.0, ended - sent[0]          # the timer-less wait took 29.5 s


# -- the CUPTI probe's pump thread -----------------------------------------------------------

def test_an_idle_cupti_pump_thread_does_not_wake_on_a_timer(tmp_path):
    from ridgeline.probes.cupti.probe import CuptiProbe
    probe = CuptiProbe(socket_path=str(tmp_path / "cupti.sock"), max_wait_s=30.0)
    probe.start()
    try:
        r0 = probe.pump_rounds
        time.sleep(2.0)
        rounds = probe.pump_rounds - r0
    finally:
        t0 = time.monotonic()
        probe.stop()
        stopped_s = time.monotonic() - t0
    assert rounds <= 4, rounds                   # the 20 ms timer made 100
    assert stopped_s < 5.0, stopped_s            # the waker ends its 30 s wait


def test_the_pump_thread_wakes_for_a_connections_deadline(tmp_path):
    """A peer that never says HELLO is cut hello_timeout_s after it connected, though no
    byte arrives and the thread's longest wait is far longer."""
    from ridgeline.probes.cupti.probe import CuptiProbe
    probe = CuptiProbe(socket_path=str(tmp_path / "cupti.sock"), max_wait_s=30.0, hello_timeout_s=0.4)
    probe.start()
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        c.connect(str(tmp_path / "cupti.sock"))
        t0 = time.monotonic()
        while probe.server.stats["hello_timeout_cut"] == 0 and time.monotonic() - t0 < 5:
            time.sleep(0.02)
        cut_s = time.monotonic() - t0
    finally:
        c.close()
        probe.stop()
    assert 0.35 <= cut_s < 5.0, cut_s            # not at the 30 s wait's end


def test_cupti_data_reaches_the_loop_through_the_ready_descriptor(tmp_path):
    """Frames of the bench's CUPTI feed (libridgeline_cupti.so's layout): the ready
    descriptor becomes readable when they are decoded, poll() reads it empty and hands on
    all the kernels; with nothing new the descriptor stays quiet."""
    pytest.importorskip("cupti")
    import select

    import bench_scale as bs

    from ridgeline.probes.cupti.probe import CuptiProbe
    stream = bs.StepStream(1, 50_000, "short")
    frames = bs.CuptiFrames(stream)
    path = str(tmp_path / "cupti.sock")
    probe = CuptiProbe(socket_path=path)
    probe.start()
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        fd = probe.ready_fd()
        assert select.select([fd], [], [], 0.3)[0] == []       # nothing yet
        c.connect(path)
        c.sendall(frames.hello())
        assert select.select([fd], [], [], 5.0)[0] == [fd]     # the HELLO: a new process
        out = probe.poll()
        assert [p for p, _ in out["new_pids"]] == [os.getpid()]
        assert select.select([fd], [], [], 0.0)[0] == []       # poll() read it empty
        base = time.time_ns() - 10**9
        want = 0
        for i in range(4):
            k, a = stream.batch(i, base)
            want += len(k)
            c.sendall(frames.batch(k, a))
        got, end = 0, time.monotonic() + 10
        while got < want and time.monotonic() < end:
            if select.select([fd], [], [], end - time.monotonic())[0]:
                out = probe.poll()
                got += len(out["trace"].kernels) if "trace" in out else 0
        assert got == want
        assert select.select([fd], [], [], 0.3)[0] == []
    finally:
        c.close()
        probe.stop()
