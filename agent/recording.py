"""Recordings of the agent's stream: a framed file of wire envelopes, and its loader.

File format (version 1; all integers little-endian)::

    magic   8 bytes   b"RLREC\\x00\\x01\\n"   (MAGIC; "RidgeLine RECording", format 1)
    frames  repeated until end of file:
        recv_ns   u64   wall-clock time the recorder received the message (ns)
        length    u32   length of the envelope in bytes (at most MAX_FRAME_BYTES)
        envelope  bytes exactly as published: aggregator.wire.encode_envelope(...)

The envelope carries its topic, per-topic sequence number, host and timestamp, so a
recording is a byte-exact copy of the stream: ``ridgeline tail`` semantics (gaps,
restarts) apply to it unchanged. A recorder killed mid-write leaves a truncated last
frame; the loader keeps every complete frame and reports the truncation.

Contract:

* :func:`is_recording(path)`: True when the file starts with :data:`MAGIC` (so an
  analyzer can dispatch on file magic: Kineto traces start with ``{`` or gzip's
  ``\\x1f\\x8b``).
* :class:`RecordingWriter`: append frames; flushes per frame so a kill loses at most one.
* :func:`iter_frames(path)`: ``(recv_ns, envelope_bytes)`` per complete frame.
* :func:`load_recording(path) -> Recording`: ``trace`` (a :class:`probes.events.Trace`
  merging every ``events`` batch, names re-interned into one table), ``windows`` (the
  decoded ``window`` payloads, in order), ``messages`` per topic, ``gaps`` per topic,
  ``restarts``, ``truncated``. Raises :class:`InputError` (one line, naming the file)
  for a file that is not a recording or whose frames do not decode.
* :func:`load_trace(path) -> Trace`: just the merged trace, the same call shape as
  :func:`probes.kineto.load_trace`.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ridgeline.probes.errors import InputError, RuntimeFailure
from ridgeline.probes.events import NameTable, Trace

MAGIC = b"RLREC\x00\x01\n"
_HEAD = struct.Struct("<QI")
MAX_FRAME_BYTES = 256 * 1024 * 1024


def is_recording(path: str | Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


class RecordingWriter:
    """Frames appended unbuffered (one ``write`` per frame, retried over short writes).

    A write that fails (a full disk, a quota, a file-size limit; issue 18.9 saw two chained
    tracebacks) cuts the file back to its last whole frame and raises
    :class:`RuntimeFailure`, one line: the file stays a readable recording, and nothing
    is left in a buffer for ``close`` to fail on again."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        from ridgeline.probes.output_file import open_output
        # never through another user's link; raw: no buffer to flush after a failure
        self._f = open_output(self.path, "recording").detach()
        self.frames = 0
        self.bytes = 0
        self._put(MAGIC)
        self.bytes = len(MAGIC)

    def _put(self, data: bytes) -> None:
        view, done = memoryview(data), 0
        try:
            while done < len(view):
                done += self._f.write(view[done:])
        except OSError as exc:
            # ftruncate frees blocks: it works on a full disk
            os.ftruncate(self._f.fileno(), self.bytes)
            self._f.close()
            kept = f"{self.frames} messages ({self.bytes} bytes) kept" if self.frames else "nothing kept"
            raise RuntimeFailure(f"{self.path}: cannot write the recording ({exc.strerror or exc}); "
                                 f"{kept}, the file ends at the last whole message") from None

    def write(self, envelope: bytes, recv_ns: int) -> None:
        if len(envelope) > MAX_FRAME_BYTES:
            raise ValueError("envelope larger than a recording frame may be")
        self._put(_HEAD.pack(recv_ns, len(envelope)) + envelope)
        self.frames += 1
        self.bytes += _HEAD.size + len(envelope)

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def iter_frames(path: str | Path, report: dict | None = None):
    """Yield ``(recv_ns, envelope)``; sets ``report["truncated"]`` on a cut-off tail."""
    p = Path(path)
    try:
        f = open(p, "rb")
    except OSError as exc:
        raise InputError(f"{p}: cannot read recording: {exc.strerror}") from None
    with f:
        if f.read(len(MAGIC)) != MAGIC:
            raise InputError(f"{p}: not a ridgeline recording (bad magic)")
        try:
            size = os.fstat(f.fileno()).st_size
        except OSError:
            size = None
        while True:
            head = f.read(_HEAD.size)
            if not head:
                return
            if len(head) < _HEAD.size:
                if report is not None:
                    report["truncated"] = True
                return
            recv_ns, n = _HEAD.unpack(head)
            if n > MAX_FRAME_BYTES:
                raise InputError(f"{p}: corrupt recording: frame of {n} bytes at offset {f.tell() - _HEAD.size}")
            if size is not None and n > size - f.tell():
                # a length the file cannot hold: never allocate it (a torn or forged tail)
                if report is not None:
                    report["truncated"] = True
                return
            env = f.read(n)
            if len(env) < n:
                if report is not None:
                    report["truncated"] = True
                return
            yield recv_ns, env


@dataclass
class Recording:
    path: str
    trace: Trace
    windows: list = field(default_factory=list)
    messages: dict = field(default_factory=dict)
    gaps: dict = field(default_factory=dict)
    restarts: int = 0
    truncated: bool = False
    hosts: list = field(default_factory=list)


_KINDS = ("kernels", "copies", "api", "ranges", "cpu_ops")


def iter_envelopes(p, report=None, wire=None):
    """``(recv_ns, envelope)`` for each frame of recording ``p`` (see :func:`iter_frames`;
    ``wire``: the codec, default ``aggregator.wire``); a frame that does not decode is an
    :class:`InputError` naming the file and frame."""
    if wire is None:
        from ridgeline.aggregator import wire
    for i, (recv_ns, env_bytes) in enumerate(iter_frames(p, report)):
        try:
            env = wire.decode_envelope(env_bytes)
        except InputError as exc:     # the codec's one error for malformed bytes
            raise InputError(f"{p}: frame {i}: {exc}") from None
        yield recv_ns, env


def merge_traces(batches: list[Trace], meta: dict | None = None) -> Trace:
    """One Trace from batches with different name tables: names are re-interned into a
    single table and every ``name_id`` (and CPU-op dims/types id) remapped, vectorised;
    rows ordered by ``start_ns`` (stable). Peak memory per kind: the batches, their
    concatenation and its sorted copy (the concatenation is dropped before the next kind)."""
    names = NameTable()
    devices: dict[int, object] = {}
    remaps = []
    for b in batches:
        remaps.append(np.fromiter((names.intern(s) for s in b.names), dtype=np.int64, count=len(b.names)))
        for d in b.devices:
            devices.setdefault(d.index, d)
    arrays = {}
    for k in _KINDS:
        parts = [getattr(b, k) for b in batches]
        lens = [len(a) for a in parts]
        if not sum(lens):
            arrays[k] = getattr(Trace(), k)
            continue
        cat = np.concatenate(parts)
        offs = np.cumsum([0] + lens)
        for col in ("name_id", "input_dims_id", "input_types_id"):
            if col not in cat.dtype.names:
                continue
            ids = cat[col]
            for i, remap in enumerate(remaps):
                if not lens[i]:
                    continue
                seg = ids[offs[i]:offs[i + 1]]       # a view: remapped in place
                ok = (seg >= 0) & (seg < len(remap))
                seg[ok] = remap[seg[ok]]
                seg[~ok] = -1
        order = np.argsort(cat["start_ns"], kind="stable")
        arrays[k] = cat[order]
        del cat, order
    return Trace(arrays["kernels"], arrays["copies"], arrays["api"], arrays["ranges"], arrays["cpu_ops"],
                 names, [devices[i] for i in sorted(devices)], dict(meta or {}))


def load_recording(path: str | Path, codec=None) -> Recording:
    """Decode a recording (``codec``: the wire module; default ``aggregator.wire``)."""
    if codec is None:
        from ridgeline.aggregator import wire as codec
    wire = codec

    from .subscriber import SeqTracker, decode_payload, envelope_field
    p = Path(path)
    report: dict = {}
    seq = SeqTracker()
    batches: list[Trace] = []
    windows: list = []
    messages: dict[str, int] = {}
    hosts: set[str] = set()
    sources: set[str] = set()
    for i, (_, env) in enumerate(iter_envelopes(p, report, wire)):
        topic = envelope_field(env, "topic") or envelope_field(env, "kind")
        payload = envelope_field(env, "payload")
        messages[topic] = messages.get(topic, 0) + 1
        hosts.add(envelope_field(env, "host", "") or "")
        seq.see(topic, int(envelope_field(env, "seq")))
        try:
            payload = decode_payload(wire, topic, payload)
        except InputError as exc:
            raise InputError(f"{p}: frame {i} ({topic}): {exc}") from None
        if topic == "events":
            sources.add(payload.meta.get("source", ""))
            batches.append(payload)
        elif topic == "window":
            windows.append(payload)
    meta = {"path": str(p), "format": "ridgeline-recording", "sources": sorted(s for s in sources if s)}
    if any(s == "simulated" or "sim" in s for s in sources):
        meta["simulated"] = True
    trace = merge_traces(batches, meta)
    return Recording(str(p), trace, windows, messages, dict(seq.gaps), seq.restarts,
                     bool(report.get("truncated")), sorted(h for h in hosts if h))


def load_trace(path: str | Path) -> Trace:
    """The merged event trace of a recording (see :func:`load_recording`)."""
    return load_recording(path).trace


# --------------------------------------------------------------------------- segments
#
# A recording may be hours long; its events are never merged into one Trace. They are
# cut into segments, each analysed and dropped before the next is read:
#
# * at an agent restart (a sequence number going back on any topic) and at lost
#   ``events`` messages (a sequence gap): the time between two such segments is the
#   agent's own downtime, not GPU idle time, so it never enters any idle figure;
# * when the events held would cost more than the memory budget (probes.budget).

@dataclass
class Segment:
    """Events of one stretch of a recording, merged (names re-interned)."""
    index: int
    trace: Trace
    started_by: str          # "start", "restart", "gap" (lost events messages) or "size"
    batches: int
    first_recv_ns: int
    last_recv_ns: int


@dataclass
class StreamSummary:
    """What :func:`iter_segments` saw, filled in as it reads (plain counts only)."""
    messages: dict = field(default_factory=dict)
    gaps: dict = field(default_factory=dict)
    restarts: int = 0
    truncated: bool = False
    hosts: set = field(default_factory=set)
    sources: set = field(default_factory=set)
    models: set = field(default_factory=set)
    windows: int = 0
    last_window: bytes | dict | None = None    # the last window's payload (bytes: decoded by who needs it)
    # the "requests" topic (issue 22): stories told, and the slowest kept (bounded)
    requests_told: int = 0
    slowest_requests: list = field(default_factory=list)


#: Request stories an analysis keeps from a recording (the slowest).
MAX_REQUESTS_KEPT = 50


def _keep_slowest(sm: StreamSummary, payload) -> None:
    stories = payload.get("stories") if isinstance(payload, dict) else None
    if not isinstance(stories, list):
        return
    good = [s for s in stories if isinstance(s, dict) and isinstance(s.get("e2e_ns"), int)]
    sm.requests_told += len(good)
    keep = sorted(sm.slowest_requests + good, key=lambda s: -s["e2e_ns"])
    sm.slowest_requests = keep[:MAX_REQUESTS_KEPT]


def _batch_cost(t: Trace) -> int:
    from ridgeline.probes.budget import ROW_COST_BYTES
    return sum(len(getattr(t, k)) * ROW_COST_BYTES[k] for k in _KINDS)


def iter_segments(path: str | Path, max_memory_bytes: int | None = None, codec=None,
                  summary: StreamSummary | None = None):
    """Yield the :class:`Segment` s of a recording in order, reading it once, holding one
    segment's events at a time (at most ``max_memory_bytes`` of analysis cost, default
    :data:`probes.budget.DEFAULT_MAX_MEMORY_BYTES`). ``summary`` collects message counts,
    gaps, restarts and truncation. InputError (one line, naming the file and frame) for
    frames that do not decode or a single events message larger than the budget."""
    from .subscriber import decode_payload, envelope_field
    if codec is None:
        from ridgeline.aggregator import wire as codec
    wire = codec
    p = Path(path)
    report: dict = {}

    def messages():
        for i, (recv_ns, env) in enumerate(iter_envelopes(p, report, wire)):
            topic = envelope_field(env, "topic") or envelope_field(env, "kind")
            payload = envelope_field(env, "payload")
            # events decode lazily (a window's payload stays bytes: decoded by who needs it)
            thunk = ((lambda payload=payload: decode_payload(wire, "events", payload)) if topic == "events"
                     else (lambda payload=payload: payload))
            yield (i, recv_ns, topic, int(envelope_field(env, "seq")), envelope_field(env, "host", "") or "",
                   thunk)
    yield from segments_of(messages(), p, max_memory_bytes, summary, report)


def segments_of(messages, p, max_memory_bytes: int | None = None, summary: StreamSummary | None = None,
                report: dict | None = None, fmt: str = "ridgeline-recording"):
    """The segmentation of :func:`iter_segments` over any stream of messages
    ``(frame, recv_ns, topic, seq, host, payload())`` in recorded order (a ``.rlrec`` file,
    or the messages table of a Parquet recording, agent.parquet_recording): the same
    cuts at restarts, lost events messages and the memory budget, so both give the same
    segments. ``payload()`` returns the events :class:`Trace` (or raises InputError) and,
    for a window, what :func:`agent.recording_analysis._last_window_verdicts` reads."""
    from ridgeline.probes.budget import BASE_BYTES, DEFAULT_MAX_MEMORY_BYTES

    from .subscriber import SeqTracker
    # a segment's rows are charged at the analysis' peak cost; merging them (batches,
    # concatenation, sorted copy) needs room too: a segment gets half of the budget
    cap = ((max_memory_bytes or DEFAULT_MAX_MEMORY_BYTES) - BASE_BYTES) // 2
    sm = summary if summary is not None else StreamSummary()
    report = report if report is not None else {}
    seq = SeqTracker()
    batches: list[Trace] = []
    cost = 0
    index = 0
    started_by = "start"
    pending = None
    first_recv = last_recv = 0

    def cut():
        nonlocal batches, cost, index
        meta = {"path": str(p), "format": fmt, "segment": index,
                "sources": sorted(s for s in sm.sources if s)}
        if any(s == "simulated" or "sim" in s for s in sm.sources):
            meta["simulated"] = True
        if len(sm.models) == 1:      # the model the events' source named (the simulator does)
            meta["model"] = next(iter(sm.models))
        seg = Segment(index, merge_traces(batches, meta), started_by, len(batches), first_recv, last_recv)
        batches, cost = [], 0
        index += 1
        return seg

    for i, recv_ns, topic, seq_no, host, payload in messages:
        sm.messages[topic] = sm.messages.get(topic, 0) + 1
        sm.hosts.add(host)
        gap, restarted = seq.see(topic, seq_no)
        if restarted:
            # the agent restarted: every topic counts from 0 again, so forget the others'
            # last numbers (their reset is this same restart, not another one)
            seq.last = {topic: seq.last[topic]}
            pending = "restart"
        elif gap and topic == "events" and pending is None:
            pending = "gap"
        if topic == "window":
            sm.windows += 1
            sm.last_window = payload()
            continue
        if topic == "requests":
            _keep_slowest(sm, payload())
            continue
        if topic != "events":
            continue
        try:
            batch = payload()
        except InputError as exc:
            raise InputError(f"{p}: frame {i} ({topic}): {exc}") from None
        sm.sources.add(batch.meta.get("source", ""))
        if isinstance(batch.meta.get("model"), str) and len(sm.models) < 8:
            sm.models.add(batch.meta["model"][:200])
        c = _batch_cost(batch)
        if c > cap:
            raise InputError(f"{p}: frame {i}: one events message holds more than an analysis within "
                             f"{(cap + BASE_BYTES) >> 20} MiB can hold; raise --max-memory")
        if batches and (pending is not None or cost + c > cap):
            reason = pending or "size"
            yield cut()
            started_by = reason
        elif not batches and pending is not None and index:
            started_by = pending
        if not batches:
            first_recv = recv_ns
        pending = None
        batches.append(batch)
        cost += c
        last_recv = recv_ns
    sm.gaps = dict(seq.gaps)
    sm.restarts = seq.restarts
    sm.truncated = bool(report.get("truncated"))
    if batches:
        yield cut()
