"""Rolling Parquet files to a folder or to S3-compatible object storage, through a bounded
local spool that loses nothing across a restart of the recorder or an outage of the store.

``ridgeline record --format parquet --sink URL --spool DIR`` runs it beside the agent (a
process of its own: the daemon never imports pyarrow). What it keeps:

* **Journal first.** Every message the recorder receives is appended to
  ``SPOOL/journal/<n>.rjl`` (a length-prefixed frame) before it reaches the Parquet writer,
  which buffers rows in memory. When the writer rolls (every ``roll_s`` seconds, or past
  ``roll_rows`` rows) its files are complete under ``SPOOL/out/`` (written under a dot-name
  and renamed), the next part and frame numbers are saved in ``SPOOL/state.json``, and only
  then is the journal removed. A recorder killed with -9 mid-file leaves its journal: on
  start the journal is replayed into a writer that numbers parts and frames as the dead one
  did, so the files it writes have the same names and rows (a crash after the rename but
  before the journal went rewrites the same files, never duplicates). A torn last frame
  (killed mid-append) is dropped and counted.
* **Upload after.** A thread uploads every complete file under ``SPOOL/out/`` (oldest
  first) to ``URL`` under the same relative path (the Hive layout of
  docs/parquet-schema.md, manifest included), then deletes it locally. A failure keeps the
  file and retries with backoff (1 s doubling to 60 s): an outage of the store costs spool
  space, not data. An object store's PUT is all or nothing, and a re-upload after a crash
  writes the same bytes to the same key.
* **Bounded.** ``spool_max_bytes`` caps the spool (journal and files). Past it, the oldest
  complete files are deleted unsent, and their bytes and files are counted
  (``dropped_files``, ``dropped_bytes``); the journal is never dropped (it holds what has no
  file yet). The host's disk is never filled: free space below ``min_free_bytes`` counts as
  over the cap too.
* **Nothing missed across a restart of the recorder.** The agent that supervises the
  recorder keeps what it published and hands the recorder it starts what it may have
  missed (agent/sink_handoff.py: ``SPOOL/handoff.rjl``, with the agent's ``epoch``).
  :meth:`ObjectSink.take_handoff` takes those messages after the journal's, in order;
  from then on a message at or below the last number taken on its topic is a duplicate
  (the hand-off and the live stream overlap) and is dropped (``duplicate_messages``).
* **Gaps said.** The last sequence number of each topic is saved with the state at every
  roll (and recovered from a replayed journal), with the epoch of the agent that numbered
  them. Every forward jump of a topic's numbers is counted (``missed_messages``): messages
  the agent published that no recorder took (a hand-off past its cap, a recorder run
  without one, a full subscriber queue), never silently absent. A recorder taking the
  hand-off of another epoch (the agent restarted) counts from that agent's 0.
* **Status.** Once a second the upload thread writes its counters to ``SPOOL/status.json``
  (atomically; :class:`SinkCounters` with the spool's bytes and files): the agent that
  supervises the recorder (agent/sink_supervisor.py) reads them for /metrics and the health
  record.

URLs: ``file:///path`` or a plain path (a folder: for a mounted share), or
``s3://bucket/prefix`` with ``endpoint`` (``host:port``), ``scheme`` and the usual AWS
credentials from the environment (pyarrow's S3 filesystem, the AWS SDK). S3-compatible
servers often lack the SDK's newer default checksums, so the sink asks for checksums only
where an operation requires them (``AWS_REQUEST_CHECKSUM_CALCULATION=when_required``) unless
the environment already says otherwise.
"""
from __future__ import annotations

import os
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from ridgeline.probes.errors import InputError, RuntimeFailure

JOURNAL_HEADER = struct.Struct("<IQB")       # frame bytes, recv_ns, kind
FRAME_ENVELOPE, FRAME_NAMES = 0, 1
# A journal starts with the event decoder's name tables (FRAME_NAMES, msgpack): event batches
# ship each name once per stream, so a journal replayed alone must know the names its batches
# refer to from before it began.
MAX_FRAME_BYTES = 256 << 20                   # the subscriber's own bound on one message
STATE = "state.json"
STATUS = "status.json"


@dataclass
class SinkCounters:
    messages: int = 0
    rolls: int = 0
    files_written: int = 0
    bytes_written: int = 0
    missed_messages: int = 0
    files_uploaded: int = 0
    bytes_uploaded: int = 0
    upload_errors: int = 0
    dropped_files: int = 0
    dropped_bytes: int = 0
    replayed_messages: int = 0
    torn_frames: int = 0
    handed_over_messages: int = 0      # taken from the agent's hand-off (agent/sink_handoff.py)
    duplicate_messages: int = 0        # the hand-off and the live stream overlap: dropped once
    last_error: str = ""
    errors_by_kind: dict = field(default_factory=dict)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_journal(path: Path) -> tuple[dict, list[tuple[bytes, int]], int]:
    """(the name tables at its head, its complete envelope frames, torn frames: 0 or 1, as
    only the last append can be cut short)."""
    import msgpack
    names: dict = {}
    out, torn = [], 0
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        if pos + JOURNAL_HEADER.size > len(data):
            torn += 1
            break
        n, recv_ns, kind = JOURNAL_HEADER.unpack_from(data, pos)
        if n > MAX_FRAME_BYTES or pos + JOURNAL_HEADER.size + n > len(data):
            torn += 1
            break
        start = pos + JOURNAL_HEADER.size
        body = data[start:start + n]
        if kind == FRAME_NAMES:
            names = msgpack.unpackb(body, strict_map_key=False)
        else:
            out.append((body, recv_ns))
        pos = start + n
    return names, out, torn


class Destination:
    """Where complete files go: ``put(rel, data)``."""

    def __init__(self, url: str, endpoint: str | None = None, scheme: str = "https", region: str | None = None):
        self.url = url
        if url.startswith("s3://"):
            os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
            os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
            try:
                import pyarrow.fs as pafs
            except ImportError:
                raise RuntimeFailure("the S3 sink needs pyarrow: pip install 'ridgeline[parquet]'") from None
            bucket_prefix = url[len("s3://"):].strip("/")
            if not bucket_prefix:
                raise InputError(f"{url}: no bucket (s3://BUCKET[/PREFIX])")
            self.base = bucket_prefix
            # the sink retries on its own, with backoff and without blocking the recorder: the
            # SDK's own retries (up to 10, with backoff) would hold one round for a minute
            kw = {"scheme": scheme, "connect_timeout": 3, "request_timeout": 30,
                  "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=1)}
            if endpoint:
                kw["endpoint_override"] = endpoint
            if region:
                kw["region"] = region
            self.fs = pafs.S3FileSystem(**kw)
            self.local = None
        else:
            self.local = Path(url[len("file://"):] if url.startswith("file://") else url)
            self.fs = None

    def put(self, rel: str, data: bytes) -> None:
        if self.local is not None:
            dest = self.local / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.part")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
            return
        with self.fs.open_output_stream(f"{self.base}/{rel}") as out:
            out.write(data)


def _stat_files(root: Path) -> dict[Path, os.stat_result]:
    """The plain files under ``root`` with their stat; one renamed or removed meanwhile (the
    writer renames its dot-file when complete) is left out, not an error."""
    out = {}
    for p in root.rglob("*"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            out[p] = st
    return out


class ObjectSink:
    """See the module docstring. ``write(envelope, recv_ns)`` as a RecordingWriter;
    ``close()`` rolls, uploads what it can within ``close_timeout_s`` and stops."""

    def __init__(self, spool: str | Path, url: str, *, endpoint: str | None = None, scheme: str = "https",
                 region: str | None = None, roll_s: float = 60.0, roll_rows: int = 500_000,
                 spool_max_bytes: int = 2 << 30, min_free_bytes: int = 1 << 30, upload_interval_s: float = 1.0,
                 recording: str | None = None, close_timeout_s: float = 30.0, clock=time.monotonic):
        from .parquet_recording import ParquetRecordingWriter
        self._writer_cls = ParquetRecordingWriter
        self.spool = Path(spool)
        self.out = self.spool / "out"
        self.jdir = self.spool / "journal"
        for d in (self.out, self.jdir):
            d.mkdir(parents=True, exist_ok=True)
        self._lock_spool()
        self.dest = Destination(url, endpoint, scheme, region)
        self.roll_s, self.roll_rows = roll_s, roll_rows
        self.spool_max_bytes, self.min_free_bytes = spool_max_bytes, min_free_bytes
        self.upload_interval_s, self.close_timeout_s = upload_interval_s, close_timeout_s
        self.clock = clock
        self.counters = SinkCounters()
        self._manifest_sent = False
        self._lock = threading.Lock()          # the writer and the journal
        self._stop = threading.Event()
        self._state = self._load_state(recording)
        self._journal_no = self._state["journal"]
        # topic -> the last sequence number taken (saved at each roll); topics this process
        # has not seen yet are checked against it once, for the gap a restart left
        self._last_seq: dict[str, int] = dict(self._state["last_seq"])
        # after a hand-off: numbers at or below the last taken are duplicates, and a topic
        # this spool took nothing of yet starts where the agent's hand-off began keeping it
        # (its first number then: a first number above it is a gap)
        self._dedupe = False
        self._baseline: dict[str, int] = {}
        self._writer = self._new_writer()
        self._replay()
        self._open_journal()
        self._rolled_at = self.clock()
        self._thread = threading.Thread(target=self._upload_loop, name="ridgeline-sink", daemon=True)
        self._thread.start()

    def _lock_spool(self) -> None:
        """One sink per spool: two would number the same parts and replay the same journal.
        The lock goes with the process (a recorder killed with -9 leaves none behind)."""
        import fcntl
        self._lockf = open(self.spool / "lock", "a+")
        try:
            fcntl.flock(self._lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lockf.seek(0)
            other = self._lockf.read(32).strip()
            self._lockf.close()
            raise RuntimeFailure(f"{self.spool}: the spool is in use by another sink (pid {other or '?'})") from None
        self._lockf.seek(0)
        self._lockf.truncate()
        self._lockf.write(str(os.getpid()))
        self._lockf.flush()

    # -- state ---------------------------------------------------------------------
    def _load_state(self, recording: str | None) -> dict:
        p = self.spool / STATE
        if p.exists():
            try:
                st = orjson.loads(p.read_bytes())
                return {"recording": str(st["recording"]), "next_part": int(st["next_part"]),
                        "next_frame": int(st["next_frame"]), "journal": int(st["journal"]),
                        "last_seq": {str(k): int(v) for k, v in dict(st.get("last_seq") or {}).items()},
                        "epoch": int(st["epoch"]) if st.get("epoch") is not None else None}
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise InputError(f"{p}: unreadable sink state ({exc}); move the spool aside") from None
        rec = recording or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"
        st = {"recording": rec, "next_part": 0, "next_frame": 0, "journal": 0, "last_seq": {}, "epoch": None}
        self._save_state(st)
        return st

    def _save_state(self, st: dict) -> None:
        p = self.spool / STATE
        tmp = p.with_name(".state.json.tmp")
        with open(tmp, "wb") as f:
            f.write(orjson.dumps(st))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        _fsync_dir(self.spool)

    def _new_writer(self):
        w = self._writer_cls(self.out, recording=self._state["recording"], flush_rows=1 << 62,
                             first_part=self._state["next_part"], first_frame=self._state["next_frame"])
        return w

    def _replay(self) -> None:
        """Journals left by a recorder that died: their messages again, in order, then one roll."""
        left = []
        for j in sorted(self.jdir.glob("*.rjl")):
            if int(j.stem) < self._state["journal"]:
                j.unlink()                 # rolled already (the state says so): its files exist
            else:
                left.append(j)
        if not left:
            return
        from ridgeline.aggregator import wire
        for j in left:
            names, frames, torn = read_journal(j)
            self.counters.torn_frames += torn
            wire.decoder_restore(names)
            for env, recv_ns in frames:
                self._writer.write(env, recv_ns)
                e = wire.decode_envelope(env)
                self._last_seq[e.topic] = int(e.seq)
                self.counters.replayed_messages += 1
        self._roll_locked(old_journals=left)

    def _open_journal(self) -> None:
        import msgpack

        from ridgeline.aggregator import wire
        self._journal = open(self.jdir / f"{self._journal_no:08d}.rjl", "ab")
        head = msgpack.packb(wire.decoder_snapshot())
        self._journal.write(JOURNAL_HEADER.pack(len(head), 0, FRAME_NAMES) + head)
        self._journal.flush()

    # -- input -----------------------------------------------------------------------
    def write(self, envelope: bytes, recv_ns: int, decoded: tuple | None = None) -> None:
        """One message as received. ``decoded``: ``(topic, seq, host, ts_ns, payload)`` when
        the subscriber decoded it already (an event batch's names are decoded once per
        stream, so it must not be decoded twice)."""
        with self._lock:
            self._write_locked(envelope, recv_ns, decoded)

    def _write_locked(self, envelope: bytes, recv_ns: int, decoded: tuple | None) -> bool:
        if decoded is None:
            from ridgeline.aggregator import wire
            e = wire.decode_envelope(envelope)
            topic, seq = e.topic, int(e.seq)
        else:
            topic, seq = decoded[0], int(decoded[1])
        last = self._last_seq.get(topic)
        if last is None:
            last = self._baseline.get(topic)
        if self._dedupe and last is not None and seq <= last:
            self.counters.duplicate_messages += 1
            return False
        # the journal first: a message is durable before it is buffered (a process kill
        # keeps what was written; fsync at each roll covers the machine's)
        self._journal.write(JOURNAL_HEADER.pack(len(envelope), recv_ns, FRAME_ENVELOPE) + envelope)
        self._journal.flush()
        if decoded is None:
            self._writer.write(envelope, recv_ns)
        else:
            _, _, host, ts_ns, payload = decoded
            self._writer.add_message(topic, seq, host, ts_ns, recv_ns, payload)
        # a lower number without a hand-off is the agent restarted (its numbers start
        # again): no gap known
        if last is not None and seq > last + 1:
            self.counters.missed_messages += seq - last - 1
        self._last_seq[topic] = seq
        self.counters.messages += 1
        if self.clock() - self._rolled_at >= self.roll_s or self._writer.pending_rows >= self.roll_rows:
            self._roll_locked()
        return True

    def take_handoff(self, handoff) -> int:
        """The agent's hand-off (:class:`agent.sink_handoff.Handoff`): its messages after the
        journal's, in order; duplicates dropped from then on. Returns the messages taken."""
        with self._lock:
            if handoff.epoch != self._state["epoch"]:
                # another agent numbered what the spool saw last (the agent restarted): this
                # agent's numbers all count from 0
                self._last_seq = {}
                self._state = dict(self._state, epoch=handoff.epoch, last_seq={})
                self._save_state(self._state)      # before any of its messages: a kill keeps the epoch
            self._dedupe = True
            self._baseline = {t: s - 1 for t, s in handoff.since.items()}
            self.counters.torn_frames += handoff.torn
            taken = 0
            for env, recv_ns in handoff.frames:
                if self._write_locked(env, recv_ns, None):
                    taken += 1
            self.counters.handed_over_messages += taken
            return taken

    def roll(self) -> None:
        with self._lock:
            self._roll_locked()

    def _roll_locked(self, old_journals: list[Path] | None = None) -> None:
        w = self._writer
        files, nbytes = w.files, w.bytes
        w.flush()
        self.counters.files_written += w.files - files
        self.counters.bytes_written += w.bytes - nbytes
        if getattr(self, "_journal", None) is not None and old_journals is None:
            self._journal.flush()
            os.fsync(self._journal.fileno())
            self._journal.close()
            old_journals = [self.jdir / f"{self._journal_no:08d}.rjl"]
        self._journal_no += 1
        self._state = {"recording": self._state["recording"], "next_part": w.next_part, "next_frame": w.frames,
                       "journal": self._journal_no, "last_seq": dict(self._last_seq), "epoch": self._state["epoch"]}
        self._save_state(self._state)         # the files are complete: now the journal may go
        for j in old_journals or []:
            j.unlink(missing_ok=True)
        self._open_journal()
        self._rolled_at = self.clock()
        self.counters.rolls += 1

    # -- output ----------------------------------------------------------------------
    def _files(self, stats: dict[Path, os.stat_result] | None = None) -> list[Path]:
        """Complete files under out/, oldest first (dot-names are being written); the manifest
        first, once per process. ``stats``: the spool's files already stat'ed this round."""
        if stats is None:
            stats = _stat_files(self.out)
        files = [p for p in stats if p.is_relative_to(self.out) and not p.name.startswith(".")
                 and not (p.name == "_ridgeline_parquet.json" and self._manifest_sent)]
        return sorted(files, key=lambda p: (p.name != "_ridgeline_parquet.json", stats[p].st_mtime_ns, str(p)))

    def spool_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.spool.rglob("*") if p.is_file())

    def _enforce_cap(self) -> list[Path]:
        """Drop the oldest files past the spool's caps; returns what is left to upload."""
        # one walk of the spool a round: each file stat'ed once, the upload queue taken from it
        stats = _stat_files(self.spool)
        total = sum(st.st_size for st in stats.values())
        files = [f for f in self._files(stats) if f.name != "_ridgeline_parquet.json"]
        while files and (total > self.spool_max_bytes or self._free_bytes() < self.min_free_bytes):
            f = files.pop(0)
            size = stats[f].st_size
            f.unlink(missing_ok=True)
            total -= size
            del stats[f]
            self.counters.dropped_files += 1
            self.counters.dropped_bytes += size
        return self._files(stats)

    def _free_bytes(self) -> int:
        st = os.statvfs(self.spool)
        return st.f_bavail * st.f_frsize

    def upload_once(self) -> int:
        """Upload every complete file now; returns how many went. Stops at the first failure
        (the store is down: the rest waits for the next round)."""
        sent = 0
        for f in self._enforce_cap():
            rel = f.relative_to(self.out).as_posix()
            try:
                data = f.read_bytes()
                self.dest.put(rel, data)
            except OSError as exc:                 # pyarrow's S3 errors are OSError
                self.counters.upload_errors += 1
                kind = type(exc).__name__
                self.counters.errors_by_kind[kind] = self.counters.errors_by_kind.get(kind, 0) + 1
                self.counters.last_error = f"{rel}: {exc}"[:300]
                return sent
            if f.name == "_ridgeline_parquet.json":
                self._manifest_sent = True
            else:
                f.unlink(missing_ok=True)
            self.counters.files_uploaded += 1
            self.counters.bytes_uploaded += len(data)
            sent += 1
        return sent

    def _upload_loop(self) -> None:
        # a round every upload_interval_s; after a failure the next upload waits (1 s doubling
        # to 60 s) while the status goes on being written every round
        delay, next_try = self.upload_interval_s, 0.0
        while not self._stop.wait(self.upload_interval_s):
            if time.monotonic() >= next_try:
                before = self.counters.upload_errors
                self.upload_once()
                delay = min(60.0, max(1.0, delay * 2)) if self.counters.upload_errors > before \
                    else self.upload_interval_s
                next_try = time.monotonic() + delay
            else:
                self._enforce_cap()       # the cap holds while the uploads wait out their backoff
            self.write_status()

    def status(self) -> dict:
        """The counters with the spool's bytes and complete files now."""
        from dataclasses import asdict
        stats = _stat_files(self.spool)
        out = asdict(self.counters)
        out["spool_bytes"] = sum(st.st_size for p, st in stats.items() if p.name != STATUS)
        out["spool_files"] = sum(1 for f in self._files(stats) if f.name != "_ridgeline_parquet.json")
        out["pid"] = os.getpid()
        out["recording"] = self._state["recording"]
        return out

    def write_status(self) -> None:
        p = self.spool / STATUS
        tmp = p.with_name(f".{STATUS}.tmp")
        tmp.write_bytes(orjson.dumps(self.status()))
        os.replace(tmp, p)          # a reader sees the old status or the new, never half

    def pending_files(self) -> int:
        return sum(1 for f in self._files() if f.name != "_ridgeline_parquet.json")

    def close(self) -> None:
        with self._lock:
            self._roll_locked()
        self._stop.set()
        self._thread.join()
        end = time.monotonic() + self.close_timeout_s
        while self.pending_files() and time.monotonic() < end:
            if not self.upload_once():
                time.sleep(0.5)
        with self._lock:
            self._journal.close()
        self.write_status()
        self._lockf.close()                    # the spool is free for the next sink
