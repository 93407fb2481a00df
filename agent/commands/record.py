"""``ridgeline record``: save the agent's stream to a recording file (see :mod:`agent.recording`)."""
from __future__ import annotations

import signal
import sys
import time

from ridgeline.probes.errors import InputError


def register(sub) -> None:
    p = sub.add_parser("record", help="save the agent's stream to a file (replayable, analyzable)")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="recording to write")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:7411", help="agent endpoint (default: %(default)s)")
    p.add_argument("--duration", type=float, default=0.0, metavar="S", help="stop after S seconds (0: until ^C)")
    p.add_argument("--topic", action="append", metavar="T", help="only this topic (repeatable; default: all)")
    p.add_argument("--server-key", metavar="Z85", help="agent's CURVE public key (for a CURVE endpoint)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ridgeline.agent.recording import RecordingWriter
    from ridgeline.agent.subscriber import Subscriber
    if args.duration < 0:
        raise InputError("--duration must be >= 0")
    stop = {"now": False}

    def _stop(*_):
        stop["now"] = True
    old = signal.signal(signal.SIGTERM, _stop)
    sub = Subscriber(args.endpoint, topics=args.topic or (),
                     server_public_key=args.server_key.encode() if args.server_key else None)
    t0 = time.monotonic()
    try:
        with RecordingWriter(args.output) as w:
            try:
                while not stop["now"] and not (args.duration and time.monotonic() - t0 >= args.duration):
                    msg = sub.receive(0.2)
                    if msg is not None:
                        w.write(msg.raw, time.time_ns())
            except KeyboardInterrupt:
                pass
            gaps = sum(sub.seq.gaps.values())
            print(f"ridgeline record: {w.frames} messages, {w.bytes} bytes to {args.output}"
                  + (f"; {gaps} missing (sequence gaps)" if gaps else "")
                  + (f"; {sub.bad} undecodable skipped" if sub.bad else ""), file=sys.stderr)
    finally:
        sub.close()
        signal.signal(signal.SIGTERM, old)
    return 0
