"""SIGHUP reloads that cannot silence the agent (issue 14.4), command-line overrides kept
across reloads (issue 11.5), a watchdog fed only while windows are published, and peer
text escaped in the log (issue 14.6)."""
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from support.net import free_port, wait_for

from ridgeline.agent import config
from ridgeline.agent.daemon import Agent
from ridgeline.agent.sdnotify import Notifier
from ridgeline.agent.subscriber import Subscriber
from ridgeline.aggregator import wire as codec


def base_toml(ep, extra=""):
    return (f'[agent]\nwindow_s = 0.2\n[publisher]\nendpoint = "{ep}"\n{extra}'
            '[prometheus]\nenabled = false\n[probes]\nenabled = []\n')


def collect(sub, seconds, topic="window", until=None):
    """Messages of ``topic`` for ``seconds``, or until ``until(messages)`` holds (then
    ``seconds`` is only the deadline: a loaded host may take long, a quick one does not wait)."""
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        m = sub.receive(0.1)
        if m is not None and m.topic == topic:
            out.append(m)
            if until is not None and until(out):
                break
    return out


@pytest.fixture
def running_agent(tmp_path):
    path = tmp_path / "agent.toml"
    ep = f"ipc://{tmp_path}/r.sock"
    path.write_text(base_toml(ep))
    agent = Agent(config.load(path), config_path=str(path), probes=[], codec=codec, notifier=Notifier({}))
    agent.start()
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    sub = Subscriber(ep, codec=codec, topics=("window",))
    try:
        yield agent, path, ep, sub
    finally:
        agent.request_stop()
        t.join(60)
        agent.shutdown()
        sub.close()


@pytest.mark.parametrize("bad", [
    '[agent]\nwindow_s = 0.2\n[publisher]\nsndhwm = 99999999999999999999\n',
    '[agent]\nwindow_s = 0.2\n[prometheus]\nlisten = "127.0.0.1:99999"\n',
    '[agent]\nwindow_s = 0.2\n[publisher]\nendpoint = "tcp://127.0.0.1:99999"\n',
    '[agent]\nwindow_s = nan\n',
])
def test_a_reload_with_a_bad_value_keeps_the_agent_publishing(running_agent, bad):
    agent, path, ep, sub = running_agent
    assert collect(sub, 30, until=len)             # subscribed and flowing
    before = (agent.cfg, agent.publisher)
    path.write_text(bad.replace("[agent]\nwindow_s = 0.2\n", "[agent]\nwindow_s = 0.2\n"
                                f'[publisher]\nendpoint = "{ep}"\n', 1) if "[publisher]" not in bad else bad)
    agent.request_reload()
    # windows on both sides of the reload, however long a loaded host takes to get there
    refused_at = []

    def past_the_reload(msgs):
        if agent.reloads_refused and not refused_at:
            refused_at.append(len(msgs))
        return len(msgs) >= 4 and refused_at and len(msgs) - refused_at[0] >= 2
    after = collect(sub, 60, until=past_the_reload)
    assert agent.reloads_refused == 1 and agent.reloads == 0
    assert (agent.cfg, agent.publisher) == before        # untouched, same socket
    assert agent.loop_errors == 0
    seqs = [m.seq for m in after]
    assert len(seqs) >= 4 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))   # no gap, no pause


def test_a_reload_whose_endpoint_cannot_bind_keeps_the_old_one(running_agent, tmp_path):
    agent, path, ep, sub = running_agent
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    busy = free_port()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", busy))
    blocker.listen(1)
    prom_port = free_port()
    try:
        assert collect(sub, 30, until=len)
        # /metrics on a free port, the stream on a taken one: all or nothing.
        path.write_text(f'[agent]\nwindow_s = 0.2\n[publisher]\nendpoint = "tcp://127.0.0.1:{busy}"\n'
                        f'[prometheus]\nenabled = true\nlisten = "127.0.0.1:{prom_port}"\n[probes]\nenabled = []\n')
        seq_before = agent.publisher.seq["window"]
        agent.request_reload()
        # the old endpoint, rebound: windows published after the reload arrive (earlier
        # ones may still be queued for the subscriber, so wait for a later number)
        after = collect(sub, 60, until=lambda msgs: agent.reloads_refused and msgs[-1].seq > seq_before)
        assert agent.reloads_refused == 1 and agent.cfg.publisher.endpoint == ep
        assert agent.prometheus is None           # the /metrics half was undone too
        with socket.socket() as s:                # and its port released
            s.bind(("127.0.0.1", prom_port))
        # sequence numbers went on: no restart, and past the number before the reload
        assert after and after[-1].seq > seq_before and not any(m.restarted for m in after)
        assert [m.seq for m in after] == sorted(m.seq for m in after)
    finally:
        taken.close()
        blocker.close()


def test_a_good_reload_still_applies(running_agent):
    agent, path, ep, sub = running_agent
    prom = free_port()
    path.write_text(f'[agent]\nwindow_s = 0.3\n[publisher]\nendpoint = "{ep}"\nsndhwm = 50\n'
                    f'[prometheus]\nenabled = true\nlisten = "127.0.0.1:{prom}"\n[probes]\nenabled = []\n')
    agent.request_reload()
    assert wait_for(lambda: agent.reloads == 1)
    assert agent.reloads == 1 and agent.cfg.agent.window_s == 0.3 and agent.cfg.publisher.sndhwm == 50
    assert agent.prometheus is not None and agent.prometheus.port == prom
    assert collect(sub, 30, until=len)


def test_sighup_keeps_command_line_overrides(tmp_path):
    """`--probes engine --no-prometheus` must survive SIGHUP (it used to come back as the
    file's settings: every probe, /metrics on)."""
    ep = f"ipc://{tmp_path}/o.sock"
    prom = free_port()
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[agent]\nwindow_s = 0.2\n[publisher]\nendpoint = "{ep}"\n'
                   f'[prometheus]\nlisten = "127.0.0.1:{prom}"\n'
                   '[probes]\nenabled = ["simulator", "engine"]\n'
                   f'[probes.engine]\nurl = "http://127.0.0.1:{free_port()}/metrics"\n')
    agent = subprocess.Popen([sys.executable, "-m", "ridgeline", "agent", "--config", str(cfg),
                              "--probes", "engine", "--no-prometheus"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sub = Subscriber(ep, codec=codec, topics=("health",))
    try:
        first = None
        end = time.monotonic() + 30
        while first is None and time.monotonic() < end:
            first = sub.receive(0.5)
        assert first is not None, "agent did not start"
        assert set(first.payload["probes"]) == {"engine"}
        agent.send_signal(signal.SIGHUP)
        reloaded = None
        end = time.monotonic() + 30
        while time.monotonic() < end:
            m = sub.receive(0.5)
            if m is not None and m.payload.get("reloads") == 1:
                reloaded = m
                break
        assert reloaded is not None, "no reload seen"
        assert set(reloaded.payload["probes"]) == {"engine"}
        with socket.socket() as s:                 # --no-prometheus held: the port is free
            s.bind(("127.0.0.1", prom))
    finally:
        sub.close()
        agent.terminate()
        _, err = agent.communicate(timeout=30)
    assert agent.returncode == 0, err
    assert "Traceback" not in err


class NotifySink:
    """A real AF_UNIX datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.path = str(path)

    def drain(self) -> list[str]:
        out = []
        while True:
            try:
                out.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                return out


def test_the_watchdog_is_fed_only_while_windows_are_published(tmp_path):
    sink = NotifySink(tmp_path / "notify")
    cfg = config.overlay(config.defaults(), {"agent": {"window_s": 0.2},
                                             "publisher": {"endpoint": f"ipc://{tmp_path}/w.sock"},
                                             "prometheus": {"enabled": False}, "probes": {"enabled": []}})
    broken = {"on": False}

    class Codec:
        def __getattr__(self, name):
            return getattr(codec, name)

        def encode_window(self, w):
            if broken["on"]:
                raise ValueError("cannot encode")
            return codec.encode_window(w)

    agent = Agent(cfg, probes=[], codec=Codec(),
                  notifier=Notifier({"NOTIFY_SOCKET": sink.path, "WATCHDOG_USEC": "200000"}))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("ridgeline").addHandler(handler)
    agent.start()
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()

    def watchdogs(seconds):
        sink.drain()
        time.sleep(seconds)
        return sum("WATCHDOG=1" in m for m in sink.drain())

    def fed(n, seconds=60.0):
        """n watchdog pings arrive (event-based: a loaded host may space them out)."""
        sink.drain()
        got, end = 0, time.monotonic() + seconds
        while got < n and time.monotonic() < end:
            got += sum("WATCHDOG=1" in m for m in sink.drain())
            time.sleep(0.02)
        return got >= n

    try:
        assert fed(3)                               # healthy: fed
        skipped = agent.watchdog_skipped
        broken["on"] = True
        # past the grace of two windows: the agent itself decided not to feed the watchdog
        # (from then on it cannot be healthy again while nothing is published)
        assert wait_for(lambda: agent.watchdog_skipped > skipped and agent.loop_errors >= 5, 60)
        assert watchdogs(1.0) == 0                  # nothing published: systemd will restart us
        assert agent.loop_errors >= 5
        broken["on"] = False
        assert fed(3)                               # publishing again: fed again
    finally:
        agent.request_stop()
        t.join(60)
        agent.shutdown()
        logging.getLogger("ridgeline").removeHandler(handler)
    # One traceback for the repeated error, not one per window.
    tracebacks = [r for r in records if r.exc_info and "cannot encode" in r.getMessage()]
    assert len(tracebacks) == 1


def test_peer_text_from_the_cupti_socket_is_escaped_in_the_log(tmp_path):
    from ridgeline.probes.cupti import protocol as P
    sock_path = tmp_path / "cupti.sock"
    cfg = config.overlay(config.defaults(), {
        "agent": {"window_s": 0.2}, "publisher": {"endpoint": f"ipc://{tmp_path}/l.sock"},
        "prometheus": {"enabled": False},
        "probes": {"enabled": ["cupti"], "cupti": {"socket": str(sock_path)}}})
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("ridgeline")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    agent = Agent(cfg, codec=codec, notifier=Notifier({}))
    agent.start()
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    forged = b"no CUPTI\nridgeline[1] ERROR forged line\r\x1b[2J\xe2\x80\xa8"
    comm = b"vllm\nfake"
    h = np.zeros(1, P.HELLO_DTYPE)
    # The agent checks the HELLO pid against the kernel's (SO_PEERCRED): ours.
    h["pid"], h["cupti_version"], h["comm_len"], h["status_len"] = os.getpid(), 130500, len(comm), len(forged)
    h["flags"] = P.FLAG_NO_CUPTI
    pad = lambda b: b + b"\0" * (-len(b) % 8)  # noqa: E731
    try:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(str(sock_path))
        c.sendall(P.encode_frame(P.MSG_HELLO, h.tobytes() + pad(comm) + pad(forged)))
        end = time.monotonic() + 30
        while time.monotonic() < end and not any("forged" in r.getMessage() for r in records):
            time.sleep(0.1)
        c.close()
    finally:
        agent.request_stop()
        t.join(60)
        agent.shutdown()
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = [r.getMessage() for r in records if "forged" in r.getMessage()]
    assert lines, [r.getMessage() for r in records]
    for line in lines:
        assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\u2028" not in line
        assert "\\nridgeline[1] ERROR forged line\\r\\x1b[2J" in line


@pytest.mark.parametrize("text, want", [
    ("plain text", "plain text"),
    ("a\nb\r\x1b[31m\x00\x7f\u2028", "a\\nb\\r\\x1b[31m\\x00\\x7f\\u2028"),
    ("already \\n escaped", "already \\n escaped"),       # not escaped twice
    (b"bytes \xff\n", "bytes \ufffd\\n"),
])
def test_for_log_makes_one_printable_line(text, want):
    from ridgeline.probes.untrusted_text import for_log
    assert for_log(text) == want


def test_for_log_is_bounded():
    from ridgeline.probes.untrusted_text import for_log
    out = for_log("\n" * 100_000, limit=50)
    assert len(out) < 80 and "\n" not in out


def test_when_no_socket_can_be_bound_windows_lost_show_as_a_gap(tmp_path):
    """Both the new and the old endpoint taken: nothing is published, the watchdog is not
    fed, the agent retries every window, and the lost windows show as a sequence gap."""
    port, other = free_port(), free_port()
    path = tmp_path / "agent.toml"
    path.write_text(base_toml(f"tcp://127.0.0.1:{port}"))
    agent = Agent(config.load(path), config_path=str(path), probes=[], codec=codec, notifier=Notifier({}))
    agent.start()
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    sub = Subscriber(f"tcp://127.0.0.1:{port}", codec=codec, topics=("window",))
    squatters = []
    try:
        assert collect(sub, 30, until=len)
        # Someone takes the new endpoint, and the old one the moment it is let go.
        s1 = socket.socket()
        s1.bind(("127.0.0.1", other))
        s1.listen(1)
        squatters.append(s1)
        real_make = agent._make_publisher

        def make(p):
            if p.endpoint.endswith(f":{port}") and len(squatters) == 1:
                s2 = socket.socket()
                s2.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s2.bind(("127.0.0.1", port))
                s2.listen(1)
                squatters.append(s2)
            return real_make(p)
        agent._make_publisher = make
        path.write_text(base_toml(f"tcp://127.0.0.1:{other}"))
        settled = time.time() - 10       # written a while ago: reloaded at once (daemon.RELOAD_SETTLE_S)
        os.utime(path, (settled, settled))
        last = agent.publisher.seq["window"]
        agent.request_reload()
        # past the watchdog's grace of two windows (however long a loaded host takes)
        assert wait_for(lambda: agent.reloads_refused == 1 and not agent.publishing_healthy(), 60)
        assert agent.publisher is None and agent.reloads_refused == 1
        assert not agent.publishing_healthy()
        squatters[1].close()                     # the endpoint is free again: rebound
        after = collect(sub, 60, until=len)
        assert agent.publisher is not None and after
        assert after[0].gap >= 2 and after[0].seq > last + 2
    finally:
        agent.request_stop()
        t.join(60)
        agent.shutdown()
        sub.close()
        for s in squatters:
            s.close()
