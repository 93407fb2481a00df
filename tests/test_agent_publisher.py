"""agent.publisher: loopback guard, CURVE with a ZAP allow-list, never-blocking sends."""
import time

import msgpack
import pytest
import zmq
import zmq.auth

from ridgeline.agent.publisher import Publisher, is_loopback
from ridgeline.probes.errors import InputError


def enc(topic, seq, payload, host, ts_ns):
    # Transport tests only: the envelope codec is aggregator.wire's (tested there).
    return msgpack.packb([topic, seq, host, ts_ns, payload])


@pytest.mark.parametrize("ep, ok", [
    ("tcp://127.0.0.1:7411", True), ("tcp://127.3.4.5:1", True), ("tcp://localhost:7411", True),
    ("tcp://[::1]:7411", True), ("ipc:///run/ridgeline/stream.sock", True),
    ("tcp://*:7411", False), ("tcp://0.0.0.0:7411", False), ("tcp://10.0.0.5:7411", False),
    ("tcp://eth0:7411", False), ("tcp://[::]:7411", False),
])
def test_is_loopback(ep, ok):
    assert is_loopback(ep) is ok


def test_non_loopback_without_curve_is_refused():
    with pytest.raises(InputError, match="refusing to publish on tcp://0.0.0.0:7499 in the clear"):
        Publisher("tcp://0.0.0.0:7499", encode=enc)


def _sub(ctx, ep, server_pub=None, keys=None):
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    if server_pub:
        pub, sec = keys
        s.setsockopt(zmq.CURVE_SERVERKEY, server_pub)
        s.setsockopt(zmq.CURVE_PUBLICKEY, pub)
        s.setsockopt(zmq.CURVE_SECRETKEY, sec)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(ep)
    return s


def _pump(pub, sock, seconds=30.0):
    """Publish until ``sock`` has a message (the subscription reached the publisher); the
    deadline is generous: a loaded host can take seconds over a CURVE handshake."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pub.publish("health", {"x": 1})
        pub.service()
        if sock.poll(50):
            return sock.recv_multipart()
    return None


def _bound_port(pub) -> int:
    """The port a ``tcp://HOST:*`` publisher was given (a fixed port can be taken by
    another test run on the same host)."""
    return int(pub.sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])


def test_curve_admits_only_allowed_clients(tmp_path):
    keys = tmp_path / "keys"
    allowed = tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    _, server_secret = zmq.auth.create_certificates(keys, "server")
    client_pub_file, client_secret_file = zmq.auth.create_certificates(keys, "client")
    # Only the client's public key goes into the allow-list.
    (allowed / "client.key").write_bytes(open(client_pub_file, "rb").read())
    server_pub, _ = zmq.auth.load_certificate(server_secret)
    pub = Publisher("tcp://0.0.0.0:*", encode=enc,
                    curve_secret_key_file=str(server_secret), curve_allowed_clients_dir=str(allowed))
    ep = f"tcp://127.0.0.1:{_bound_port(pub)}"
    ctx = zmq.Context()
    try:
        good = _sub(ctx, ep, server_pub, zmq.auth.load_certificate(client_secret_file))
        stranger = _sub(ctx, ep, server_pub, zmq.curve_keypair())
        plain = _sub(ctx, ep)
        got = _pump(pub, good)
        assert got is not None and got[0] == b"health"
        assert stranger.poll(300) == 0 and plain.poll(100) == 0
    finally:
        for s in (good, stranger, plain):
            s.close(0)
        ctx.term()
        pub.close()


def test_curve_needs_allowed_clients(tmp_path):
    _, secret = zmq.auth.create_certificates(tmp_path, "server")
    with pytest.raises(InputError, match="curve_allowed_clients_dir"):
        Publisher("tcp://0.0.0.0:17432", encode=enc, curve_secret_key_file=str(secret))


def test_bad_key_file_is_one_line(tmp_path):
    bad = tmp_path / "k"
    bad.write_text("short")
    with pytest.raises(InputError, match="40-character Z85"):
        Publisher("tcp://0.0.0.0:17433", encode=enc, curve_secret_key_file=str(bad),
                  curve_allowed_clients_dir=str(tmp_path))


def test_sequence_numbers_per_topic_and_frames(tmp_path):
    ep = f"ipc://{tmp_path}/s.sock"
    pub = Publisher(ep, host="h1", encode=enc)
    ctx = zmq.Context()
    s = _sub(ctx, ep)
    try:
        assert _pump(pub, s) is not None       # subscription established
        while s.poll(100):
            s.recv_multipart()
        pub.publish("window", {"a": 1})
        pub.publish("window", {"a": 2})
        pub.publish("device", {"b": 1})
        got = [s.recv_multipart() for _ in range(3)]
        topics = [g[0] for g in got]
        decoded = [msgpack.unpackb(g[1]) for g in got]
        assert topics == [b"window", b"window", b"device"]
        assert [d[1] for d in decoded] == [0, 1, 0] and decoded[0][2] == "h1"
    finally:
        s.close(0)
        ctx.term()
        pub.close()


def test_slow_subscriber_never_blocks_and_drops_are_counted(tmp_path):
    ep = f"ipc://{tmp_path}/slow.sock"
    pub = Publisher(ep, sndhwm=10, encode=enc)
    ctx = zmq.Context()
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.RCVHWM, 10)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(ep)
    try:
        assert _pump(pub, s) is not None
        t0 = time.monotonic()
        big = {"blob": b"x" * 100_000}
        for _ in range(2000):
            pub.publish("events", big)          # nobody reads: queues fill
        # never blocked: a blocking send would wait for ever (nobody reads); the bound only
        # keeps a loaded host's slowness (2000 x 100 kB encoded) from failing the test
        assert time.monotonic() - t0 < 60
        assert pub.drops["events"] > 0           # the slow subscriber missed messages: counted
        assert pub.sent["events"] == 2000 and pub.errors == 0
        assert pub.lossy_sent == pub.drops["events"]
        assert pub.seq["events"] == 2000        # missed messages consumed their number
    finally:
        s.close(0)
        ctx.term()
        pub.close()


def test_publishing_with_no_subscriber_is_fine(tmp_path):
    pub = Publisher(f"ipc://{tmp_path}/none.sock", encode=enc)
    for _ in range(100):
        pub.publish("window", {"x": 1})
    assert pub.drops["window"] == 0 and pub.sent["window"] == 100
    pub.close()
    pub.close()   # idempotent


def test_garbage_from_peers_is_counted_not_fatal():
    pub = Publisher("tcp://127.0.0.1:*", encode=enc)
    port = _bound_port(pub)
    import socket as pysock
    raw = pysock.create_connection(("127.0.0.1", port))
    raw.sendall(b"\xff" * 64 + b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 8)
    ctx = zmq.Context()
    x = ctx.socket(zmq.XSUB)          # a peer that sends a malformed subscription frame
    x.connect(f"tcp://127.0.0.1:{port}")
    x.send(b"\x07not-a-subscription")
    x.send(b"")
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and pub.bad_frames == 0:
            pub.service()
            pub.publish("health", {"ok": True})
            time.sleep(0.02)
        assert pub.bad_frames >= 1
        assert pub.publish("health", {"ok": True}) is True
    finally:
        raw.close()
        x.close(0)
        ctx.term()
        pub.close()


@pytest.mark.parametrize("reader", ["stalled", "intermittent"])
def test_a_stalled_subscriber_costs_the_healthy_ones_nothing(tmp_path, reader):
    """Issue 14.8: one stalled (or slow, intermittently failing) subscriber must not cost
    a healthy one a single message; its own misses are counted."""
    ep = f"ipc://{tmp_path}/stall.sock"
    # A high-water mark well above the few messages a healthy reader has in flight (at a
    # tiny mark libzmq's lazy read acknowledgements make even a healthy pipe look full).
    pub = Publisher(ep, sndhwm=20, encode=enc, stall_s=0.2)
    ctx = zmq.Context()
    stuck = ctx.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 1024)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(ep)
    live = _sub(ctx, ep)
    try:
        assert _pump(pub, live) is not None
        assert _pump(pub, stuck) is not None
        while live.poll(100):
            live.recv_multipart()
        big = b"x" * 150_000
        first = pub.seq["events"]
        seen = []
        lossy_seen = False
        for i in range(300):
            pub.publish("events", {"blob": big})
            # lossy is true while a miss is recent (stall_s): seen at some point of the
            # stall, not necessarily at its end, which a loaded host may reach later
            lossy_seen |= pub.lossy
            if reader == "intermittent" and i % 7 == 0:
                try:                                   # a slow reader: now and then one message
                    stuck.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    pass
            # The healthy subscriber reads each message before the next is sent.
            assert live.poll(30000), f"healthy subscriber lost message {i}"
            seen.append(msgpack.unpackb(live.recv_multipart()[1])[1])
        assert seen == list(range(first, first + 300))
        assert pub.drops["events"] > 0 and pub.stalls >= 1 and lossy_seen
        assert pub.sent["events"] >= 300 and pub.errors == 0
        stuck.close(0)                            # the stall clears: misses stop growing
        # once libzmq's I/O thread has let the closed pipe go (a loaded host can take a
        # while): a send taken whole and the stall older than stall_s
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            before = pub.drops["events"]
            pub.publish("events", {"small": 1})
            while live.poll(0):
                live.recv_multipart()
            if pub.drops["events"] == before and not pub.lossy:
                break
            time.sleep(0.05)
        before = pub.drops["events"]
        for _ in range(50):
            pub.publish("events", {"small": 1})
            while live.poll(0):
                live.recv_multipart()
            time.sleep(0.01)
        assert not pub.lossy and pub.drops["events"] == before
    finally:
        live.close(0)
        stuck.close(0)
        ctx.term()
        pub.close()
