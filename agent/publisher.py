"""The agent's ZeroMQ stream: one publishing socket, msgpack envelopes, never blocking.

Contract:

* Messages are two frames: ``[topic, envelope]``. ``topic`` is the ASCII topic name
  (``window``, ``events``, ``sched``, ``device``, ``engine``, ``health``) so subscribers
  filter with ``SUBSCRIBE``; ``envelope`` is ``aggregator.wire.encode_envelope(topic,
  seq, payload, host, ts_ns)``, with ``seq`` counting from 0 per topic for the life of the
  publisher, so a subscriber counts gaps.
* :meth:`Publisher.publish` never blocks. The socket is an XPUB with ``XPUB_NODROP`` and a
  send high-water mark: when a subscriber's queue is full the send fails at once
  (``zmq.Again``) instead of dropping silently as a plain PUB would, so the agent knows.
* One stalled subscriber never costs the others a message: a send that fails that way
  is at once sent again with ``XPUB_NODROP`` off, which delivers it to every subscriber
  with room and skips only the full ones (they see a sequence gap). Such a message is
  counted in ``drops`` (per topic: messages some subscriber missed) and in
  ``lossy_sent``; every episode of failures (a failure after ``stall_s`` without one)
  counts one ``stalls``, and ``lossy`` is true while failures are recent. libzmq then
  marks the full subscriber's pipe inactive and skips it without telling the sender
  until it reads again, so ``drops`` counts the misses the publisher saw (the first of an
  episode and any later failure), not every message the stalled subscriber lost: that
  exact count is the subscriber's, from its sequence gaps (``ridgeline tail`` reports them). This works the
  same whether the failures are continuous or intermittent (a slow reader). A message no
  subscriber can get (an encoding or socket error) is counted in ``drops`` and
  ``errors``. The sequence number is consumed either way, so gaps show at subscribers.
* A tcp bind to an address that is not loopback is refused with :class:`InputError`
  unless a CURVE server secret key is configured; with CURVE, a ZAP authenticator
  admits only the client public keys found in the allowed-clients folder.
  :func:`check_settings` runs those checks (and reads the key files) without binding.
* An ``ipc://`` socket is made mode 0660, group ``ipc_group`` when given: only the
  agent's user and that group can subscribe. Its folder is never created, except a
  missing folder directly under ``/run`` (mode 0750).
* :meth:`Publisher.service` drains subscription frames the socket receives (without
  trusting their content: anything malformed is counted in ``bad_frames``).
"""
from __future__ import annotations

import ipaddress
import os
import socket
import time
from pathlib import Path
from typing import Callable

import zmq

from ridgeline.probes.errors import InputError

TOPICS = ("window", "events", "sched", "device", "engine", "health", "requests")


def _tcp_host(endpoint: str) -> str:
    rest = endpoint[len("tcp://"):]
    # tcp://[::1]:7411, tcp://127.0.0.1:7411, tcp://*:7411, tcp://eth0:7411
    if rest.startswith("["):
        return rest[1:rest.index("]")]
    return rest.rsplit(":", 1)[0]


def is_loopback(endpoint: str) -> bool:
    """True for ``ipc://`` and for tcp endpoints bound to a loopback address only."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = _tcp_host(endpoint)
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False   # '*', an interface name or a host name: may face the network


def _read_secret_key(path: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a zmq.auth secret certificate or a bare key file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="ascii")
    except OSError as exc:
        raise InputError(f"publisher.curve_secret_key_file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise InputError(f"publisher.curve_secret_key_file {path}: not a Z85 key file") from None
    if "secret-key" in text:
        import zmq.auth
        try:
            public, secret = zmq.auth.load_certificate(p)
        except (OSError, ValueError) as exc:   # zmq.auth: unreadable file, no key in it, not text
            raise InputError(f"publisher.curve_secret_key_file {path}: bad certificate ({exc})") from None
        if not secret:
            raise InputError(f"publisher.curve_secret_key_file {path}: certificate holds no secret key")
        return public, secret
    key = text.strip().encode()
    if len(key) != 40:
        raise InputError(f"publisher.curve_secret_key_file {path}: expected a 40-character Z85 secret key")
    try:
        public = zmq.curve_public(key)
    except zmq.ZMQError as exc:
        raise InputError(f"publisher.curve_secret_key_file {path}: invalid key ({exc})") from None
    return public, key


def check_settings(p) -> None:
    """Raise :class:`InputError` for ``[publisher]`` settings (``agent.config.PublisherSettings``)
    that cannot bind, without
    binding: the clear-text rule and the CURVE key files."""
    ep = p.endpoint
    curve = bool(p.curve_secret_key_file)
    if not is_loopback(ep) and not curve:
        raise InputError(
            f"refusing to publish on {ep} in the clear: a non-loopback bind needs CURVE keys "
            "(set publisher.curve_secret_key_file and publisher.curve_allowed_clients_dir)")
    if curve:
        if not p.curve_allowed_clients_dir:
            raise InputError("publisher.curve_allowed_clients_dir must name the folder of allowed client keys")
        _read_secret_key(p.curve_secret_key_file)
        if not Path(p.curve_allowed_clients_dir).is_dir():
            raise InputError(f"publisher.curve_allowed_clients_dir {p.curve_allowed_clients_dir}: not a folder")


def _ipc_folder(path: str) -> None:
    """Create the socket's folder only when it sits directly under /run (systemd's
    RuntimeDirectory does the same); anywhere else it must exist."""
    folder = Path(path).parent
    if folder.is_dir():
        return
    if str(folder.parent) != "/run":
        raise InputError(f"cannot bind ipc://{path}: folder {folder} does not exist")
    try:
        folder.mkdir(mode=0o750)
    except FileExistsError:
        pass
    except OSError as exc:
        raise InputError(f"cannot bind ipc://{path}: cannot create {folder}: {exc.strerror or exc}") from None


def _default_encoder():
    from ridgeline.aggregator import wire
    return wire.encode_envelope


class Publisher:
    """Bind, publish, count. Construct with the ``[publisher]`` config values."""

    def __init__(self, endpoint: str, host: str = "", sndhwm: int = 1000,
                 curve_secret_key_file: str = "", curve_allowed_clients_dir: str = "",
                 encode: Callable | None = None, context: zmq.Context | None = None,
                 stall_s: float = 2.0, probe_s: float = 5.0, clock=time.monotonic, ipc_group: str = ""):
        self.endpoint = endpoint
        self.host = host or socket.gethostname()
        self._encode = encode or _default_encoder()
        self.seq = {t: 0 for t in TOPICS}
        #: ``tap(topic, seq, envelope)`` sees every encoded message, sent or not (the sink's
        #: hand-off, agent/sink_handoff.py); it must not raise or block
        self.tap: Callable[[str, int, bytes], None] | None = None
        self.sent = {t: 0 for t in TOPICS}
        self.drops = {t: 0 for t in TOPICS}
        self.errors = 0
        self.bytes_sent = 0
        self.bad_frames = 0
        self.subscriptions = 0
        self.lossy = False           # a subscriber's queue was full within the last stall_s
        self.lossy_sent = 0          # messages sent past a full subscriber (it missed them)
        self.stalls = 0              # episodes of full subscriber queues
        self._stall_s, self._probe_s, self._clock = stall_s, probe_s, clock
        self._last_failure: float | None = None
        self.curve = bool(curve_secret_key_file)
        self._auth = None
        if not is_loopback(endpoint) and not self.curve:
            raise InputError(
                f"refusing to publish on {endpoint} in the clear: a non-loopback bind needs CURVE keys "
                "(set publisher.curve_secret_key_file and publisher.curve_allowed_clients_dir)")
        if self.curve and not curve_allowed_clients_dir:
            raise InputError("publisher.curve_allowed_clients_dir must name the folder of allowed client keys")
        self._own_ctx = context is None
        self.ctx = context or zmq.Context()
        sock = self.ctx.socket(zmq.XPUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.setsockopt(zmq.SNDHWM, sndhwm)
            except (zmq.ZMQError, OverflowError, TypeError, ValueError):
                raise InputError(f"publisher.sndhwm {sndhwm!r} is not a valid high-water mark") from None
            sock.setsockopt(zmq.RCVHWM, 1000)
            sock.setsockopt(zmq.XPUB_NODROP, 1)
            # Subscriber handshakes and subscription frames are small; a peer sending a
            # huge frame is cut off instead of making the agent allocate it.
            sock.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)
            if self.curve:
                public, secret = _read_secret_key(curve_secret_key_file)
                allowed = Path(curve_allowed_clients_dir)
                if not allowed.is_dir():
                    raise InputError(f"publisher.curve_allowed_clients_dir {allowed}: not a folder")
                from zmq.auth.thread import ThreadAuthenticator
                self._auth = ThreadAuthenticator(self.ctx)
                self._auth.start()
                self._auth.configure_curve(domain="ridgeline", location=str(allowed))
                sock.setsockopt(zmq.CURVE_SERVER, 1)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
                sock.setsockopt(zmq.ZAP_DOMAIN, b"ridgeline")
            if endpoint.startswith("ipc://"):
                _ipc_folder(endpoint[len("ipc://"):])
            try:
                sock.bind(endpoint)
            except zmq.ZMQError as exc:
                raise InputError(f"cannot bind {endpoint}: {exc}") from None
            if endpoint.startswith("ipc://"):
                # Owner and group only: the stream names the host's processes and kernels.
                # (The folder, 0750 from systemd, is the first gate; this is the second.)
                path = endpoint[len("ipc://"):]
                try:
                    if ipc_group:
                        import grp
                        os.chown(path, -1, grp.getgrnam(ipc_group).gr_gid)
                    os.chmod(path, 0o660)
                except (OSError, KeyError) as exc:
                    raise InputError(f"cannot restrict {path} to its owner and group "
                                     f"{ipc_group or '(own)'}: {exc}") from None
        except BaseException:
            sock.close(0)
            self._stop_auth()
            if self._own_ctx:
                self.ctx.term()
            raise
        self.sock = sock

    def _stop_auth(self):
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def publish(self, topic: str, payload, ts_ns: int | None = None) -> bool:
        """Encode and send without blocking. True when the socket took the message (a
        subscriber whose queue was full may have missed it: counted in ``drops``); False
        when nobody can get it (counted in ``drops`` and ``errors``)."""
        seq = self.seq.get(topic)
        if seq is None:
            raise ValueError(f"unknown topic {topic!r}")
        self.seq[topic] = seq + 1
        try:
            env = self._encode(topic, seq, payload, self.host, ts_ns if ts_ns is not None else time.time_ns())
        except Exception:
            self.errors += 1
            self.drops[topic] += 1
            raise
        if self.tap is not None:
            self.tap(topic, seq, env)
        frames = (topic.encode(), env)
        copy = len(env) < 65536
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            # libzmq learns that subscribers have read their messages from commands it
            # processes lazily (throttled in send()); reading ZMQ_EVENTS processes them now,
            # so a queue that only looked full gets its message after all.
            try:
                self.sock.getsockopt(zmq.EVENTS)
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                return self._send_past_full(topic, frames, copy, len(env))
            except zmq.ZMQError:
                self.errors += 1
                self.drops[topic] += 1
                return False
        except zmq.ZMQError:
            self.errors += 1
            self.drops[topic] += 1
            return False
        if self.lossy and self._clock() - self._last_failure >= self._stall_s:
            self.lossy = False
        self.sent[topic] += 1
        self.bytes_sent += len(env)
        return True

    def _send_past_full(self, topic: str, frames, copy: bool, nbytes: int) -> bool:
        """Some subscriber's queue is full: send to the others (XPUB_NODROP off for this
        one message) and count the miss."""
        now = self._clock()
        if self._last_failure is None or now - self._last_failure >= self._stall_s:
            self.stalls += 1
        self._last_failure = now
        self.lossy = True
        self.drops[topic] += 1
        self.sock.setsockopt(zmq.XPUB_NODROP, 0)
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
        except zmq.ZMQError:
            self.errors += 1
            return False
        finally:
            self.sock.setsockopt(zmq.XPUB_NODROP, 1)
        self.lossy_sent += 1
        self.sent[topic] += 1
        self.bytes_sent += nbytes
        return True

    def service(self, max_frames: int = 1000) -> int:
        """Drain subscription frames (non-blocking); returns how many were read."""
        n = 0
        while n < max_frames:
            try:
                # Ask before reading: the loop calls this 20 times a second and there is
                # almost never a frame; a zmq.Again raised each time cost 3x the question.
                if not self.sock.get(zmq.EVENTS) & zmq.POLLIN:
                    break
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError:
                self.bad_frames += 1
                break
            n += 1
            # XPUB delivers b"\x01topic" (subscribe) or b"\x00topic" (unsubscribe).
            if frame[:1] == b"\x01":
                self.subscriptions += 1
            elif frame[:1] == b"\x00":
                self.subscriptions = max(0, self.subscriptions - 1)
            else:
                self.bad_frames += 1
        return n

    def counters(self) -> dict:
        return {"sent": dict(self.sent), "drops": dict(self.drops), "errors": self.errors,
                "bytes_sent": self.bytes_sent, "bad_frames": self.bad_frames,
                "subscriptions": self.subscriptions, "lossy": self.lossy, "lossy_sent": self.lossy_sent,
                "stalls": self.stalls}

    def close(self) -> None:
        sock = getattr(self, "sock", None)
        if sock is not None:
            sock.close(0)
            self.sock = None
        self._stop_auth()
        if self._own_ctx and not self.ctx.closed:
            self.ctx.term()
