"""Issue 18.2: the demangler worker parses hostile names with no privilege.

Read from the kernel's own view of the worker (/proc/PID/status): as root the worker
becomes nobody with every capability set empty (bounding and ambient included),
no_new_privs set and one seccomp filter; a system call outside its allow list kills it
(SIGSYS), and the parent counts workers that died so.
"""
from __future__ import annotations

import os
import pwd
import signal
import subprocess
import sys

import pytest

from ridgeline.probes.cupti import demangle as dm

pytestmark = pytest.mark.skipif(not dm.available(), reason="no libstdc++ __cxa_demangle here")


def _status(pid: int) -> dict[str, str]:
    return dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)


def test_worker_runs_as_nobody_without_capabilities_under_seccomp():
    w = dm._Worker()
    try:
        assert w.run([b"_ZN5flash3fwdIiEEvT_"], 5.0) == [(dm._OK, b"void flash::fwd<int>(int)")]
        st = _status(w.proc.pid)
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            assert st["Uid"].split() == [str(nobody.pw_uid)] * 4 and st["Gid"].split() == [str(nobody.pw_gid)] * 4
            assert st["Groups"].strip() == ""
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(st[cap], 16) == 0, (cap, st[cap])
        assert st["NoNewPrivs"].strip() == "1" and st["Seccomp"].strip() == "2"
    finally:
        w.kill()


def test_a_forbidden_system_call_kills_the_locked_down_process():
    code = dm._LOCKDOWN_CODE + "\nlockdown()\nimport sys\nsys.stdout.write('locked\\n'); sys.stdout.flush()\n" \
        "os.open('/etc/hostname', os.O_RDONLY)\nsys.stdout.write('opened\\n')\n"
    p = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=30)
    assert p.stdout == "locked\n" and p.returncode == -signal.SIGSYS, (p.returncode, p.stdout, p.stderr)


def test_the_worker_exits_cleanly_under_its_filter_and_a_sigsys_death_is_counted():
    w = dm._Worker()
    w.run([b"_Z3foov"], 5.0)
    p = w.proc
    p.stdin.close()                       # end of input: the worker exits through its filter
    assert p.wait(10) == 0
    w.proc = None
    w.run([b"_Z3foov"], 5.0)
    # the death the filter causes, delivered by hand: the exit status the parent sees
    os.kill(w.proc.pid, signal.SIGSYS)
    w.proc.wait(10)
    assert w.run([b"_Z3foov"], 5.0) == [(dm._OK, b"foo()")]    # the dead worker replaced, and counted
    assert w.seccomp_kills == 1 and w.starts == 3
    w.kill()
    assert w.seccomp_kills == 1


def test_kill_counts_a_worker_the_filter_killed():
    w = dm._Worker()
    w.run([b"_Z3foov"], 5.0)
    os.kill(w.proc.pid, signal.SIGSYS)
    w.proc.wait(10)
    w.kill()
    assert w.seccomp_kills == 1


def test_the_probe_publishes_the_workers_seccomp_kills(monkeypatch):
    """The count reaches the probe's counters (and so /metrics:
    ridgeline_agent_cupti_demangler_seccomp_kills): the process-wide worker's, not a copy."""
    from ridgeline.probes.cupti.probe import CuptiProbe
    w = dm._Worker()
    monkeypatch.setattr(dm, "_worker", w)
    p = CuptiProbe("/nonexistent/c.sock")
    assert p.counters()["demangler_seccomp_kills"] == 0
    w.run([b"_Z3foov"], 5.0)
    os.kill(w.proc.pid, signal.SIGSYS)
    w.proc.wait(10)
    w.kill()
    assert p.counters()["demangler_seccomp_kills"] == 1
