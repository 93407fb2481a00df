"""Issue 18.4: no local user's idle connections keep another user's (or root's) served
process from connecting to the CUPTI socket.

Four users x 256 idle connections (past HELLO) filled every slot of a 1,024-slot socket;
then root's and a fifth user's libraries were refused. Now a full table gives the newcomer
of root, or of a user holding fewer connections than the user holding the most, the slot of
that user's longest-idle connection; idle peers are cut after ``idle_peer_s``. Shown with
fake uids at the server's peer-credential boundary (``peer_cred``) and with real processes
running as four real uids (setuid children, root only).
"""
from __future__ import annotations

import collections
import os
import re
import resource
import shutil
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from support import cupti_records as R
from support.cupti_server import cupti_server, pump_until

from ridgeline.probes.cupti.server import CuptiServer


@pytest.fixture
def many_fds():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 8192:
        pytest.skip(f"the server takes 1,024 connections at a quarter of RLIMIT_NOFILE: hard limit {hard} < 8192")
    resource.setrlimit(resource.RLIMIT_NOFILE, (8192, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _pump_until(s, what, seconds=20.0):
    return pump_until(s, what, seconds)


def _hellos(s) -> list:
    return [m for m in s.drain() if m.kind == "hello"]


def test_four_users_with_256_idle_connections_each_refuse_neither_root_nor_a_fifth_user(tmp_path, many_fds):
    uids = collections.deque()                 # the uid each next accepted connection has
    s = CuptiServer(str(tmp_path / "f.sock"), max_connections=1024,
                    peer_cred=lambda sock: (os.getpid(), uids.popleft()))
    s.open()
    held = []
    try:
        assert s.max_connections == 1024 and s.max_connections_per_uid == 256
        for uid in (1001, 1002, 1003, 1004):
            for _ in range(256):
                c = socket.socket(socket.AF_UNIX)
                uids.append(uid)
                c.connect(s.path)
                c.sendall(R.hello_frame())
                held.append(c)
                s.pump(0)
        got = []
        assert _pump_until(s, lambda: got.extend(_hellos(s)) or (s.connections == 1024 and len(got) == 1024))
        # each user's 257th is refused at its share
        c = socket.socket(socket.AF_UNIX)
        uids.append(1002)
        c.connect(s.path)
        assert _pump_until(s, lambda: s.stats["refused_connections_uid"] == 1)
        c.close()
        # root's library and a fifth user's: each takes a slot of the user holding the most
        for uid in (0, 2005):
            c = socket.socket(socket.AF_UNIX)
            uids.append(uid)
            c.connect(s.path)
            c.sendall(R.hello_frame())
            held.append(c)
            assert _pump_until(s, lambda: len(_hellos(s)) == 1, 5)
        assert s.connections == 1024 and s.stats["evicted_fair_share"] == 2
        assert s.stats["refused_connections"] == 0
        assert s._per_uid[0] == 1 and s._per_uid[2005] == 1
        assert sorted(s._per_uid[u] for u in (1001, 1002, 1003, 1004)) == [255, 255, 256, 256]
        # a user that lost one does not take it back from a user holding one more: no see-saw
        loser = min((1001, 1002, 1003, 1004), key=lambda u: s._per_uid[u])
        c = socket.socket(socket.AF_UNIX)
        uids.append(loser)
        c.connect(s.path)
        assert _pump_until(s, lambda: s.stats["refused_connections"] == 1)
        c.close()
        assert s.stats["evicted_fair_share"] == 2
    finally:
        for c in held:
            c.close()
        s.close()


def test_the_evicted_connection_is_the_longest_idle_of_the_top_user(tmp_path):
    uids = collections.deque()
    s = CuptiServer(str(tmp_path / "e.sock"), max_connections=4, max_connections_per_uid=4,
                    peer_cred=lambda sock: (os.getpid(), uids.popleft()))
    s.open()
    try:
        cs = []
        for i in range(4):
            c = socket.socket(socket.AF_UNIX)
            uids.append(1001)
            c.connect(s.path)
            if i != 2:
                c.sendall(R.hello_frame())     # the third never says HELLO: it goes first
            cs.append(c)
            _pump_until(s, lambda: s.connections == i + 1)
            time.sleep(0.02)
        n = R.make_buffer(4, seed=3, with_markers=False)
        cs[0].sendall(R.batch_frame([(10, R.KERNEL.itemsize, n.kernels.tobytes())], n.names))
        _pump_until(s, lambda: False, 0.1)
        for k in (1, 2):                      # two of root's libraries arrive
            c = socket.socket(socket.AF_UNIX)
            uids.append(0)
            c.connect(s.path)
            cs.append(c)
            assert _pump_until(s, lambda: s._per_uid[0] == k)

        def closed(c):
            c.setblocking(False)
            try:
                return c.recv(1) == b""
            except BlockingIOError:
                return False
        # the one without HELLO, then the idlest with HELLO (the second: the first sent a batch)
        assert [closed(c) for c in cs[:4]] == [False, True, True, False]
    finally:
        s.close()


def test_idle_peers_after_hello_are_cut_and_busy_ones_stay(tmp_path):
    with cupti_server(tmp_path / "i.sock", idle_peer_s=0.4) as s:
        idle, busy = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
        idle.connect(s.path)
        busy.connect(s.path)
        idle.sendall(R.hello_frame())
        busy.sendall(R.hello_frame())
        b = R.make_buffer(4, seed=3, with_markers=False)
        frame = R.batch_frame([(10, R.KERNEL.itemsize, b.kernels.tobytes())], b.names)
        end = time.monotonic() + 1.2
        while time.monotonic() < end:
            busy.sendall(frame)
            _pump_until(s, lambda: False, 0.1)
        assert s.stats["idle_peer_cut"] == 1 and s.connections == 1
        assert idle.recv(1) == b""


@pytest.mark.skipif(shutil.which("ss") is None, reason="iproute2's ss is not installed")
def test_listen_backlog_is_the_systems_largest(tmp_path):
    """``ss -lx`` reads the backlog the kernel gave the listener (Send-Q of a listening
    socket): the system's largest (net.core.somaxconn), not 128, so a connect flood between
    two rounds does not make a real library's non-blocking connect fail with EAGAIN."""
    s = CuptiServer(str(tmp_path / "b.sock"))
    s.open()
    try:
        out = subprocess.run(["ss", "-lxn"], capture_output=True, text=True, check=True).stdout
        line = next(x for x in out.splitlines() if s.path in x)
        backlog = int(re.split(r"\s+", line.strip())[3])
        somaxconn = int(open("/proc/sys/net/core/somaxconn").read())
        assert backlog == min(somaxconn, socket.SOMAXCONN) or backlog == somaxconn, (line, somaxconn)
        assert backlog > 128
    finally:
        s.close()


# ------------------------------------------------------------------------------ real users

_HOLDER = textwrap.dedent("""
    # Opens n connections to the socket, each with a HELLO for this process, holds them
    # until stdin closes. argv: socket path, n, HELLO hex (pid at byte 16 set to ours).
    import os, socket, struct, sys
    path, n, hello = sys.argv[1], int(sys.argv[2]), bytearray.fromhex(sys.argv[3])
    struct.pack_into("<I", hello, 16, os.getpid())
    held, refused = [], 0
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX); s.connect(path)
        try:
            s.sendall(bytes(hello)); held.append(s)
        except OSError:
            refused += 1
    print(os.getuid(), len(held), flush=True)
    sys.stdin.read()
""")


def _as(uid):
    def drop():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    return drop


def test_real_users_four_times_256_idle_then_root_and_a_fifth_user_connect(tmp_path, many_fds):
    """Real processes as uids 65534 and 60001-60003 (setuid children; no passwd entry is
    needed) each hold 256 idle connections past HELLO; a library of root and one of uid
    60004 then connect and their HELLOs come through within a few rounds."""
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root (setuid children) and /usr/bin/python3 for them")
    import tempfile
    d = Path(tempfile.mkdtemp(prefix="rl-starve-", dir="/tmp"))     # pytest's tmp_path is root's only
    d.chmod(0o755)
    s = CuptiServer(str(d / "c.sock"), max_connections=1024)
    s.open()
    procs = []
    try:
        hello = R.hello_frame(pid=0).hex()
        for uid in (65534, 60001, 60002, 60003):
            p = subprocess.Popen(["/usr/bin/python3", "-c", _HOLDER, s.path, "256", hello], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, preexec_fn=_as(uid), cwd="/")
            procs.append(p)
            import threading
            line = []
            t = threading.Thread(target=lambda: line.append(p.stdout.readline()), daemon=True)
            t.start()
            while t.is_alive():
                s.pump(0.01)
            assert line[0].split() == [str(uid), "256"]
        got = []
        assert _pump_until(s, lambda: got.extend(_hellos(s)) or (s.connections == 1024 and len(got) == 1024))
        assert s.stats["rejected_peers"] == 0 and s.stats["refused_connections"] == 0
        p = subprocess.Popen(["/usr/bin/python3", "-c", _HOLDER, s.path, "1", hello], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, preexec_fn=_as(60004), cwd="/")
        procs.append(p)
        root = socket.socket(socket.AF_UNIX)
        root.connect(s.path)
        root.sendall(R.hello_frame())
        got = []
        assert _pump_until(s, lambda: got.extend(_hellos(s)) or len(got) == 2, 20)
        assert s.stats["evicted_fair_share"] == 2 and s.stats["refused_connections"] == 0
        assert s._per_uid[0] == 1 and s._per_uid[60004] == 1 and s.connections == 1024
        root.close()
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=30)
        s.close()
        shutil.rmtree(d, ignore_errors=True)
