"""The agent's CUPTI socket against hostile and unprivileged peers: real clients, real server.

* a HELLO naming callback id 0xFFFFFFFF (which made the agent allocate ~20 GiB and lose the
  messages it had drained) costs one counted rejection, under a 3 GiB address-space limit;
* a peer runs as ``nobody`` (root is needed to show it): it can connect through a socket
  folder that systemd created 0750, report for itself, and nothing more: claiming another
  pid is refused and counted, and it can neither list, create nor remove anything there;
* 1,200 connections against an agent whose descriptor limit is 1,024: connections are
  bounded well below it, refusals are counted, and a /metrics-like HTTP endpoint of the
  same process keeps answering.
"""
from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from support import cupti_records as R

from ridgeline.probes.cupti.probe import CuptiProbe
from ridgeline.probes.cupti.server import CuptiServer, connection_limit

ROOT = Path(__file__).resolve().parent.parent
NOBODY = 65534


def _kernels(n=4):
    b = R.make_buffer(n, seed=3, with_markers=False)
    return b, [(10, R.KERNEL.itemsize, b.kernels.tobytes())]


def test_hello_with_callback_id_0xffffffff_costs_one_rejection_not_20_gib(tmp_path):
    """Run in a child with RLIMIT_AS = 3 GiB: before the fix np.full(2**32) raised
    MemoryError out of poll() and the good peer's batch, already drained, was lost."""
    code = textwrap.dedent(f"""
        import resource, socket, sys, json
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        from support import cupti_records as R
        from ridgeline.probes.cupti.probe import CuptiProbe
        b = R.make_buffer(4, seed=3, with_markers=False)
        p = CuptiProbe({str(tmp_path / 'c.sock')!r}); p.start()
        good = socket.socket(socket.AF_UNIX); good.connect(p.socket_path)
        good.sendall(R.hello_frame() + R.batch_frame([(10, R.KERNEL.itemsize, b.kernels.tobytes())], b.names))
        bad = socket.socket(socket.AF_UNIX); bad.connect(p.socket_path)
        bad.sendall(R.hello_frame(cbids=[(1, 0xFFFFFFFF, 1, b"x")]))
        got = R.poll_until(p, lambda g: any("trace" in x for x in g) and p.counters().get("server_protocol_errors", 0))
        c = p.counters(); p.stop()
        print(json.dumps({{"kernels": sum(len(x["trace"].kernels) for x in got if "trace" in x),
                          "protocol_errors": c.get("server_protocol_errors", 0), "decode_errors": p.decode_errors}}))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"kernels": 4, "protocol_errors": 1, "decode_errors": 0}


# ---------------------------------------------------------------------------------- as nobody

_CLIENT = textwrap.dedent("""
    # A peer of the CUPTI socket using only the standard library. argv: socket path,
    # "self" or a pid to claim, then frames (hex) whose body starts with the pid (u32).
    import os, socket, struct, sys, json
    path, claim, frames = sys.argv[1], sys.argv[2], [bytes.fromhex(x) for x in sys.argv[3:]]
    pid = os.getpid() if claim == "self" else int(claim)
    res = {"pid": os.getpid(), "uid": os.getuid()}
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        for f in frames:
            f = bytearray(f); struct.pack_into("<I", f, 16, pid); s.sendall(bytes(f))
        s.shutdown(socket.SHUT_WR)
        s.settimeout(30)     # the agent's thread answers the EOF; a loaded host can be slow
        res["closed_by_agent"] = s.recv(1) == b""
        res["connect"] = "ok"
    except OSError as e:
        res["connect"] = type(e).__name__
    d = os.path.dirname(path)
    for what, fn in (("list", lambda: os.listdir(d)), ("create", lambda: open(os.path.join(d, "x"), "w")),
                     ("unlink", lambda: os.unlink(path))):
        try:
            fn(); res[what] = "allowed"
        except OSError as e:
            res[what] = type(e).__name__
    print(json.dumps(res))
""")


def _as_nobody(args, timeout=90):
    def drop():
        os.setgid(NOBODY if os.path.exists("/etc/group") else NOBODY)
        os.setgroups([])
        os.setuid(NOBODY)
    r = subprocess.run(["/usr/bin/python3", "-c", _CLIENT, *args], capture_output=True, text=True,
                       timeout=timeout, preexec_fn=drop, cwd="/")
    assert r.returncode == 0, r.stderr[-1500:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def run_dir():
    if os.geteuid() != 0:
        pytest.skip("needs root: the peer must run as another user (nobody)")
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("no /usr/bin/python3 for the unprivileged client")
    base = Path(tempfile.mkdtemp(prefix="rl-sock-", dir="/tmp"))
    base.chmod(0o755)
    d = base / "ridgeline"
    d.mkdir(mode=0o750)          # what systemd's RuntimeDirectoryMode=0750 makes
    d.chmod(0o750)
    yield d
    subprocess.run(["rm", "-rf", str(base)], check=False)


def test_unprivileged_peer_connects_and_reports_only_for_itself(run_dir):
    probe = CuptiProbe(str(run_dir / "cupti.sock"))
    probe.start()
    try:
        assert run_dir.stat().st_mode & 0o777 == 0o751      # searchable, not listable by others
        b, sections = _kernels(4)
        frames = [R.hello_frame(pid=0).hex(), R.batch_frame(sections, b.names, pid=0).hex()]
        me = _as_nobody([probe.socket_path, "self", *frames])
        assert me["uid"] == NOBODY and me["connect"] == "ok"
        assert me["list"] == "PermissionError" and me["create"] == "PermissionError"
        assert me["unlink"] == "PermissionError"
        got = R.poll_until(probe, lambda g: any("trace" in x for x in g))
        tr = [x["trace"] for x in got if "trace" in x]
        assert len(tr) == 1 and set(tr[0].kernels["pid"].tolist()) == {me["pid"]}
        # the same client claiming to be another process (init, or the agent itself)
        for claim in ("1", str(os.getpid())):
            other = _as_nobody([probe.socket_path, claim, *frames])
            # the agent cuts it: seen as EOF, or as a reset while it was still sending
            assert other["connect"] in ("ConnectionResetError", "BrokenPipeError") or other["closed_by_agent"]
        time.sleep(0.2)
        got = R.poll_until(probe, lambda g: probe.counters()["server_rejected_peers"] >= 2, timeout_s=30)
        c = probe.counters()
        assert c["server_rejected_peers"] == 2
        assert not any("trace" in x for x in got)            # nothing reported for pid 1 or the agent
        assert set(probe.decoders) == {me["pid"]} or not probe.decoders
    finally:
        probe.stop()


def test_peer_in_its_own_pid_namespace_reports_under_the_pid_the_agent_sees(tmp_path):
    """A served process in a container (its own pid namespace, the agent in the host's, as
    with hostPID): the library reports getpid() of its namespace (1 here), the kernel gives
    the agent the host pid (SO_PEERCRED), and /proc/<host pid>/status lists both (NSpid,
    outermost first). The peer is accepted and its events carry the host pid; the same
    claim of pid 1 from a process of the agent's namespace is refused (the other test)."""
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root (unshare --pid) and /usr/bin/python3 for the client")
    probe = CuptiProbe(str(tmp_path / "ns.sock"))
    probe.start()
    try:
        b, sections = _kernels(4)
        frames = [R.hello_frame(pid=0).hex(), R.batch_frame(sections, b.names, pid=0).hex()]
        r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "/usr/bin/python3", "-c", _CLIENT,
                            probe.socket_path, "self", *frames], capture_output=True, text=True, timeout=30)
        if r.returncode != 0 and "unshare" in r.stderr:
            pytest.skip(f"no pid namespace here: {r.stderr.strip()[-200:]}")
        me = json.loads(r.stdout.strip().splitlines()[-1])
        assert me["pid"] == 1 and me["connect"] == "ok", me
        got = R.poll_until(probe, lambda g: any("trace" in x for x in g))
        tr = [x["trace"] for x in got if "trace" in x]
        pids = set(tr[0].kernels["pid"].tolist())
        assert len(pids) == 1 and pids != {1} and pids != {os.getpid()}
        assert probe.counters().get("server_rejected_peers", 0) == 0
    finally:
        probe.stop()


def test_socket_group_limits_who_may_connect(run_dir):
    """With ``socket_group`` the socket is 0660 root:<group>: nobody (not a member) is refused
    by the kernel, before the agent reads a byte."""
    s = CuptiServer(str(run_dir / "cupti.sock"), socket_group=0)
    s.open()
    try:
        st = os.stat(s.path)
        assert st.st_mode & 0o777 == 0o660 and st.st_gid == 0
        assert _as_nobody([s.path, "self"])["connect"] == "PermissionError"
    finally:
        s.close()


def test_one_user_flooding_the_socket_leaves_room_for_the_served_processes(run_dir):
    """A local user (nobody) opens as many connections as it can and holds them: it gets a
    quarter of the slots; the rest stay for other users' processes (here root's)."""
    s = CuptiServer(str(run_dir / "cupti.sock"), max_connections=8)
    s.open()
    flood = textwrap.dedent("""
        import socket, sys
        held = []
        for _ in range(8):
            c = socket.socket(socket.AF_UNIX); c.connect(sys.argv[1]); held.append(c)
        print(len(held), flush=True)
        sys.stdin.read()
    """)

    def drop():
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    p = subprocess.Popen(["/usr/bin/python3", "-c", flood, s.path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, preexec_fn=drop, cwd="/")
    try:
        assert p.stdout.readline().strip() == "8"
        for _ in range(20):
            s.pump(0.01)
        assert s.connections == 2 and s.stats["refused_connections_uid"] == 6
        mine = [socket.socket(socket.AF_UNIX) for _ in range(6)]
        for c in mine:
            c.connect(s.path)
            c.sendall(R.hello_frame())
        for _ in range(20):
            s.pump(0.01)
        assert s.connections == 8 and s.stats["refused_connections"] == 0
        assert sum(m.kind == "hello" for m in s.drain()) == 6
        for c in mine:
            c.close()
    finally:
        p.stdin.close()
        p.wait(timeout=10)
        s.close()


# ---------------------------------------------------------------------------- descriptor flood

def test_connection_limit_follows_the_descriptor_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        assert connection_limit() == 256 and connection_limit(100) == 100 and connection_limit(5000) == 256
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(65536, hard), hard))
        assert connection_limit() == min(1024, min(65536, hard) // 4)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


_AGENT = textwrap.dedent("""
    # The agent's CUPTI probe with the default descriptor limit of a service (1024), and an
    # HTTP endpoint in the same process standing in for /metrics.
    import http.server, json, resource, sys, threading
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    from ridgeline.probes.cupti.probe import CuptiProbe
    p = CuptiProbe(sys.argv[1]); p.start()
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(p.counters()).encode()
            self.send_response(200); self.end_headers(); self.wfile.write(body)
        def log_message(self, *a): pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    print(srv.server_address[1], flush=True)
    srv.serve_forever()
""")


def test_1200_connections_leave_the_agent_descriptors_for_metrics(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1400:
        pytest.skip(f"this test opens 1,200 sockets; the hard descriptor limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    sock = str(tmp_path / "c.sock")
    agent = subprocess.Popen([sys.executable, "-c", _AGENT, sock], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    clients = []
    try:
        port = int(agent.stdout.readline())
        def metrics():
            return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30).read())
        for _ in range(1200):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            deadline = time.monotonic() + 20
            while True:                  # a full listen backlog answers EAGAIN: wait for accept
                try:
                    c.connect(sock)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, "the agent stopped accepting"
                    time.sleep(0.005)
            clients.append(c)
        end = time.monotonic() + 30
        m = {}
        while time.monotonic() < end:
            m = metrics()
            if m["connections"] + m.get("server_refused_connections", 0) >= 1200:
                break
            time.sleep(0.2)
        assert m["connections"] == 256                       # a quarter of the 1024 descriptors
        assert m["server_refused_connections"] == 1200 - 256
        assert m.get("server_accept_errors", 0) == 0
        for _ in range(20):                                   # /metrics keeps answering
            assert metrics()["connections"] == 256
    finally:
        for c in clients:
            c.close()
        agent.kill()
        agent.wait()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_peer_text_cannot_write_lines_into_the_log(tmp_path, caplog):
    """Issue 14 item 6: a HELLO's process name and status reach the log and the probe's
    output escaped, on one line."""
    import logging

    from ridgeline.probes.cupti import protocol as P
    probe = CuptiProbe(str(tmp_path / "c.sock"))
    probe.start()
    evil = b"conflict: x\n2026-01-01 CRITICAL agent: forged line\x1b[2J"
    try:
        with caplog.at_level(logging.WARNING), socket.socket(socket.AF_UNIX) as c:
            c.connect(probe.socket_path)
            frame = bytearray(R.hello_frame(comm=b"vllm\nFAKE", status=evil))
            flags_at = 16 + P.HELLO_DTYPE.fields["flags"][1]
            frame[flags_at:flags_at + 4] = P.FLAG_CONFLICT.to_bytes(4, "little")
            c.sendall(bytes(frame))
            got = R.poll_until(probe, lambda g: any("status" in x for x in g))
    finally:
        probe.stop()
    status = next(x["status"] for x in got if "status" in x)[os.getpid()]
    comm = next(x["new_pids"] for x in got if "new_pids" in x)[0][1]
    assert "\n" not in status and "\x1b" not in status and "forged line" in status
    assert "\n" not in comm
    logged = [r.getMessage() for r in caplog.records if "cupti" in r.getMessage()]
    assert logged and all("\n" not in m and "\x1b" not in m for m in logged)


def _unit_memory_max_bytes() -> int:
    """MemoryMax of the shipped unit (systemd/ridgeline.service): the agent's whole budget."""
    import re
    text = (ROOT / "systemd" / "ridgeline.service").read_text()
    m = re.search(r"^MemoryMax=(\d+)([KMG]?)\s*$", text, re.M)
    assert m, "systemd/ridgeline.service has no MemoryMax"
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def test_peers_parking_large_frames_keep_the_agent_inside_the_units_memory(tmp_path):
    """Six local peers each send a HELLO and 95 MiB of a 96 MiB batch, then stall. The
    agent (default bounds, in its own process) must stay under the unit's MemoryMax
    (384 MiB: past it the kernel kills the agent); before the fix it held 5 x 95 MiB
    (peak RSS 585 MiB). A library arriving meanwhile still gets its kernels through."""
    from ridgeline.probes.cupti import protocol as P
    sock = str(tmp_path / "m.sock")
    agent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import json, sys, time
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from support import cupti_records as R
        from ridgeline.probes.cupti.probe import CuptiProbe
        p = CuptiProbe({sock!r}); p.start()
        print("ready", flush=True)
        # 8 s of peers parking frames at least; then on until the late library's kernels
        # came (a loaded host may take long to move 6 x 95 MiB), within a minute
        kernels, end, last = 0, time.monotonic() + 8, time.monotonic() + 60
        while time.monotonic() < last and (time.monotonic() < end or kernels < 4):
            r = p.poll()
            kernels += len(r["trace"].kernels) if "trace" in r else 0
            time.sleep(0.05)
        hwm = [int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
        c = p.counters(); p.stop()
        print(json.dumps({{"hwm_bytes": hwm, "kernels": kernels, "cut": c.get("server_partial_cap_cut", 0)}}))
    """)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert agent.stdout.readline().strip() == "ready"
        body = bytes(95 << 20)
        header = P.encode_frame(P.MSG_BATCH, b"")[:8] + (96 << 20).to_bytes(4, "little") + bytes(4)
        peers = []

        def park():
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock)
            peers.append(s)
            try:
                s.sendall(R.hello_frame() + header)
                s.sendall(body)
            except OSError:
                pass                               # cut by the agent
        import threading
        threads = [threading.Thread(target=park, daemon=True) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(2)
        b, sections = _kernels(4)
        good = socket.socket(socket.AF_UNIX)
        good.connect(sock)
        good.sendall(R.hello_frame() + R.batch_frame(sections, b.names))
        out = json.loads(agent.stdout.read().strip().splitlines()[-1])
        good.close()
        for s in peers:
            s.close()
    finally:
        agent.kill()
        agent.wait()
    print("agent peak RSS MiB", out["hwm_bytes"] >> 20)
    assert out["kernels"] == 4 and out["cut"] >= 1
    assert out["hwm_bytes"] < _unit_memory_max_bytes(), out


def test_unix_listeners_from_proc_net_unix_literal():
    from ridgeline.probes.cupti.probe import unix_listeners
    # Lines as Linux prints them (net/unix/af_unix.c unix_seq_show): flags 00010000 is
    # __SO_ACCEPTCON (listening); the path is the rest of the line.
    text = ("Num       RefCount Protocol Flags    Type St Inode Path\n"
            "0000000000000000: 00000002 00000000 00010000 0001 01 21611 /run/ridgeline/cupti.sock\n"
            "0000000000000000: 00000003 00000000 00000000 0001 03 363279 /run/ridgeline/cupti.sock\n"
            "0000000000000000: 00000002 00000000 00010000 0001 01 16893 /run/a path with spaces\n"
            "0000000000000000: 00000002 00000000 00000000 0002 01 16894 /run/dgram.sock\n"
            "0000000000000000: 00000003 00000000 00000000 0001 03 77529\n")
    assert unix_listeners(text) == {"/run/ridgeline/cupti.sock", "/run/a path with spaces"}


def test_check_tells_a_live_agent_socket_and_a_host_without_driver(tmp_path):
    """Issue 24.3: not `will listen on` while an agent already listens there (opening would
    take its socket), and a host with no NVIDIA driver is said to have none."""
    from ridgeline.probes.cupti.probe import CuptiProbe
    path = str(tmp_path / "cupti.sock")
    probe = CuptiProbe(socket_path=path)
    probe.driver_version_file = str(tmp_path / "no-driver-version")
    av = probe.check()
    assert av.ok and "no NVIDIA driver" in av.reason and str(tmp_path / "no-driver-version") in av.reason
    (tmp_path / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15\n")
    probe.driver_version_file = str(tmp_path / "version")
    assert probe.check().reason in (f"will listen on {path}",
                                    f"listening is possible, but the injection library "
                                    f"{__import__('ridgeline.probes.cupti.library', fromlist=['x']).library_path()} "
                                    "is not built")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)     # an agent already there
    try:
        live.bind(path)
        live.listen(1)
        av = probe.check()
        assert not av.ok and probe.socket_in_use and av.reason == f"an agent already listens on {path}"
    finally:
        live.close()
    assert os.path.exists(path)          # a stale socket file, nobody listening: usable again
    assert probe.check().ok and not probe.socket_in_use


def test_ridgeline_check_beside_a_running_agent_says_it_listens(tmp_path):
    from ridgeline.agent import config
    path = str(tmp_path / "cupti.sock")
    cfg = config.overlay(config.defaults(), {"probes": {"enabled": ["cupti"], "cupti": {"socket": path}}})
    (tmp_path / "a.toml").write_text(config.to_toml(cfg))
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        live.bind(path)
        live.listen(1)
        r = subprocess.run([sys.executable, "-m", "ridgeline", "check", "--probe", "cupti", "--agent-timeout", "0",
                            "--config", str(tmp_path / "a.toml")], capture_output=True, text=True, timeout=60)
    finally:
        live.close()
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"a running agent listens on {path}" in r.stdout and "will listen" not in r.stdout
