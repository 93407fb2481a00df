"""``ridgeline top``: live view of the running agent's windows, one frame per window: per GPU
the verdict (which face binds, and why) with each phase's
roofline position, the serving engine's KV cache and latencies, and the agent's own health.

Reads the agent's stream (``--endpoint``, default the configuration's
``publisher.endpoint``). In a terminal the frame fits the window (80x24 and up) and keys
work as in htop: q quits, s sorts the GPU/process list, g and p pick a GPU and a process;
each GPU's verdict carries a sparkline of its binding face's figure over the last windows.
Without a terminal it prints frames (see :mod:`agent.top_frame`).
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
    from rich.console import Console
    from rich.live import Live

    from ridgeline.agent.subscriber import open_stream
    from ridgeline.agent.top import TopState
    from ridgeline.agent.top_frame import frame
    from ridgeline.agent.top_view import ViewState
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
    view = ViewState()
    keys = _Keys() if interactive else None
    last_window: dict | None = None

    def draw(window: dict):
        w, h = console.size
        return frame(window, state, view, width=w, height=h if interactive else None)
    try:
        while True:
            now = time.monotonic()
            if args.duration and now - t0 >= args.duration:
                break
            if keys is not None and any([view.key(ch) for ch in keys.read()]):
                if view.quit:
                    break
                if live is not None and last_window is not None:
                    live.update(draw(last_window))
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
            last_window = msg.payload
            view.observe(last_window)
            shown = draw(last_window)
            if args.once:
                console.print(shown, soft_wrap=True)
                return 0
            if interactive:
                if live is None:
                    # The alternate screen, as htop's: the frame is redrawn in place.
                    live = Live(shown, console=console, refresh_per_second=4, screen=True)
                    live.start()
                else:
                    live.update(shown)
            elif time.monotonic() - last_print >= args.every:
                # No terminal (a pipe, CI, a log): print a frame now and then.
                last_print = time.monotonic()
                console.print(shown, soft_wrap=True)
                console.rule()
    finally:
        if live is not None:
            live.stop()
        if keys is not None:
            keys.close()
        sub.close()
    return 0


class _Keys:
    """Keys from the terminal without waiting for Enter (cbreak mode, restored on close)."""

    def __init__(self):
        import sys
        import termios
        import tty
        self._fd = sys.stdin.fileno()
        try:
            self._saved = termios.tcgetattr(self._fd)
            tty.setcbreak(self._fd)
        except termios.error:       # stdin is not a terminal (stdout is): no keys
            self._saved = None

    def read(self) -> list[str]:
        import os
        import select
        if self._saved is None:
            return []
        out = []
        while select.select([self._fd], [], [], 0)[0] and len(out) < 16:
            ch = os.read(self._fd, 1)
            if not ch:
                break
            out.append(ch.decode("latin-1"))
        return out

    def close(self) -> None:
        import termios
        if self._saved is not None:
            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
            self._saved = None
