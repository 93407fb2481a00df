"""``ridgeline record``: save the running agent's stream (windows, events, engine and device
records) to a recording file (``.rlrec``), or with ``--format parquet`` to Parquet folders (optionally
rolled to object storage with ``--sink``), that ``ridgeline analyze`` reports on and
``ridgeline agent`` can replay as live; what was recorded is kept when it stops.

Format: see :mod:`agent.recording`.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from ridgeline.agent.commands import description
from ridgeline.probes.errors import InputError, RuntimeFailure


def register(sub) -> None:
    from ridgeline.agent.subscriber import add_stream_arguments
    p = sub.add_parser("record", help="save the agent's stream to a file (replayable, analyzable)",
                       description=description(__doc__))
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="recording to write (a folder with --format parquet)")
    p.add_argument("--format", choices=("rlrec", "parquet"), default="rlrec",
                   help="rlrec: one framed file (default); parquet: Hive-style folders host=/gpu=/hour= "
                        "(docs/parquet-schema.md; needs the ridgeline[parquet] extra)")
    p.add_argument("--sink", default=None, metavar="URL",
                   help="with --format parquet: roll the files through a spool to URL (s3://BUCKET/PREFIX or "
                        "a folder); -o is then the spool folder (agent/object_sink.py)")
    p.add_argument("--sink-endpoint", default=None, metavar="HOST:PORT", help="S3-compatible endpoint")
    p.add_argument("--sink-scheme", default="https", choices=("http", "https"))
    p.add_argument("--sink-region", default=None)
    p.add_argument("--roll-s", type=float, default=60.0, metavar="S", help="with --sink: a file set every S seconds")
    p.add_argument("--spool-max-bytes", type=int, default=2 << 30, metavar="N",
                   help="with --sink: the spool's cap; past it the oldest unsent files are dropped, counted")
    p.add_argument("--min-free-bytes", type=int, default=1 << 30, metavar="N",
                   help="with --sink: free disk space kept under the spool; below it files are dropped as past "
                        "the cap")
    p.add_argument("--stop-with-parent", type=int, default=0, metavar="PID", help=argparse.SUPPRESS)
    # the supervising agent hands over what this recorder may have missed (agent/sink_handoff.py),
    # at most N bytes: 0, no hand-off (a recorder run by hand)
    p.add_argument("--handoff-bytes", type=int, default=0, metavar="N", help=argparse.SUPPRESS)
    add_stream_arguments(p)
    p.add_argument("--duration", type=float, default=0.0, metavar="S", help="stop after S seconds (0: until ^C)")
    p.add_argument("--timeout", type=float, default=0.0, metavar="S",
                   help="give up after S seconds without a message, exit 1 (0: wait); what was recorded is kept")
    p.set_defaults(func=run)


def run(args) -> int:
    from ridgeline.agent.recording import RecordingWriter
    from ridgeline.agent.subscriber import open_stream
    if args.format == "parquet":
        from ridgeline.agent.parquet_recording import ParquetRecordingWriter as RecordingWriter  # noqa: N814
    if args.sink is not None:
        if args.format != "parquet":
            raise InputError("--sink needs --format parquet")
        if not (args.roll_s > 0 and args.spool_max_bytes > 0 and args.min_free_bytes >= 0):
            raise InputError("--roll-s and --spool-max-bytes must be > 0, --min-free-bytes >= 0")
        return _run_sink(args)
    if not args.duration >= 0:
        raise InputError("--duration must be >= 0")
    if not args.timeout >= 0:
        raise InputError("--timeout must be >= 0")
    stop = {"now": False}

    def _stop(*_):
        stop["now"] = True
    old = signal.signal(signal.SIGTERM, _stop)
    sub = open_stream(args, codec=_columns_codec() if args.format == "parquet" else None)
    t0 = last = time.monotonic()
    failure = None
    try:
        with RecordingWriter(args.output) as w:
            t0 = last = time.monotonic()     # --duration counts from the writer's readiness
            try:
                while not stop["now"] and not (args.duration and time.monotonic() - t0 >= args.duration):
                    msg = sub.receive(0.2)
                    if sub.refused:
                        failure = f"record: {sub.refused}"
                        break
                    if msg is not None and args.format == "parquet":
                        # the subscriber decoded the payload already (a stateful stream's
                        # names are decoded once)
                        w.add_message(msg.topic, msg.seq, msg.host, msg.ts_ns, time.time_ns(), msg.payload)
                        last = time.monotonic()
                    elif msg is not None:
                        w.write(msg.raw, time.time_ns())
                        last = time.monotonic()
                    elif args.timeout and time.monotonic() - last > args.timeout:
                        failure = (f"record: no message for {args.timeout:g} s from {args.endpoint} "
                                   "(is `ridgeline agent` running?)")
                        break
            except KeyboardInterrupt:
                pass
            gaps = sum(sub.seq.gaps.values())
            w.close()       # a Parquet writer writes its last files here: counted below
            print(f"ridgeline record: {w.frames} messages, {w.bytes} bytes to {args.output}"
                  + (f"; {gaps} missing (sequence gaps)" if gaps else "")
                  + (f"; {sub.bad} undecodable skipped" if sub.bad else ""), file=sys.stderr)
    finally:
        sub.close()
        signal.signal(signal.SIGTERM, old)
    if failure:
        raise RuntimeFailure(failure)
    return 0


def _run_sink(args) -> int:
    """``record --format parquet --sink URL``: the stream through agent.object_sink."""
    from ridgeline.agent.object_sink import ObjectSink
    from ridgeline.agent.subscriber import open_stream
    stop = {"now": False}

    def _stop(*_):
        stop["now"] = True
    old = signal.signal(signal.SIGTERM, _stop)
    sink = ObjectSink(args.output, args.sink, endpoint=args.sink_endpoint, scheme=args.sink_scheme,
                      region=args.sink_region, roll_s=args.roll_s, spool_max_bytes=args.spool_max_bytes,
                      min_free_bytes=args.min_free_bytes)
    sub = open_stream(args, codec=_columns_codec())
    handoff = _Handoff(sink, args.output, args.handoff_bytes) if args.handoff_bytes > 0 else None
    t0 = time.monotonic()
    try:
        while not stop["now"] and not (args.duration and time.monotonic() - t0 >= args.duration):
            if args.stop_with_parent and os.getppid() != args.stop_with_parent:
                print(f"ridgeline record: the agent (pid {args.stop_with_parent}) is gone; stopping",
                      file=sys.stderr)
                break       # the agent that started this sink died: roll, upload, stop
            msg = sub.receive(0.05 if handoff is not None else 0.2)
            if sub.refused:
                raise RuntimeFailure(f"record: {sub.refused}")
            if handoff is not None:
                if msg is not None:
                    handoff.hold(msg)
                if handoff.poll():
                    handoff = None
            elif msg is not None:
                sink.write(msg.raw, time.time_ns(), (msg.topic, msg.seq, msg.host, msg.ts_ns, msg.payload))
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
        if handoff is not None:
            handoff.finish()   # stopped before the hand-off ended: what it and this recorder hold
        sink.close()
        signal.signal(signal.SIGTERM, old)
        c = sink.counters
        print(f"ridgeline record: {c.messages} messages; {c.files_uploaded} files ({c.bytes_uploaded} bytes) to "
              f"{args.sink}; {sink.pending_files()} still in the spool {args.output}"
              + (f"; {c.dropped_files} dropped over the spool cap" if c.dropped_files else "")
              + (f"; {c.upload_errors} failed uploads (last: {c.last_error})" if c.upload_errors else ""),
              file=sys.stderr)
    return 0


class _Handoff:
    """The recorder's side of agent/sink_handoff.py: messages received directly are held
    (bounded) from the first one on, which says the subscription is in effect (the LIVE
    marker tells the agent); once the agent has ended the hand-off file (or
    ``WAIT_S`` later), its messages go to the sink first, then the held ones, duplicates
    dropped by sequence number."""
    WAIT_S = 10.0

    def __init__(self, sink, spool: str, max_bytes: int):
        from pathlib import Path
        self.sink, self.max_bytes = sink, max_bytes
        self.spool = Path(spool)
        self.held: list[tuple[bytes, int, tuple]] = []
        self.held_bytes = 0
        self.over_cap = 0               # received while held past the cap: gaps the sink counts
        self.live_at: float | None = None

    def hold(self, msg) -> None:
        from ridgeline.agent.sink_handoff import LIVE
        if self.live_at is None:
            self.live_at = time.monotonic()
            tmp = self.spool / f".{LIVE}.tmp"
            tmp.write_text(str(os.getpid()))
            os.replace(tmp, self.spool / LIVE)
        if self.held_bytes + len(msg.raw) > self.max_bytes:
            self.over_cap += 1
            return
        self.held.append((msg.raw, time.time_ns(), (msg.topic, msg.seq, msg.host, msg.ts_ns, msg.payload)))
        self.held_bytes += len(msg.raw)

    def poll(self) -> bool:
        """True once the hand-off is taken (the recorder then writes as it receives)."""
        from ridgeline.agent.sink_handoff import HANDOFF, has_ended
        if self.live_at is None:
            return False
        if not has_ended(self.spool / HANDOFF) and time.monotonic() - self.live_at < self.WAIT_S:
            return False
        self.finish()
        return True

    def finish(self) -> None:
        from ridgeline.agent.sink_handoff import HANDOFF, LIVE, read_handoff
        path = self.spool / HANDOFF
        h = read_handoff(path, self.max_bytes)
        if h is None:
            print(f"ridgeline record: no hand-off from the agent in {path}; what it published before this "
                  "recorder's first message is counted as missed", file=sys.stderr)
        else:
            n = self.sink.take_handoff(h)
            print(f"ridgeline record: took {n} messages from the agent's hand-off ({len(h.frames)} in it"
                  + ("" if h.ended else "; not ended: the agent never closed it") + ")", file=sys.stderr)
            if h.ended:
                path.unlink(missing_ok=True)
                (self.spool / LIVE).unlink(missing_ok=True)
        for raw, recv_ns, decoded in self.held:
            self.sink.write(raw, recv_ns, decoded)
        self.held, self.held_bytes = [], 0


def _columns_codec():
    """Event batches decoded into columns, which the Parquet writer takes as they are."""
    from ridgeline.agent.parquet_recording import COLUMNS_CODEC
    return COLUMNS_CODEC
