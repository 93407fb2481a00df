"""The native injection library driven by the tests: :class:`Harness` feeds it buffers laid
out as CUPTI lays them out; :class:`StubApp` is a served process on the real injection path
over the stand-in libcupti (probes/native/tests/stub_cupti.c), both through
support/native_harness.py, one command a line; :class:`Agent` is the agent's CUPTI server
alone. A test module that imports ``built`` builds the library first (the fixture is autouse).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ridgeline.probes.cupti import protocol as P
from ridgeline.probes.cupti.server import CuptiServer
from support import cupti_records as R

ROOT = Path(__file__).resolve().parents[2]


NATIVE = ROOT / "probes" / "native"


LIB = NATIVE / "libridgeline_cupti.so"
# the same library plus the test entry points (ridgeline_test_*), which the harness drives
TESTLIB = NATIVE / "build" / "libridgeline_cupti_test.so"


STUB = NATIVE / "build" / "libcupti_stub.so"


HARNESS = Path(__file__).parent / "native_harness.py"


@pytest.fixture(scope="module", autouse=True)
def built():
    r = subprocess.run(["make", "-s", "-C", str(NATIVE)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


class StubApp:
    """A served process on the real injection path, over the stand-in libcupti."""

    def __init__(self, sock: Path, **env):
        e = {k: v for k, v in os.environ.items() if not k.startswith(("STUB_", "RIDGELINE_"))}
        e.update(RIDGELINE_LIBCUPTI=str(STUB), RIDGELINE_SOCKET=str(sock), RIDGELINE_RECONNECT_MS="50",
                 **{k: str(v) for k, v in env.items()})
        self.p = subprocess.Popen([sys.executable, str(HARNESS), "--stub", str(TESTLIB), str(STUB)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=e)

    def __call__(self, line: str) -> dict:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        out = self.p.stdout.readline()
        assert out, f"stub app died on {line!r}: {self.p.stderr.read()[-2000:]}"
        return json.loads(out)

    def close(self) -> str:
        if self.p.poll() is None:
            try:
                self("quit")
            except (AssertionError, BrokenPipeError):
                pass
        self.p.wait(timeout=15)
        return self.p.stderr.read()


class Agent:
    """The agent's real CUPTI server alone, keeping every HELLO and the kernels' correlation ids."""

    def __init__(self, path):
        self.srv = CuptiServer(str(path))
        self.srv.open()
        self.hellos: list[P.Hello] = []
        self.corr: list[int] = []
        self.kernels: dict[int, tuple[int, int]] = {}   # correlation id -> (start, end)

    def pump(self, seconds: float, until=None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.srv.pump(0.02)
            for m in self.srv.drain():
                if m.kind == "hello":
                    self.hellos.append(m.body)
                elif m.kind == "batch":
                    for s in m.body.sections:
                        if s.kind == 10:           # the stub writes cupti-python's layout
                            v = np.frombuffer(s.data, R.KERNEL)
                            self.corr += v["correlation_id"].tolist()
                            self.kernels.update(zip(v["correlation_id"].tolist(),
                                                    zip(v["start"].tolist(), v["end"].tolist())))
            if until and until(self):
                return

    def taken_over(self) -> bool:
        return bool(self.hellos) and bool(self.hellos[-1].flags & P.FLAG_TAKEN_OVER)

    def reclaim(self) -> None:
        frame = bytearray(P.encode_control(P.MODE_ALWAYS_ON, 0))
        frame[-8:-4] = (1).to_bytes(4, "little")          # rl_control_t.flags = RL_CONTROL_RECLAIM
        for c in list(self.srv._conns.values()):
            c.sock.send(bytes(frame))

    def close(self):
        self.srv.close()


class Harness:
    """The library driven by support/native_harness.py with buffers laid out as CUPTI lays them
    out (no stub libcupti): one command a line, one JSON answer a line."""

    def __init__(self, env_extra: dict | None = None):
        env = dict(os.environ, RIDGELINE_QUIET="1", **(env_extra or {}))
        self.p = subprocess.Popen([sys.executable, str(HARNESS), str(TESTLIB)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)

    def __call__(self, line: str) -> dict:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        out = self.p.stdout.readline()
        assert out, f"harness died on {line!r}"
        return json.loads(out)

    def close(self):
        if self.p.poll() is None:
            try:
                self("quit")
            except (OSError, ValueError, AssertionError):    # the harness already gone: wait() reaps it
                pass
            self.p.wait(timeout=10)
