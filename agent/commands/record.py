"""``ridgeline record``: save the running agent's stream (windows, events, engine and device
records) to a recording file (``.rlrec``) that ``ridgeline analyze`` reports on and
``ridgeline agent`` can replay as live; what was recorded is kept when it stops.

Format: see :mod:`agent.recording`.
"""
from __future__ import annotations

import signal
import sys
import time

from ridgeline.agent.commands import description
from ridgeline.probes.errors import InputError, RuntimeFailure


def register(sub) -> None:
    from ridgeline.agent.subscriber import add_stream_arguments
    p = sub.add_parser("record", help="save the agent's stream to a file (replayable, analyzable)",
                       description=description(__doc__))
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="recording to write")
    add_stream_arguments(p)
    p.add_argument("--duration", type=float, default=0.0, metavar="S", help="stop after S seconds (0: until ^C)")
    p.add_argument("--timeout", type=float, default=0.0, metavar="S",
                   help="give up after S seconds without a message, exit 1 (0: wait); what was recorded is kept")
    p.set_defaults(func=run)


def run(args) -> int:
    from ridgeline.agent.recording import RecordingWriter
    from ridgeline.agent.subscriber import open_stream
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
            try:
                while not stop["now"] and not (args.duration and time.monotonic() - t0 >= args.duration):
                    msg = sub.receive(0.2)
                    if sub.refused:
                        failure = f"record: {sub.refused}"
                        break
                    if msg is not None:
                        w.write(msg.raw, time.time_ns())
                        last = time.monotonic()
                    elif args.timeout and time.monotonic() - last > args.timeout:
                        failure = (f"record: no message for {args.timeout:g} s from {args.endpoint} "
                                   "(is `ridgeline agent` running?)")
                        break
            except KeyboardInterrupt:
                pass
            gaps = sum(sub.seq.gaps.values())
            print(f"ridgeline record: {w.frames} messages, {w.bytes} bytes to {args.output}"
                  + (f"; {gaps} missing (sequence gaps)" if gaps else "")
                  + (f"; {sub.bad} undecodable skipped" if sub.bad else ""), file=sys.stderr)
    finally:
        sub.close()
        signal.signal(signal.SIGTERM, old)
    if failure:
        raise RuntimeFailure(failure)
    return 0
