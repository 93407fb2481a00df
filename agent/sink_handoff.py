"""What the agent published while its sink recorder was not listening, handed to the next one.

Why: the recorder (agent/object_sink.py) is a subscriber of the agent's stream like any
other. While it restarts (killed, crashed, reconfigured) nobody takes the agent's messages,
and a subscriber that connects misses what was published before its subscription took
effect (ZeroMQ's "slow joiner"). Before this, those messages were only counted
(``missed_messages``: 58 in one restart of tests/test_sink_agent.py). The agent keeps what
it published in memory, bounded, and hands the recorder it starts what it may have missed,
through a file in the spool: no new socket, no request a local client could send.

Contract:

* :class:`HandoffRing` (daemon side; agent.sink_supervisor.SinkSupervisor owns it).
  :meth:`~HandoffRing.keep` takes every message the agent publishes (``Publisher.tap``:
  topic, sequence number, envelope bytes) and keeps the newest ``max_bytes`` of envelopes
  (the oldest go first, counted in ``ring_dropped``). :meth:`~HandoffRing.open`, when a
  recorder is started, writes the kept messages newer than the spool's last saved numbers
  (``SPOOL/state.json``, when it belongs to this agent's numbering: the same ``epoch``) to
  ``SPOOL/handoff.rjl`` (under a dot-name, then renamed), and from then on appends every
  message published until :meth:`~HandoffRing.poll` closes it with an END frame: once the
  recorder says it is live (``SPOOL/handoff.live`` exists: it has received a message, so
  its subscription is in effect and everything later reaches it directly), or after
  ``timeout_s``, or once the file holds ``max_bytes`` (the rest is then a gap the recorder
  counts). The union of the file and what the recorder receives directly is every message,
  with overlap (messages published between the recorder's first message and the END):
  the recorder drops duplicates by sequence number.
* :func:`read_handoff` (recorder side): the file's epoch, its complete envelope frames, and
  whether it has ended. Bounded: a file over ``max_bytes`` plus one frame is refused.
* ``epoch``: a random number per agent process (its sequence numbers count from 0 per
  topic for the life of the process, agent/publisher.py): the recorder knows from it whether
  the spool's last numbers are this agent's (then messages at or below them are
  duplicates) or another's (the agent restarted: every number is new).

Frames are the journal's (:data:`agent.object_sink.JOURNAL_HEADER`: bytes, recv_ns, kind):
one HEAD (msgpack ``{"epoch": E, "since": {topic: first number kept}}``), ENVELOPE frames, one END (its recv_ns field holds
:data:`END_MAGIC`, so an END is known from the file's last bytes alone).
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import orjson

from .object_sink import FRAME_ENVELOPE, JOURNAL_HEADER, MAX_FRAME_BYTES, STATE

log = logging.getLogger("ridgeline.agent")

HANDOFF = "handoff.rjl"
LIVE = "handoff.live"
FRAME_HEAD, FRAME_END = 2, 3
END_MAGIC = int.from_bytes(b"RLHANDED", "little")
#: A spool state file is a few hundred bytes: read at most this much of it.
MAX_STATE_BYTES = 1 << 20


@dataclass
class Handoff:
    epoch: int
    #: topic -> the first number the agent kept of it (where the hand-off's view begins)
    since: dict[str, int] = field(default_factory=dict)
    frames: list[tuple[bytes, int]] = field(default_factory=list)     # (envelope, recv_ns)
    ended: bool = False
    torn: int = 0


def spool_last_seq(spool: Path, epoch: int) -> dict[str, int]:
    """The spool's last saved sequence numbers when they are ``epoch``'s, else {}."""
    try:
        with open(spool / STATE, "rb") as f:
            st = orjson.loads(f.read(MAX_STATE_BYTES))
    except FileNotFoundError:
        return {}
    except orjson.JSONDecodeError:
        return {}           # the recorder refuses it with one line; the hand-off just sends all
    if not isinstance(st, dict) or st.get("epoch") != epoch or not isinstance(st.get("last_seq"), dict):
        return {}
    return {str(k): v for k, v in st["last_seq"].items() if type(v) is int}


class HandoffRing:
    def __init__(self, epoch: int, max_bytes: int = 32 << 20, timeout_s: float = 60.0, clock=time.monotonic):
        self.epoch, self.max_bytes, self.timeout_s, self.clock = epoch, max_bytes, timeout_s, clock
        self._ring: deque[tuple[str, int, bytes]] = deque()
        self._first: dict[str, int] = {}       # topic -> the first number kept (the sink's start)
        self._bytes = 0
        self.ring_dropped = 0          # messages that left the ring before any hand-off needed them
        self.handed_off = 0            # messages written to hand-off files
        self.truncated = 0             # hand-offs closed at max_bytes (the rest a counted gap)
        self.file_errors = 0           # the spool refused a write (full disk): that hand-off ends there
        self._f = None
        self._path: Path | None = None
        self._file_bytes = 0
        self._opened_at = 0.0

    def keep(self, topic: str, seq: int, envelope: bytes) -> None:
        """Every published message (the publisher's tap: it must never raise or block)."""
        n = len(envelope)
        self._first.setdefault(topic, seq)
        if n > self.max_bytes:
            self.ring_dropped += 1
            return
        self._ring.append((topic, seq, envelope))
        self._bytes += n
        while self._bytes > self.max_bytes:
            _, _, old = self._ring.popleft()
            self._bytes -= len(old)
            self.ring_dropped += 1
        if self._f is not None:
            self._append(envelope)

    @property
    def ring_bytes(self) -> int:
        return self._bytes

    @property
    def is_open(self) -> bool:
        return self._f is not None

    def _append(self, envelope: bytes) -> None:
        if self._file_bytes + len(envelope) > self.max_bytes:
            self.truncated += 1
            log.warning("sink: the hand-off to the recorder reached %d bytes before it was live; the rest is a gap "
                        "it counts (missed_messages)", self.max_bytes)
            self.close()
            return
        try:
            self._f.write(JOURNAL_HEADER.pack(len(envelope), time.time_ns(), FRAME_ENVELOPE) + envelope)
        except OSError as exc:
            # called from the publisher's tap: a full spool must never cost the stream a message
            self._failed(exc)
            return
        self._file_bytes += len(envelope)
        self.handed_off += 1

    def _failed(self, exc: OSError) -> None:
        self.file_errors += 1
        log.warning("sink: the hand-off file could not be written (%s); the recorder counts what it lacks as "
                    "missed", exc.strerror or exc)
        f, self._f, self._path = self._f, None, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass                    # its buffered tail is lost with the write that failed

    def open(self, spool: Path) -> None:
        """A recorder is being started on ``spool``: what it may have missed, into the file."""
        self.close()
        spool = Path(spool)
        (spool / LIVE).unlink(missing_ok=True)          # a dead recorder's word is not the new one's
        after = spool_last_seq(spool, self.epoch)
        tmp = spool / f".{HANDOFF}.tmp"
        try:
            f = open(tmp, "wb")
            head = msgpack.packb({"epoch": self.epoch, "since": self._first})
            f.write(JOURNAL_HEADER.pack(len(head), 0, FRAME_HEAD) + head)
            self._f, self._file_bytes, self._opened_at = f, 0, self.clock()
            for topic, seq, env in list(self._ring):
                if seq > after.get(topic, -1) and self._f is not None:
                    self._append(env)
            if self._f is not None:
                self._f.flush()
            # the open file follows the rename (truncated while writing the ring: closed, ended)
            os.replace(tmp, spool / HANDOFF)
        except OSError as exc:
            self._failed(exc)
            return
        if self._f is not None:
            self._path = spool

    def poll(self) -> None:
        """Close the file once the recorder is live, or after ``timeout_s``; flush otherwise."""
        if self._f is None:
            return
        if (self._path / LIVE).exists() or self.clock() - self._opened_at >= self.timeout_s:
            self.close()
            return
        try:
            self._f.flush()
        except OSError as exc:
            self._failed(exc)

    def close(self) -> None:
        f, self._f = self._f, None
        if f is None:
            return
        self._path = None
        try:
            f.write(JOURNAL_HEADER.pack(0, END_MAGIC, FRAME_END))
            f.close()
        except OSError as exc:
            self._failed(exc)


def has_ended(path: Path) -> bool:
    """Whether the hand-off file ends with its END frame (its last bytes only)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() < JOURNAL_HEADER.size:
                return False
            f.seek(-JOURNAL_HEADER.size, os.SEEK_END)
            tail = f.read(JOURNAL_HEADER.size)
    except FileNotFoundError:
        return False
    n, magic, kind = JOURNAL_HEADER.unpack(tail)
    return n == 0 and magic == END_MAGIC and kind == FRAME_END


def read_handoff(path: Path, max_bytes: int) -> Handoff | None:
    """The hand-off file's content (None when there is none). A file bigger than
    ``max_bytes`` plus its frame headers is cut there (its rest counted torn)."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + (1 << 20))
    except FileNotFoundError:
        return None
    out = Handoff(epoch=-1)
    pos = 0
    while pos < len(data):
        if pos + JOURNAL_HEADER.size > len(data):
            out.torn += 1
            break
        n, recv_ns, kind = JOURNAL_HEADER.unpack_from(data, pos)
        start = pos + JOURNAL_HEADER.size
        if n > MAX_FRAME_BYTES or start + n > len(data):
            out.torn += 1
            break
        if kind == FRAME_HEAD:
            try:
                head = msgpack.unpackb(data[start:start + n])
            except (ValueError, TypeError):   # msgpack's ExtraData, FormatError, StackError
                head = None
            if not isinstance(head, dict) or type(head.get("epoch")) is not int:
                return None             # not a hand-off file: nothing taken from it
            out.epoch = head["epoch"]
            since = head.get("since")
            if isinstance(since, dict):
                out.since = {str(k): v for k, v in since.items() if type(v) is int and v >= 0}
        elif kind == FRAME_END:
            out.ended = True
            break
        elif kind == FRAME_ENVELOPE:
            out.frames.append((data[start:start + n], recv_ns))
        pos = start + n
    return out if out.epoch >= 0 else None
