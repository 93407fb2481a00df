"""What Perfetto's trace processor makes of a Chrome-trace JSON file: its slices, tracks,
names, flows and the import errors it records in its ``stats`` table.

Used where the real ``trace_processor_shell`` cannot run (it is not shipped by any package
registry this project can reach; the ``perfetto`` Python package downloads it at run
time). This is a transcription, not a model of our own exporter: each rule below is the
importer's code in google/perfetto at commit ec5d16b14b743ba6063d720956d6d6af6610fd72
(2026-08-22), restricted to the event phases ("X", "M") and fields our export writes.
It was checked against the real trace processor of release v58.2 (add693d8b3; its JSON
importer, slice, flow and sorter code is that commit's; its process_tracker.cc differs
only in lookups by tid alone, which integer tids do not use), built from source: on the exports of the shared traces and on one small document per rule, recorded
in tests/data/perfetto/shared_traces.json; that comparison corrected the thread rule.

* ``src/trace_processor/importers/json/json_trace_tokenizer.cc``
  ``ParseTraceEventContents``: an event without "ph" is a ``json_tokenizer_failure``;
  an event other than "M" without a numeric "ts" likewise; a non-numeric "dur" likewise.
  ``CoerceToTs``: a double ts/dur becomes ``llround(x * 1000)`` ns unless integral
  (then ``x * 1000``); an integer ``x * 1000``. pid/tid: ints (uint32); a tid of 0 with
  a non-zero pid becomes the pid. ``bind_id``, ``flow_in``, ``flow_out`` (booleans).
  The top-level key ``displayTimeUnit`` is reported as ``json_display_time_unit``.
* ``src/trace_processor/sorter/trace_sorter.h`` (``SlowOperatorLess``): events are
  ordered by ts, then "X" events longer first, then file order.
* ``importers/json/json_trace_parser.cc`` ``ParseJsonPacket``: threads are found by
  (tid, pid) (``ProcessTracker::UpdateThread(tid, pid)`` -> ``GetThreadOrNull(tid, pid)``:
  the latest thread with that tid whose process has that pid, else a new thread; so a tid
  met under a second pid is a second thread, and back under the first pid the first
  one again); "X" -> ``SliceTracker::Scoped`` on the thread's track; on a
  partial overlap the slice is spilled to an overflow track and
  ``slice_spill_overlapping_complete_event`` (an error) is recorded; an "X" whose
  dur is missing is a ``json_parser_failure``. "M" process_name / thread_name with an
  empty or missing ``args.name`` is a ``json_parser_failure``. ``MaybeAddFlow``: a
  slice with bind_id and flow_out begins a flow, with flow_in ends one
  (``FlowTracker``: a second begin with the same id is ``flow_duplicate_id``, an end
  before any begin ``flow_end_without_start``); neither direction is
  ``flow_without_direction``.
* ``importers/common/slice_tracker.cc`` ``MaybeCloseStack``: an open slice ending before
  the new start, or at it unless both last 0 ns, is closed; a new slice starting inside
  the innermost open one and ending after it is a partial overlap.

:func:`import_json` returns an :class:`Imported` with those tables.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

ERROR_STATS = ("json_tokenizer_failure", "json_parser_failure", "slice_spill_overlapping_complete_event",
               "slice_drop_overlapping_complete_event", "flow_duplicate_id", "flow_without_direction",
               "flow_no_enclosing_slice", "flow_invalid_id")


@dataclass
class Imported:
    slices: list = field(default_factory=list)        # (utid, ts_ns, dur_ns, cat, name, spilled)
    threads: dict = field(default_factory=dict)        # utid -> (pid, tid)
    thread_names: dict = field(default_factory=dict)   # utid -> name
    process_names: dict = field(default_factory=dict)  # pid -> name
    flows: list = field(default_factory=list)          # (slice index out, slice index in)
    stats: dict = field(default_factory=dict)          # stat name -> count

    def errors(self) -> dict:
        return {k: v for k, v in self.stats.items() if k in ERROR_STATS and v}


def _ts_ns(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, int):
        return v * 1000
    return int(v) * 1000 if v == math.trunc(v) else int(round(v * 1000.0))   # llround


def import_json(path: str | Path) -> Imported:
    doc = json.loads(Path(path).read_text())
    out = Imported()
    stats = out.stats

    def stat(name):
        stats[name] = stats.get(name, 0) + 1
    if isinstance(doc, dict) and "displayTimeUnit" in doc:
        stat("json_display_time_unit")
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    queue = []
    for pos, e in enumerate(events):
        ph = e.get("ph")
        if not ph:
            if e:
                stat("json_tokenizer_failure")
            continue
        ts = _ts_ns(e.get("ts"))
        if ts is None:
            if ph != "M":
                stat("json_tokenizer_failure")
                continue
            ts = 0
        dur = None
        if "dur" in e:
            dur = _ts_ns(e["dur"])
            if dur is None:
                stat("json_tokenizer_failure")
                continue
        pid, tid = int(e.get("pid", 0)) & 0xFFFFFFFF, int(e.get("tid", 0)) & 0xFFFFFFFF
        if tid == 0 and pid != 0:
            tid = pid
        key = (2**63 - 1 - dur) if ph == "X" and dur is not None else 2**63 - 1
        queue.append((ts, key, pos, ph, pid, tid, dur, e))
    queue.sort(key=lambda x: x[:3])

    utid_of: dict = {}
    stacks: dict = {}
    flow_begin: dict = {}
    overflow: dict = {}

    def thread(pid, tid):
        u = utid_of.get((tid, pid))
        if u is None:
            u = len(out.threads)
            out.threads[u] = (pid, tid)
            utid_of[(tid, pid)] = u
        return u

    def scoped(track, ts, dur):
        """SliceTracker::MaybeCloseStack + push; False on a partial overlap."""
        stack = stacks.setdefault(track, [])
        while stack:
            s_ts, s_dur, _ = stack[-1]
            end = s_ts + s_dur
            if end < ts or (end == ts and not (s_dur == 0 and dur == 0)):
                stack.pop()
                continue
            if ts < end < ts + dur:
                return False
            break
        return True

    for ts, _, _, ph, pid, tid, dur, e in queue:
        utid = thread(pid, tid)
        if ph == "M":
            name = e.get("name")
            if name in ("process_name", "thread_name"):
                arg = (e.get("args") or {}).get("name")
                if not isinstance(arg, str) or not arg:
                    stat("json_parser_failure")
                elif name == "thread_name":
                    out.thread_names[utid] = arg
                else:
                    out.process_names[pid] = arg
            continue
        if ph != "X":
            continue
        if dur is None:
            stat("json_parser_failure")
            continue
        track, spilled = ("thread", utid), False
        if not scoped(track, ts, dur):
            stat("slice_spill_overlapping_complete_event")
            lanes = overflow.setdefault(utid, [])
            for lane in range(len(lanes) + 1):
                track = ("overflow", utid, lane)
                if lane == len(lanes):
                    lanes.append(track)
                if scoped(track, ts, dur):
                    break
            spilled = True
        idx = len(out.slices)
        stacks.setdefault(track, []).append((ts, dur, idx))
        out.slices.append((utid, ts, dur, e.get("cat"), e.get("name"), spilled))
        if "bind_id" in e:
            fid = e["bind_id"]
            fin, fout = e.get("flow_in") is True, e.get("flow_out") is True
            if fin and fout:
                if fid in flow_begin:
                    out.flows.append((flow_begin[fid], idx))
                    flow_begin[fid] = idx
                else:
                    stat("flow_step_without_start")
            elif fout:
                if fid in flow_begin:
                    stat("flow_duplicate_id")
                else:
                    flow_begin[fid] = idx
            elif fin:
                if fid in flow_begin:
                    out.flows.append((flow_begin[fid], idx))
                else:
                    stat("flow_end_without_start")
            else:
                stat("flow_without_direction")
    return out


def summary(imp: Imported) -> dict:
    """The figures recorded from the real trace processor (tests/data/perfetto/), from the
    transcription: slice count, slices per category, flow count, error stats, and per
    thread that holds slices its process name, thread name and slice count, the slices
    spilled to the thread's overflow tracks counted apart, with "(spilled)" after the name."""
    per_cat: dict = {}
    per_track: dict = {}
    for utid, _ts, _dur, cat, _name, spilled in imp.slices:
        per_cat[cat] = per_cat.get(cat, 0) + 1
        per_track[(utid, bool(spilled))] = per_track.get((utid, bool(spilled)), 0) + 1
    rows = []
    for (utid, spilled), n in per_track.items():
        p, t = imp.process_names.get(imp.threads[utid][0]), imp.thread_names.get(utid)
        rows.append([p, f"{t} (spilled)" if spilled else t, n])
    return {"slices": len(imp.slices), "slices_by_category": dict(sorted(per_cat.items())),
            "flows": len(imp.flows), "error_stats": dict(sorted(imp.errors().items())),
            "tracks": sorted(rows, key=track_order)}


def track_order(row: list) -> tuple:
    """Sort key of a summary's track rows [process name, thread name, slices]; a name may
    be None (an unnamed process or thread)."""
    return (row[0] or "", row[1] or "", row[2])
