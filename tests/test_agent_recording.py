"""agent.recording: the framed file format, truncation, magic, merging of event batches."""
import struct

import numpy as np
import pytest

from ridgeline.agent.recording import MAGIC, RecordingWriter, is_recording, iter_frames, load_recording, merge_traces
from ridgeline.aggregator import wire as codec
from ridgeline.probes.errors import InputError
from ridgeline.probes.events import KERNEL_DTYPE, Device, NameTable, Trace, empty


def batch(names, ids, start):
    k = empty(KERNEL_DTYPE, len(ids))
    k["name_id"] = ids
    k["start_ns"] = start + np.arange(len(ids)) * 10
    k["end_ns"] = k["start_ns"] + 5
    k["device"] = 0
    return Trace(kernels=k, names=NameTable(names), devices=[Device(0, "NVIDIA H100 80GB HBM3")],
                 meta={"source": "simulated"})


def test_frames_roundtrip_and_layout(tmp_path):
    p = tmp_path / "r.rlrec"
    with RecordingWriter(p) as w:
        w.write(b"abc", 7)
        w.write(b"", 8)
    raw = p.read_bytes()
    assert raw[:8] == MAGIC
    assert raw[8:20] == struct.pack("<QI", 7, 3) and raw[20:23] == b"abc"
    assert list(iter_frames(p)) == [(7, b"abc"), (8, b"")]
    assert is_recording(p)


def test_truncated_tail_keeps_complete_frames(tmp_path):
    p = tmp_path / "r.rlrec"
    with RecordingWriter(p) as w:
        w.write(b"one", 1)
        w.write(b"two", 2)
    p.write_bytes(p.read_bytes()[:-2])        # killed mid-write
    report = {}
    assert list(iter_frames(p, report)) == [(1, b"one")]
    assert report["truncated"]


def test_not_a_recording(tmp_path):
    p = tmp_path / "t.json"
    p.write_text('{"traceEvents": []}')
    assert not is_recording(p)
    with pytest.raises(InputError, match="not a ridgeline recording"):
        list(iter_frames(p))
    with pytest.raises(InputError, match="cannot read recording"):
        list(iter_frames(tmp_path / "missing"))


def test_corrupt_length_is_one_line(tmp_path):
    p = tmp_path / "r.rlrec"
    p.write_bytes(MAGIC + struct.pack("<QI", 1, 0xFFFFFFFF))
    with pytest.raises(InputError, match="corrupt recording"):
        list(iter_frames(p))


def test_merge_reinterns_names():
    a = batch(["gemm", "flash"], [1, 0], 0)
    b = batch(["flash", "norm"], [0, 1, -1], 100)
    m = merge_traces([a, b])
    assert m.names.names_of(m.kernels["name_id"]) == ["flash", "gemm", "flash", "norm", ""]
    assert len(m.devices) == 1


def test_load_recording_collects_windows_events_and_gaps(tmp_path):
    p = tmp_path / "r.rlrec"
    with RecordingWriter(p) as w:
        w.write(codec.encode_envelope("events", 0, codec.encode_event_batch(batch(["gemm"], [0, 0], 0)), "h", 1), 1)
        w.write(codec.encode_envelope("window", 0, codec.encode_window({"gpus": [], "duration_ns": 1}), "h", 2), 2)
        w.write(codec.encode_envelope("events", 3, codec.encode_event_batch(batch(["flash"], [0], 50)), "h", 3), 3)
        w.write(codec.encode_envelope("events", 0, codec.encode_event_batch(batch(["norm"], [0], 90)), "h", 4), 4)
    rec = load_recording(p, codec=codec)
    assert rec.messages == {"events": 3, "window": 1}
    assert rec.gaps == {"events": 2} and rec.restarts == 1
    assert len(rec.trace.kernels) == 4 and rec.trace.meta["simulated"]
    assert rec.trace.names.names_of(rec.trace.kernels["name_id"]) == ["gemm", "gemm", "flash", "norm"]
    assert rec.windows[0]["duration_ns"] == 1 and rec.hosts == ["h"]


def test_undecodable_frame_names_file_and_frame(tmp_path):
    p = tmp_path / "r.rlrec"
    with RecordingWriter(p) as w:
        w.write(b"\xc1garbage", 1)
    with pytest.raises(InputError, match=r"r\.rlrec: frame 0"):
        load_recording(p, codec=codec)
