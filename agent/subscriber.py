"""The consumer side of the agent's stream, shared by ``tail``, ``top`` and ``record``.

Contract: :class:`Subscriber` connects a SUB socket (CURVE when given the server's public
key and a client key pair), and :meth:`Subscriber.receive` returns the next
:class:`Message` or ``None`` after ``timeout_s``. Each message has its topic, raw
envelope bytes and the decoded envelope fields. Sequence numbers are tracked per topic:
a jump forward is reported as ``gap`` (messages lost: dropped by the agent or by this
subscriber's queue), a jump back as ``restarted`` (the agent restarted and counts from
0 again). A frame that does not decode is counted in ``bad`` and skipped, never raised.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import zmq

from ridgeline.probes.errors import InputError

DEFAULT_ENDPOINT = "tcp://127.0.0.1:7411"


def envelope_field(env, name: str, default=None):
    """Read a field of a decoded envelope whether it is a dict or an object."""
    if isinstance(env, dict):
        return env.get(name, default)
    return getattr(env, name, default)


def decode_payload(codec, topic: str, payload):
    """Window and event-batch payloads decoded by the wire codec; others as they are."""
    if topic == "window" and not isinstance(payload, dict):
        return codec.decode_window(payload)
    if topic == "events" and not hasattr(payload, "kernels"):
        return codec.decode_event_batch(payload)
    return payload


@dataclass
class Message:
    topic: str
    raw: bytes
    envelope: object
    seq: int
    payload: object
    host: str = ""
    ts_ns: int = 0
    gap: int = 0             # messages missing before this one on its topic
    restarted: bool = False  # sequence went backwards: the agent restarted


@dataclass
class SeqTracker:
    last: dict = field(default_factory=dict)
    gaps: dict = field(default_factory=dict)
    restarts: int = 0

    def see(self, topic: str, seq: int) -> tuple[int, bool]:
        prev = self.last.get(topic)
        self.last[topic] = seq
        if prev is None:
            return 0, False
        if seq <= prev:
            self.restarts += 1
            return 0, True
        gap = seq - prev - 1
        if gap:
            self.gaps[topic] = self.gaps.get(topic, 0) + gap
        return gap, False


def _wire():
    from ridgeline.aggregator import wire
    return wire


class Subscriber:
    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, topics: list[str] | tuple[str, ...] = (),
                 rcvhwm: int = 10000, server_public_key: bytes | None = None,
                 client_keys: tuple[bytes, bytes] | None = None, codec=None,
                 context: zmq.Context | None = None):
        # codec: the wire module (decode_envelope, decode_window, decode_event_batch).
        self.codec = codec or _wire()
        self._decode = self.codec.decode_envelope
        self._own_ctx = context is None
        self.ctx = context or zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if server_public_key:
            pub, sec = client_keys or zmq.curve_keypair()
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, server_public_key)
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, pub)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, sec)
        for t in topics or ("",):
            self.sock.setsockopt(zmq.SUBSCRIBE, t.encode())
        try:
            self.sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise InputError(f"cannot connect to {endpoint}: {exc}") from None
        self.endpoint = endpoint
        self.seq = SeqTracker()
        self.bad = 0
        self.received = 0
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def receive(self, timeout_s: float) -> Message | None:
        """Next decodable message within ``timeout_s`` seconds, else None."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left < 0 or not self.poller.poll(max(0, int(left * 1000))):
                return None
            frames = self.sock.recv_multipart(zmq.NOBLOCK)
            msg = self._message(frames)
            if msg is not None:
                return msg

    def _message(self, frames: list[bytes]) -> Message | None:
        if len(frames) != 2:
            self.bad += 1
            return None
        topic_b, raw = frames
        try:
            env = self._decode(raw)
            topic = envelope_field(env, "topic") or envelope_field(env, "kind") or topic_b.decode("ascii", "replace")
            seq = int(envelope_field(env, "seq"))
        except Exception:
            self.bad += 1
            return None
        payload = envelope_field(env, "payload")
        try:
            payload = decode_payload(self.codec, topic, payload)
        except Exception:
            self.bad += 1
            return None
        self.received += 1
        gap, restarted = self.seq.see(topic, seq)
        return Message(topic=topic, raw=raw, envelope=env, seq=seq, payload=payload,
                       host=envelope_field(env, "host", "") or "", ts_ns=int(envelope_field(env, "ts_ns", 0) or 0),
                       gap=gap, restarted=restarted)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        if self._own_ctx and not self.ctx.closed:
            self.ctx.term()
