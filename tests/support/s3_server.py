"""A real S3 API server on loopback for the sink tests (tests/test_object_sink.py,
tests/test_sink_agent.py): s3rver 3.7.1 from npm, which keeps its objects in a folder, so it
can be killed and started again mid-run with its data, as a real store comes back.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
NODE = ROOT / "build" / "node-s3rver"
S3RVER_VERSION = "3.7.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3rver_bin() -> Path:
    """The s3rver executable, installed from npm into build/ once; skips without npm."""
    import fcntl
    exe = NODE / "node_modules" / ".bin" / "s3rver"
    if exe.exists():
        return exe
    if not shutil.which("npm"):
        pytest.skip("npm not installed: no S3 API server for the sink tests")
    NODE.mkdir(parents=True, exist_ok=True)
    # two test files under xdist may both install it: one at a time, the second finds it
    with open(NODE / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not exe.exists():
            r = subprocess.run(["npm", "install", "--prefix", str(NODE), "--no-audit", "--no-fund",
                                f"s3rver@{S3RVER_VERSION}"], capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                pytest.skip(f"s3rver not installable from npm: {r.stderr.strip().splitlines()[-1:]}")
    return exe


class S3Server:
    """s3rver on loopback, its objects under ``data`` (they outlive the process)."""

    def __init__(self, exe: Path, data: Path, bucket: str = "fleet"):
        self.exe, self.data, self.bucket = exe, data, bucket
        self.port = _free_port()
        self.p = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self):
        self.data.mkdir(parents=True, exist_ok=True)
        self.p = subprocess.Popen([str(self.exe), "-d", str(self.data), "-a", "127.0.0.1", "-p", str(self.port),
                                   "-s", "--configure-bucket", self.bucket], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        end = time.monotonic() + 20
        while time.monotonic() < end:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise AssertionError("s3rver did not start")

    def kill(self):
        if self.p and self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait()

    def download(self, to: Path) -> Path:
        """Every object of the bucket, through the AWS SDK (pyarrow's S3 filesystem)."""
        import pyarrow.fs as pafs
        fs = self.fs()
        for info in fs.get_file_info(pafs.FileSelector(self.bucket, recursive=True)):
            if info.type == pafs.FileType.File:
                rel = info.path[len(self.bucket) + 1:]
                (to / rel).parent.mkdir(parents=True, exist_ok=True)
                with fs.open_input_stream(info.path) as f:
                    (to / rel).write_bytes(f.read())
        return to

    def fs(self):
        import pyarrow.fs as pafs
        os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
        os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
        return pafs.S3FileSystem(access_key="S3RVER", secret_key="S3RVER", endpoint_override=self.endpoint,
                                 scheme="http", region="us-east-1", connect_timeout=1, request_timeout=3)


def s3_env(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "S3RVER")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "S3RVER")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
