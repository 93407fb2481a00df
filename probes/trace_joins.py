"""Joins between the record kinds of a :class:`probes.events.Trace`.

* :func:`join_launch_threads`: kernels' and copies' launching process and thread, from the
  runtime/driver API record with the same correlation id (the importers fill ``pid``/``tid``
  with it, which Kineto and Nsight Systems put elsewhere);
* :func:`kernel_cpu_op_index`: for each kernel, the CPU operator (``trace.cpu_ops``) that
  launched it. Computed once per Trace and kept in the Trace's ``cpu_op_join`` field with
  the arrays it was computed from; phase mapping and the shape-based work model both read
  it, and this is the only place it is computed.
"""
from __future__ import annotations

import bisect

import numpy as np

from .events import API_LAUNCH, MISSING, CpuOpJoin, Trace

__all__ = ["join_launch_threads", "kernel_cpu_op_index", "JOIN_ROWS"]


_MISSING_PAIR = int(np.array([MISSING, MISSING], np.int32).view(np.int64)[0])


def _pid_tid(a: np.ndarray) -> np.ndarray | None:
    """The adjacent pid and tid fields of each row as one 8-byte view (a strided int64), so
    that the join gathers and writes both at once; None when they are not adjacent."""
    f = a.dtype.fields
    o = f["pid"][1]
    if f["tid"][1] != o + 4 or f["pid"][0].itemsize != 4 or f["tid"][0].itemsize != 4:
        return None
    return a.view(np.dtype({"names": ["pt"], "formats": [np.int64], "offsets": [o],
                            "itemsize": a.dtype.itemsize}))["pt"]


def join_launch_threads(api: np.ndarray, *targets: np.ndarray) -> None:
    """Fill pid/tid of each of ``targets`` (kernels, copies) from the API record with the
    same correlation id, with one sort of the API records' correlation ids, not one per
    target; none when they are already in order (a stable argsort of sorted ids is the identity, so the result is the same).
    pid and tid travel as one 8-byte value where both layouts put them side by side."""
    if not len(api):
        for t in targets:
            t["pid"] = MISSING
            t["tid"] = MISSING
        return
    corr = np.ascontiguousarray(api["correlation_id"])
    if len(corr) > 1 and not (corr[1:] >= corr[:-1]).all():
        order = np.argsort(corr, kind="stable")
        corr = corr[order]
    else:
        order = None
    both = _pid_tid(api)
    for t in targets:
        if not len(t):
            t["pid"] = MISSING
            t["tid"] = MISSING
            continue
        want = np.ascontiguousarray(t["correlation_id"])
        pos = np.searchsorted(corr, want)
        np.minimum(pos, len(corr) - 1, out=pos)
        hit = corr[pos] == want
        hit &= want >= 0
        src = pos if order is None else order[pos]
        into = _pid_tid(t) if both is not None else None
        if into is not None:
            v = both[src]
            v[~hit] = _MISSING_PAIR
            into[...] = v
            continue
        t["pid"] = np.where(hit, api["pid"][src], MISSING)
        t["tid"] = np.where(hit, api["tid"][src], MISSING)


# Rows of the API records or operators read at a time by the joins: bounds their transient
# memory (a few tens of bytes a row) whatever the trace's size.
JOIN_ROWS = 1 << 18


def _key_positions(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``values`` equal to one of the sorted unique ``keys``, and that key's index."""
    p = np.searchsorted(keys, values)
    np.minimum(p, len(keys) - 1, out=p)
    j = np.flatnonzero(keys[p] == values)
    return j, p[j]


def _first_row(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """For each of the sorted unique ``keys``, the first row of ``values`` equal to it; -1 if none."""
    first = np.full(len(keys), -1, dtype=np.int64)
    if not len(keys):
        return first
    for lo in range(0, len(values), JOIN_ROWS):
        j, p = _key_positions(keys, values[lo:lo + JOIN_ROWS])
        if not len(j):
            continue
        u, at = np.unique(p, return_index=True)    # the first row of the block per key
        new = first[u] < 0
        first[u[new]] = j[at[new]] + lo
    return first


def _last_starting(keys: np.ndarray, values: np.ndarray, start: np.ndarray) -> np.ndarray:
    """For each of the sorted unique ``keys``, the row of ``values`` equal to it with the
    latest ``start`` (ties: the last such row); -1 if none."""
    best = np.full(len(keys), -1, dtype=np.int64)
    best_start = np.zeros(len(keys), dtype=np.int64)
    if not len(keys):
        return best
    for lo in range(0, len(values), JOIN_ROWS):
        j, p = _key_positions(keys, values[lo:lo + JOIN_ROWS])
        if not len(j):
            continue
        s = start[lo:lo + JOIN_ROWS][j]
        o = np.lexsort((s, p))                       # stable: equal starts keep row order
        j, p, s = j[o], p[o], s[o]
        last = np.append(p[1:] != p[:-1], True)      # the last row of each key in the block
        j, p, s = j[last] + lo, p[last], s[last]
        # later blocks hold later rows, so an equal start replaces the earlier row
        take = (best[p] < 0) | (s >= best_start[p])
        best[p[take]], best_start[p[take]] = j[take], s[take]
    return best


def _external_id_is_correlation(api: np.ndarray) -> bool:
    """True for older Kineto, whose API records carry External id == correlation id
    (an id of the launch itself, not of the operator), so matching ops by it would pair
    unrelated records whose numbers happen to coincide."""
    ext = api["external_id"]
    launches = (api["category"] == API_LAUNCH) & (ext >= 0)   # masks, not a copy of the rows
    n = int(np.count_nonzero(launches))
    if not n:
        return False
    launches &= ext == api["correlation_id"]
    return int(np.count_nonzero(launches)) / n > 0.9


def _api_for(correlation: np.ndarray, api: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index into ``api`` of the (first) record with each correlation id, and whether it
    exists (the index is 0 where it does not)."""
    if not len(api) or not len(correlation):
        return np.zeros(len(correlation), dtype=np.int64), np.zeros(len(correlation), dtype=bool)
    keys, inv = np.unique(correlation, return_inverse=True)
    pos = _first_row(keys, api["correlation_id"])[inv]
    hit = (pos >= 0) & (correlation >= 0)
    pos[~hit] = 0
    return pos, hit


def _stack_parents(thread: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Parent of each interval (sorted by thread, start, longer first) as a stack pass per
    thread gives it: the latest earlier interval of the thread with end >= this start,
    -1 if none.

    Vectorised by pointer jumping: every candidate starts at the previous interval; one
    whose candidate ends before its start jumps to the candidate's own current candidate,
    which skips only intervals ending before the candidate's start (so before its own).
    Rounds grow with the nesting depth, not the number of intervals."""
    n = len(start)
    idx = np.int32 if n < 2**31 - 1 else np.int64    # half the temporaries' memory
    cand = np.arange(-1, n - 1, dtype=idx)
    if n:
        cand[0] = -1
        cand[1:][thread[1:] != thread[:-1]] = -1
    todo = np.flatnonzero(cand >= 0).astype(idx)
    while len(todo):
        c = cand[todo]
        bad = end[c] < start[todo]
        todo = todo[bad]
        cand[todo] = cand[c[bad]]
        todo = todo[cand[todo] >= 0]
    return cand


def _enclosing_launch(ops: np.ndarray, api: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """:func:`_enclosing` of the API records ``rows`` (their thread and start)."""
    return _enclosing(ops, api["pid"][rows], api["tid"][rows], api["start_ns"][rows])


def _rows_where(mask: np.ndarray) -> np.ndarray:
    """``np.flatnonzero(mask)`` as int32 where that fits, built a block at a time (the
    int64 result for a whole thread's operators is the largest temporary otherwise)."""
    idx = np.int32 if len(mask) < 2**31 - 1 else np.int64
    out = np.empty(int(np.count_nonzero(mask)), dtype=idx)
    at = 0
    for lo in range(0, len(mask), JOIN_ROWS):
        j = np.flatnonzero(mask[lo:lo + JOIN_ROWS])
        out[at:at + len(j)] = j + lo
        at += len(j)
    return out


def _in_stack_order(ops: np.ndarray, members: np.ndarray) -> np.ndarray:
    """``members`` (rows of one thread's operators, owned by the caller) ordered by start,
    longer first on equal starts: the stack pass's order, as ``np.lexsort((-end, start))``
    gives it. Operators come in start order in the files seen (Kineto writes them so) but
    not always longer first among equal starts: then only runs of equal starts are
    reordered, in place, a block at a time whose bounds fall between runs."""
    st, en = ops["start_ns"], ops["end_ns"]
    n = len(members)
    ties_out_of_order = False
    for lo in range(0, n, JOIN_ROWS):
        m = members[lo:lo + JOIN_ROWS + 1]          # one row of overlap with the next block
        s, e = st[m], en[m]
        ds = s[1:] - s[:-1]
        if (ds < 0).any():                          # not in start order: sort all
            s, e = st[members], en[members]
            o = np.lexsort((-e, s))
            del s, e
            return members[o]
        ties_out_of_order |= bool(((ds == 0) & (e[1:] > e[:-1])).any())
    if not ties_out_of_order:
        return members
    lo = 0
    while lo < n:
        hi = min(lo + JOIN_ROWS, n)
        if hi < n:                                  # move the bound past the run it splits
            last = int(st[members[hi - 1]])
            hi = bisect.bisect_right(members, last, lo=hi, key=lambda i: int(st[i]))
        block = members[lo:hi]
        block[:] = block[np.lexsort((-en[block], st[block]))]
        lo = hi
    return members


def _enclosing(ops: np.ndarray, pid: np.ndarray, tid: np.ndarray, t_ns: np.ndarray) -> np.ndarray:
    """Innermost op on thread (pid, tid) whose [start, end] contains t_ns; -1 if none.

    Ops on one thread nest properly, so the answer is the latest-starting op with
    start <= t, or the nearest ancestor of it that still contains t. One thread at a
    time and, within it, :data:`JOIN_ROWS` operators at a time in start order: a block's
    parents are computed with the chain of operators still open where it begins (the
    stack of a stack pass, at most the nesting depth) put in front of it, which is all a
    stack pass over the whole thread would have there, so the parents are the same.
    """
    res = np.full(len(t_ns), -1, dtype=np.int64)
    if not len(t_ns) or not len(ops):
        return res
    qkey = (pid.astype(np.int64) << 32) | (tid.astype(np.int64) & 0xFFFFFFFF)
    op_pid, op_tid, op_st, op_en = ops["pid"], ops["tid"], ops["start_ns"], ops["end_ns"]
    for kv in np.unique(qkey).tolist():
        low = kv & 0xFFFFFFFF
        members = _rows_where((op_pid == kv >> 32) & (op_tid == (low - (1 << 32) if low >> 31 else low)))
        if not len(members):
            continue
        members = _in_stack_order(ops, members)
        q = _rows_where(qkey == kv)
        tq = t_ns[q]
        # block b holds the queries whose latest-starting op is in it (none before the first op)
        bounds = op_st[members[::JOIN_ROWS]].tolist() + [None]
        open_chain = np.zeros(0, dtype=members.dtype)
        for b, lo in enumerate(range(0, len(members), JOIN_ROWS)):
            rows = np.concatenate((open_chain, members[lo:lo + JOIN_ROWS]))
            st, en = op_st[rows], op_en[rows]
            parent = _stack_parents(np.zeros(len(rows), dtype=np.int8), st, en)
            inside = tq >= bounds[b]
            if bounds[b + 1] is not None:
                inside &= tq < bounds[b + 1]
            here = _rows_where(inside)
            del inside
            if len(here):
                t = tq[here]
                n0 = len(open_chain)
                cand = n0 + np.searchsorted(st[n0:], t, side="right") - 1
                for _ in range(64):  # nesting depth bound; each round climbs one level
                    bad = (cand >= 0) & (en[np.maximum(cand, 0)] < t)
                    if not bad.any():
                        break
                    cand = np.where(bad, parent[np.maximum(cand, 0)], cand)
                res[q[here]] = np.where(cand >= 0, rows[np.maximum(cand, 0)], -1)
            chain = []                               # the last row and its ancestors
            i = len(rows) - 1
            while i >= 0:
                chain.append(i)
                i = int(parent[i])
            open_chain = rows[chain[::-1]]
    return res


def kernel_cpu_op_index(trace: Trace) -> np.ndarray:
    """For each kernel, the index into ``trace.cpu_ops`` of the operator that launched it
    (-1 none), computed once per trace (see :func:`_computed` for how).

    The join costs about a second at a million kernels and both phase mapping and the
    shape-based work model need it, so the result is kept in ``trace.cpu_op_join`` with the
    kernel, API and CPU-op arrays it was computed from: assigning a new array to any of them
    recomputes it, and a derived Trace (``Trace.sorted()``, ``dataclasses.replace``) starts
    without it. The returned array is read-only. Contract: the arrays of a trace are not
    modified in place after this has been called (derive a changed trace as a new Trace).
    """
    memo = trace.cpu_op_join
    if memo is not None and memo.kernels is trace.kernels and memo.api is trace.api \
            and memo.cpu_ops is trace.cpu_ops:
        return memo.index
    out = np.asarray(_computed(trace), dtype=np.int64)
    out.setflags(write=False)
    trace.cpu_op_join = CpuOpJoin(trace.kernels, trace.api, trace.cpu_ops, out)
    return out


def _computed(trace: Trace) -> np.ndarray:
    """The join itself, uncached: for each kernel, the index into ``trace.cpu_ops`` of the
    operator that launched it.

    First by Kineto's ``External id`` (the kernel's own, or else that of the runtime API
    record with the kernel's correlation id), which is how current Kineto links them.
    Older Kineto (2023, e.g. HTA's A100 traces) gives the runtime record an External id
    of its own; there the operator is the innermost ``cpu_op`` on the launching thread
    whose interval contains the launch call. ``-1`` where neither finds one.

    Memory: the API records and operators (5.6 M and 4.2 M at a million kernels) are read
    :data:`JOIN_ROWS` at a time against the kernels' sorted keys; nothing the size of
    either is sorted or copied, so the transient memory follows the kernels and the block.
    """
    k = trace.kernels
    ops = trace.cpu_ops
    out = np.full(len(k), MISSING, dtype=np.int64)
    if not len(ops) or not len(k):
        return out
    api_pos, api_hit = _api_for(k["correlation_id"], trace.api)
    if _external_id_is_correlation(trace.api):
        rest = np.flatnonzero(api_hit)
        out[rest] = _enclosing_launch(ops, trace.api, api_pos[rest])
        return out
    ext = k["external_id"].copy()
    if len(trace.api):
        api_ext = trace.api["external_id"][api_pos]
        ext = np.where((ext < 0) & api_hit, api_ext, ext)
        del api_ext
    # the op with each External id that starts last (ties: the later record) is the innermost
    keys, inv = np.unique(ext, return_inverse=True)
    op = _last_starting(keys, ops["external_id"], ops["start_ns"])[inv]
    hit = (op >= 0) & (ext >= 0)
    out[hit] = op[hit]
    del keys, inv, op, ext
    hit ^= True
    hit &= api_hit
    rest = np.flatnonzero(hit)
    del hit
    if len(rest):
        out[rest] = _enclosing_launch(ops, trace.api, api_pos[rest])
    return out
