"""The real InitializeInjection path against a stand-in libcupti (probes/native/tests/stub_cupti.c).

No GPU or driver is needed: the stub logs every CUPTI call the library makes and plays
CUPTI delivering completed buffers through the callbacks the library registered. This
checks what CUPTI is asked for (kinds, cbid filtering, graph-level, modes), how another
subscriber or an enable conflict is detected and reported, and that buffers delivered
through CUPTI's callbacks reach the agent with CUPTI's dropped count.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support import cupti_records as R

from ridgeline.probes.cupti.probe import CuptiProbe
from ridgeline.probes.cupti.protocol import FLAG_CONFLICT, FLAG_GRAPH_LEVEL, FLAG_MULTI_SUBSCRIBER

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "probes" / "native"
LIB = NATIVE / "libridgeline_cupti.so"
STUB = NATIVE / "build" / "libcupti_stub.so"

# A stand-in served process: the driver's part (InitializeInjection), then CUPTI's part
# (stub_deliver), then it reports the stub's call log.
APP = textwrap.dedent(f"""
    import ctypes, json, os, sys, time
    sys.path.insert(0, {str(Path(__file__).parent)!r})
    from support import cupti_records as R
    lib = ctypes.CDLL({str(LIB)!r})
    rc = lib.InitializeInjection()
    stub = ctypes.CDLL({str(STUB)!r})      # the very object the library dlopen'ed
    stub.stub_deliver.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    stub.stub_log.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    keep = []
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "deliver":
            b = R.make_buffer(int(cmd[1]), seed=9)
            keep.append(b)
            out = {{"rc": stub.stub_deliver(b.data, len(b.data))}}
        elif cmd[0] == "nvtx":
            f = lib.InitializeInjectionNvtx2
            f.argtypes = [ctypes.c_void_p]
            out = {{"rc": f(ctypes.c_void_p(0x1000))}}
        elif cmd[0] == "log":
            buf = ctypes.create_string_buffer(1 << 16)
            stub.stub_log(buf, 1 << 16)
            out = {{"log": buf.value.decode().splitlines(), "init": rc}}
        elif cmd[0] == "quit":
            break
        print(json.dumps(out), flush=True)
""")


@pytest.fixture(scope="module", autouse=True)
def built():
    r = subprocess.run(["make", "-s", "-C", str(NATIVE)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert STUB.exists()


class App:
    def __init__(self, sock: Path, **env):
        e = dict(os.environ, RIDGELINE_LIBCUPTI=str(STUB), RIDGELINE_SOCKET=str(sock), RIDGELINE_RECONNECT_MS="50",
                 **{k: str(v) for k, v in env.items()})
        for k in list(e):
            if k.startswith("STUB_CUPTI_") and k not in env:
                del e[k]
        self.p = subprocess.Popen([sys.executable, "-c", APP], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=e)

    def __call__(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self) -> str:
        self.p.stdin.write("quit\n")
        self.p.stdin.flush()
        self.p.wait(timeout=10)
        return self.p.stderr.read()


def collect(probe, pred, timeout=30.0):
    got = {"batches": [], "new_pids": [], "status": {}}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = probe.poll()
        got["batches"] += R.split_by_pid(out)
        got["new_pids"] += out.get("new_pids", [])
        got["status"].update(out.get("status", {}))
        if pred(got):
            break
        time.sleep(0.02)
    return got


def log_until(app, pred, timeout_s: float = 30.0) -> list[str]:
    """The stand-in's call log once ``pred(log)`` holds (or at the deadline)."""
    end = time.monotonic() + timeout_s
    while True:
        log = app("log")["log"]
        if pred(log) or time.monotonic() > end:
            return log
        time.sleep(0.02)


@pytest.fixture
def probe(tmp_path):
    p = CuptiProbe(str(tmp_path / "cupti.sock"))
    p.start()
    yield p
    p.stop()


def test_what_cupti_is_asked_for_and_buffers_through_callbacks(probe, tmp_path):
    app = App(tmp_path / "cupti.sock", STUB_CUPTI_DROPPED=5)
    try:
        log = app("log")["log"]
        assert app("deliver 200")["rc"] == 0
        got = collect(probe, lambda g: g["batches"])
        # deep dive and back, without a restart; the control message crosses the socket to
        # the library's sender thread: wait for its effect, not for a fixed time
        assert probe.set_mode("deep") == 1
        deep_log = log_until(app, lambda x: "latency 1" in x[len(log):])
        probe.set_mode("always-on")
        back_log = log_until(app, lambda x: "latency 0" in x[len(deep_log):])
    finally:
        stderr = app.close()
    # legacy single-subscriber CUPTI: probe for another subscriber, then let go at once
    assert log[:5] == ["version", "subscribe_v2 allow=1 name=ridgeline", "subscribe_v2 allow=0 name=ridgeline",
                       "unsubscribe", "register"]
    enabled = {int(x.split()[1]) for x in log if x.startswith("enable ")}
    assert enabled == {10, 1, 2, 12, 39}                 # CONCURRENT_KERNEL, MEMCPY, MEMSET, MARKER, EXT_CORR
    assert 3 not in enabled and 5 not in enabled and 4 not in enabled   # never KERNEL, never all API calls
    rt = {int(x.split()[1]) for x in log if x.startswith("rt ")}
    # launch, graph launch, sync, and the copy/memset calls (copies get their thread); never all
    assert {211, 311, 131, 165, 41, 51} <= rt and len(rt) <= 24
    drv = {int(x.split()[1]) for x in log if x.startswith("drv ")}
    assert {307, 514, 126, 800} <= drv and len(drv) <= 30  # cuLaunchKernel, cuGraphLaunch, cuStreamSynchronize, _v2
    assert "flushperiod 500" in log and "finalize" not in log and 51 not in enabled
    # deep dive: NVTX payloads, queued/submitted timestamps; back: off again, launch records stay
    # (the sender's periodic flushes interleave: tests/test_native_cupti_flush.py)
    new = [x for x in deep_log[len(log):] if not x.startswith("flushall")]
    assert new == ["enable 13", "latency 1"]
    back = [x for x in back_log[len(deep_log):] if not x.startswith("flushall")]
    assert back == ["disable 13", "latency 0"]
    # the buffer CUPTI handed over reached the agent, with CUPTI's dropped count
    b = got["batches"][0]
    assert len(b["trace"].kernels) == 200 and (b["trace"].kernels["tid"] >= 0).all()
    assert b["trace"].meta["library_counters"]["dropped_cupti"] == 5
    assert "using" in stderr and "libcupti_stub.so" in stderr


def test_another_subscriber_is_reported_and_left_alone(probe, tmp_path):
    app = App(tmp_path / "cupti.sock", STUB_CUPTI_OTHER_SUBSCRIBER="Nsight Systems")
    try:
        got = collect(probe, lambda g: g["status"])
        log = app("log")["log"]
        rc = app("deliver 10")["rc"]
    finally:
        stderr = app.close()
    assert "conflict: another CUPTI subscriber is active (Nsight Systems)" in stderr
    (pid, status), = got["status"].items()
    assert "Nsight Systems" in status
    assert probe.decoders[pid].flags & FLAG_CONFLICT
    assert not any(x.startswith(("register", "enable", "rt ", "unsubscribe", "finalize")) for x in log)
    assert rc == -2      # no callbacks registered: nothing of ours in the other tool's way


def test_activity_enable_conflict_is_reported(probe, tmp_path):
    app = App(tmp_path / "cupti.sock", STUB_CUPTI_CONFLICT_KINDS="10")
    try:
        got = collect(probe, lambda g: g["status"])
    finally:
        stderr = app.close()
    assert "conflict: enabling activity kind 10 failed" in stderr
    (pid, status), = got["status"].items()
    assert "activity kind 10" in status


def test_multi_subscriber_mode_uses_the_v2_api(probe, tmp_path):
    app = App(tmp_path / "cupti.sock", STUB_CUPTI_MULTI=1, STUB_CUPTI_OTHER_SUBSCRIBER="torch")
    try:
        assert app("deliver 50")["rc"] == 0
        got = collect(probe, lambda g: g["batches"])
        log = app("log")["log"]
    finally:
        app.close()
    assert "register2" in log and "enable2 10" in log and "unsubscribe" not in log
    assert any(x.startswith("rt2 211 1") for x in log)
    b = got["batches"][0]
    assert b["trace"].meta["flags"] & FLAG_MULTI_SUBSCRIBER and len(b["trace"].kernels) == 50


def test_graph_level_only_by_configuration(probe, tmp_path):
    app = App(tmp_path / "cupti.sock", RIDGELINE_GRAPH_LEVEL=1)
    try:
        app("deliver 5")
        got = collect(probe, lambda g: g["batches"])
        log = app("log")["log"]
    finally:
        app.close()
    assert "enable 51" in log
    assert got["batches"][0]["trace"].meta["flags"] & FLAG_GRAPH_LEVEL


def test_nvtx_injection_is_forwarded_to_the_same_libcupti(probe, tmp_path):
    app = App(tmp_path / "cupti.sock")
    try:
        assert app("nvtx")["rc"] == 1
        log = app("log")["log"]
    finally:
        app.close()
    assert "nvtx_init table" in log


def test_multi_subscriber_granted_but_not_active_falls_back_to_legacy(probe, tmp_path):
    # CUPTI accepted allowMultipleSubscribers but reports single-subscriber state: do not
    # hold the only subscriber (torch.profiler could not subscribe later)
    app = App(tmp_path / "cupti.sock", STUB_CUPTI_MULTI=1, STUB_CUPTI_MULTI_STATE=0)
    try:
        log = app("log")["log"]
    finally:
        app.close()
    assert log[:5] == ["version", "subscribe_v2 allow=1 name=ridgeline", "getattr2 12", "unsubscribe", "register"]
    assert "enable 10" in log and "register2" not in log


def test_multi_subscriber_mode_reads_cuptis_dropped_count(probe, tmp_path):
    # in multi-subscriber mode the per-subscriber count (cuptiActivityGetNumDroppedRecords_v2)
    app = App(tmp_path / "cupti.sock", STUB_CUPTI_MULTI=1, STUB_CUPTI_DROPPED=7)
    try:
        assert app("deliver 20")["rc"] == 0
        got = collect(probe, lambda g: g["batches"])
        log = app("log")["log"]
    finally:
        app.close()
    assert "register2" in log and "dropped2" in log
    assert got["batches"][0]["trace"].meta["library_counters"]["dropped_cupti"] == 7


def test_unknown_kernel_layout_never_dereferences_the_name_offset(probe, tmp_path):
    """CUPTI reports (cuptiActivityGetStructSize) a kernel record size no known layout has:
    whatever sits at the usual name offset must not be read as a pointer. The records carry
    a wild pointer there; reading it would kill the served process."""
    from support.cupti_stub import StubApp
    name_off = R.KERNEL.fields["name"][1]
    app = StubApp(tmp_path / "cupti.sock", STUB_CUPTI_KERNEL_SIZE=256, RIDGELINE_FLUSH_MS=0)
    try:
        spec = [{"kind": 10, "size": 256, "u64": {str(name_off): 0x10}} for _ in range(3)]
        assert app("deliverspec " + json.dumps(spec))["rc"] == 0
        collect(probe, lambda g: g["status"] and "layout not known" in "".join(g["status"].values()))
        c = app("counters")
        alive = app.p.poll() is None
    finally:
        stderr = app.close()
    assert alive and c["records_in"] == 3 and c["walk_errors"] == 0
    assert "kernel records of 256 bytes: layout not known to this library; sent without names" in stderr
