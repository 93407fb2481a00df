"""The agent's hand-off to a restarted sink recorder (agent/sink_handoff.py, issue 23): what
the agent published while no recorder listened reaches the next one, once, in order.

The messages are the simulator's stream written with the real wire encoder
(tests/support/recording_synth.py); the recorder is the real ObjectSink writing real Parquet
files, read back with the project's reader. The whole path (the agent as a process, its
child killed with -9, a real S3 API server) is tests/test_sink_agent.py.
"""
from __future__ import annotations

import orjson
import pytest

from ridgeline.agent import sink_handoff as H
from ridgeline.aggregator import wire


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _env(topic: str, seq: int, pad: int = 0) -> bytes:
    return wire.encode_envelope(topic, seq, {"source": "t", "data": {"pad": "x" * pad}}, "h", 1)


def _write_state(spool, epoch, last_seq):
    spool.mkdir(parents=True, exist_ok=True)
    (spool / "state.json").write_bytes(orjson.dumps({"recording": "r", "next_part": 0, "next_frame": 0,
                                                     "journal": 0, "last_seq": last_seq, "epoch": epoch}))


def _seqs(h: H.Handoff) -> list[tuple[str, int]]:
    return [(e.topic, int(e.seq)) for e in (wire.decode_envelope(b) for b, _ in h.frames)]


def test_the_ring_keeps_the_newest_bytes_and_counts_what_left():
    ring = H.HandoffRing(7, max_bytes=10_000)
    envs = [_env("health", i, pad=900) for i in range(30)]
    for i, e in enumerate(envs):
        ring.keep("health", i, e)
    assert ring.ring_bytes <= 10_000
    kept = 30 - ring.ring_dropped
    assert ring.ring_dropped > 0 and kept * len(envs[0]) == ring.ring_bytes
    ring.keep("engine", 3, b"x" * 20_000)            # bigger than the whole ring: never kept
    assert ring.ring_dropped == 30 - kept + 1


def test_the_file_holds_what_the_spool_lacks_then_ends_when_the_recorder_is_live(tmp_path):
    spool = tmp_path / "spool"
    _write_state(spool, 7, {"health": 4, "engine": 1})     # this agent's numbers, saved at a roll
    clock = FakeClock()
    ring = H.HandoffRing(7, clock=clock)
    for i in range(8):
        ring.keep("health", i, _env("health", i))
        if i < 3:
            ring.keep("engine", i, _env("engine", i))
    ring.open(spool)
    ring.keep("health", 8, _env("health", 8))            # published after the child started
    ring.poll()
    h = H.read_handoff(spool / H.HANDOFF, 1 << 20)
    assert h.epoch == 7 and not h.ended and h.since == {"health": 0, "engine": 0}
    assert _seqs(h) == [("engine", 2), ("health", 5), ("health", 6), ("health", 7), ("health", 8)]   # as published
    assert not H.has_ended(spool / H.HANDOFF)
    (spool / H.LIVE).write_text("123")                   # the recorder received its first message
    ring.poll()
    ring.keep("health", 9, _env("health", 9))            # reaches the recorder directly: not in the file
    h = H.read_handoff(spool / H.HANDOFF, 1 << 20)
    assert h.ended and H.has_ended(spool / H.HANDOFF) and _seqs(h)[-1] == ("health", 8)


def test_another_agents_spool_gets_everything_kept(tmp_path):
    spool = tmp_path / "spool"
    _write_state(spool, 99, {"health": 400})             # the agent restarted: those numbers are not ours
    ring = H.HandoffRing(7)
    for i in range(5):
        ring.keep("health", i, _env("health", i))
    ring.open(spool)
    ring.close()
    h = H.read_handoff(spool / H.HANDOFF, 1 << 20)
    assert h.ended and [s for _, s in _seqs(h)] == [0, 1, 2, 3, 4]


def test_a_recorder_that_never_says_live_gets_an_ended_file_after_the_timeout(tmp_path):
    clock = FakeClock()
    ring = H.HandoffRing(7, timeout_s=60, clock=clock)
    ring.keep("health", 0, _env("health", 0))
    ring.open(tmp_path)
    clock.t = 59.0
    ring.poll()
    assert ring.is_open
    clock.t = 60.0
    ring.poll()
    assert not ring.is_open and H.read_handoff(tmp_path / H.HANDOFF, 1 << 20).ended


def test_a_hand_off_past_its_cap_ends_there(tmp_path):
    ring = H.HandoffRing(7, max_bytes=5_000)
    e = _env("health", 0, pad=1000)
    ring.open(tmp_path)
    for i in range(10):
        ring.keep("health", i, _env("health", i, pad=1000))
    assert ring.truncated == 1 and not ring.is_open
    h = H.read_handoff(tmp_path / H.HANDOFF, 5_000)
    assert h.ended and len(h.frames) == 5_000 // len(e)


def test_torn_and_foreign_files(tmp_path):
    ring = H.HandoffRing(7)
    ring.open(tmp_path)
    for i in range(3):
        ring.keep("health", i, _env("health", i))
    ring._f.flush()
    p = tmp_path / H.HANDOFF
    p.write_bytes(p.read_bytes()[:-5])                   # cut mid-frame (no END yet)
    h = H.read_handoff(p, 1 << 20)
    assert h.torn == 1 and len(h.frames) == 2 and not h.ended
    assert H.read_handoff(tmp_path / "absent", 1 << 20) is None
    (tmp_path / "other").write_bytes(b"\x00" * 64)       # not a hand-off: nothing taken
    assert H.read_handoff(tmp_path / "other", 1 << 20) is None
    ring._f = None


# -- the recorder's side: the real ObjectSink ---------------------------------------------

@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    """(recv_ns, envelope, topic, seq) of a 2-minute simulated stream (120 batches, 120 windows)."""
    pytest.importorskip("pyarrow", reason="pyarrow (the ridgeline[parquet] extra) is not installed")
    from support.recording_synth import simulated_trace, write_recording

    from ridgeline.agent.recording import iter_frames
    base = tmp_path_factory.getbasetemp()
    src = simulated_trace(base / "ridgeline-sim10.json.gz")
    rec = base / "handoff-source.rlrec"
    if not rec.exists():
        write_recording(rec, src, minutes=2)
    out = []
    for recv_ns, env in iter_frames(rec):
        e = wire.decode_envelope(env)
        out.append((recv_ns, env, e.topic, int(e.seq)))
    return out


def _stored(dest) -> list[tuple[str, int]]:
    from ridgeline.agent import parquet_recording as pqr
    (host, rec), = pqr.recordings_in(dest)
    return [(topic, seq) for _, _, topic, seq, _, _ in pqr.iter_messages(dest, host, rec)]


def _sink(tmp_path):
    from ridgeline.agent.object_sink import ObjectSink
    return ObjectSink(tmp_path / "spool", f"file://{tmp_path / 'dest'}", roll_s=1e6, upload_interval_s=0.05,
                      recording="r")


def test_a_restarted_recorder_takes_what_it_missed_once(tmp_path, frames):
    ring = H.HandoffRing(7)
    spool = tmp_path / "spool"
    spool.mkdir()
    ring.open(spool)                                     # the first child: nothing published yet
    first = _sink(tmp_path)
    first.take_handoff(H.read_handoff(spool / H.HANDOFF, 1 << 20))
    for recv_ns, env, topic, seq in frames[:100]:
        ring.keep(topic, seq, env)
        first.write(env, recv_ns)
    first.close()                                        # the child ends; the agent goes on
    for _, env, topic, seq in frames[100:150]:     # ... publishing to nobody
        ring.keep(topic, seq, env)
    ring.open(spool)                                     # the next child is started
    for _, env, topic, seq in frames[150:160]:     # published before its subscription took
        ring.keep(topic, seq, env)
    second = _sink(tmp_path)
    (spool / H.LIVE).write_text("1")
    for _, env, topic, seq in frames[160:170]:     # in the file and received directly
        ring.keep(topic, seq, env)
    ring.poll()
    h = H.read_handoff(spool / H.HANDOFF, 1 << 20)
    assert h.ended
    assert second.take_handoff(h) == 70
    for recv_ns, env, _, _ in frames[160:]:
        second.write(env, recv_ns)
    second.close()
    c = second.counters
    assert c.handed_over_messages == 70 and c.duplicate_messages == 10 and c.missed_messages == 0
    got = _stored(tmp_path / "dest")
    assert got == [(t, s) for _, _, t, s in frames]      # every message once, in order


def test_what_the_ring_lost_is_a_counted_gap(tmp_path, frames):
    """A ring too small for the outage: the recorder counts exactly what never reached it."""
    spool = tmp_path / "spool"
    spool.mkdir()
    size = sorted(len(env) for _, env, _, _ in frames)[-1]
    ring = H.HandoffRing(7, max_bytes=size * 3)         # a few messages at most
    for _, env, topic, seq in frames[:60]:
        ring.keep(topic, seq, env)
    ring.open(spool)
    ring.close()
    h = H.read_handoff(spool / H.HANDOFF, 1 << 20)
    kept = len(h.frames)
    assert 0 < kept < 60 and h.since == {t: 0 for t in {t for _, _, t, _ in frames[:60]}}
    sink = _sink(tmp_path)
    sink.take_handoff(h)
    for recv_ns, env, _, _ in frames[60:]:
        sink.write(env, recv_ns)
    sink.close()
    assert sink.counters.missed_messages == 60 - kept
    got = _stored(tmp_path / "dest")
    assert len(got) == len(frames) - (60 - kept)


def test_a_restarted_agent_numbers_from_zero_again(tmp_path, frames):
    """The spool's last numbers are the old agent's: the new agent's low numbers are new."""
    spool = tmp_path / "spool"
    spool.mkdir()
    old = H.HandoffRing(1)
    old.open(spool)
    sink = _sink(tmp_path)
    sink.take_handoff(H.read_handoff(spool / H.HANDOFF, 1 << 20))
    for recv_ns, env, _, _ in frames:
        sink.write(env, recv_ns)
    sink.close()
    new = H.HandoffRing(2)
    for _, env, topic, seq in frames[:20]:
        new.keep(topic, seq, env)
    new.open(spool)
    new.close()
    again = _sink(tmp_path)
    assert again.take_handoff(H.read_handoff(spool / H.HANDOFF, 1 << 20)) == 20
    again.close()
    assert again.counters.duplicate_messages == 0 and again.counters.missed_messages == 0
    assert _stored(tmp_path / "dest") == [(t, s) for _, _, t, s in frames] + [(t, s) for _, _, t, s in frames[:20]]


def test_a_full_spool_costs_the_hand_off_never_the_stream(tmp_path):
    """/dev/full refuses every write with ENOSPC: keep() (the publisher's tap) must not raise."""
    import os
    ring = H.HandoffRing(7)
    ring.keep("health", 0, _env("health", 0))
    ring.open(tmp_path)
    ring._f.close()
    ring._f = open("/dev/full", "wb", buffering=0)           # the disk fills while the file is open
    for i in range(1, 5):
        ring.keep("health", i, _env("health", i))             # never raises
    assert ring.file_errors == 1 and not ring.is_open and ring.ring_bytes > 0
    ring.poll()
    ring.close()
    assert os.path.exists(tmp_path / H.HANDOFF)               # what was written stays for the recorder
