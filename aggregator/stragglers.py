"""Tensor- and pipeline-parallel stragglers: which rank arrives last at each collective.

On one host Ridgeline sees every rank's kernels on one clock (the CUPTI records of all the
served processes, or the per-rank traces of one job). A collective kernel (NCCL's
``ncclDevKernel_*``/``ncclKernel_*``, PyTorch's symmetric-memory ``multimem_all_reduce_kernel``,
vLLM's ``cross_device_reduce_*``: the ``collective`` signatures of
``data/kernel_signatures.toml``) starts on each rank's GPU when that rank reaches it and
then spins until the last rank has arrived, so all ranks of a group end it together. Hence:

- **groups**: ranks (pid, device) whose collective kernels end together (within
  ``END_TOLERANCE_NS``, or 1% of a long kernel's duration) for at least
  ``GROUP_MATCH_SHARE`` of their collectives form one TP/PP group;
- **instances**: the k-th kernel of one collective name on every rank of a group, kept when
  their ends agree (a rank that missed one would shift every later pairing: counted);
- **the late rank** of an instance starts last; it is late by its start minus the median
  start of the others, and each other rank waits from its own start to the late one's;
- **why it is late**, from what each GPU did since the group's previous collective ended:
  the late rank's excess over the others' median in time on its own kernels (``kernel``:
  more or slower work), on copies (``copy``), or idle (``host``: its GPU waited for launches,
  the launch thread being off-CPU or busy); the largest excess is the cause.

``analyse`` returns the instances as one structured array (columnar, no object per
collective) and a typed summary per group. Pure: numpy arrays in, numpy and Structs out.
"""
from __future__ import annotations

import msgspec
import numpy as np

from ridgeline.aggregator.roofline import covered_ns, union_intervals
from ridgeline.aggregator.signatures import ROLE_COLLECTIVE, classify_kernels
from ridgeline.probes.events import Trace

#: Ends of one collective on the ranks of a group agree within this (the last arrival plus
#: the transfer finish it on every rank; ring steps and stream scheduling spread it by
#: microseconds, not by the tens of microseconds between successive collectives).
END_TOLERANCE_NS = 50_000
#: A long collective's ends spread with its transfer (each rank's last chunk lands when it
#: lands): pairing allows this share of the kernel's duration where that is more than
#: END_TOLERANCE_NS. On HTA's two sampled pipeline-parallel ranks (tests/THIRD_PARTY.md,
#: ``hta/``) a 42 ms SendRecv ends 332 us apart on its two ranks, an 11.7 ms one 55 us.
END_TOLERANCE_SHARE = 0.01
#: Share of a rank's collectives that must end with the other's for the two to be one group:
#: a tensor-parallel rank shares all of them with every other rank of its group, a
#: pipeline stage its sends and receives with its two neighbours (about half with each:
#: 5 of 10 on HTA's two sampled ranks of a 128-rank job, the others going to ranks not
#: recorded).
GROUP_MATCH_SHARE = 0.45
#: At most this many ranks are analysed (8 GPUs x 8 processes); more are counted, not read.
MAX_RANKS = 64

CAUSE_KERNEL, CAUSE_COPY, CAUSE_HOST = 0, 1, 2
CAUSE_NAMES = ("kernel", "copy", "host")

INSTANCE_DTYPE = np.dtype([
    ("group", "<i4"),
    ("name_id", "<i4"),            # the collective's kernel name
    ("late_rank", "<i4"),          # index into the group's ranks
    ("start_ns", "<i8"),           # the earliest arrival
    ("late_start_ns", "<i8"),      # the last arrival
    ("end_ns", "<i8"),             # the latest end
    ("late_by_ns", "<i8"),         # last arrival minus the median arrival of the others
    ("wait_ns", "<i8"),            # summed over the other ranks: last arrival minus their own
    ("cause", "u1"),               # CAUSE_* of the late rank's lateness
    ("excess_kernel_ns", "<i8"),   # since the previous collective: the late rank's kernel time
    ("excess_copy_ns", "<i8"),     # ... copy time and idle time, minus the others' median
    ("excess_idle_ns", "<i8"),
])


class RankFigures(msgspec.Struct, frozen=True):
    pid: int
    device: int
    last_count: int                 # instances where this rank arrived last
    last_share: float
    late_by_p50_ns: int             # over the instances where it was last (0 if never)
    late_by_p99_ns: int
    wait_ns: int                    # time its collectives spun waiting for a later rank
    cause: str                      # its dominant cause when last ("" if never last)


class GroupFigures(msgspec.Struct, frozen=True):
    group: int
    ranks: list[RankFigures]
    instances: int
    misaligned: int                 # collectives left out: their ends did not agree across ranks
    span_ns: int
    waiting_share: float            # of the ranks' time, spent in collectives waiting for the last
    straggler: int                  # index of the rank most often last (-1: none)
    straggler_late_by_p50_ns: int


class Stragglers(msgspec.Struct, frozen=True):
    groups: list[GroupFigures]
    ranks_seen: int
    ranks_left_out: int             # past MAX_RANKS


def _rank_keys(k: np.ndarray) -> np.ndarray:
    return k["pid"].astype(np.int64) << 32 | (k["device"].astype(np.int64) & 0xFFFFFFFF)


def _match_share(a_end: np.ndarray, b_end: np.ndarray, tol, a_tol: np.ndarray | None = None) -> float:
    """Share of ``a_end`` (sorted) with an end of ``b_end`` (sorted) within ``tol`` (or the
    per-kernel ``a_tol``), over the time both ranks were seen (a rank whose records start
    later, or whose buffers arrive a window after the other's in the agent, is judged where
    both have records)."""
    if not len(a_end) or not len(b_end):
        return 0.0
    if a_tol is not None:
        tol = a_tol
    seen = (a_end >= b_end[0] - tol) & (a_end <= b_end[-1] + tol)
    a_end = a_end[seen]
    if a_tol is not None:
        tol = tol[seen]
    if not len(a_end):
        return 0.0
    i = np.clip(np.searchsorted(b_end, a_end), 1, len(b_end) - 1) if len(b_end) > 1 else np.zeros(len(a_end), int)
    near = np.abs(b_end[i] - a_end)
    if len(b_end) > 1:
        near = np.minimum(near, np.abs(b_end[i - 1] - a_end))
    return float((near <= tol).mean())


def _groups(ends: dict[int, tuple[np.ndarray, np.ndarray]], tol: int) -> list[list[int]]:
    """Ranks joined when their collective ends agree both ways (union-find); ``ends``: per
    rank its collectives' ends (sorted) and each one's tolerance."""
    keys = sorted(ends)
    parent = {r: r for r in keys}

    def find(r):
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            (ae, at), (be, bt) = ends[a], ends[b]
            if min(_match_share(ae, be, tol, at), _match_share(be, ae, tol, bt)) >= GROUP_MATCH_SHARE:
                parent[find(a)] = find(b)
    out: dict[int, list[int]] = {}
    for r in keys:
        out.setdefault(find(r), []).append(r)
    return [sorted(g) for g in out.values() if len(g) > 1]


def analyse(trace: Trace, collective: np.ndarray | None = None,
            tol_ns: int = END_TOLERANCE_NS) -> tuple[Stragglers, np.ndarray]:
    """Stragglers of every group in ``trace``; ``collective``: bool per kernel (default: the
    ``collective`` role of the kernel signatures). Returns (summary, instances)."""
    k = trace.kernels
    if collective is None:
        collective = classify_kernels(trace).role == ROLE_COLLECTIVE
    coll = np.flatnonzero(collective)
    keys_all = _rank_keys(k)
    ranks = np.unique(keys_all[coll]) if len(coll) else np.empty(0, np.int64)
    left_out = max(0, len(ranks) - MAX_RANKS)
    ranks = ranks[:MAX_RANKS]
    ends = {}
    for r in ranks:
        mine = coll[keys_all[coll] == r]
        o = np.argsort(k["end_ns"][mine], kind="stable")
        e, d = k["end_ns"][mine][o], (k["end_ns"][mine] - k["start_ns"][mine])[o]
        ends[int(r)] = (e, np.maximum(tol_ns, (d * END_TOLERANCE_SHARE).astype(np.int64)))
    groups = _groups(ends, tol_ns)
    copies = trace.copies
    ckeys = _rank_keys(copies) if len(copies) else np.empty(0, np.int64)
    rows, figures = [], []
    for gi, members in enumerate(groups):
        inst, misaligned, per_rank_wait = _instances(k, coll, keys_all, members, tol_ns)
        busy = {}
        for r in members:
            own = np.flatnonzero((keys_all == r) & ~collective)
            busy[r] = union_intervals(k["start_ns"][own], k["end_ns"][own])
        cbusy = {r: union_intervals(copies["start_ns"][ckeys == r], copies["end_ns"][ckeys == r]) for r in members}
        if inst:
            rows.append(_judge(gi, inst, members, busy, cbusy,
                               int(k["start_ns"][np.isin(keys_all, members)].min())))
        figures.append((gi, members, misaligned, per_rank_wait))
    inst_arr = np.concatenate(rows) if rows else np.zeros(0, INSTANCE_DTYPE)
    out = []
    for gi, members, misaligned, per_rank_wait in figures:
        mine = inst_arr[inst_arr["group"] == gi]
        n = len(mine)
        sel = np.isin(keys_all, members)
        span = int(k["end_ns"][sel].max() - k["start_ns"][sel].min()) if sel.any() else 0
        ranks_out = []
        for ri, r in enumerate(members):
            last = mine[mine["late_rank"] == ri]
            causes = np.bincount(last["cause"], minlength=3)
            ranks_out.append(RankFigures(
                pid=int(r >> 32), device=int(np.int32(r & 0xFFFFFFFF)), last_count=int(len(last)),
                last_share=len(last) / n if n else 0.0,
                late_by_p50_ns=int(np.percentile(last["late_by_ns"], 50)) if len(last) else 0,
                late_by_p99_ns=int(np.percentile(last["late_by_ns"], 99)) if len(last) else 0,
                wait_ns=int(per_rank_wait[ri]), cause=CAUSE_NAMES[int(np.argmax(causes))] if len(last) else ""))
        counts = [rf.last_count for rf in ranks_out]
        strag = int(np.argmax(counts)) if n and max(counts) > 0 else -1
        out.append(GroupFigures(
            group=gi, ranks=ranks_out, instances=n, misaligned=misaligned, span_ns=span,
            waiting_share=float(mine["wait_ns"].sum()) / (len(members) * span) if span else 0.0,
            straggler=strag, straggler_late_by_p50_ns=ranks_out[strag].late_by_p50_ns if strag >= 0 else 0))
    return Stragglers(groups=out, ranks_seen=len(ranks) + left_out, ranks_left_out=left_out), inst_arr


def _judge(gi: int, inst: list, members: list[int], busy: dict, cbusy: dict, first_ns: int) -> np.ndarray:
    """The instance rows of one group, vectorised over its instances."""
    inst.sort(key=lambda x: int(x[1].min()))
    starts = np.stack([x[1] for x in inst]).astype(np.int64)           # [n, members]
    ends = np.array([x[2] for x in inst], np.int64)
    n, m = starts.shape
    prev = np.maximum.accumulate(np.concatenate([[first_ns], ends[:-1]]))   # the group's previous collective end
    spent = np.zeros((n, m, 3), np.int64)                                # kernel, copy, idle since prev
    for j, r in enumerate(members):
        b = np.maximum(prev, starts[:, j])
        kn = covered_ns(prev, b, *busy[r])
        cn = covered_ns(prev, b, *cbusy[r])
        spent[:, j] = np.stack([kn, cn, np.maximum(0, b - prev - kn - cn)], axis=1)
    late = np.argmax(starts, axis=1)
    rows = np.arange(n)
    mask = np.ones((n, m), bool)
    mask[rows, late] = False
    others = starts[mask].reshape(n, m - 1)
    med = np.median(others, axis=1).astype(np.int64)
    late_start = starts[rows, late]
    other_spent = spent[mask].reshape(n, m - 1, 3)
    excess = spent[rows, late] - np.median(other_spent, axis=1).astype(np.int64)
    out = np.zeros(n, INSTANCE_DTYPE)
    out["group"], out["name_id"], out["late_rank"] = gi, [x[0] for x in inst], late
    out["start_ns"], out["late_start_ns"], out["end_ns"] = starts.min(axis=1), late_start, ends
    out["late_by_ns"] = late_start - med
    out["wait_ns"] = (late_start[:, None] - others).sum(axis=1)
    out["cause"] = np.argmax(excess, axis=1)
    out["excess_kernel_ns"], out["excess_copy_ns"], out["excess_idle_ns"] = excess.T
    return out


def _aligned(k, coll, keys_all, members, tol_ns):
    """Per collective name: (name_id, starts [n, members], ends [n, members], ok [n], unpaired).

    Instances are the first member's kernels of that name; each other member's kernel is
    paired by its end (the nearest within ``tol_ns``), never by its position, so one lost
    record costs one instance, not every later one. ``ok``: every member paired;
    ``unpaired``: other members' kernels paired with none."""
    mine = coll[np.isin(keys_all[coll], members)]
    for name_id in np.unique(k["name_id"][mine]):
        per = []
        for r in members:
            idx = mine[(keys_all[mine] == r) & (k["name_id"][mine] == name_id)]
            per.append(idx[np.argsort(k["end_ns"][idx], kind="stable")])
        ref = per[0]
        if not len(ref):
            continue
        ref_end = k["end_ns"][ref]
        tol = np.maximum(tol_ns, ((ref_end - k["start_ns"][ref]) * END_TOLERANCE_SHARE).astype(np.int64))
        starts = np.zeros((len(ref), len(members)), np.int64)
        ends = np.zeros((len(ref), len(members)), np.int64)
        ok = np.ones(len(ref), bool)
        starts[:, 0], ends[:, 0] = k["start_ns"][ref], ref_end
        unpaired = 0
        for j, p in enumerate(per[1:], start=1):
            if not len(p):
                ok[:] = False
                continue
            e = k["end_ns"][p]
            i = np.clip(np.searchsorted(e, ref_end), 0, len(e) - 1)
            lo = np.clip(i - 1, 0, len(e) - 1)
            pick = np.where(np.abs(e[lo] - ref_end) < np.abs(e[i] - ref_end), lo, i)
            hit = np.abs(e[pick] - ref_end) <= tol
            ok &= hit
            starts[:, j], ends[:, j] = k["start_ns"][p[pick]], e[pick]
            unpaired += len(p) - len(np.unique(pick[hit]))
        yield int(name_id), starts, ends, ok, unpaired


def _instances(k, coll, keys_all, members, tol_ns):
    """The group's paired instances, how many were not paired, and each member's wait
    (summed over the paired instances: the last start minus its own), in one alignment."""
    inst, misaligned = [], 0
    wait = np.zeros(len(members), np.int64)
    for name_id, starts, ends, ok, extra in _aligned(k, coll, keys_all, members, tol_ns):
        misaligned += int((~ok).sum()) + extra
        for i in np.flatnonzero(ok):
            inst.append((name_id, starts[i], int(ends[i].max())))
        s = starts[ok]
        wait += (s.max(axis=1, keepdims=True) - s).sum(axis=0)
    return inst, misaligned, wait
