"""bench/bench_scale.py's CUPTI feed: the frames its generator writes, read by the agent's
real CUPTI probe (socket server, parse, decode, launch join), decode to the simulated
stream's own kernels and launch records, so that the bench's agent folds the same
events with the intake as without it (``--feed arrays``)."""
from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cupti")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_scale as bs  # noqa: E402

from ridgeline.probes.cupti.probe import CuptiProbe  # noqa: E402


def _send_and_collect(tmp_path, gpus: int, periods: range):
    stream = bs.StepStream(gpus, 50_000, "short")
    frames = bs.CuptiFrames(stream)
    path = str(tmp_path / "cupti.sock")
    probe = CuptiProbe(socket_path=path)
    probe.start()
    try:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(path)
        c.sendall(frames.hello())
        base = time.time_ns() - 10**9            # API times before the agent receives them
        ks, aps = [], []
        for i in periods:
            k, a = stream.batch(i, base)
            ks.append(k)
            aps.append(a)
            c.sendall(frames.batch(k, a))
        want = sum(len(k) for k in ks)
        got, end = [], time.monotonic() + 20
        while sum(len(t.kernels) for t in got) < want and time.monotonic() < end:
            out = probe.poll()
            if "trace" in out:
                got.append(out["trace"])
            time.sleep(0.02)
        c.close()
    finally:
        probe.stop()
    return stream, np.concatenate(ks), np.concatenate(aps), got


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_cupti_frames_decode_to_the_streams_own_events(tmp_path, gpus):
    stream, k, a, got = _send_and_collect(tmp_path, gpus, range(3))
    tk = np.concatenate([t.kernels for t in got])
    names = got[0].names
    assert len(tk) == len(k) and sum(len(t.api) for t in got) == len(a)
    o1 = np.lexsort((tk["device"], tk["start_ns"]))
    o2 = np.lexsort((k["device"], k["start_ns"]))
    tk, k = tk[o1], k[o2]
    for f in ("start_ns", "end_ns", "device", "stream", "grid_x", "grid_y", "grid_z", "block_x", "block_y",
              "block_z", "registers", "shared_mem_bytes", "graph_id", "graph_node_id", "external_id"):
        assert np.array_equal(tk[f], k[f]), f
    assert [names[int(i)] for i in tk["name_id"]] == [stream.names[int(i)] for i in k["name_id"]]
    # joined with their launch records: the launch thread is the GPU's, as the generator says
    assert np.array_equal(tk["tid"], 9000 + k["device"])
    # one kernel, one launch, one correlation id (CUPTI's uint32, unique in the process)
    assert len(np.unique(tk["correlation_id"])) == len(tk)
    ta = np.concatenate([t.api for t in got])
    assert np.array_equal(np.sort(ta["start_ns"]), np.sort(a["start_ns"]))
