"""``ridgeline top``: live view of the running agent's windows, one frame per window: per GPU
the verdict (which face binds, and why) with each phase's
roofline position, the serving engine's KV cache and latencies, and the agent's own health.

Reads the agent's stream (``--endpoint``, default the configuration's
``publisher.endpoint``); without a terminal it prints frames (see :mod:`agent.top`).
"""
from __future__ import annotations

import time

from ridgeline.agent.commands import description
from ridgeline.probes.errors import InputError, RuntimeFailure


def register(sub) -> None:
    from ridgeline.agent.subscriber import add_stream_arguments
    p = sub.add_parser("top", help="live terminal view of the agent's windows",
                       description=description(__doc__))
    add_stream_arguments(p, topics=False)
    p.add_argument("--once", action="store_true", help="print one window and exit")
    p.add_argument("--duration", type=float, default=0.0, metavar="S", help="exit after S seconds (0: run until ^C)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="with --once/--duration: give up after S seconds without a window, exit 1 "
                        "(default: %(default)s)")
    p.add_argument("--every", type=float, default=5.0, metavar="S",
                   help="without a terminal, print a frame at most every S seconds (default: %(default)s)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ridgeline.agent.extras import require
    require("rich", "ridgeline top")
    from rich.console import Console
    from rich.live import Live

    from ridgeline.agent.subscriber import open_stream
    from ridgeline.agent.top import TopState, render
    for name in ("duration", "timeout", "every"):
        if not getattr(args, name) >= 0:
            raise InputError(f"--{name} must be >= 0")
    console = Console()
    sub = open_stream(args, topics=("window",))
    state = TopState(endpoint=args.endpoint)
    t0 = time.monotonic()
    last_msg = t0
    bounded = args.once or args.duration
    live = None
    last_print = 0.0
    interactive = console.is_terminal and not args.once
    try:
        while True:
            now = time.monotonic()
            if args.duration and now - t0 >= args.duration:
                break
            msg = sub.receive(0.25)
            if sub.refused:
                raise RuntimeFailure(f"top: {sub.refused}")
            if msg is None:
                if bounded and time.monotonic() - last_msg > args.timeout:
                    raise RuntimeFailure(f"top: no window from {args.endpoint} for {args.timeout:g} s "
                                         "(is `ridgeline agent` running?)")
                continue
            last_msg = time.monotonic()
            state.windows += 1
            state.gaps = dict(sub.seq.gaps)
            state.restarts = sub.seq.restarts
            state.bad = sub.bad
            if not isinstance(msg.payload, dict):
                continue
            view = render(msg.payload, state)
            if args.once:
                console.print(view)
                return 0
            if interactive:
                if live is None:
                    live = Live(view, console=console, refresh_per_second=4, screen=False)
                    live.start()
                else:
                    live.update(view)
            elif time.monotonic() - last_print >= args.every:
                # No terminal (a pipe, CI, a log): print a frame now and then.
                last_print = time.monotonic()
                console.print(view)
                console.rule()
    finally:
        if live is not None:
            live.stop()
        sub.close()
    return 0
