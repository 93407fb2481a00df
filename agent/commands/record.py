"""``ridgeline record``: save the agent's stream to a recording file (see :mod:`agent.recording`)."""
from __future__ import annotations

import signal
import sys
import time

from ridgeline.probes.errors import InputError, RuntimeFailure


def register(sub) -> None:
    from ridgeline.agent.subscriber import add_stream_arguments
    p = sub.add_parser("record", help="save the agent's stream to a file (replayable, analyzable)")
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="recording to write (a folder with --format parquet)")
    p.add_argument("--format", choices=("rlrec", "parquet"), default="rlrec",
                   help="rlrec: one framed file (default); parquet: Hive-style folders host=/gpu=/hour= "
                        "(docs/parquet-schema.md; needs the ridgeline[parquet] extra)")
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
    if not args.duration >= 0:
        raise InputError("--duration must be >= 0")
    if not args.timeout >= 0:
        raise InputError("--timeout must be >= 0")
    stop = {"now": False}

    def _stop(*_):
        stop["now"] = True
    old = signal.signal(signal.SIGTERM, _stop)
    sub = open_stream(args)
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
