"""The CUPTI socket server's frame bodies (probes.cupti.server): received in place into
a buffer reused from frame to frame, which must never be overwritten while a batch made
from it is alive, and which follows what a peer sent, not what its header announced."""
from __future__ import annotations

import select
import socket
import threading
import time

import numpy as np
from support import cupti_records as R
from support.cupti_server import cupti_server, pump_until

from ridgeline.probes.cupti import protocol as P
from ridgeline.probes.cupti import server as S


def _send(c: socket.socket, data: bytes) -> threading.Thread:
    """Write in a thread: a frame larger than the socket's buffer waits for the server,
    which this thread pumps."""
    t = threading.Thread(target=c.sendall, args=(data,), daemon=True)
    t.start()
    return t


def _said_hello(path) -> socket.socket:
    """A client of the server at ``path`` that has sent the library's hello."""
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(str(path))
    c.sendall(R.hello_frame())
    return c


def _kernel_section(n: int, fill: int) -> tuple[int, int, bytes]:
    k = np.zeros(n, R.KERNEL)
    k["kind"] = R.KIND_CONCURRENT_KERNEL
    k["correlation_id"] = fill
    return (R.KIND_CONCURRENT_KERNEL, R.KERNEL.itemsize, k.tobytes())


def test_a_reused_body_never_overwrites_a_batch_still_held(tmp_path):
    path = tmp_path / "s.sock"
    with cupti_server(path) as srv:
        c = _said_hello(path)
        n = 6000                                   # 1.5 MB: a body over FIRST_BODY_BYTES, grown
        got = []

        def batches():
            got.extend(m for m in srv.drain() if m.kind == "batch")
            return len(got)
        _send(c, R.batch_frame([_kernel_section(n, 7)]))
        assert pump_until(srv, lambda: batches() >= 1, 10)
        first = got[0]                             # held: its sections are views of the body
        _send(c, R.batch_frame([_kernel_section(n, 9)]))
        assert pump_until(srv, lambda: batches() >= 2, 10)
        v1 = np.frombuffer(first.body.sections[0].data, R.KERNEL)
        v2 = np.frombuffer(got[1].body.sections[0].data, R.KERNEL)
        assert (v1["correlation_id"] == 7).all() and (v2["correlation_id"] == 9).all()
        # Both released: the next frame of that size goes into a buffer already used.
        conn = next(iter(srv._conns.values()))
        lo = conn.spare.__array_interface__["data"][0]       # (a reference here would block the reuse)
        hi = lo + len(conn.spare)
        del first, got[:], v1, v2
        _send(c, R.batch_frame([_kernel_section(n, 11)]))
        assert pump_until(srv, lambda: batches() >= 1, 10)
        at = np.frombuffer(got[0].body.sections[0].data, np.uint8).__array_interface__["data"][0]
        assert lo <= at < hi
        assert (np.frombuffer(got[0].body.sections[0].data, R.KERNEL)["correlation_id"] == 11).all()
        c.close()


def test_a_header_announcing_a_large_body_allocates_what_was_sent(tmp_path):
    path = tmp_path / "s.sock"
    with cupti_server(path) as srv:
        c = _said_hello(path)
        pump_until(srv, lambda: any(x.hello is not None for x in srv._conns.values()), 5)
        hdr = np.zeros(1, P.FRAME_DTYPE)
        hdr["magic"], hdr["type"], hdr["proto"], hdr["length"] = P.MAGIC, P.MSG_BATCH, P.PROTO_VERSION, \
            P.MAX_BODY_BYTES
        c.sendall(hdr.tobytes() + b"\0" * 10)
        end = time.monotonic() + 2
        while time.monotonic() < end:
            srv.pump(0.01)
        conn = next(iter(srv._conns.values()))
        assert conn.need == P.MAX_BODY_BYTES and conn.got == 10
        assert len(conn.body) == S.FIRST_BODY_BYTES           # not the 96 MiB announced
        _send(c, b"\0" * S.FIRST_BODY_BYTES)                     # past the first buffer: it doubles
        end = time.monotonic() + 2
        while time.monotonic() < end and conn.got < S.FIRST_BODY_BYTES + 10:
            srv.pump(0.01)
        assert conn.got == S.FIRST_BODY_BYTES + 10 and len(conn.body) == 2 * S.FIRST_BODY_BYTES
        c.close()


def test_kept_body_buffers_are_bounded_per_connection_and_in_all(tmp_path):
    """A peer that sends one large frame on each of its connections (garbage bodies, refused
    as batches) must not make the agent keep every body buffer for the connections' lives:
    each kept buffer is at most MAX_SPARE_BYTES and all together SPARE_TOTAL_BYTES (found by
    review: 4 connections x 48 MiB kept 192 MiB outside the partial and queued bounds)."""
    import threading

    from ridgeline.probes.cupti import server as S
    path = tmp_path / "s.sock"
    sizes = [7 << 20] * 6 + [12 << 20]          # 42 MiB of small-enough ones, one too large
    with cupti_server(path) as srv:
        cs = [_said_hello(path) for _ in sizes]
        assert pump_until(srv, lambda: sum(x.hello is not None for x in srv._conns.values()) == len(cs), 10)
        srv.drain()
        for c, size in zip(cs, sizes):
            hdr = np.zeros(1, P.FRAME_DTYPE)
            hdr["magic"], hdr["type"], hdr["proto"], hdr["length"] = P.MAGIC, P.MSG_BATCH, P.PROTO_VERSION, size
            t = threading.Thread(target=c.sendall, args=(hdr.tobytes() + b"\0" * size,), daemon=True)
            t.start()
            assert pump_until(srv, lambda: not t.is_alive() and all(x.need == 0 for x in srv._conns.values()), 30)
        srv.drain()
        kept = [len(x.spare) for x in srv._conns.values() if x.spare is not None]
        assert len(srv._conns) == len(cs) and srv.stats["rejected_batches"] == len(cs)
        assert kept and max(kept) <= S.MAX_SPARE_BYTES
        assert sum(kept) == srv._spare_bytes <= S.SPARE_TOTAL_BYTES
        for c in cs[:3]:
            c.close()
        assert pump_until(srv, lambda: len(srv._conns) == len(cs) - 3, 10)
        assert srv._spare_bytes == sum(len(x.spare) for x in srv._conns.values() if x.spare is not None)
        for c in cs[3:]:
            c.close()


def test_the_unshared_test_follows_live_views():
    """probes.buffer_reuse measures the count of an unshared buffer on this interpreter (3.14
    counts a borrowed local no more): a buffer held as the reuse sites hold it is unshared,
    and any view, field or slice of it alive makes it shared."""
    from ridgeline.probes.buffer_reuse import unshared

    class Holder:
        __slots__ = ("raw",)
    h = Holder()
    h.raw = np.empty(64, np.uint8)
    raw = h.raw
    assert unshared(raw)
    for make in (lambda b: b[:8], lambda b: b.view(np.uint16), lambda b: np.frombuffer(b, np.uint8)):
        v = make(raw)
        assert not unshared(raw)
        del v
        assert unshared(raw)


def test_the_probes_pump_thread_reuses_the_body_buffer_from_frame_to_frame(tmp_path, monkeypatch):
    """The started probe (its own pump thread, as the agent runs it): once a frame's
    batch is decoded and handed on, the next frame of that size is received into the same
    buffer. The thread used to hold the last round's messages through its wait, so every
    4 MiB frame of the bench's CUPTI feed grew a fresh buffer (1 -> 2 -> 4 MiB, fresh
    pages each time)."""
    from ridgeline.probes.cupti.probe import CuptiProbe
    grown = []
    real = S._grown

    def counting(body, got, need):
        grown.append(need)
        return real(body, got, need)
    monkeypatch.setattr(S, "_grown", counting)
    path = str(tmp_path / "cupti.sock")
    probe = CuptiProbe(socket_path=path)
    probe.start()
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        c.connect(path)
        c.sendall(R.hello_frame())
        fd = probe.ready_fd()
        assert select.select([fd], [], [], 10)[0] == [fd]
        probe.poll()
        n = 6000                                   # 1.5 MB: a body over FIRST_BODY_BYTES
        frame = R.batch_frame([_kernel_section(n, 7)])
        per_frame = []
        for i in range(4):
            before = len(grown)
            c.sendall(frame)
            # decoded (its all-zero records rejected and counted) and handed on
            assert select.select([fd], [], [], 10)[0] == [fd]
            probe.poll()
            assert probe.server.stats["messages"] == 2 + i
            per_frame.append(len(grown) - before)
            time.sleep(0.1)                        # the thread back in its wait
    finally:
        c.close()
        probe.stop()
    assert per_frame[0] >= 1 and per_frame[1:] == [0, 0, 0], per_frame
