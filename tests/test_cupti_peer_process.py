"""Issue 18.3: a CUPTI socket connection is bound to its process (pid + start time).

A connection can outlive the process that connected (a forked child keeps the socket);
when the pid is then given to another process, the connection must not report under it.
Checked three ways: the start-time parser against procps' reading of the same field, the
server against a fake /proc reader at its boundary (``proc_start``), and real processes:
fork, exit, and a real pid reuse (``/proc/sys/kernel/ns_last_pid``, root only, as CRIU
restores pids).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from support import cupti_records as R
from support.cupti_server import cupti_server, pump_until

from ridgeline.probes.cupti import peer_process as PP
from ridgeline.probes.cupti.server import CuptiServer

# ------------------------------------------------------------------------------ the parser

def test_start_time_parser_reads_field_22_after_the_comm_whatever_it_holds():
    # proc(5): pid (comm) state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt
    # cmajflt utime stime cutime cstime priority nice num_threads itrealvalue starttime ...
    line = b"4242 (a) b (c 1 2) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 1 0 987654 12345 67\n"
    assert PP.parse_start_ticks(line) == 987654
    with pytest.raises(ValueError):
        PP.parse_start_ticks(b"4242 (short) S 1 2 3\n")
    with pytest.raises(ValueError):
        PP.parse_start_ticks(b"no comm here")


@pytest.mark.skipif(shutil.which("ps") is None, reason="procps' ps is not installed")
def test_start_time_agrees_with_procps_for_a_process_named_to_fool_a_naive_parser():
    """procps (``ps -o etimes``) reads the same field with its own parser: elapsed time =
    uptime - starttime. A child names itself ``x) R 1 2 3 (y`` (comm is the process's own
    choice, 15 bytes) so that splitting on spaces would read the wrong field."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        open('/proc/self/comm', 'w').write('x) R 1 2 3 (y')
        print('named', flush=True)
        time.sleep(30)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "named"
        time.sleep(1.2)
        start = PP.read_start_ticks(child.pid)
        etimes = int(subprocess.run(["ps", "-o", "etimes=", "-p", str(child.pid)], capture_output=True,
                                    text=True, check=True).stdout)
        ours = (PP.boot_ticks() - start) / PP.CLK_TCK
        assert etimes >= 1 and abs(ours - etimes) <= 1.0, (ours, etimes)
        assert open(f"/proc/{child.pid}/comm").read().strip() == "x) R 1 2 3 (y"
    finally:
        child.kill()
        child.wait()
    assert PP.read_start_ticks(child.pid) is None or PP.read_start_ticks(child.pid) != start


def test_judge_literals():
    assert PP.judge(None, 500, 1000) == PP.ALIVE            # started before the accept
    assert PP.judge(None, 1001, 1000) == PP.ALIVE           # the tick of slack
    assert PP.judge(None, 1002, 1000) == PP.REUSED          # started after the accept: not the peer
    assert PP.judge(500, 500, 1000) == PP.ALIVE
    assert PP.judge(500, 900, 1000) == PP.REUSED
    assert PP.judge(500, None, 1000) == PP.GONE
    assert PP.judge(None, None, 1000) == PP.GONE


# ------------------------------------------------------------------------------ fake /proc

class FakeProc:
    """The server's boundary to /proc: pid -> start ticks (None: no such process)."""

    def __init__(self, start: int = 100):
        self.start = {os.getpid(): start}
        self.reads = 0

    def __call__(self, pid):
        self.reads += 1
        return self.start.get(pid)


def _server(tmp_path, proc, **kw):
    s = CuptiServer(str(tmp_path / "id.sock"), proc_start=proc, boot_ticks=lambda: 1000, **kw)
    s.open()
    return s


def _pump_until(s, what, seconds=5.0):
    return pump_until(s, what, seconds)


def _batch():
    b = R.make_buffer(4, seed=3, with_markers=False)
    return R.batch_frame([(10, R.KERNEL.itemsize, b.kernels.tobytes())], b.names)


def test_batches_after_the_pid_changed_hands_are_dropped_and_the_connection_cut(tmp_path):
    proc = FakeProc()
    s = _server(tmp_path, proc)
    got = []
    try:
        c = socket.socket(socket.AF_UNIX)
        c.connect(s.path)
        c.sendall(R.hello_frame() + _batch())
        assert _pump_until(s, lambda: got.extend(s.drain()) or sum(m.kind == "batch" for m in got) == 1)
        assert [m.kind for m in got] == ["hello", "batch"]
        proc.start[os.getpid()] = 777                      # another process under this pid now
        time.sleep(s.identity_check_s)
        c.sendall(_batch() * 3)
        assert _pump_until(s, lambda: s.stats["pid_reused_cut"] == 1)
        after = s.drain()
        assert [m.kind for m in after] == ["closed"] and after[0].body == "pid reused"
        # the first one's check cut it (the check was due): the others were never read
        assert s.stats["identity_dropped_batches"] == 1 and s.connections == 0
    finally:
        s.close()


def test_a_gone_process_is_cut_and_what_it_sent_before_is_kept(tmp_path):
    """Its final flush arrives as it exits: handed on (no one else holds the pid yet)."""
    proc = FakeProc()
    s = _server(tmp_path, proc, identity_sweep_s=0.2)
    try:
        c = socket.socket(socket.AF_UNIX)
        c.connect(s.path)
        c.sendall(R.hello_frame())
        assert _pump_until(s, lambda: s.connections == 1 and s._conns[next(iter(s._conns))].hello is not None)
        c.sendall(_batch())
        del proc.start[os.getpid()]                      # exited before the batch was checked
        assert _pump_until(s, lambda: s.stats["process_gone_cut"] == 1)
        kinds = [m.kind for m in s.drain()]
        assert kinds == ["hello", "batch", "closed"] and s.stats["identity_dropped_batches"] == 0
        # a silent connection of a gone process is found by the sweep
        c2 = socket.socket(socket.AF_UNIX)
        proc.start[os.getpid()] = 100
        c2.connect(s.path)
        c2.sendall(R.hello_frame())
        assert _pump_until(s, lambda: s.connections == 1 and s._conns[next(iter(s._conns))].hello is not None)
        del proc.start[os.getpid()]
        assert _pump_until(s, lambda: s.stats["process_gone_cut"] == 2)
    finally:
        s.close()


def test_a_process_started_after_the_accept_is_not_the_peer(tmp_path):
    """The pid changed hands between connect() and the HELLO: refused at once."""
    proc = FakeProc(start=5000)                           # boot clock at the accept: 1000
    s = _server(tmp_path, proc)
    try:
        c = socket.socket(socket.AF_UNIX)
        c.connect(s.path)
        c.sendall(R.hello_frame() + _batch())
        assert _pump_until(s, lambda: s.stats["pid_reused_cut"] == 1)
        assert [m.kind for m in s.drain()] == ["closed"]
    finally:
        s.close()


def test_checks_are_rate_limited_per_connection(tmp_path):
    """A peer sending 200 batches back to back costs a handful of /proc reads, not 200."""
    proc = FakeProc()
    s = _server(tmp_path, proc)
    try:
        c = socket.socket(socket.AF_UNIX)
        c.connect(s.path)
        import threading  # more than a socket buffer holds: sent while the server reads
        threading.Thread(target=c.sendall, args=(R.hello_frame() + _batch() * 200,), daemon=True).start()
        got = []
        assert _pump_until(s, lambda: got.extend(s.drain()) or sum(m.kind == "batch" for m in got) == 200)
        assert proc.reads <= 6, proc.reads
    finally:
        s.close()


# ------------------------------------------------------------------------------ real processes

# A served process that hands its connection to a child and exits: argv socket path, go
# FIFO, HELLO hex, batch hex (the pid, at byte 16, is set to the parent's).
_FORKER = textwrap.dedent("""
    import os, signal, socket, struct, sys
    path, go, hello, batch = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]), bytearray.fromhex(sys.argv[4])
    s = socket.socket(socket.AF_UNIX); s.connect(path)
    me = os.getpid()
    h = bytearray(hello); struct.pack_into("<I", h, 16, me); s.sendall(bytes(h))
    struct.pack_into("<I", batch, 16, me)
    sys.stdin.readline()                 # the agent has seen the HELLO
    if os.fork() == 0:                   # the child keeps the socket, the parent exits
        os.setsid()
        signal.alarm(60)                 # never outlives its test (a FIFO nobody opens blocks)
        open(go).read()                  # told to send
        try:
            s.sendall(bytes(batch) * 3)
            s.recv(1)
        except OSError:
            pass
        os._exit(0)
    print(me, flush=True)
    os._exit(0)
""")


def _forked_peer(s, tmp_path):
    go = tmp_path / f"go{time.monotonic_ns()}"
    os.mkfifo(go)
    b = R.make_buffer(4, seed=3, with_markers=False)
    p = subprocess.Popen([sys.executable, "-c", _FORKER, s.path, str(go), R.hello_frame().hex(),
                          R.batch_frame([(10, R.KERNEL.itemsize, b.kernels.tobytes())], b.names).hex()],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    got = []
    assert _pump_until(s, lambda: got.extend(s.drain()) or any(m.kind == "hello" for m in got), 20)
    p.stdin.write("\n")
    p.stdin.flush()
    pid = int(p.stdout.readline())
    p.wait(timeout=20)                   # exited and reaped: its pid is free
    return pid, go


def _spawn_with_pid(pid: int, tries: int = 20):
    """A process given exactly ``pid`` (the next pid after ns_last_pid), or None."""
    for _ in range(tries):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        v = subprocess.Popen(["sleep", "30"])
        if v.pid == pid:
            return v
        v.kill()
        v.wait()
    return None


def test_real_pid_reuse_reports_nothing_under_the_victims_pid(tmp_path):
    if os.geteuid() != 0 or not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("needs root and a writable /proc/sys/kernel/ns_last_pid to give a freed pid to a victim")
    # no sweep in between: the pid is reused while the connection is silent
    s = CuptiServer(str(tmp_path / "r.sock"), identity_sweep_s=3600)
    s.open()
    victim = None
    try:
        pid, go = _forked_peer(s, tmp_path)
        victim = _spawn_with_pid(pid)
        if victim is None:
            pytest.skip(f"pid {pid} was taken by another process on this host before the victim got it")
        open(go, "w").close()            # the child sends 3 batches under the parent's pid
        assert _pump_until(s, lambda: s.stats["pid_reused_cut"] == 1, 20)
        assert not [m for m in s.drain() if m.kind == "batch"]
        assert s.stats["identity_dropped_batches"] >= 1 and s.connections == 0
    finally:
        if victim is not None:
            victim.kill()
            victim.wait()
        s.close()


def test_real_fork_and_exit_the_connection_is_cut(tmp_path):
    """No reuse: the parent exited, its child sends under the parent's pid; what came is
    handed on (under a pid nobody holds) and the connection is cut, so the child cannot
    go on reporting once the pid is given to someone else."""
    with cupti_server(tmp_path / "f.sock", identity_sweep_s=3600) as s:
        pid, go = _forked_peer(s, tmp_path)
        open(go, "w").close()
        assert _pump_until(s, lambda: s.stats["process_gone_cut"] == 1, 20)
        assert s.connections == 0 and s.stats["pid_reused_cut"] == 0
        assert {m.pid for m in s.drain()} <= {pid}


def test_real_exit_is_found_by_the_sweep(tmp_path):
    with cupti_server(tmp_path / "w.sock", identity_sweep_s=0.3) as s:
        _, go = _forked_peer(s, tmp_path)        # the child stays silent, holding the socket
        assert _pump_until(s, lambda: s.stats["process_gone_cut"] == 1, 20)
        assert s.connections == 0
        try:                                     # let the child go (it finds the socket cut)
            os.close(os.open(go, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:                          # ENXIO: no reader, the child is gone already
            pass
