"""How much time each peer's names may cost the agent: seconds, per process and per user.

Two budgets are kept this way: the demangler's (wall time of each call, issue 18.2) and
the kernel-name classifier's (CPU time of the pump thread matching a process's new names
against the signatures, issue 18.1).

Every call of :func:`probes.cupti.demangle.demangle_many` for a peer's names is charged its
wall time, whatever its outcome (all names demangled, an answer over the length cap, a
deadline): counting only deadlines let names that take just under the deadline, or whose
answers pass the cap, keep the demangler busy for every batch (issue 18.2: a 42 s stall).
Two token buckets must both hold time for a call to be made: one per process (pid) and one
per peer identity (uid, from ``SO_PEERCRED``), so one user forking processes is bounded as
a whole. The buckets live in the probe, not in a connection or a process's decoder, so a
reconnect (or a new decoder after the old one was released) starts from what was left.

Real names cost microseconds each (a process with 10,000 kernels: tens of milliseconds,
plus the worker's start), so the default burst is never reached by a real process; the
refill lets a long-lived process that loads new kernels later keep being demangled.
Bounded: at most ``max_keys`` pids and uids are remembered (the least recently charged go).
"""
from __future__ import annotations

import time
from collections import OrderedDict

#: Demangler seconds one process may spend at once, and how fast that comes back.
PID_BURST_S = 2.0
PID_REFILL_PER_S = 2.0 / 3600
#: The same for all processes of one user together.
UID_BURST_S = 5.0
UID_REFILL_PER_S = 5.0 / 3600
#: Classifier CPU seconds of one process, and of one user's processes together. A real
#: name costs about 90 us against the built-in signatures (RE2, 48 patterns), so 20,000
#: kernel names of one process stay inside the burst; a 4 kB adversarial name costs about
#: 0.3 ms (linear: no backtracking), so one user's 10 s burst is some 30,000 such names.
CLASSIFY_PID_BURST_S = 3.0
CLASSIFY_PID_REFILL_PER_S = 3.0 / 3600
CLASSIFY_UID_BURST_S = 10.0
CLASSIFY_UID_REFILL_PER_S = 10.0 / 3600


class _Buckets:
    __slots__ = ("burst", "rate", "max_keys", "_t")

    def __init__(self, burst: float, rate: float, max_keys: int):
        self.burst, self.rate, self.max_keys = burst, rate, max_keys
        self._t: OrderedDict[int, tuple[float, float]] = OrderedDict()   # key -> (seconds left, as of)

    def left(self, key: int, now: float) -> float:
        v = self._t.get(key)
        if v is None:
            return self.burst
        return min(self.burst, v[0] + (now - v[1]) * self.rate)

    def charge(self, key: int, seconds: float, now: float) -> None:
        self._t[key] = (self.left(key, now) - seconds, now)
        self._t.move_to_end(key)
        while len(self._t) > self.max_keys:
            self._t.popitem(last=False)


class PeerTimeBudget:
    """Per-pid and per-uid time (see the module docstring); the demangler's by default."""

    def __init__(self, pid_burst_s: float = PID_BURST_S, pid_refill_per_s: float = PID_REFILL_PER_S,
                 uid_burst_s: float = UID_BURST_S, uid_refill_per_s: float = UID_REFILL_PER_S,
                 max_keys: int = 4096, clock=time.monotonic):
        self._pid = _Buckets(pid_burst_s, pid_refill_per_s, max_keys)
        self._uid = _Buckets(uid_burst_s, uid_refill_per_s, max_keys)
        self.clock = clock
        self.spent_s = 0.0            # all peers together, since start (published)
        self.refused_calls = 0        # calls not made: the pid's or the uid's time was spent

    def allowed(self, pid: int, uid: int) -> bool:
        now = self.clock()
        ok = self._pid.left(pid, now) > 0 and self._uid.left(uid, now) > 0
        if not ok:
            self.refused_calls += 1
        return ok

    def charge(self, pid: int, uid: int, seconds: float) -> None:
        now = self.clock()
        seconds = max(0.0, seconds)
        self._pid.charge(pid, seconds, now)
        self._uid.charge(uid, seconds, now)
        self.spent_s += seconds

    def left(self, pid: int, uid: int) -> tuple[float, float]:
        now = self.clock()
        return self._pid.left(pid, now), self._uid.left(uid, now)
