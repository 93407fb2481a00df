"""The recent past the agent joins served requests against, bounded, and the per-window join.

An engine exports a request's span when the request ends, but the steps it ran in were
seen over its whole life, many windows earlier, and so were the requests batched with it.
:class:`RequestHistory` keeps, for ``history_ns`` back from the newest window end:

* the GPU steps (``request_join.STEP_DTYPE`` plus the device and process they ran on),
  at most :data:`MAX_STEPS`;
* the request spans received (``probes.request_spans.RequestSpan``), at most
  ``request_join.MAX_REQUESTS`` (past it the oldest go, counted in ``requests_dropped``);
* the engine's KV-cache usage samples (one per window and endpoint), at most
  :data:`MAX_KV_SAMPLES`.

:meth:`RequestHistory.close` (once per window) joins the requests that are *due*, those
that ended, and reached the agent, at least ``join_delay_ns`` before the window's end, so
that a request batched with them and ending a little later has sent its span too (an
exporter that sends late, a BatchSpanProcessor's 5 s schedule or a stalled host, sends
the batch mates late as well: the wait counts from the arrival then), against every request held
and the steps of the busiest (device, process) over their lives (and ``FIT_LOOKBACK_S``
before, for the step-time fit). Each request is told
once, at most :data:`MAX_JOIN_PER_WINDOW` a window (oldest first; the rest wait, counted
in ``join_backlog``). It returns ``(WindowRequests, stories)``: the window's aggregates (the wire's
``requests`` record) and every story told (bounded by ``MAX_REQUESTS``). A request whose
span comes later than ``history_ns`` after it ended finds no steps: it is told with
no decode steps, never guessed.

Pure: numpy and msgspec only; times are the engines' wall clock (unix epoch ns), as the
steps' are.
"""
from __future__ import annotations

import collections

import numpy as np

from ridgeline.probes.request_spans import RequestSpan, merge

from . import request_join as rj

#: Steps held at most (about 30 minutes at 100 steps a second).
MAX_STEPS = 200_000
MAX_KV_SAMPLES = 16_384
HISTORY_S = 120.0
JOIN_DELAY_S = 5.0
#: Seconds of steps before the told requests' lives that the step-time fit also reads.
FIT_LOOKBACK_S = 30.0
#: Requests joined per window at most (bench/bench_requests.py: 0.06 s of CPU for 128 due
#: on a quiet host, 0.25 s for 256: the [candidate, step] join grows with due x co-batched).
MAX_JOIN_PER_WINDOW = 128
#: Ids of requests already told, remembered so that a span sent twice is told once.
MAX_TOLD = 100_000

HELD_DTYPE = np.dtype([("start_ns", np.int64), ("end_ns", np.int64), ("phase", np.uint8),
                       ("device", np.int32), ("pid", np.int32)])


class RequestHistory:
    def __init__(self, history_s: float = HISTORY_S, join_delay_s: float = JOIN_DELAY_S,
                 estimate_step_ns=None):
        self.history_ns = int(history_s * 1e9)
        self.join_delay_ns = int(join_delay_s * 1e9)
        self.estimate_step_ns = estimate_step_ns
        self.estimate_key = None        # what estimate_step_ns was built for (the window builder's)
        self._steps: list[np.ndarray] = []
        self._n_steps = 0
        self._requests: dict[str, RequestSpan] = {}
        self._arrived: dict[str, int] = {}  # request id -> the agent's clock when its span came
        self._told: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._kv: collections.deque = collections.deque(maxlen=MAX_KV_SAMPLES)
        self.requests_dropped = 0       # cumulative: over the bound, or repeated after being told
        self.steps_dropped = 0
        self.requests_joined = 0        # cumulative
        self._dropped_at_close = 0
        self.join_backlog = 0           # due requests left for the next window at the last close

    def configure(self, history_s: float, join_delay_s: float) -> None:
        self.history_ns, self.join_delay_ns = int(history_s * 1e9), int(join_delay_s * 1e9)

    # -- intake ---------------------------------------------------------------------------
    def add_steps(self, steps: np.ndarray) -> None:
        """Steps of ``HELD_DTYPE`` (the window's folded steps)."""
        if not len(steps):
            return
        self._steps.append(np.asarray(steps, dtype=HELD_DTYPE))
        self._n_steps += len(steps)
        while self._n_steps > MAX_STEPS and self._steps:
            over = self._n_steps - MAX_STEPS
            first = self._steps[0]
            if len(first) <= over:
                self._steps.pop(0)
                self._n_steps -= len(first)
                self.steps_dropped += len(first)
            else:
                self._steps[0] = first[over:]
                self._n_steps -= over
                self.steps_dropped += over

    def add_requests(self, spans: list[RequestSpan], arrived_ns: int | None = None) -> None:
        """``arrived_ns``: the agent's wall clock when these spans came (None for a replay,
        whose spans are all there at once): a request is not due before ``join_delay_ns``
        after it."""
        for s in spans:
            if s.request_id in self._told:
                self.requests_dropped += 1
                continue
            held = self._requests.get(s.request_id)
            # A second span of the same request (vLLM's journey events may come on their
            # own span): one record, the two merged.
            self._requests[s.request_id] = s if held is None else merge(held, s)
            if arrived_ns is not None:
                self._arrived[s.request_id] = int(arrived_ns)
        if len(self._requests) > rj.MAX_REQUESTS:
            old = sorted(self._requests.values(), key=lambda r: r.end_ns)[:len(self._requests) - rj.MAX_REQUESTS]
            for r in old:
                del self._requests[r.request_id]
                self._arrived.pop(r.request_id, None)
            self.requests_dropped += len(old)

    def add_kv(self, ts_ns: int, usage_ratio: float) -> None:
        if 0.0 <= usage_ratio <= 1.0:
            self._kv.append((int(ts_ns), float(usage_ratio)))

    # -- per window -----------------------------------------------------------------------
    def _held_steps(self) -> np.ndarray:
        if not self._steps:
            return np.empty(0, HELD_DTYPE)
        if len(self._steps) > 1:
            self._steps = [np.concatenate(self._steps)]
        return self._steps[0]

    def _prune(self, end_ns: int) -> None:
        lo = end_ns - self.history_ns
        st = self._held_steps()
        if len(st):
            keep = st["end_ns"] >= lo
            if not keep.all():
                self._steps = [st[keep]]
                self._n_steps = int(keep.sum())
        for rid in [rid for rid, r in self._requests.items() if r.end_ns < lo - self.join_delay_ns]:
            del self._requests[rid]
            self._arrived.pop(rid, None)

    def close(self, end_ns: int) -> tuple[rj.WindowRequests, list[rj.RequestStory]]:
        cut = end_ns - self.join_delay_ns
        due_list = sorted((r for rid, r in self._requests.items()
                           if r.end_ns <= cut and self._arrived.get(rid, cut) <= cut
                           and rid not in self._told),
                          key=lambda r: r.end_ns)
        # Bounded work per window: the oldest first, the rest wait for the next window (a
        # server ending more than this many requests a window for long loses the oldest
        # at the held bound, counted).
        self.join_backlog = max(0, len(due_list) - MAX_JOIN_PER_WINDOW)
        due = {r.request_id for r in due_list[:MAX_JOIN_PER_WINDOW]}
        stories: list[rj.RequestStory] = []
        if due:
            stories = self._join(due)
            for rid in due:
                self._told[rid] = None
            while len(self._told) > MAX_TOLD:
                self._told.popitem(last=False)
            self.requests_joined += len(stories)
        # Told requests stay held while they may still be co-batched members of later ones.
        self._prune(end_ns)
        dropped = self.requests_dropped - self._dropped_at_close
        self._dropped_at_close = self.requests_dropped
        return rj.window_figures(stories, dropped), stories

    def _join(self, due: set[str]) -> list[rj.RequestStory]:
        told = [self._requests[rid] for rid in due]
        # The steps over their lives, and FIT_LOOKBACK_S before: the baseline step time is
        # fitted on steps with culprits and without, and the quiet ones may be earlier.
        lo = min(r.start_ns for r in told) - int(FIT_LOOKBACK_S * 1e9)
        hi = max(r.end_ns for r in told)
        members = [r for r in self._requests.values() if r.end_ns >= lo and r.start_ns <= hi]
        st = self._held_steps()
        st = st[(st["end_ns"] >= lo) & (st["start_ns"] <= hi)]
        if len(st):
            # One engine's steps: the (device, process) with the most steps over these
            # lives (tensor-parallel ranks run the same steps; another served process's
            # steps would be other requests').
            key = (st["device"].astype(np.int64) << 32) | (st["pid"].astype(np.int64) & 0xFFFFFFFF)
            u, n = np.unique(key, return_counts=True)
            st = st[key == u[int(np.argmax(n))]]
        steps = np.empty(len(st), rj.STEP_DTYPE)
        for f in rj.STEP_DTYPE.names:
            steps[f] = st[f]
        kv = np.array(list(self._kv), dtype=rj.KV_DTYPE) if self._kv else None
        return rj.join(members, steps, kv, estimate_step_ns=self.estimate_step_ns, report=due)
