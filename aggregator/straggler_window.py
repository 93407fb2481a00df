"""Tensor-parallel stragglers online: :mod:`aggregator.stragglers` over the agent's windows.

The agent folds each event batch when it arrives and keeps no batch (``aggregator.windows``),
but the straggler analysis needs every rank's kernels side by side, and the ranks' CUPTI
buffers arrive when each process flushes them, not together. :class:`LiveStragglers` keeps,
for the last :data:`HOLD_WINDOWS` windows (by arrival), the kernels and copies of the
sources that have shown a collective kernel (a process that never runs one costs one
classification per batch and nothing held), at most :data:`MAX_HELD_KERNELS` kernels
(past it the oldest window goes, counted in ``kernels_dropped``).

At each window close it runs :func:`aggregator.stragglers.analyse` over what it holds and
reports each collective once: per group (its ranks, as (pid, device)), the instances that
ended after the last one reported and no later than the group's *settled* time, the
earliest of its ranks' latest kernel ends (a rank whose buffer has not come yet holds the
group's newer collectives back to a later window instead of pairing them wrongly).

:meth:`LiveStragglers.close` returns :class:`WindowStragglers` (the window record's
``stragglers``): per group the collectives reported, the share of the group's time its
ranks spent waiting in them for the last rank, the straggler (the rank most often last),
how late it was (p50, p99), its dominant cause (``kernel``, ``copy``, ``host``: see
:mod:`aggregator.stragglers`) and per rank how often it was last and how long it waited.
At most :data:`MAX_GROUPS` groups (the most waiting first). Pure: numpy and msgspec.
"""
from __future__ import annotations

import collections

import msgspec
import numpy as np

from ridgeline.probes.events import COPY_DTYPE, KERNEL_DTYPE, NameTable, Trace, empty
from ridgeline.probes.records import (  # noqa: F401 (its records)
    GroupStragglers,
    RankStragglers,
    SchedFigures,
    SchedThread,
    Window,
    WindowStragglers,
)

from . import stragglers as S
from .signatures import ROLE_COLLECTIVE, classify_kernels

#: Windows of kernels held (by arrival): a rank's buffer may come a window after another's.
HOLD_WINDOWS = 3
#: Kernels held at most, over all sources (8 ranks x 3 windows at about 12,000 kernels/s).
MAX_HELD_KERNELS = 300_000
#: Groups reported per window at most (8 GPUs x 8 processes cannot form more than 32).
MAX_GROUPS = 16
#: Name tables whose collective names are remembered (one per served process and source).
MAX_NAME_TABLES = 256
#: Group keys remembered (their last reported collective).
MAX_GROUP_KEYS = 256
#: Kernels that ended this long before the earliest collective reported at the last close
#: are left out of the next analysis (reported already; what a lagging rank still owes is
#: after it): the time "since the previous collective" and the grouping need only a margin.
LOOKBACK_NS = 100_000_000

_HELD_KERNEL = np.dtype([("pid", "<i4"), ("device", "<i4"), ("name_id", "<i4"), ("start_ns", "<i8"),
                         ("end_ns", "<i8"), ("collective", "?")])
_HELD_COPY = np.dtype([("pid", "<i4"), ("device", "<i4"), ("start_ns", "<i8"), ("end_ns", "<i8")])


def _sched_rows(window: Window, pid: int) -> list[SchedThread]:
    """The window's scheduling rows of process ``pid`` (a source or row of another shape is
    skipped)."""
    out = []
    for data in window.sched.values():
        try:
            threads = msgspec.convert(data, SchedFigures).threads
        except msgspec.ValidationError:
            continue
        for th in threads if isinstance(threads, list) else ():
            try:
                row = msgspec.convert(th, SchedThread)
            except msgspec.ValidationError:
                continue
            if row.pid == pid:
                out.append(row)
    return out


def _off_cpu(window: Window, pid: int, device: int) -> float:
    """The off-CPU share (run queue and blocked) of the threads that launched the kernels of
    (``pid``, ``device``): the GPU entry's ``launch_tids``, else the threads the scheduling
    probe saw launching; -1 when unknown."""
    tids = {t for g in window.gpus if g.pid == pid and g.device == device
            for t in g.launch_tids if isinstance(t, int)}
    on = off = 0.0
    for th in _sched_rows(window, pid):
        if tids and th.tid not in tids or not tids and not th.launches:
            continue
        v = (th.on_cpu_ns, th.runq_wait_ns, th.blocked_ns)
        if any(x is None for x in v):
            continue
        on += v[0]
        off += v[1] + v[2]
    return off / (on + off) if on + off > 0 else -1.0


def annotate_launch_threads(window: Window) -> None:
    """Fill each group's ``straggler_launch_off_cpu_ratio`` and ``others_launch_off_cpu_ratio``
    from the window's scheduling rows: the threads that launched the rank's kernels (the
    GPU entry's ``launch_tids``, else the threads the probe saw launching), their run-queue
    plus blocked time over their whole time. Unknown stays -1."""
    s = window.stragglers
    if s is None:
        return
    groups = []
    for g in s.groups:
        who = (g.straggler_pid, g.straggler_device)
        others = [_off_cpu(window, r.pid, r.device) for r in g.ranks if (r.pid, r.device) != who]
        others = [x for x in others if x >= 0]
        groups.append(msgspec.structs.replace(
            g, straggler_launch_off_cpu_ratio=_off_cpu(window, *who),
            others_launch_off_cpu_ratio=float(np.median(others)) if others else -1.0))
    window.stragglers = msgspec.structs.replace(s, groups=groups)


class LiveStragglers:
    def __init__(self):
        self.names = NameTable()           # collective names, one table over every source
        self._windows: collections.deque = collections.deque()   # [(kernels, copies)] per window
        self._open_k: list[np.ndarray] = []
        self._open_c: list[np.ndarray] = []
        self._held = 0
        self._with_collectives: set = set()
        self._reported: collections.OrderedDict = collections.OrderedDict()   # group key -> end_ns
        self.kernels_dropped = 0
        self._cutoff_ns = None               # see LOOKBACK_NS
        self._roles: dict[int, tuple] = {}   # id(name table) -> (table, collective per name id + 1)

    def add(self, trace: Trace, source: str) -> None:
        k = trace.kernels
        if not len(k) and not len(trace.copies):
            return
        coll = self._collective_names(trace.names)[k["name_id"].astype(np.int64) + 1] if len(k) else np.zeros(0, bool)
        if coll.any():
            self._with_collectives.add(source)
        elif source not in self._with_collectives:
            return
        rows = np.zeros(len(k), _HELD_KERNEL)
        for f in ("pid", "device", "start_ns", "end_ns"):
            rows[f] = k[f]
        rows["collective"] = coll
        rows["name_id"] = -1
        if coll.any():
            ids = k["name_id"][coll]
            u, inv = np.unique(ids, return_inverse=True)
            glob = np.array([self.names.intern(trace.names[int(i)]) for i in u], np.int32)
            rows["name_id"][coll] = glob[inv]
        c = trace.copies
        crow = np.zeros(len(c), _HELD_COPY)
        for f in _HELD_COPY.names:
            crow[f] = c[f]
        self._open_k.append(rows)
        self._open_c.append(crow)
        self._held += len(rows)
        while self._held > MAX_HELD_KERNELS and self._windows:
            old_k, _old_c = self._windows.popleft()
            self._held -= len(old_k)
            self.kernels_dropped += len(old_k)
        if self._held > MAX_HELD_KERNELS:      # one window alone over the bound: its oldest batches go
            while self._held > MAX_HELD_KERNELS and len(self._open_k) > 1:
                self._held -= len(self._open_k[0])
                self.kernels_dropped += len(self._open_k.pop(0))
                self._open_c.pop(0)

    def _collective_names(self, names: NameTable) -> np.ndarray:
        """Per name id + 1 (slot 0: no name), whether it is a collective kernel: classified
        once per name of each name table (a batch costs one index, not a classification)."""
        held = self._roles.get(id(names))
        if held is not None and held[0] is names and len(held[1]) == len(names) + 1:
            return held[1]
        old = held[1] if held is not None and held[0] is names else np.zeros(1, bool)
        new_ids = np.arange(len(old) - 1, len(names), dtype=np.int32)
        k = empty(KERNEL_DTYPE, len(new_ids))
        k["name_id"] = new_ids
        roles = classify_kernels(Trace(kernels=k, names=names)).role == ROLE_COLLECTIVE
        arr = np.concatenate([old, roles])
        if len(self._roles) >= MAX_NAME_TABLES and id(names) not in self._roles:
            self._roles.pop(next(iter(self._roles)))
        self._roles[id(names)] = (names, arr)
        return arr

    def close(self) -> WindowStragglers | None:
        """This window's figures, or None when no source has shown a collective."""
        self._windows.append((np.concatenate(self._open_k) if self._open_k else np.zeros(0, _HELD_KERNEL),
                              np.concatenate(self._open_c) if self._open_c else np.zeros(0, _HELD_COPY)))
        self._open_k, self._open_c = [], []
        while len(self._windows) > HOLD_WINDOWS:
            self._held -= len(self._windows.popleft()[0])
        if not self._with_collectives:
            return None
        ks = np.concatenate([w[0] for w in self._windows])
        cs = np.concatenate([w[1] for w in self._windows])
        if self._cutoff_ns is not None:
            ks = ks[ks["end_ns"] >= self._cutoff_ns]
            cs = cs[cs["end_ns"] >= self._cutoff_ns]
        groups = self._figures(ks, cs) if len(ks) else []
        groups.sort(key=lambda g: -g.waiting_share_ratio)
        return WindowStragglers(groups=groups[:MAX_GROUPS], straggler_kernels_dropped=self.kernels_dropped)

    def _figures(self, ks: np.ndarray, cs: np.ndarray) -> list[GroupStragglers]:
        order = np.argsort(ks["start_ns"], kind="stable")
        ks = ks[order]
        k = empty(KERNEL_DTYPE, len(ks))
        for f in ("pid", "device", "name_id", "start_ns", "end_ns"):
            k[f] = ks[f]
        c = empty(COPY_DTYPE, len(cs))
        for f in _HELD_COPY.names:
            c[f] = cs[f]
        summary, inst = S.analyse(Trace(kernels=k, copies=c, names=self.names), collective=ks["collective"])
        keys_all = S._rank_keys(k)
        out = []
        reported_ends = []
        for g in summary.groups:
            members = [(r.pid, r.device) for r in g.ranks]
            key = tuple(members)
            mk = np.array([(p << 32) | (d & 0xFFFFFFFF) for p, d in members], np.int64)
            # Settled: every rank has sent its kernels up to here (an instance's ends agree
            # within the tolerance, so one whose kernel every rank has sent ends by then).
            settled = min(int(k["end_ns"][keys_all == m].max()) for m in mk) + S.END_TOLERANCE_NS
            last = self._reported.get(key, -1)
            mine = inst[(inst["group"] == g.group) & (inst["end_ns"] > last) & (inst["end_ns"] <= settled)]
            if not len(mine):
                continue
            self._reported[key] = int(mine["end_ns"].max())
            reported_ends.append(int(mine["end_ns"].max()))
            self._reported.move_to_end(key)
            while len(self._reported) > MAX_GROUP_KEYS:
                self._reported.popitem(last=False)
            m = len(members)
            counts = np.bincount(mine["late_rank"], minlength=m)
            strag = int(np.argmax(counts))
            late = mine[mine["late_rank"] == strag]
            causes = np.bincount(late["cause"], minlength=3)
            begin = last if last >= 0 else int(mine["start_ns"].min())
            span = max(1, int(mine["end_ns"].max()) - begin)
            per_rank = self._per_rank_wait(k, keys_all, mk, mine)
            out.append(GroupStragglers(
                ranks=[RankStragglers(pid=p, device=d, last_count=int(counts[i]), wait_ns=int(per_rank[i]))
                       for i, (p, d) in enumerate(members)],
                collectives=len(mine), waiting_share_ratio=float(mine["wait_ns"].sum()) / (m * span),
                straggler_pid=members[strag][0], straggler_device=members[strag][1],
                straggler_last_share_ratio=float(counts[strag]) / len(mine),
                late_by_p50_ns=int(np.percentile(late["late_by_ns"], 50)),
                late_by_p99_ns=int(np.percentile(late["late_by_ns"], 99)),
                cause=S.CAUSE_NAMES[int(np.argmax(causes))]))
        # Every group reported this time has told all its collectives up to its newest
        # reported end: nothing before the earliest of those (minus the margin) is needed.
        self._cutoff_ns = (min(reported_ends) - LOOKBACK_NS) if reported_ends else self._cutoff_ns
        return out

    @staticmethod
    def _per_rank_wait(k, keys_all, mk, mine) -> np.ndarray:
        """Per rank, summed over the reported collectives: the last arrival minus its own
        start of that collective (its kernel of that name whose end is nearest the
        instance's, within the end tolerance: END_TOLERANCE_NS, or a share of a long
        kernel's duration, as the pairing allows)."""
        wait = np.zeros(len(mk), np.int64)
        for j, m in enumerate(mk):
            sel = np.flatnonzero(keys_all == m)
            for name_id in np.unique(mine["name_id"]):
                rows = mine[mine["name_id"] == name_id]
                own = sel[k["name_id"][sel] == name_id]
                if not len(own):
                    continue
                o = np.argsort(k["end_ns"][own], kind="stable")
                ends, starts = k["end_ns"][own][o], k["start_ns"][own][o]
                i = np.clip(np.searchsorted(ends, rows["end_ns"]), 0, len(ends) - 1)
                lo = np.clip(i - 1, 0, len(ends) - 1)
                pick = np.where(np.abs(ends[lo] - rows["end_ns"]) < np.abs(ends[i] - rows["end_ns"]), lo, i)
                tol = np.maximum(S.END_TOLERANCE_NS, ((ends[pick] - starts[pick]) * S.END_TOLERANCE_SHARE)
                                 .astype(np.int64))
                hit = np.abs(ends[pick] - rows["end_ns"]) <= tol
                wait[j] += int(np.maximum(0, rows["late_start_ns"][hit] - starts[pick][hit]).sum())
        return wait
