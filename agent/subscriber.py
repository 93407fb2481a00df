"""The consumer side of the agent's stream, shared by ``tail``, ``top`` and ``record``.

Contract: :class:`Subscriber` connects a SUB socket (CURVE when given the server's public
key and the client's key pair: :func:`server_key` and :func:`client_keys` read them from
the command line's ``--server-key``/``--client-key``, as written by ``ridgeline keys`` or
``zmq.auth.create_certificates``), and :meth:`Subscriber.receive` returns the next
:class:`Message` or ``None`` after ``timeout_s``. Each message has its topic, raw
envelope bytes and the decoded envelope fields. Sequence numbers are tracked per topic:
a jump forward is reported as ``gap`` (messages lost: dropped by the agent or by this
subscriber's queue), a jump back as ``restarted`` (the agent restarted and counts from
0 again). A frame that does not decode is counted in ``bad`` and skipped, never raised.
A CURVE handshake the agent refuses (a client key not in its allowed folder, a wrong
server key) sets :attr:`Subscriber.refused` to a one-line reason instead of waiting on in
silence. :func:`default_endpoint` is the agent's configured endpoint.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import zmq
import zmq.utils.z85

from ridgeline.probes.errors import InputError

DEFAULT_ENDPOINT = "ipc:///run/ridgeline/stream.sock"


def default_endpoint() -> str:
    """The endpoint the agent publishes on: ``publisher.endpoint`` of
    /etc/ridgeline/agent.toml when it is there and valid, else the default."""
    from . import config
    try:
        return config.load(None, missing_ok=True).publisher.endpoint
    except InputError:
        return DEFAULT_ENDPOINT


def server_key(text: str) -> bytes:
    """The agent's CURVE public key from ``--server-key``: 40 Z85 characters, or a
    certificate file (``server.key`` of ``ridgeline keys``/``zmq.auth``)."""
    # Z85's alphabet holds "/" and ".", so a key may look like a path: a 40-character value
    # is a key unless a file of that name exists.
    if len(text) == 40 and not os.path.isfile(text):
        key = text.encode("ascii", "replace")
    else:
        from zmq import auth
        try:
            key, _ = auth.load_certificate(text)
        except (OSError, ValueError) as exc:
            raise InputError(f"--server-key {text}: neither a 40-character Z85 key nor a certificate file "
                             f"({exc})") from None
    try:
        zmq.utils.z85.decode(key)
    except (ValueError, TypeError, KeyError, IndexError):
        raise InputError(f"--server-key {text}: not a Z85 key") from None
    return key


def client_keys(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from a secret certificate file (``NAME.key_secret`` of
    ``ridgeline keys``)."""
    import zmq.auth
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise InputError(f"--client-key {path}: cannot read the certificate ({exc})") from None
    if not secret:
        raise InputError(f"--client-key {path}: holds no secret key (give the NAME.key_secret file)")
    return public, secret


TOPICS = ("window", "events", "sched", "device", "engine", "health", "requests")


def add_stream_arguments(p, topics: bool = True) -> None:
    """The options ``tail``, ``top`` and ``record`` share: endpoint, CURVE keys, topics."""
    p.add_argument("--endpoint", default=None,
                   help="agent endpoint (default: publisher.endpoint of /etc/ridgeline/agent.toml, "
                        f"else {DEFAULT_ENDPOINT})")
    p.add_argument("--server-key", metavar="Z85|FILE",
                   help="the agent's CURVE public key (40 Z85 characters or its certificate file), "
                        "for a CURVE endpoint; a Z85 key that starts with '-' goes as --server-key=KEY")
    p.add_argument("--client-key", metavar="FILE",
                   help="this client's secret certificate (NAME.key_secret from `ridgeline keys`); its public "
                        "key must be in the agent's curve_allowed_clients_dir")
    if topics:
        p.add_argument("--topic", action="append", metavar="T", choices=TOPICS,
                       help=f"only this topic (repeatable): {', '.join(TOPICS)}")


def open_stream(args, topics=None, codec=None) -> "Subscriber":
    """A :class:`Subscriber` for the parsed ``add_stream_arguments`` options (``codec``: see
    :class:`Subscriber`)."""
    if not args.endpoint:
        args.endpoint = default_endpoint()
    _check_ipc_access(args.endpoint)
    return Subscriber(args.endpoint, topics=topics if topics is not None else (getattr(args, "topic", None) or ()),
                      codec=codec, **curve_options(args))


def _check_ipc_access(endpoint: str) -> None:
    """A unix socket this user may not open fails at once (zmq would retry in silence)."""
    if not endpoint.startswith("ipc://"):
        return
    import os

    from ridgeline.probes.errors import RuntimeFailure
    path = endpoint[len("ipc://"):]
    folder = os.path.dirname(path) or "."
    if os.path.isdir(folder) and not os.access(folder, os.X_OK):
        raise RuntimeFailure(f"cannot open {endpoint}: no access to {folder} (the agent's stream is for its "
                             "user and publisher.ipc_group; ask to be added to that group)")
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        raise RuntimeFailure(f"cannot open {endpoint}: permission denied (the agent's stream is for its "
                             "user and publisher.ipc_group; ask to be added to that group)")


def curve_options(args) -> dict:
    """Subscriber keyword arguments for ``--server-key``/``--client-key`` (both or neither)."""
    sk, ck = getattr(args, "server_key", None), getattr(args, "client_key", None)
    if bool(sk) != bool(ck):
        raise InputError("--server-key and --client-key go together: the agent admits only clients whose "
                         "public key is in its publisher.curve_allowed_clients_dir (make a pair with `ridgeline keys`)")
    if not sk:
        return {}
    return {"server_public_key": server_key(sk), "client_keys": client_keys(ck)}


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
        self.refused: str | None = None
        self._monitor = None
        if server_public_key:
            if not client_keys:
                self.close()
                raise InputError("a CURVE endpoint needs the client's key pair (--client-key)")
            pub, sec = client_keys
            try:
                self.sock.setsockopt(zmq.CURVE_SERVERKEY, server_public_key)
                self.sock.setsockopt(zmq.CURVE_PUBLICKEY, pub)
                self.sock.setsockopt(zmq.CURVE_SECRETKEY, sec)
            except zmq.ZMQError as exc:
                self.close()
                raise InputError(f"bad CURVE key: {exc}") from None
            # Handshake failures are told only through the monitor: watch it, so a
            # refused key is one clear line rather than a silent wait.
            self._monitor = self.sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
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
        if self._monitor is not None:
            self.poller.register(self._monitor, zmq.POLLIN)

    def receive(self, timeout_s: float) -> Message | None:
        """Next decodable message within ``timeout_s`` seconds, else None."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left < 0:
                return None
            ready = dict(self.poller.poll(max(0, int(left * 1000))))
            if not ready:
                return None
            if self._monitor is not None and self._monitor in ready:
                self._handshake_event()
            if self.sock not in ready:
                continue
            frames = self.sock.recv_multipart(zmq.NOBLOCK)
            msg = self._message(frames)
            if msg is not None:
                return msg

    def _handshake_event(self) -> None:
        from zmq.utils.monitor import recv_monitor_message
        try:
            ev = recv_monitor_message(self._monitor, zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.refused = (f"the agent at {self.endpoint} refused this client key (its public key must be in "
                            "the agent's publisher.curve_allowed_clients_dir)")
        else:
            self.refused = (f"CURVE handshake with {self.endpoint} failed (wrong --server-key, or the endpoint "
                            "does not use CURVE)")

    def _message(self, frames: list[bytes]) -> Message | None:
        if len(frames) != 2:
            self.bad += 1
            return None
        topic_b, raw = frames
        try:
            env = self._decode(raw)
            topic = envelope_field(env, "topic") or envelope_field(env, "kind") or topic_b.decode("ascii", "replace")
            seq = int(envelope_field(env, "seq"))
        except (InputError, TypeError, ValueError):   # malformed envelope, or no integer seq: counted
            self.bad += 1
            return None
        payload = envelope_field(env, "payload")
        try:
            payload = decode_payload(self.codec, topic, payload)
        except InputError:          # the codec's one error for a malformed payload: counted
            self.bad += 1
            return None
        self.received += 1
        gap, restarted = self.seq.see(topic, seq)
        return Message(topic=topic, raw=raw, envelope=env, seq=seq, payload=payload,
                       host=envelope_field(env, "host", "") or "", ts_ns=int(envelope_field(env, "ts_ns", 0) or 0),
                       gap=gap, restarted=restarted)

    def close(self) -> None:
        if getattr(self, "_monitor", None) is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._monitor = None
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        if self._own_ctx and not self.ctx.closed:
            self.ctx.term()
