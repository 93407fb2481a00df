"""``ridgeline requests``: the slowest served requests of the next windows, with their
segments and culprits (from the agent's ``requests`` topic; ``--json`` gives the same)."""
from __future__ import annotations

import sys
import time

from ridgeline.agent.commands import description
from ridgeline.probes.errors import InputError, RuntimeFailure


def register(sub) -> None:
    from ridgeline.agent.subscriber import add_stream_arguments
    p = sub.add_parser("requests", help="slowest served requests: queue, prefill, decode, time dragged, culprits",
                       description=description(__doc__))
    add_stream_arguments(p, topics=False)
    p.add_argument("--windows", type=int, default=5, metavar="N",
                   help="read the requests joined over N windows, then print (default: %(default)s)")
    p.add_argument("--limit", type=int, default=10, metavar="K", help="show the K slowest (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="give up after S seconds without a window, exit 1 (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="the same as JSON: {\"windows\": N, \"requests\": [story...]}")
    p.set_defaults(func=run)


def collect(args, want_id: str | None = None):
    """Stories read over ``args.windows`` windows (or until ``want_id`` is told): (stories, windows)."""
    from ridgeline.agent.request_view import stories_of
    from ridgeline.agent.subscriber import open_stream
    sub = open_stream(args, topics=("window", "requests"))
    stories, windows, bad = [], 0, 0
    last = time.monotonic()
    try:
        while want_id is not None or windows < args.windows:
            msg = sub.receive(0.25)
            if sub.refused:
                raise RuntimeFailure(f"{args.command}: {sub.refused}")
            if msg is None:
                if time.monotonic() - last > args.timeout:
                    if want_id is not None and windows:
                        raise RuntimeFailure(f"why: request {want_id!r} was not told in {windows} window(s) "
                                             f"({args.timeout:g} s without it); it may have ended before this "
                                             "command started (give --input with a `ridgeline requests --json` "
                                             "output) or its engine sends no spans to the agent")
                    raise RuntimeFailure(f"{args.command}: no window from {args.endpoint} for {args.timeout:g} s "
                                         "(is `ridgeline agent` running?)")
                continue
            if msg.topic == "window":
                windows += 1
                if want_id is None:
                    last = time.monotonic()
                continue
            got, b = stories_of(msg.payload)
            bad += b
            stories.extend(got)
            if want_id is not None and any(s.request_id == want_id for s in got):
                break
    finally:
        sub.close()
    if bad:
        print(f"ridgeline {args.command}: {bad} malformed request record(s) skipped", file=sys.stderr)
    return stories, windows


def run(args) -> int:
    from ridgeline.agent import request_view
    if args.windows < 1:
        raise InputError("--windows must be >= 1")
    if args.limit < 1:
        raise InputError("--limit must be >= 1")
    if not args.timeout > 0:
        raise InputError("--timeout must be > 0")
    stories, windows = collect(args)
    top = request_view.slowest(stories, args.limit)
    if args.json:
        print(request_view.as_json(top, windows))
    else:
        print(f"{len(stories)} request(s) joined over {windows} window(s); the {len(top)} slowest:")
        print(request_view.table(top))
    return 0
