"""Target discovery: explicit pids, announcements, processes with a GPU device file open.

Fake /proc functions test the rules; a real child process holding a file open (standing
in for /dev/nvidia0, which this machine does not have) tests the /proc scan itself."""
from __future__ import annotations

import os
import subprocess
import sys

from ridgeline.probes import targets as tg


class FakeProc:
    def __init__(self):
        self.pids = {1: False, 100: False, 200: True}   # pid -> has a GPU file open
        self.t = 0.0
        self.device_checks = 0

    def list_pids(self):
        return list(self.pids)

    def alive(self, pid):
        return pid in self.pids

    def has_device(self, pid, prefixes):
        self.device_checks += 1
        return self.pids.get(pid, False)

    def clock(self):
        return self.t


def _set(fp, **kw):
    return tg.TargetSet(list_pids=fp.list_pids, alive=fp.alive, has_device=fp.has_device, clock=fp.clock, **kw)


def test_gpu_processes_found_and_exits_dropped():
    fp = FakeProc()
    ts = _set(fp)
    added, removed = ts.poll()
    assert added == [200] and removed == []
    assert ts.sources == {200: tg.SOURCE_GPU}
    # a process that opens the GPU later is found at its recheck, not before
    fp.pids[100] = True
    fp.t = 5.0
    assert ts.poll() == ([], [])
    fp.t = 10.5
    assert ts.poll() == ([100], [])
    # a new process is checked at the next rescan
    fp.pids[300] = True
    fp.t = 12.6
    assert ts.poll() == ([300], [])
    del fp.pids[200]
    assert ts.poll() == ([], [200])
    assert ts.targets == {100, 300}


def test_rescans_are_rate_limited():
    fp = FakeProc()
    ts = _set(fp, rescan_s=2.0)
    ts.poll()
    n = fp.device_checks
    fp.t = 1.0
    ts.poll()
    assert fp.device_checks == n          # no rescan before rescan_s
    fp.t = 2.5
    ts.poll()
    assert fp.device_checks == n          # known non-GPU pids wait for recheck_s


def test_explicit_and_announced():
    fp = FakeProc()
    ts = _set(fp, pids=[100], discover_gpu=False)
    assert ts.poll() == ([100], [])
    tg.announce(1)
    tg.announce(999)                       # not alive: ignored
    assert ts.poll() == ([1], [])
    assert ts.sources[1] == tg.SOURCE_ANNOUNCED and ts.sources[100] == tg.SOURCE_EXPLICIT
    del fp.pids[100]
    assert ts.poll() == ([], [100])
    assert ts.poll() == ([], [])           # an exited explicit pid does not come back


def test_real_process_with_a_device_file_open(tmp_path):
    dev = tmp_path / "nvidia0"
    dev.write_text("")
    code = "import sys; f = open(sys.argv[1]); print('OPEN', flush=True); sys.stdin.readline()"
    p = subprocess.Popen([sys.executable, "-c", code, str(dev)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "OPEN"
        ts = tg.TargetSet(device_prefixes=(str(tmp_path / "nvidia"),), rescan_s=0.0)
        added, _ = ts.poll()
        assert p.pid in added and os.getpid() not in ts.targets
    finally:
        p.stdin.write("x\n"); p.stdin.flush(); p.wait(timeout=10)
    ts.rescan_s = 0.0
    assert ts.poll() == ([], [p.pid])


def test_discovered_process_is_probed_without_restart(tmp_path):
    """TargetSet feeding a live SchedProbe: a GPU process (a stand-in device file) that starts
    after the probe is tracked, and dropped when it exits."""
    import pytest

    from ridgeline.probes import bpf as bpfmod
    if not bpfmod.availability().ok:
        pytest.skip(f"ebpf: {bpfmod.availability().reason}")
    from ridgeline.probes.sched import SchedProbe
    dev = tmp_path / "nvidia0"
    dev.write_text("")
    ts = tg.TargetSet(device_prefixes=(str(tmp_path / "nvidia"),), rescan_s=0.0)
    probe = SchedProbe(discover=False)
    probe.start()
    try:
        ts.poll()
        code = ("import sys, time\nf = open(sys.argv[1])\nprint('OPEN', flush=True)\n"
                "for i in range(40): time.sleep(0.005)\nsys.stdin.readline()\n")
        p = subprocess.Popen([sys.executable, "-c", code, str(dev)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        p.stdout.readline()
        added, removed = ts.poll()
        for pid in added:
            probe.add_target(pid)
        assert p.pid in probe.targets
        p.stdin.write("x\n"); p.stdin.flush()
        p.wait(timeout=10)
        win = probe.poll()
        added, removed = ts.poll()
        for pid in removed:
            probe.remove_target(pid)
        assert removed == [p.pid] and p.pid not in probe.targets
        rows = win["threads"][win["threads"]["tgid"] == p.pid]
        assert len(rows) >= 1 and int(rows["voluntary_switches"].sum()) >= 20
    finally:
        probe.stop()


def test_probe_with_discovery_takes_announced_processes():
    import pytest

    from ridgeline.probes import bpf as bpfmod
    if not bpfmod.availability().ok:
        pytest.skip(f"ebpf: {bpfmod.availability().reason}")
    from ridgeline.probes.sched import SchedProbe
    probe = SchedProbe()             # discover=True: the agent's configuration
    probe.start()
    try:
        p = subprocess.Popen([sys.executable, "-c", "import sys, time\nfor i in range(30): time.sleep(0.005)\n"
                              "sys.stdin.readline()"], stdin=subprocess.PIPE, text=True)
        tg.announce(p.pid)           # what the CUPTI probe does when an injected process connects
        probe.poll()
        assert p.pid in probe.targets
        p.stdin.write("x\n"); p.stdin.flush(); p.wait(timeout=10)
        win = probe.poll()
        assert p.pid not in probe.targets
        assert (win["threads"]["tgid"] == p.pid).any()
    finally:
        probe.stop()


def test_forget_and_recheck():
    fp = FakeProc()
    ts = _set(fp)
    ts.poll()
    ts.forget(200)
    assert 200 not in ts.targets
    fp.t = 3.0
    assert ts.poll() == ([], [])          # not before its recheck
    fp.t = 10.5
    assert ts.poll() == ([200], [])       # still a GPU process: found again
    ts.add(100)
    assert ts.poll() == ([100], [])
    del fp.pids[100]
    assert ts.poll() == ([], [100])
