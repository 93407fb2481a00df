"""The agent as a process: sd_notify, tail, restarts, slow and absent subscribers,
malformed input on every socket it reads, and bounded memory (slow)."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from support.agent_process import TRACE, start_agent, stop, write_config
from support.net import free_port

SMALL = "nvidia-inference/nanovllm_rtx4080laptop_decode_step0_fragment.json.gz"   # 17 kernels per 3.9 ms lap


def subscriber(endpoint, topics=(), rcvhwm=10000):
    from ridgeline.agent.subscriber import Subscriber
    return Subscriber(endpoint, topics=topics, rcvhwm=rcvhwm)


def receive(sub, n, timeout_s=30, topic=None):
    out = []
    end = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < end:
        m = sub.receive(0.2)
        if m is not None and (topic is None or m.topic == topic):
            out.append(m)
    return out


class NotifyReader:
    """$NOTIFY_SOCKET read as systemd reads it: at once, on a thread. A unix datagram queue
    holds 10 messages (net.unix.max_dgram_qlen), and the agent's sends never block: read
    only now and then, a queue full of WATCHDOG=1 made the agent drop STOPPING=1 (failed
    2/3 under load)."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)
        self.seen: list[str] = []
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop:
            try:
                self.seen.append(self.sock.recv(4096).decode())
            except (socket.timeout, TimeoutError):
                pass

    def wait(self, pred, seconds=60.0) -> bool:
        end = time.monotonic() + seconds
        while not pred(list(self.seen)):
            if time.monotonic() > end:
                return False
            time.sleep(0.05)
        return True

    def close(self):
        self._stop = True
        self._t.join(10)
        self.sock.close()


def test_sd_notify_ready_watchdog_status_stopping_and_tail(tmp_path, trace_path):
    cfg, ep = write_config(tmp_path, trace_path(TRACE))
    sock_path = str(tmp_path / "notify.sock")
    notify = NotifyReader(sock_path)
    agent = start_agent(cfg, env={"NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "400000"})
    try:
        try:
            assert notify.wait(lambda seen: any("READY=1" in m for m in seen)), notify.seen
            tail = subprocess.run([sys.executable, "-m", "ridgeline", "tail", "--endpoint", ep, "--json", "--count",
                                   "6", "--timeout", "20"], capture_output=True, text=True, timeout=60)
            assert tail.returncode == 0, tail.stderr
            recs = [json.loads(line) for line in tail.stdout.splitlines()]
            assert len(recs) == 6 and {r["topic"] for r in recs} <= {"window", "health", "engine", "device", "sched"}
            win = [r for r in recs if r["topic"] == "window"]
            assert win and win[0]["payload"]["sources"] == ["replay"]
            notify.wait(lambda seen: "WATCHDOG=1" in seen and any(m.startswith("STATUS=window") for m in seen), 30)
            assert "WATCHDOG=1" in notify.seen
            assert any(m.startswith("STATUS=window:") for m in notify.seen)
        finally:
            rc = stop(agent)
        assert rc == 0
        assert notify.wait(lambda seen: any(m.startswith("STOPPING=1") for m in seen), 30), notify.seen[-20:]
    finally:
        notify.close()


def test_sigkill_and_restart_shows_restart_and_no_crash(tmp_path, trace_path):
    cfg, ep = write_config(tmp_path, trace_path(TRACE), speed=1.0)
    sub = subscriber(ep, topics=("window",))
    a = start_agent(cfg)
    try:
        first = receive(sub, 3)
        assert len(first) == 3 and [m.seq for m in first] == sorted(m.seq for m in first)
        a.send_signal(signal.SIGKILL)
        a.wait(10)
        b = start_agent(cfg)
        try:
            after = receive(sub, 3)
            assert len(after) == 3
            assert after[0].restarted and after[0].seq < first[-1].seq
            assert sub.seq.restarts == 1
        finally:
            assert stop(b) == 0
    finally:
        if a.poll() is None:
            a.kill()
        sub.close()


def test_tail_reports_gaps_and_restarts_to_stderr(tmp_path, trace_path):
    cfg, ep = write_config(tmp_path, trace_path(SMALL), speed=2.0)
    a = start_agent(cfg)
    tail = subprocess.Popen([sys.executable, "-m", "ridgeline", "tail", "--endpoint", ep, "--topic", "window",
                             "--count", "6", "--timeout", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        first = [tail.stdout.readline(), tail.stdout.readline()]
        assert all(line.startswith("window") for line in first)
        a.send_signal(signal.SIGKILL)
        a.wait(10)
        a = start_agent(cfg)
        out, err = tail.communicate(timeout=60)
        assert tail.returncode == 0
        assert "window sequence restarted" in err
        assert len(out.splitlines()) == 4
    finally:
        tail.kill() if tail.poll() is None else None
        stop(a)


def test_slow_absent_and_restarted_subscribers(tmp_path, trace_path):
    import zmq
    cfg, ep = write_config(tmp_path, trace_path(TRACE), speed=1.0, sndhwm=4, events=True)
    a = start_agent(cfg)
    ctx = zmq.Context()
    try:
        time.sleep(2)                                  # no subscriber at all: nothing breaks
        assert a.poll() is None
        fast = subscriber(ep, topics=("health",))
        slow = ctx.socket(zmq.SUB)                     # subscribes to everything, never reads
        slow.setsockopt(zmq.RCVHWM, 1)
        slow.setsockopt(zmq.RCVBUF, 1024)
        slow.setsockopt(zmq.SUBSCRIBE, b"")
        slow.connect(ep)
        # until the slow one's misses show (a loaded host may take long), not for a fixed 12 s
        health = []
        end = time.monotonic() + 60
        while time.monotonic() < end and not (len(health) >= 5 and health[-1].payload["publisher_drops"] > 0
                                              and health[-1].payload["publisher_stalls"] >= 1):
            health += receive(fast, 1, timeout_s=1, topic="health")
        assert a.poll() is None
        # Drops are counted, the agent never blocked, and the fast subscriber kept
        # receiving while the slow one was stuck (its gaps are only the stall's detection).
        assert health[-1].payload["publisher_drops"] > 0
        assert health[-1].payload["publisher_stalls"] >= 1
        assert len(health) >= 5
        slow.close(0)
        fast.close()
        again = subscriber(ep, topics=("window",))     # a subscriber restarted
        assert len(receive(again, 2)) == 2
        again.close()
    finally:
        ctx.term()
        assert stop(a) == 0


def test_malformed_input_on_every_socket(tmp_path, trace_path):
    import httpx
    import zmq

    from ridgeline.agent import config, registry
    prom = free_port()
    cupti_sock = tmp_path / "cupti.sock"
    have_cupti = registry.availability("cupti", config.overlay(
        config.defaults(), {"probes": {"cupti": {"socket": str(cupti_sock)}}}))[1].ok
    cfg, ep = write_config(tmp_path, trace_path(TRACE), prom_port=prom,
                           probes=("replay", "cupti") if have_cupti else ("replay",),
                           extra=f'[probes.cupti]\nsocket = "{cupti_sock}"\n')
    a = start_agent(cfg)
    sub = subscriber(ep, topics=("health",))
    try:
        assert receive(sub, 1), "agent did not start"
        host, port = ep[len("tcp://"):].rsplit(":", 1)
        # The stream socket: raw bytes, a half ZMTP greeting, bad subscription frames.
        for junk in (b"\x00" * 3, b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00" + b"X" * 100, os.urandom(4096)):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(junk)
        ctx = zmq.Context()
        x = ctx.socket(zmq.XSUB)
        x.connect(ep)
        time.sleep(0.3)
        x.send(b"\x05bogus")
        x.send(b"")
        x.send(b"\x01" + b"A" * 100_000)            # over MAXMSGSIZE: the peer is cut off
        # The Prometheus endpoint: garbage requests.
        for junk in (b"\x16\x03\x01\x02\x00" + os.urandom(512), b"GET /" + b"A" * 70000 + b" HTTP/1.1\r\n\r\n",
                     b"POST /metrics HTTP/1.1\r\nContent-Length: -5\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", prom)) as s:
                s.sendall(junk)
        # The CUPTI socket (injected processes' buffers): garbage, a bogus header, a huge length.
        if have_cupti:
            for junk in (os.urandom(2048), b"RLCP" + b"\xff" * 60, (2**31 - 1).to_bytes(4, "little") * 16):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(str(cupti_sock))
                    s.sendall(junk)
        # the bad subscription frames counted in a health record, and the agent still
        # publishing windows later (however long a loaded host takes; a fixed 1.5 s before)
        h = []
        end = time.monotonic() + 60
        while time.monotonic() < end and not (len(h) >= 3 and h[-1].payload["bad_frames"] >= 1):
            h += receive(sub, 1, timeout_s=1, topic="health")
        assert a.poll() is None
        assert httpx.get(f"http://127.0.0.1:{prom}/metrics", timeout=30).status_code == 200
        assert h and h[-1].payload["bad_frames"] >= 1
        x.close(0)
        ctx.term()
    finally:
        sub.close()
        assert stop(a) == 0


def _rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


_TRIM = re.compile(rb"heap: freed fold memory given back \(RSS (\d+) -> (\d+) MiB; trim (\d+)")


@pytest.mark.slow
def test_rss_stays_bounded_over_ten_minutes_of_fast_replay(tmp_path, trace_path):
    """RSS under the design's 256 MB throughout, and no leak: what is live after the agent
    gives its freed heap back (agent/allocator.SpikeTrim, logged at each trim) is no more in
    the last trims than in the first ones. RSS itself is no leak measure: it holds the
    largest recent fold's temporaries, which grow with the batches a loaded host leaves
    (CI's loaded hosts failed a first-minute-against-last-minute RSS bound, 80 -> 130 MiB:
    the replay probe then handed a starved agent a whole second's catch-up per poll; capped
    at 30% of a core the agent stood at 130-163 MiB, 59-63 MiB since its batches are
    bounded, probes/replay.py)."""
    cfg, ep = write_config(tmp_path, trace_path(TRACE), speed=3.0, events=True)
    cfg.write_text(cfg.read_text().replace("window_s = 0.5", 'window_s = 0.5\nlog_level = "debug"', 1))
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as log:
        a = start_agent(cfg, log=log)
        sub = subscriber(ep, topics=("health",))
        samples = []
        try:
            end = time.monotonic() + 600
            while time.monotonic() < end:
                time.sleep(10)
                assert a.poll() is None, "agent died"
                samples.append(_rss_bytes(a.pid))
                while sub.receive(0) is not None:
                    pass
        finally:
            sub.close()
            assert stop(a) == 0
    trims = [(int(m[1]), int(m[2]), int(m[3])) for m in _TRIM.finditer(log_path.read_bytes())]
    after = [t[1] for t in trims[1:]]        # the start-up trim's is before the first folds settle
    print(f"RSS peak {max(samples) / 2**20:.0f} MiB, last minute {max(samples[-6:]) / 2**20:.0f} MiB; "
          f"{len(trims)} trims, RSS before / after (MiB): {[t[:2] for t in trims]}")
    assert max(samples) < 256 * 2**20
    # one trim per 120 windows at least (60 s of 0.5-s windows; a loaded host's are longer)
    assert [t[2] for t in trims] == list(range(1, len(trims) + 1)) and len(after) >= 4, trims
    early, late = max(after[:3]), max(after[-3:])
    assert late <= early * 1.15 + 16, (early, late, trims)


def test_top_once_and_a_recording_that_loads_back(tmp_path, trace_path):
    from ridgeline.agent.recording import is_recording, load_recording
    cfg, ep = write_config(tmp_path, trace_path(TRACE), events=True)
    a = start_agent(cfg)
    try:
        top = subprocess.run([sys.executable, "-m", "ridgeline", "top", "--once", "--endpoint", ep, "--timeout", "30"],
                             capture_output=True, text=True, timeout=90)
        assert top.returncode == 0, top.stderr
        assert "REPLAY DATA" in top.stdout and "GPU 0" in top.stdout and "agent:" in top.stdout
        out = tmp_path / "s.rlrec"
        rec = subprocess.run([sys.executable, "-m", "ridgeline", "record", "-o", str(out), "--endpoint", ep,
                              "--duration", "3"], capture_output=True, text=True, timeout=90)
        assert rec.returncode == 0 and "messages" in rec.stderr
    finally:
        assert stop(a) == 0
    assert is_recording(out)
    r = load_recording(out)
    assert r.messages.get("window", 0) >= 2 and r.messages.get("events", 0) >= 2
    assert len(r.trace.kernels) > 100 and not r.truncated
    names = set(r.trace.names.names_of(r.trace.kernels["name_id"][:50]))
    assert "" not in names and r.trace.meta["sources"] == ["replay"]


def test_record_top_tail_without_agent_fail_cleanly(tmp_path):
    ep = f"tcp://127.0.0.1:{free_port()}"
    for args in (["tail", "--timeout", "1"], ["top", "--once", "--timeout", "1"]):
        r = subprocess.run([sys.executable, "-m", "ridgeline", *args, "--endpoint", ep], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_sighup_reloads_and_a_bad_file_is_refused(tmp_path, trace_path):
    cfg, ep = write_config(tmp_path, trace_path(SMALL))
    sock_path = str(tmp_path / "notify.sock")
    notify = NotifyReader(sock_path)
    read = [0]

    def wait_for(prefix):
        """The next message (after the last one returned) with a line starting with prefix."""
        def hit(seen):
            return any(any(line.startswith(prefix) for line in m.split("\n")) for m in seen[read[0]:])
        assert notify.wait(hit, 60), (prefix, notify.seen)
        for i in range(read[0], len(notify.seen)):
            m = notify.seen[i]
            if any(line.startswith(prefix) for line in m.split("\n")):
                read[0] = i + 1
                return m

    a = start_agent(cfg, env={"NOTIFY_SOCKET": sock_path})
    try:
        wait_for("READY=1")
        cfg.write_text(cfg.read_text().replace("window_s = 0.5", "window_s = 0.25"))
        a.send_signal(signal.SIGHUP)
        wait_for("RELOADING=1")
        assert "reloaded" in wait_for("READY=1")
        good = cfg.read_text()
        cfg.write_text("[agent]\nwindow_s = 'soon'\n")
        a.send_signal(signal.SIGHUP)
        assert "reload refused" in wait_for("STATUS=reload refused")
        cfg.write_text(good)
        sub = subscriber(ep, topics=("window",))
        got = receive(sub, 3)
        sub.close()
        # Still publishing after the refused reload (the window length itself is checked
        # in-process, where timing does not depend on the machine's load).
        assert len(got) == 3 and a.poll() is None
    finally:
        assert stop(a) == 0
        notify.close()
