"""Malformed and hostile messages on the agent's CUPTI socket: rejected, counted, harmless."""
from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

from ridgeline.probes.cupti import protocol as P
from ridgeline.probes.cupti.server import CuptiServer


def hello_body(pid=None, comm=b"vllm", status=b"", cbids=()) -> bytes:
    """A HELLO; ``pid`` defaults to this process (the server checks it with SO_PEERCRED)."""
    pid = os.getpid() if pid is None else pid
    h = np.zeros(1, P.HELLO_DTYPE)
    h["pid"], h["cupti_version"], h["comm_len"], h["status_len"] = pid, 130500, len(comm), len(status)
    h["n_cbids"] = len(cbids)
    pad = lambda b: b + b"\0" * (-len(b) % 8)  # noqa: E731
    out = h.tobytes() + pad(comm) + pad(status)
    for domain, cbid, category, name in cbids:
        c = np.zeros(1, P.CBID_DTYPE)
        c["domain"], c["cbid"], c["category"], c["name_len"] = domain, cbid, category, len(name)
        out += c.tobytes() + pad(name)
    return out


def batch_body(n_names=0, sections=(), records=None, names=(), pid=None) -> bytes:
    b = np.zeros(1, P.BATCH_DTYPE)
    b["pid"], b["n_names"], b["n_sections"] = os.getpid() if pid is None else pid, n_names, len(sections)
    b["records"] = sum(c for _, _, c, _ in sections) if records is None else records
    out = b.tobytes()
    for ptr, s in names:
        n = np.zeros(1, P.NAME_DTYPE)
        n["ptr"], n["len"] = ptr, len(s)
        out += n.tobytes() + s + b"\0" * (-len(s) % 8)
    for kind, size, count, data in sections:
        s = np.zeros(1, P.SECTION_DTYPE)
        s["kind"], s["record_size"], s["count"] = kind, size, count
        out += s.tobytes() + data
    return out


def test_well_formed_messages_parse():
    h = P.parse_hello(hello_body(7, status=b"conflict: x"))
    assert (h.pid, h.comm, h.status) == (7, "vllm", "conflict: x")
    b = P.parse_batch(batch_body(1, [(10, 248, 2, bytes(496))], names=[(0x1000, b"k")]))
    assert b.names == {0x1000: "k"} and b.sections[0].count == 2


@pytest.mark.parametrize("body, msg", [
    (batch_body(records=5), "header says 5 records"),
    (batch_body(sections=[(10, 248, 3, bytes(248))]), "truncated"),
    (batch_body(sections=[(10, 2**32 - 8, 2**31, b"")]), "truncated"),
    (batch_body(n_names=10**9), "cannot fit"),
    (batch_body(1, names=[(1, b"x" * 5000)]), "exceeds"),
    (batch_body() + b"junk0000", "trailing"),
    (b"\1\2\3", "truncated"),
])
def test_bad_batches_are_protocol_errors(body, msg):
    with pytest.raises(P.ProtocolError, match=msg):
        P.parse_batch(body)


@pytest.mark.parametrize("section, reason", [
    ((10, 12, 1, bytes(12)), "implausible record size"),
    ((10, 1 << 20, 1, bytes(1 << 20)), "implausible record size"),  # a failed record walk: one huge record
    ((99, 8, 1, bytes(8)), "bad or repeated record kind"),
])
def test_a_bad_section_costs_only_that_section(section, reason):
    good = (5, 40, 2, bytes(80))
    b = P.parse_batch(batch_body(sections=[section, good]))
    assert [(s.kind, s.count) for s in b.sections] == [(5, 2)]
    assert len(b.rejected) == 1 and reason in b.rejected[0][2] and b.rejected[0][1] == 1
    b = P.parse_batch(batch_body(sections=[good, (5, 40, 1, bytes(40))]))   # the same kind twice
    assert len(b.sections) == 1 and "repeated" in b.rejected[0][2]


@pytest.mark.parametrize("cbid, domain", [(0xFFFFFFFF, 1), (4096, 2), (5, 7)])
def test_hello_callback_ids_are_bounded(cbid, domain):
    with pytest.raises(P.ProtocolError, match="out of range"):
        P.parse_hello(hello_body(7, cbids=[(domain, cbid, 1, b"cudaLaunchKernel")]))


def test_library_counters_are_bounded():
    b = np.frombuffer(batch_body(), P.BATCH_DTYPE).copy()
    b["dropped_cupti"] = 2**64 - 1
    with pytest.raises(P.ProtocolError, match="dropped_cupti"):
        P.parse_batch(b.tobytes())


def test_bad_frame_headers():
    good = P.encode_frame(P.MSG_HELLO, b"")
    with pytest.raises(P.ProtocolError, match="magic"):
        P.parse_frame_header(b"XXXX" + good[4:16])
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.parse_frame_header(P.encode_frame(P.MSG_BATCH, b"")[:8] + (P.MAX_BODY_BYTES + 1).to_bytes(4, "little") + b"\0" * 4)
    with pytest.raises(P.ProtocolError, match="unknown message type"):
        P.parse_frame_header(P.encode_frame(77, b""))


@pytest.fixture
def server(tmp_path):
    s = CuptiServer(str(tmp_path / "c.sock"), idle_timeout_s=0.3, max_connections=4)
    s.open()
    yield s
    s.close()


def connect(path) -> socket.socket:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(path)
    return c


def pump(server, rounds=20):
    for _ in range(rounds):
        server.pump(0.01)


def settle(server):
    """Past the identity check's interval: batches that came right after the HELLO's check
    wait for the next check of the peer's start time (issue 18.3), then are handed on."""
    time.sleep(server.identity_check_s)
    pump(server, 2)


def test_hostile_peers_are_cut_and_counted_and_the_good_one_keeps_working(server):
    good = connect(server.path)
    good.sendall(P.encode_frame(P.MSG_HELLO, hello_body()))
    garbage = connect(server.path)
    garbage.sendall(b"GET / HTTP/1.1\r\n\r\n")
    impostor = connect(server.path)
    impostor.sendall(P.encode_frame(P.MSG_HELLO, hello_body(pid=1)))     # claims to be init
    early = connect(server.path)
    early.sendall(P.encode_frame(P.MSG_BATCH, batch_body()))
    pump(server)
    assert server.stats["protocol_errors"] == 3 and server.stats["rejected_peers"] == 1
    assert server.connections == 1
    # a batch that lies about its record count, then one for another pid: each costs
    # only itself, the connection and the next batch survive
    good.sendall(P.encode_frame(P.MSG_BATCH, batch_body(records=9))
                 + P.encode_frame(P.MSG_BATCH, batch_body(pid=1))
                 + P.encode_frame(P.MSG_BATCH, batch_body(1, [(10, 248, 1, bytes(248))], names=[(5, b"k")])))
    pump(server)
    assert server.stats["rejected_batches"] == 2 and server.connections == 1
    msgs = server.drain()
    kinds = [m.kind for m in msgs if m.conn_id == 1]
    assert kinds == ["hello", "batch"]
    assert {m.pid for m in msgs if m.conn_id == 1} == {os.getpid()}
    for s in (good, garbage, impostor, early):
        s.close()


def test_slow_half_frame_is_cut_without_stalling(server):
    slow = connect(server.path)
    slow.sendall(P.encode_frame(P.MSG_HELLO, hello_body())[:20])   # header + 4 bytes, then silence
    t = time.monotonic()
    pump(server, 5)
    time.sleep(0.35)
    pump(server, 5)
    # ten pump rounds of 10 ms and the sleep: about 0.45 s. A blocking read of the half
    # frame would wait for ever (the peer sends nothing more); the bound leaves a loaded
    # host room (2 s before)
    assert time.monotonic() - t < 10
    assert server.stats["idle_cut"] == 1 and server.connections == 0
    slow.close()


def test_connection_limit(server):
    socks = [connect(server.path) for _ in range(6)]
    pump(server)
    assert server.connections == 4 and server.stats["refused_connections"] == 2
    for s in socks:
        s.close()


def test_queue_bound_drops_batches(tmp_path):
    from ridgeline.probes.cupti.server import MESSAGE_OVERHEAD_BYTES as O
    body = batch_body(0, [(10, 248, 4, bytes(992))])
    # room for the HELLO and two batches, each with its objects' overhead
    s = CuptiServer(str(tmp_path / "q.sock"), max_queued_bytes=len(hello_body()) + O + 2 * (len(body) + O) + 10)
    s.open()
    try:
        c = connect(s.path)
        c.sendall(P.encode_frame(P.MSG_HELLO, hello_body()))
        for _ in range(5):
            c.sendall(P.encode_frame(P.MSG_BATCH, body))
        pump(s)
        settle(s)
        assert s.stats["dropped_batches_queue_full"] == 3
        assert sum(m.kind == "batch" for m in s.drain()) == 2
        c.close()
    finally:
        s.close()


def test_refuses_to_replace_a_regular_file(tmp_path):
    p = tmp_path / "not-a-socket"
    p.write_text("x")
    with pytest.raises(OSError, match="not a socket"):
        CuptiServer(str(p)).open()
    assert p.read_text() == "x"


def test_control_frame_round_trip():
    f = P.encode_control(P.MODE_DEEP, 3)
    t, n = P.parse_frame_header(f[:16])
    c = np.frombuffer(f[16:], P.CONTROL_DTYPE)[0]
    assert (t, n, int(c["mode"]), int(c["kernel_sample_every"])) == (P.MSG_CONTROL, 16, 1, 3)


def test_half_received_frames_are_bounded_across_peers(tmp_path):
    s = CuptiServer(str(tmp_path / "p.sock"), max_partial_bytes=100_000)
    s.open()
    try:
        big = P.encode_frame(P.MSG_HELLO, b"\0" * 80_000)[:60_000]   # header says 80 kB, 60 kB sent
        a, b = connect(s.path), connect(s.path)
        a.sendall(big)
        pump(s)
        assert s.connections == 2 and s.stats["partial_cap_cut"] == 0
        b.sendall(big)             # together over 100 kB: the peer that went over is cut
        pump(s)
        settle(s)
        assert s.stats["partial_cap_cut"] == 1 and s.connections == 1
        a.close()
        b.close()
        pump(s)
        assert s._partial_bytes == 0
    finally:
        s.close()


def test_repeated_hello_updates_the_state_and_reclaim_reaches_the_library(tmp_path):
    """The library sends HELLO again when a takeover starts or ends (probes/native); the
    agent keeps the connection, counts the process as taken over, and can ask it to
    reclaim CUPTI. A repeated HELLO naming another pid is refused like a first one."""
    from support import cupti_records as R

    from ridgeline.probes.cupti.probe import CuptiProbe
    probe = CuptiProbe(str(tmp_path / "c.sock"))
    probe.start()
    try:
        c = connect(probe.socket_path)
        c.sendall(R.hello_frame())
        R.poll_until(probe, lambda g: any("new_pids" in x for x in g))
        h = np.frombuffer(R.hello_frame()[16:56], P.HELLO_DTYPE).copy()
        h["flags"] = P.FLAG_TAKEN_OVER
        status = b"takeover: torch.profiler re-registered the buffer callbacks"
        h["status_len"] = len(status)
        body = h.tobytes() + b"python\0\0" + status + b"\0" * (-len(status) % 8) + R.hello_frame()[16 + 40 + 8:]
        c.sendall(P.encode_frame(P.MSG_HELLO, body))
        got = R.poll_until(probe, lambda g: any("status" in x for x in g))
        assert any(os.getpid() in x.get("status", {}) for x in got)
        assert not any("new_pids" in x for x in got)                   # the same process, not a new one
        assert probe.counters()["processes_taken_over"] == 1 and probe.server.connections == 1
        assert probe.reclaim() == 1
        c.settimeout(5)
        frame = c.recv(32)
        t, n = P.parse_frame_header(frame[:16])
        ctl = np.frombuffer(frame[16:16 + n], P.CONTROL_DTYPE)[0]
        assert t == P.MSG_CONTROL and int(ctl["flags"]) == P.CONTROL_RECLAIM
        c.sendall(R.hello_frame(pid=1))                                # now claiming init
        R.poll_until(probe, lambda g: probe.counters().get("server_rejected_peers", 0) == 1, timeout_s=5)
        assert probe.counters()["server_rejected_peers"] == 1
        c.close()
    finally:
        probe.stop()


def test_trickling_peer_is_cut_at_the_frame_deadline_though_it_progresses(tmp_path):
    """Slowloris: one byte at a time, each in time for a progress timeout, never finishing
    a frame. The deadline runs from the frame's first byte, so the peer is cut."""
    s = CuptiServer(str(tmp_path / "t.sock"), idle_timeout_s=0.5)
    s.open()
    try:
        slow = connect(s.path)
        frame = P.encode_frame(P.MSG_HELLO, hello_body())
        for i in range(12):                     # 1.2 s, a byte every 0.1 s (< idle_timeout_s)
            try:
                slow.send(frame[i:i + 1])
            except OSError:
                break
            pump(s, 1)
            time.sleep(0.1)
        pump(s, 2)
        assert s.stats["idle_cut"] == 1 and s.connections == 0
        slow.close()
    finally:
        s.close()


def test_connection_that_never_says_hello_is_cut(tmp_path):
    """A peer that connects and stays silent holds a connection slot (of a bounded number)
    for ever unless the HELLO the library sends at once is awaited with a deadline."""
    s = CuptiServer(str(tmp_path / "h.sock"), hello_timeout_s=0.3)
    s.open()
    try:
        silent, good = connect(s.path), connect(s.path)
        good.sendall(P.encode_frame(P.MSG_HELLO, hello_body()))
        pump(s, 3)
        time.sleep(0.4)
        pump(s, 3)
        assert s.stats["hello_timeout_cut"] == 1 and s.connections == 1
        assert [m.kind for m in s.drain()] == ["hello", "closed"]
        silent.close()
        good.close()
    finally:
        s.close()


def test_peer_parking_a_large_frame_is_cut_not_the_next_sender(tmp_path):
    """Half-received bytes are bounded across peers; the peer cut when the bound is passed
    is the one holding the most, not the legitimate library whose frame came next."""
    s = CuptiServer(str(tmp_path / "p.sock"), max_partial_bytes=100_000)
    s.open()
    try:
        park = connect(s.path)
        park.sendall(P.encode_frame(P.MSG_HELLO, b"\0" * 90_000)[:85_000])     # 85 of 90 kB, then silence
        pump(s)
        good = connect(s.path)
        good.sendall(P.encode_frame(P.MSG_HELLO, hello_body())
                     + P.encode_frame(P.MSG_BATCH, batch_body(0, [(10, 248, 100, bytes(248 * 100))])))
        pump(s)
        settle(s)
        assert s.stats["partial_cap_cut"] == 1 and s.connections == 1
        assert [m.kind for m in s.drain() if m.kind != "closed"] == ["hello", "batch"]
        park.close()
        good.close()
    finally:
        s.close()


def test_hello_flood_is_cut_and_queues_nothing_more(tmp_path):
    """A library sends HELLO at connect and on takeover changes. 300,000 HELLOs of 64 bytes
    held one pump round for 9.7 s and queued 300,000 messages (RSS 85 -> 247 MiB); now a
    burst of 16 repeats is allowed, then one a second, and a peer going faster is cut."""
    s = CuptiServer(str(tmp_path / "hf.sock"))
    s.open()
    try:
        c = connect(s.path)
        c.sendall(P.encode_frame(P.MSG_HELLO, hello_body()) * 200)
        pump(s, 5)
        assert s.stats["hello_flood_cut"] == 1 and s.connections == 0
        msgs = s.drain()
        assert sum(m.kind == "hello" for m in msgs) == 1 + 16 and msgs[-1].kind == "closed"
        c.close()
    finally:
        s.close()


def test_tiny_messages_count_their_objects_against_the_queue_and_the_round(tmp_path):
    """Batches of 184 bytes: the queue bound counts each message's objects too (400,000 of
    them took the agent from 137 to 592 MiB under a 256 MiB bound on body bytes), and one
    round reads a bounded number of frames from one peer, so other peers are served."""
    from ridgeline.probes.cupti.server import MAX_FRAMES_PER_ROUND, MESSAGE_OVERHEAD_BYTES
    body = batch_body()
    s = CuptiServer(str(tmp_path / "tb.sock"), max_queued_bytes=100 * (len(body) + MESSAGE_OVERHEAD_BYTES))
    s.open()
    try:
        c = connect(s.path)
        try:       # room for every frame in the socket, so that one round could read them all
            c.setsockopt(socket.SOL_SOCKET, 32, 8 << 20)     # SO_SNDBUFFORCE (root)
            forced = True
        except OSError:
            forced = False
        c.sendall(P.encode_frame(P.MSG_HELLO, hello_body()))
        pump(s, 2)
        assert len(s.drain()) == 1
        c.sendall(P.encode_frame(P.MSG_BATCH, body) * 3000) if forced else None
        if forced:
            s.pump(0.5)
            assert 0 < s.stats["messages"] - 1 <= MAX_FRAMES_PER_ROUND
        else:
            import threading
            threading.Thread(target=c.sendall, args=(P.encode_frame(P.MSG_BATCH, body) * 3000,), daemon=True).start()
        for _ in range(200):
            if s.stats["messages"] == 1 + 3000:
                break
            s.pump(0.01)
        assert s.stats["messages"] == 1 + 3000
        settle(s)      # held batches count against the bound as queued ones do
        assert len(s.drain()) == 100 and s.stats["dropped_batches_queue_full"] == 2900
        c.close()
    finally:
        s.close()
