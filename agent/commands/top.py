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
    p.add_argument("--duration", type=float, default=0.0, metavar="S", help="exit S seconds after the first window (0: run until ^C)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="with --once/--duration: give up after S seconds without a window, exit 1 "
                        "(default: %(default)s)")
    p.add_argument("--every", type=float, default=5.0, metavar="S",
                   help="without a terminal, print a frame at most every S seconds (default: %(default)s)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ridgeline.agent.subscriber import open_stream
    from ridgeline.agent.top import TopState
    for name in ("duration", "timeout", "every"):
        if not getattr(args, name) >= 0:
            raise InputError(f"--{name} must be >= 0")
    sub = open_stream(args, topics=("window",))
    state = TopState(endpoint=args.endpoint)
    screen = _Screen(state, once=args.once, every=args.every)
    last_msg = time.monotonic()
    first_window = None          # --duration counts from the first frame: a slow start shows one
    bounded = args.once or args.duration
    try:
        while not (args.duration and first_window is not None and time.monotonic() - first_window >= args.duration):
            if screen.keys_pressed():
                break                          # q
            msg = sub.receive(0.25)
            if sub.refused:
                raise RuntimeFailure(f"top: {sub.refused}")
            if msg is None:
                if bounded and time.monotonic() - last_msg > args.timeout:
                    raise RuntimeFailure(f"top: no window from {args.endpoint} for {args.timeout:g} s "
                                         "(is `ridgeline agent` running?)")
                continue
            last_msg = time.monotonic()
            if first_window is None:
                first_window = last_msg
            state.windows += 1
            state.gaps = dict(sub.seq.gaps)
            state.restarts = sub.seq.restarts
            state.bad = sub.bad
            if isinstance(msg.payload, dict) and screen.show(msg.payload):
                return 0                       # --once: one frame printed
    finally:
        screen.close()
        sub.close()
    return 0


class _Screen:
    """Where frames go: the alternate screen with keys in a terminal, printed frames (at
    most every ``every`` seconds) without one, one frame with ``--once``."""

    def __init__(self, state, once: bool, every: float):
        from rich.console import Console

        from ridgeline.agent.top_view import ViewState
        self.console = Console()
        self.state, self.once, self.every = state, once, every
        self.interactive = self.console.is_terminal and not once
        self.view = ViewState()
        self.keys = _Keys() if self.interactive else None
        self.live = None
        self.window = None               # the latest window (probes.records.Window)
        self.last_print = 0.0

    def _frame(self):
        from ridgeline.agent.top_frame import frame
        w, h = self.console.size
        return frame(self.window, self.state, self.view, width=w, height=h if self.interactive else None)

    def keys_pressed(self) -> bool:
        """Apply the keys pressed since the last call, redraw if they changed the view;
        True when one of them quits."""
        if self.keys is None or not any([self.view.key(ch) for ch in self.keys.read()]):
            return False
        if not self.view.quit and self.live is not None and self.window is not None:
            self.live.update(self._frame())
        return self.view.quit

    def show(self, window: dict) -> bool:
        """Show a new window; True when that was the one frame ``--once`` prints."""
        import msgspec
        from rich.live import Live

        from ridgeline.probes.records import window_of
        try:
            typed = window_of(window)
        except msgspec.ValidationError as exc:      # a producer's bug, said in one line
            self.console.print(f"window #{self.state.windows} not readable as a window record: {exc}")
            return self.once
        self.window = typed
        self.view.observe(typed)
        shown = self._frame()
        if self.once:
            self.console.print(shown, soft_wrap=True)
            return True
        if self.interactive:
            if self.live is None:
                # The alternate screen, as htop's: the frame is redrawn in place.
                self.live = Live(shown, console=self.console, refresh_per_second=4, screen=True)
                self.live.start()
            else:
                self.live.update(shown)
        elif time.monotonic() - self.last_print >= self.every:
            # No terminal (a pipe, CI, a log): print a frame now and then.
            self.last_print = time.monotonic()
            self.console.print(shown, soft_wrap=True)
            self.console.rule()
        return False

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
        if self.keys is not None:
            self.keys.close()


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
