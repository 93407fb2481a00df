"""Rate limit on the agent's log lines, per kind and per peer (issue 18.5).

One bad frame per connection gave 4,578 lines/s, far above journald's default rate limit,
which then drops the agent's real messages too. :class:`LogLimit` is a ``logging.Filter``
on the agent's handler: a line's *kind* is its logger and format string (``record.msg``,
before the peer's values are put in), its *peer* the ``peer`` attribute callers pass with
``extra={"peer": uid}`` (none: one peer). Each (kind, peer) has a token bucket
(``burst`` lines, then ``per_s``), and each kind as a whole another, so many peers cannot
flood one kind either. Suppressed lines are counted (``suppressed``, per kind, published by
the probes' counters) and summarised in one line per kind once its bucket refills.
Bounded: at most ``max_keys`` buckets (least recently used dropped).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict


class LogLimit(logging.Filter):
    def __init__(self, burst: int = 10, per_s: float = 0.2, kind_burst: int = 30, kind_per_s: float = 1.0,
                 max_keys: int = 4096, clock=time.monotonic):
        super().__init__()
        self.burst, self.per_s, self.kind_burst, self.kind_per_s = burst, per_s, kind_burst, kind_per_s
        self.max_keys, self.clock = max_keys, clock
        self._b: OrderedDict[tuple, tuple[float, float]] = OrderedDict()
        self.suppressed: dict[str, int] = {}        # kind -> lines suppressed since start
        self._pending: dict[str, int] = {}          # kind -> suppressed since its last summary

    def _take(self, key, burst, rate, now) -> bool:
        left, t = self._b.get(key, (float(burst), now))
        left = min(float(burst), left + (now - t) * rate)
        ok = left >= 1.0
        self._b[key] = (left - 1.0 if ok else left, now)
        self._b.move_to_end(key)
        while len(self._b) > self.max_keys:
            self._b.popitem(last=False)
        return ok

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True                              # errors are never suppressed
        kind = f"{record.name}: {record.msg}"[:160]
        now = self.clock()
        peer = getattr(record, "peer", None)
        # the peer's bucket first: a peer past its share does not spend the kind's
        ok = self._take(("p", kind, peer), self.burst, self.per_s, now) and \
            self._take(("k", kind), self.kind_burst, self.kind_per_s, now)
        if not ok:
            self.suppressed[kind] = self.suppressed.get(kind, 0) + 1
            self._pending[kind] = self._pending.get(kind, 0) + 1
            if len(self.suppressed) > self.max_keys:
                self.suppressed.pop(next(iter(self.suppressed)))
            return False
        n = self._pending.pop(kind, 0)
        if n:
            record.msg = f"{record.msg} [{n} more lines of this kind suppressed since the last one shown]"
        return True

    def total_suppressed(self) -> int:
        return sum(self.suppressed.values())


#: The agent's one limiter (installed on its log handler by agent.daemon.configure_logging).
LIMIT = LogLimit()
