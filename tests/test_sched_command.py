"""`ridgeline sched`: errors are one line with exit 2; a real run reports the documented keys."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ridgeline.agent import cli
from ridgeline.probes.probe import Availability


def test_missing_process_is_one_line_exit_2(capsys):
    assert cli.main(["sched", "--pid", "999999999", "--duration", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ridgeline: error: no process with pid 999999999"]


def test_bad_duration(capsys):
    assert cli.main(["sched", "--pid", "1", "--duration", "0"]) == 2
    assert "duration" in capsys.readouterr().err


def test_no_ebpf_is_one_line_exit_1(capsys, monkeypatch):
    # A probe that cannot run here is a runtime failure (exit 1), as in `ridgeline check`.
    import ridgeline.probes.sched as sched
    monkeypatch.setattr(sched.SchedProbe, "check",
                        lambda self: Availability(False, "eBPF probes need root (euid 1000)", "run as root"))
    assert cli.main(["sched", "--pid", "1", "--duration", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "need root" in err[0] and err[0].startswith("ridgeline: error: ")


@pytest.mark.ebpf
def test_json_report_of_a_live_process():
    code = ("import threading, time, sys\n"
            "def spin():\n"
            "    t = time.time() + 60\n"
            "    while time.time() < t: pass\n"
            "threading.Thread(target=spin, daemon=True).start()\n"
            "print('UP', threading.get_native_id(), flush=True)\n"
            "sys.stdin.readline()\n")
    c = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        c.stdout.readline()
        out = subprocess.run([sys.executable, "-m", "ridgeline", "sched", "--pid", str(c.pid), "--duration", "1.5",
                              "--json"], capture_output=True, text=True, timeout=120)
    finally:
        c.stdin.write("x\n"); c.stdin.flush(); c.wait(timeout=10)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["pid"] == c.pid
    keys = {"tid", "comm", "on_cpu_ns", "runq_wait_ns", "blocked_ns", "voluntary_switches", "involuntary_switches"}
    assert rep["threads"] and keys <= set(rep["threads"][0])
    spinner = max(rep["threads"], key=lambda t: t["on_cpu_ns"])
    # the spinner ran for the whole 1.5 s window, on CPU or waiting for it
    assert spinner["on_cpu_ns"] + spinner["runq_wait_ns"] + spinner["unattributed_ns"] >= 1.2e9
    assert isinstance(rep["runq_hist"], list)
