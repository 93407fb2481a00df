"""Served processes whose CUPTI another tool took over, and when to ask for it back.

On legacy (single-subscriber) CUPTI a later torch.profiler (Kineto) run re-registers the
activity buffer callbacks; the injection library notices, flags every HELLO with
``RL_FLAG_TAKEN_OVER`` and pauses (docs/cupti.md, "Sharing CUPTI"). It resumes by itself
when the other tool finalized CUPTI or (CUPTI >= 13.2) disabled every activity kind; on
12.x/13.0/13.1 without teardown only the agent can tell it to (``RL_CONTROL_RECLAIM``).

Contract of :class:`TakeoverWatch` (pure: times are given, nothing is sent):

* :meth:`observe` takes the pids flagged as taken over now (plus the status lines that
  came since the last call) and returns the pids to send a reclaim to now;
* a pid is asked at most once per ``reclaim_after_s`` (a failed reclaim is asked again
  one period later, never in a loop);
* automatic reclaim happens only when ``reclaim_after_s`` > 0 and the takeover is at least
  that old; :meth:`request` (the operator's ``ridgeline cupti reclaim``) asks at the next
  :meth:`observe` whatever its age;
* :meth:`report` lists each taken-over process: ``pid``, ``since_unix_s``,
  ``taken_over_s``, ``status`` (the library's own line, escaped by the probe),
  ``reclaims_requested``, and whose process it is, ``uid`` and ``comm`` (given by
  :meth:`owners`; -1 and "" until then), at most :data:`REPORT_MAX` of them (longest
  first; :meth:`count` counts all). Processes no longer flagged (resumed, or gone) leave
  the list;
* :meth:`by_uid` counts them per uid for /metrics: any local user may flag its own
  process as taken over (issue 18.3), so the alert says whose; at most :data:`UID_SERIES`
  uids (those with the most), the rest under ``"other"``.

Why automatic reclaim is off by default: Kineto keeps its outstanding buffers in its own
map (``CuptiActivityApi::allocatedGpuTraceBuffers_``) and frees them itself; a reclaim
while its session runs hands those buffers to Ridgeline's completion callback (Kineto's
trace loses them and the buffer has two owners). A torch.profiler session ends when the
user's code leaves it, a schedule with ``repeat=0`` starts a new one every cycle, and
Kineto finalizes CUPTI only with ``TEARDOWN_CUPTI=1`` (torch.compile's CUDA-graph mode
forces 0), so no fixed age proves the other tool is done. Set it only on hosts whose
profiling sessions are known to be shorter (on-demand Kineto traces default to 500 ms).
"""
from __future__ import annotations

from dataclasses import dataclass

#: Status line kept per process (the library's text, cut): the health record is sent
#: every window, so it stays small however many processes are taken over.
STATUS_MAX_CHARS = 1000
#: Processes listed in the health record (the longest taken over first); the count
#: (:meth:`TakeoverWatch.count`) covers them all.
REPORT_MAX = 64
#: uids named on /metrics (bounded cardinality); the others are summed under "other"
UID_SERIES = 16


@dataclass
class _Episode:
    since_unix_s: float
    status: str = ""
    reclaims_requested: int = 0
    last_request_s: float | None = None
    uid: int = -1
    comm: str = ""


class TakeoverWatch:
    def __init__(self, reclaim_after_s: float = 0.0):
        self.reclaim_after_s = float(reclaim_after_s)
        self._episodes: dict[int, _Episode] = {}
        self._status: dict[int, str] = {}        # latest takeover line per pid, before it is flagged
        self._requested: set[int] | None = None   # operator: None = nothing asked; empty = every pid
        self._asked_all = False
        self.reclaims_requested = 0

    def status_lines(self, lines: dict) -> None:
        """The library's status lines (``poll()["status"]``): the takeover line is kept."""
        for pid, text in lines.items():
            text = str(text)[:STATUS_MAX_CHARS]
            if "takeover:" in text:
                self._status[int(pid)] = text
                if int(pid) in self._episodes:
                    self._episodes[int(pid)].status = text

    def request(self, pid: int | None = None) -> None:
        """The operator asks for a reclaim (of one pid, or of every taken-over process)."""
        if pid is None:
            self._asked_all = True
        else:
            self._requested = (self._requested or set()) | {int(pid)}

    def observe(self, taken_over: set[int], now_s: float) -> list[int]:
        for pid in list(self._episodes):
            if pid not in taken_over:
                del self._episodes[pid]
                self._status.pop(pid, None)
        out = []
        for pid in sorted(taken_over):
            ep = self._episodes.get(pid)
            if ep is None:
                ep = self._episodes[pid] = _Episode(now_s, self._status.get(pid, ""))
            asked = self._asked_all or (self._requested is not None and pid in self._requested)
            due = (self.reclaim_after_s > 0 and now_s - ep.since_unix_s >= self.reclaim_after_s
                   and (ep.last_request_s is None or now_s - ep.last_request_s >= self.reclaim_after_s))
            if asked or due:
                ep.reclaims_requested += 1
                ep.last_request_s = now_s
                self.reclaims_requested += 1
                out.append(pid)
        self._asked_all, self._requested = False, None
        return out

    def count(self) -> int:
        return len(self._episodes)

    def owners(self, owners: dict) -> None:
        """``{pid: (uid, comm)}`` of the taken-over processes (the probe's)."""
        for pid, (uid, comm) in owners.items():
            ep = self._episodes.get(int(pid))
            if ep is not None:
                ep.uid, ep.comm = int(uid), str(comm)[:15]

    def by_uid(self) -> dict[str, int]:
        n: dict[str, int] = {}
        for ep in self._episodes.values():
            n[str(ep.uid)] = n.get(str(ep.uid), 0) + 1
        top = sorted(n.items(), key=lambda kv: (-kv[1], kv[0]))
        out = dict(top[:UID_SERIES])
        if len(top) > UID_SERIES:
            out["other"] = sum(v for _, v in top[UID_SERIES:])
        return out

    def report(self, now_s: float) -> list[dict]:
        eps = sorted(self._episodes.items(), key=lambda kv: (kv[1].since_unix_s, kv[0]))[:REPORT_MAX]
        return [{"pid": pid, "since_unix_s": ep.since_unix_s, "taken_over_s": max(0.0, now_s - ep.since_unix_s),
                 "status": ep.status, "reclaims_requested": ep.reclaims_requested, "uid": ep.uid, "comm": ep.comm}
                for pid, ep in eps]
