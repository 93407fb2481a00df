"""A bounded, seeded mutation fuzzer over the agent's CUPTI socket path: real server, real
client socket, real decoder (probes/cupti/{protocol,server,decode,probe}.py).

Streams start as valid library traffic (a HELLO and batches of every decoded kind, laid
out by cupti-python's dtypes) and are mutated: bytes flipped, aligned 4- and 8-byte
fields overwritten with boundary values (0, 2**31, 2**32-1, 2**63, 2**64-1, the body
length), frames cut, repeated and spliced, record fields randomised. For every stream:

* nothing escapes ``pump()``/``drain()``/``ingest()``/``collect()`` and the decoder never
  raises (``decode_errors`` stays 0: an exception there is a bug, even though poll()
  would contain it);
* the memory allocated while handling the stream stays under a fixed bound, whatever
  sizes or counts the stream claims (tracemalloc sees numpy's buffers);
* every complete frame is accounted for: it became a message, or was counted as a
  rejected batch, a dropped batch, or the protocol error that closed the connection;
  every record of an accepted batch is decoded, undecodable or rejected, never lost.

The test runs a few seconds with a fixed seed; ``python tests/test_cupti_fuzz.py 60``
runs for 60 seconds with a random seed (printed, so a finding can be replayed).
"""
from __future__ import annotations

import os
import random
import socket
import sys
import time
import tracemalloc

from support import cupti_records as R

from ridgeline.probes.cupti import protocol as P
from ridgeline.probes.cupti.probe import CuptiProbe

#: Memory one stream may cost the agent (streams are at most a few hundred KiB).
MAX_PEAK_BYTES = 24 << 20
_U32 = (0, 1, 7, 8, 63, 64, 4095, 4096, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF)
_U64 = (0, 1, (1 << 53), (1 << 63) - 1, 1 << 63, (1 << 64) - 1)


def _seed_frames(rng: random.Random) -> list[bytes]:
    b = R.make_buffer(rng.randint(1, 40), seed=rng.randint(0, 1000))
    sections = [(10, R.KERNEL.itemsize, b.kernels.tobytes()), (5, R.API.itemsize, b.api.tobytes()),
                (1, R.MEMCPY.itemsize, b.copies.tobytes()), (2, R.MEMSET.itemsize, b.memsets.tobytes()),
                (39, R.EXTCORR.itemsize, b.extcorr.tobytes()), (12, R.MARKER.itemsize, b.markers.tobytes())]
    rng.shuffle(sections)
    frames = [R.hello_frame(status=b"ok" * rng.randint(0, 3))]
    k = rng.randint(1, len(sections))
    frames.append(R.batch_frame(sections[:k], b.names))
    if k < len(sections):
        frames.append(R.batch_frame(sections[k:], {}))
    return frames


def _mutate_bytes(rng: random.Random, f: bytearray) -> None:
    for _ in range(rng.randint(1, 4)):
        if not f:
            return
        op = rng.randrange(6)
        if op == 0:
            f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
        elif op in (1, 2) and len(f) >= 8:
            at = rng.randrange(0, len(f) - 3) & ~3
            v = rng.choice(_U32 + (len(f), len(f) - 16, len(f) + 8))
            f[at:at + 4] = (v & 0xFFFFFFFF).to_bytes(4, "little")
        elif op == 3 and len(f) >= 16:
            at = rng.randrange(0, len(f) - 7) & ~7
            f[at:at + 8] = rng.choice(_U64).to_bytes(8, "little")
        elif op == 4:
            at = rng.randrange(len(f))
            del f[at:at + rng.randint(1, 64)]
        else:
            at = rng.randrange(len(f) + 1)
            f[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))


def _mutate_header(rng: random.Random, f: bytearray) -> None:
    """Header fields the parser reads first: frame length, then the HELLO/BATCH counts."""
    if len(f) < 16 + 40:
        return
    fields = [12, 16 + 24, 16 + 28, 16 + 32, 16 + 36, 16 + 40 + 8, 16 + 40 + 12, 16 + 40 + 16]
    at = rng.choice([x for x in fields if x + 4 <= len(f)])
    f[at:at + 4] = rng.choice(_U32 + (len(f),)).to_bytes(4, "little")


def make_stream(rng: random.Random) -> bytes:
    frames = [bytearray(x) for x in _seed_frames(rng)]
    for f in frames:
        r = rng.random()
        if r < 0.35:
            _mutate_bytes(rng, f)
        elif r < 0.6:
            _mutate_header(rng, f)
    r = rng.random()
    if r < 0.1:
        frames.insert(rng.randrange(len(frames) + 1), bytearray(rng.choice(frames)))
    elif r < 0.2:
        frames.pop(rng.randrange(len(frames)))
    elif r < 0.3 and frames:
        i = rng.randrange(len(frames))
        frames[i] = frames[i][:rng.randrange(len(frames[i]) + 1)]
    return b"".join(frames)


def _complete_frames(stream: bytes) -> int:
    """Frames a reader of the format would complete before the stream breaks or ends."""
    n, at = 0, 0
    while at + 16 <= len(stream):
        try:
            _, length = P.parse_frame_header(stream[at:at + 16])
        except P.ProtocolError:
            return n
        if at + 16 + length > len(stream):
            return n
        at += 16 + length
        n += 1
    return n


def run_one(probe: CuptiProbe, stream: bytes) -> None:
    """Send ``stream`` on a new connection and check the invariants of the module doc."""
    srv = probe.server
    before = dict(srv.stats)
    dec_before = {pid: dict(d.counters) for pid, d in probe.decoders.items()}
    c = socket.socket(socket.AF_UNIX)
    c.connect(probe.socket_path)
    c.setblocking(False)
    sent = 0
    tracemalloc.start()
    tracemalloc.reset_peak()
    msgs = []
    deadline = time.monotonic() + 30        # a few KiB; generous for a loaded host under tracemalloc
    try:
        while srv.connections or sent < len(stream) or not msgs:
            if sent < len(stream):
                try:
                    sent += c.send(stream[sent:sent + (1 << 16)])
                except BlockingIOError:
                    pass
                except OSError:          # the server closed it (a protocol error)
                    sent = len(stream)
                if sent == len(stream):
                    c.shutdown(socket.SHUT_WR)
            srv.pump(0.01)
            got = srv.drain()
            msgs += got
            if any(m.kind == "closed" for m in got) or time.monotonic() > deadline:
                break
        batches = [m.body for m in msgs if m.kind == "batch"]
        probe.ingest(msgs)
        # read before collect(): it releases the decoders of closed connections
        got_records = 0
        for pid, dd in probe.decoders.items():
            old = dec_before.get(pid, {})
            got_records += sum(dd.counters[k] - old.get(k, 0)
                               for k in ("records", "undecodable_records", "rejected_records"))
        probe.collect()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        c.close()
    assert time.monotonic() <= deadline, "the server did not finish a stream of a few KiB"
    assert probe.decode_errors == 0, "the decoder raised on a batch the parser accepted"
    assert peak < MAX_PEAK_BYTES, f"{peak} bytes allocated for a stream of {len(stream)}"
    d = {k: srv.stats[k] - before.get(k, 0) for k in set(srv.stats) | set(before)}
    n_msg = sum(1 for m in msgs if m.kind in ("hello", "batch"))
    # each complete frame: a message, a counted rejection, or the error that closed the connection
    accounted = n_msg + d.get("rejected_batches", 0) + d.get("dropped_batches_queue_full", 0)
    assert d.get("messages", 0) - accounted in (0, 1)
    if d.get("messages", 0) != accounted:
        assert d.get("protocol_errors", 0) == 1
    if not d.get("protocol_errors", 0):
        assert d.get("messages", 0) == _complete_frames(stream)
    # records of accepted batches: decoded, undecodable or rejected, never lost
    assert got_records == sum(int(b.header["records"]) for b in batches)


def fuzz(seconds: float, seed: int, tmp: str, min_streams: int = 0) -> int:
    rng = random.Random(seed)
    probe = CuptiProbe(os.path.join(tmp, "f.sock"))
    probe.server = None
    from ridgeline.probes.cupti.server import CuptiServer
    probe.server = CuptiServer(probe.socket_path)
    probe.server.open()
    n = 0
    try:
        # ``seconds`` of fuzzing, and on (within a hard cap) until ``min_streams`` were run:
        # a loaded host runs fewer streams in the same time, the count is what is checked
        end = time.monotonic() + seconds
        hard_end = end + 120
        while time.monotonic() < end or (n < min_streams and time.monotonic() < hard_end):
            stream = make_stream(rng)
            try:
                run_one(probe, stream)
            except AssertionError as e:
                raise AssertionError(f"seed {seed}, stream {n} ({len(stream)} bytes): {e}") from e
            n += 1
    finally:
        probe.server.close()
    return n


def test_fuzzed_library_traffic_never_escapes_allocates_or_goes_uncounted(tmp_path):
    n = fuzz(4.0, seed=20261201, tmp=str(tmp_path), min_streams=50)
    assert n >= 50


if __name__ == "__main__":
    import tempfile
    secs = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else random.SystemRandom().randrange(1 << 32)
    with tempfile.TemporaryDirectory() as d:
        t = time.monotonic()
        print(f"seed {seed}: {fuzz(secs, seed, d)} streams in {time.monotonic() - t:.1f} s, no finding")
