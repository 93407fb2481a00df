"""The object-storage sink (agent/object_sink.py, issue 23): rolling Parquet files to a folder or
to S3 through a bounded spool, losing nothing across an outage of the store or a recorder
killed with -9 mid-file.

The store is a real S3 API server on loopback: s3rver (npm, 3.7.1), which keeps its objects
in a folder, so it can be killed and started again mid-run with its data, as a real store
comes back. What is uploaded is read back through pyarrow's S3 filesystem (the AWS SDK) and
the project's own Parquet reader. The messages are the simulator's stream written with the
real wire encoder (tests/support/recording_synth.py).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pyarrow", reason="pyarrow (the ridgeline[parquet] extra) is not installed")

from support import s3_server  # noqa: E402

from ridgeline.agent import object_sink as S  # noqa: E402
from ridgeline.agent import parquet_recording as pqr  # noqa: E402
from ridgeline.agent.recording import iter_frames  # noqa: E402

pytestmark = pytest.mark.long   # minutes: started first under xdist (tests/conftest.py)



@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    """(recv_ns, envelope) of a 2-minute simulated stream: 120 event batches and 120 windows."""
    from support.recording_synth import simulated_trace, write_recording
    base = tmp_path_factory.getbasetemp()
    src = simulated_trace(base / "ridgeline-sim10.json.gz")
    rec = base / "sink-source.rlrec"
    if not rec.exists():
        write_recording(rec, src, minutes=2)
    return list(iter_frames(rec))


@pytest.fixture(scope="module")
def s3rver_bin():
    return s3_server.s3rver_bin()


@pytest.fixture
def s3_env(monkeypatch):
    s3_server.s3_env(monkeypatch)


_free_port = s3_server._free_port
S3Server = s3_server.S3Server


def _frames_in(root: Path) -> list[int]:
    """Frame numbers of the recording's messages, as the project's reader reads them."""
    (host, rec), = pqr.recordings_in(root)
    return [m[0] for m in pqr.iter_messages(root, host, rec)]


def _direct(tmp_path: Path, frames) -> Path:
    """The same messages through the plain Parquet writer: what the sink must deliver."""
    out = tmp_path / "direct"
    with pqr.ParquetRecordingWriter(out, recording="direct") as w:
        for recv_ns, env in frames:
            w.write(env, recv_ns)
    return out


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_folder_sink_delivers_every_message_once(tmp_path, frames):
    clock = FakeClock()
    sink = S.ObjectSink(tmp_path / "spool", f"file://{tmp_path / 'dest'}", roll_s=30, clock=clock,
                        upload_interval_s=0.05, recording="r1")
    for i, (recv_ns, env) in enumerate(frames):
        clock.t = i * 0.5              # a message every half second: a roll every 60 messages (4 files)
        sink.write(env, recv_ns)
    sink.close()
    assert sink.counters.rolls >= 5 and sink.counters.dropped_files == 0
    assert _frames_in(tmp_path / "dest") == list(range(len(frames)))
    assert _frames_in(_direct(tmp_path, frames)) == list(range(len(frames)))
    assert sink.pending_files() == 0 and not list((tmp_path / "spool" / "journal").glob("*.rjl"))[1:]


def test_s3_outage_mid_run_loses_nothing(tmp_path, frames, s3rver_bin, s3_env):
    srv = S3Server(s3rver_bin, tmp_path / "s3data").start()
    clock = FakeClock()
    sink = S.ObjectSink(tmp_path / "spool", "s3://fleet/ridgeline", endpoint=srv.endpoint, scheme="http",
                        region="us-east-1", roll_s=20, clock=clock, upload_interval_s=0.05, recording="r2")
    try:
        third = len(frames) // 3
        for i, (recv_ns, env) in enumerate(frames[:third]):
            clock.t = i * 0.5
            sink.write(env, recv_ns)
        sink.roll()
        assert sink.upload_once() >= 0
        srv.kill()                                            # the store goes away mid-run
        for i, (recv_ns, env) in enumerate(frames[third:2 * third], start=third):
            clock.t = i * 0.5
            sink.write(env, recv_ns)
        sink.roll()
        sink.upload_once()
        held = sink.pending_files()
        assert sink.counters.upload_errors >= 1 and held >= 1   # kept in the spool, not lost
        srv.start()                                           # ... and comes back with its data
        for i, (recv_ns, env) in enumerate(frames[2 * third:], start=2 * third):
            clock.t = i * 0.5
            sink.write(env, recv_ns)
        sink.close()
        assert sink.pending_files() == 0 and sink.counters.dropped_files == 0
        got = srv.download(tmp_path / "from-s3")
    finally:
        srv.kill()
    assert _frames_in(got / "ridgeline") == list(range(len(frames)))
    print(f"outage: {held} files held in the spool while the store was down, {sink.counters.upload_errors} "
          f"failed uploads, {sink.counters.files_uploaded} files / {sink.counters.bytes_uploaded} bytes uploaded")


CHILD = """
import sys, time
from ridgeline.agent.object_sink import ObjectSink
from ridgeline.agent.recording import iter_frames
frames = list(iter_frames(sys.argv[3]))
sink = ObjectSink(sys.argv[1], sys.argv[2], roll_s=2.0, upload_interval_s=0.05, recording="r3")
for i, (recv_ns, env) in enumerate(frames):
    sink.write(env, recv_ns)
    print(i, flush=True)              # durable: in the journal before this line
    time.sleep(0.02)
time.sleep(600)
"""


def test_a_recorder_killed_mid_file_loses_nothing(tmp_path, frames):
    src = tmp_path / "src.rlrec"
    from ridgeline.agent.recording import RecordingWriter
    with RecordingWriter(src) as w:
        for recv_ns, env in frames:
            w.write(env, recv_ns)
    spool, dest = tmp_path / "spool", tmp_path / "dest"
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(spool), f"file://{dest}", str(src)],
                         stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    written = -1
    end = time.monotonic() + 120
    while time.monotonic() < end:       # past a roll (2 s) and well inside the next file
        line = p.stdout.readline()
        if not line:
            break
        written = int(line)
        if written >= 150:
            break
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert written >= 150, "the child did not get far enough"
    assert list((spool / "journal").glob("*.rjl"))           # the open file's rows: only in the journal
    sink = S.ObjectSink(spool, f"file://{dest}", upload_interval_s=0.05)
    sink.close()
    assert sink.counters.replayed_messages >= 1
    got = _frames_in(dest)
    assert got[:written + 1] == list(range(written + 1))     # every message it had taken, once each
    assert len(got) == len(set(got))


def test_a_torn_journal_frame_is_dropped_and_counted(tmp_path):
    j = tmp_path / "00000000.rjl"
    body = b"x" * 10
    j.write_bytes(S.JOURNAL_HEADER.pack(len(body), 5, S.FRAME_ENVELOPE) + body
                  + S.JOURNAL_HEADER.pack(100, 6, S.FRAME_ENVELOPE) + b"cut")
    names, frames, torn = S.read_journal(j)
    assert frames == [(body, 5)] and torn == 1 and names == {}


def test_the_spool_is_bounded_and_what_it_drops_is_counted(tmp_path, frames):
    dead = f"127.0.0.1:{_free_port()}"                       # nothing listens: every upload fails
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "x")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "x")
    clock = FakeClock()
    cap = 400_000
    sink = S.ObjectSink(tmp_path / "spool", "s3://fleet/x", endpoint=dead, scheme="http", region="us-east-1",
                        roll_s=5, clock=clock, spool_max_bytes=cap, upload_interval_s=3600, recording="r4",
                        close_timeout_s=0)
    peak = 0
    for i, (recv_ns, env) in enumerate(frames):
        clock.t = i * 0.5
        sink.write(env, recv_ns)
        if i % 30 == 29:
            sink.upload_once()
            peak = max(peak, sink.spool_bytes())
    sink.close()
    assert sink.counters.dropped_files > 0 and sink.counters.dropped_bytes > 0
    assert sink.counters.upload_errors > 0
    # at most the cap plus what arrived since the last check (one roll's files and journal)
    assert peak <= cap + 300_000, peak


def test_one_sink_per_spool(tmp_path):
    a = S.ObjectSink(tmp_path / "spool", f"file://{tmp_path / 'dest'}", upload_interval_s=0.05, recording="r5")
    try:
        with pytest.raises(S.RuntimeFailure, match=rf"the spool is in use by another sink \(pid {os.getpid()}\)"):
            S.ObjectSink(tmp_path / "spool", f"file://{tmp_path / 'dest'}", upload_interval_s=0.05)
    finally:
        a.close()
