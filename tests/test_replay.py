"""probes.replay: rebased, speed-scaled, looping playback of a trace, with fake clocks."""
import numpy as np
import pytest

from ridgeline.probes.events import KERNEL_DTYPE, NameTable, Trace, empty
from ridgeline.probes.replay import ReplayProbe


class Clock:
    def __init__(self):
        self.t = 0

    def __call__(self):
        return self.t


def _trace():
    k = empty(KERNEL_DTYPE, 3)
    k["start_ns"] = [1_000_000_000, 1_000_400_000, 1_000_800_000]   # 0, 0.4, 0.8 ms
    k["end_ns"] = k["start_ns"] + 100_000
    k["device"] = 0
    k["name_id"] = 0
    return Trace(kernels=k, names=NameTable(["gemm"]), meta={"path": "t.json"})


def test_check_without_path_says_why():
    av = ReplayProbe().check()
    assert not av.ok and "no trace" in av.reason and "probes.replay.path" in av.hint


def test_plays_in_time_and_loops_with_increasing_times():
    mono, wall = Clock(), Clock()
    wall.t = 5_000_000_000
    p = ReplayProbe(trace=_trace(), speed=1.0, clock=mono, wall_clock=wall)
    assert p.check().ok
    p.start()
    assert p.poll() is None
    mono.t = 500_000                            # 0.5 ms: first two kernels due
    d = p.poll()
    assert d["kind"] == "events" and len(d["trace"].kernels) == 2
    assert d["trace"].kernels["start_ns"][0] == 5_000_000_000
    assert d["trace"].meta["source"] == "replay"
    # Span is 0.9 ms, lap is span + 1 ms gap = 1.9 ms; 3 ms covers the rest of lap 0 and part of lap 1.
    mono.t = 3_000_000
    d = p.poll()
    starts = d["trace"].kernels["start_ns"]
    assert len(starts) == 1 + 3
    assert np.all(np.diff(starts) > 0)
    assert starts[1] == 5_000_000_000 + 1_900_000
    assert p.counters()["records"] == 6 and p.laps == 1
    p.stop()
    p.stop()
    assert p.poll() is None


def test_speed_scales_and_no_loop_finishes():
    mono = Clock()
    p = ReplayProbe(trace=_trace(), speed=10.0, loop=False, clock=mono, wall_clock=lambda: 0)
    p.start()
    mono.t = 50_000                              # 0.5 ms of trace time at 10x
    assert len(p.poll()["trace"].kernels) == 2
    mono.t = 10_000_000
    assert len(p.poll()["trace"].kernels) == 1
    assert p.finished
    assert p.poll() is None


def test_bad_speed_and_empty_trace():
    with pytest.raises(ValueError):
        ReplayProbe(trace=_trace(), speed=0)
    p = ReplayProbe(trace=Trace())
    with pytest.raises(ValueError, match="no events"):
        p.start()


def test_replays_real_trace(shared_traces):
    path = shared_traces / "nvidia-inference/nanovllm_rtx4080laptop_decode_step0_fragment.json.gz"
    mono = Clock()
    p = ReplayProbe(path, speed=1.0, clock=mono, wall_clock=lambda: 0)
    assert p.check().ok
    p.start()
    mono.t = 10_000_000_000
    d = p.poll()
    assert len(d["trace"].kernels) >= 17


def test_a_stalled_caller_gets_bounded_batches_and_counted_drops():
    mono = Clock()
    p = ReplayProbe(trace=_trace(), speed=1.0, clock=mono, wall_clock=lambda: 0, max_catchup_s=0.0038)
    p.start()
    mono.t = 100 * 1_900_000 + 500_000            # 100 laps late (lap = 1.9 ms), 0.5 ms into lap 100
    d = p.poll()
    # Only the last 3.8 ms (2 laps) come back: lap 98 from 0.5 ms, lap 99, lap 100 up to 0.5 ms.
    assert len(d["trace"].kernels) == 1 + 3 + 2
    assert p.drops == 98 * 3 + 2
    assert p.counters()["records"] + p.drops == 100 * 3 + 2


def test_a_late_caller_gets_the_backlog_in_bounded_batches_and_loses_nothing():
    # max_batch_s of one lap (1.9 ms): a caller 3 laps and 0.5 ms late gets a lap per poll
    mono = Clock()
    p = ReplayProbe(trace=_trace(), speed=1.0, clock=mono, wall_clock=lambda: 0, max_catchup_s=1.0,
                    max_batch_s=0.0019)
    p.start()
    mono.t = 3 * 1_900_000 + 500_000
    got = []
    while (d := p.poll()) is not None:
        got.append(len(d["trace"].kernels))
    # laps 0, 1, 2 whole, then lap 3 up to 0.5 ms (its first two kernels); a batch bound of
    # its own does not make a poll return everything due (24 MiB at once from a starved
    # agent's 3x replay)
    assert got == [3, 3, 3, 2] and p.drops == 0
    starts = []
    mono.t += 1_900_000
    while (d := p.poll()) is not None:
        starts.extend(d["trace"].kernels["start_ns"].tolist())
    assert starts == sorted(starts) and len(starts) == 3
