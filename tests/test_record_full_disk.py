"""Issue 18.9: `record` onto a full disk gives one line, exit 1, and a readable file.

The fault is the kernel's, at the write boundary: the recorder runs under a file-size
limit (RLIMIT_FSIZE, SIGXFSZ ignored: write(2) fails with EFBIG, as ENOSPC does on a
full disk), or, as root where tmpfs can be mounted, on a 256 KiB tmpfs (ENOSPC).
A plain zmq PUB socket sends the golden window envelope (tests/data) as the agent would.
"""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import pytest
from support.golden_stream import golden_window_stream

from ridgeline.agent.recording import MAGIC, iter_frames


@pytest.fixture
def stream(tmp_path):
    ep = f"ipc://{tmp_path}/pub.sock"
    with golden_window_stream(ep) as size:
        yield ep, size


def record(out, ep, preexec=None):
    return subprocess.run([sys.executable, "-m", "ridgeline", "record", "-o", str(out), "--endpoint", ep,
                           "--duration", "60"], preexec_fn=preexec, capture_output=True, text=True, timeout=120)


def check(p, out, env_bytes):
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ridgeline: error: ") and "cannot write the recording" in lines[0]
    report = {}
    frames = list(iter_frames(out, report))
    assert frames and not report.get("truncated")
    assert all(len(e) == env_bytes for _, e in frames)
    assert out.stat().st_size == len(MAGIC) + len(frames) * (12 + env_bytes)
    assert f"{len(frames)} messages" in lines[0]


def test_record_past_a_file_size_limit(tmp_path, stream):
    ep, env_bytes = stream
    limit = 64 << 10

    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    out = tmp_path / "r.rlrec"
    p = record(out, ep, pre)
    check(p, out, env_bytes)
    assert "too large" in p.stderr.lower()


def test_record_onto_a_full_tmpfs(tmp_path, stream):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if m.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {m.stderr.strip()}")
    try:
        ep, env_bytes = stream
        out = mnt / "r.rlrec"
        p = record(out, ep)
        check(p, out, env_bytes)
        assert "no space left" in p.stderr.lower()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
