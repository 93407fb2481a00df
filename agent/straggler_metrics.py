"""Tensor-parallel stragglers on ``/metrics`` (issue 23), bounded.

Contract: :class:`StragglerMetrics` is fed each typed window (:meth:`observe`, its
:class:`probes.records.WindowStragglers`) by :class:`agent.prometheus.WindowCollector` and
yields its families (:meth:`families`). A group is labelled ``group`` = its GPUs' indices
joined by commas (``"0,1,2,3"``; stable across a server restart, unlike process ids);
per-rank series add ``gpu``, the cause ``cause`` from the fixed set. Cardinality: at most
:data:`MAX_GROUPS` groups (a group unseen for :data:`STALE_WINDOWS` windows is dropped, then
the least recently seen past the bound, counted in ``ridgeline_tp_groups_evicted_total``),
each with 11 series plus one per rank (the analysis reads at most 64 ranks): at most
16 x 11 + 64 + 1 = 241 series.

* counters ``ridgeline_tp_collectives_total`` and ``ridgeline_tp_wait_seconds_total``
  (the ranks' time spinning in collectives for the last rank; rate() over any interval);
* gauges of the group's last window with collectives: ``ridgeline_tp_waiting_share_ratio``,
  ``ridgeline_tp_straggler_gpu`` (the GPU index most often last),
  ``ridgeline_tp_straggler_late_seconds`` (``percentile`` p50, p99),
  ``ridgeline_tp_straggler_cause`` (1 for the dominant cause, 0 for the others) and
  ``ridgeline_tp_rank_last_share_ratio`` per ``gpu``, and
  ``ridgeline_tp_launch_off_cpu_ratio`` (``rank``: straggler, others; the launch threads'
  run-queue plus blocked share, when the scheduling probe saw them).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ridgeline.probes.records import GroupStragglers, RankStragglers, Window

CAUSES = ("kernel", "copy", "host")
MAX_GROUPS = 16
MAX_RANKS = 64
STALE_WINDOWS = 300


@dataclass
class _Group:
    """One group's counters, and its last window with collectives (for the gauges)."""
    last: GroupStragglers
    ranks: list[RankStragglers]
    seen: int              # the window count when it was last seen
    collectives: float = 0.0
    wait_s: float = 0.0


class StragglerMetrics:
    def __init__(self):
        self.groups: collections.OrderedDict[str, _Group] = collections.OrderedDict()
        self.windows = 0
        self.evicted = 0
        self.seen = False

    def observe(self, window: Window) -> None:
        self.windows += 1
        s = window.stragglers
        if s is not None:
            self.seen = True
            for g in s.groups:
                if not g.collectives:
                    continue
                ranks = g.ranks[:MAX_RANKS]
                key = ",".join(str(r.device) for r in ranks)
                st = self.groups.pop(key, None) or _Group(g, ranks, self.windows)
                st.collectives += float(g.collectives)
                st.wait_s += sum(float(r.wait_ns) for r in ranks) * 1e-9
                st.last, st.ranks, st.seen = g, ranks, self.windows
                self.groups[key] = st
        for key in [k for k, st in self.groups.items() if self.windows - st.seen >= STALE_WINDOWS]:
            del self.groups[key]
        while len(self.groups) > MAX_GROUPS:
            self.groups.popitem(last=False)
            self.evicted += 1

    def families(self, host: str):
        if not self.seen:
            return
        fam = {}

        def f(kind, name, doc, labels):
            if name not in fam:
                fam[name] = kind(name, doc, labels=["Hostname", "group"] + labels)
            return fam[name]
        for key, st in self.groups.items():
            g = st.last
            f(CounterMetricFamily, "ridgeline_tp_collectives", "Collectives of the tensor-parallel group seen on "
              "every rank", []).add_metric([host, key], st.collectives)
            f(CounterMetricFamily, "ridgeline_tp_wait_seconds", "Time the group's ranks spent in collectives "
              "waiting for the last rank to arrive, summed over ranks", []).add_metric([host, key], st.wait_s)
            f(GaugeMetricFamily, "ridgeline_tp_waiting_share_ratio", "Share of the group's rank time spent "
              "waiting for the last rank (its last window with collectives)", []).add_metric(
                [host, key], float(g.waiting_share_ratio))
            f(GaugeMetricFamily, "ridgeline_tp_straggler_gpu", "GPU index of the rank most often last at the "
              "group's collectives", []).add_metric([host, key], float(g.straggler_device))
            late = f(GaugeMetricFamily, "ridgeline_tp_straggler_late_seconds", "How late the straggler arrived "
                     "at the collectives where it was last, against the others' median", ["percentile"])
            late.add_metric([host, key, "p50"], g.late_by_p50_ns * 1e-9)
            late.add_metric([host, key, "p99"], g.late_by_p99_ns * 1e-9)
            cause = f(GaugeMetricFamily, "ridgeline_tp_straggler_cause", "Why the straggler is late: 1 for the "
                      "dominant cause (kernel: more GPU work; copy: copies; host: its launches came late)",
                      ["cause"])
            for c in CAUSES:
                cause.add_metric([host, key, c], 1.0 if g.cause == c else 0.0)
            offc = f(GaugeMetricFamily, "ridgeline_tp_launch_off_cpu_ratio", "Share of the window the launch "
                     "threads were off-CPU (run queue or blocked): the straggler's, and the other ranks' median",
                     ["rank"])
            for who, v in (("straggler", g.straggler_launch_off_cpu_ratio),
                           ("others", g.others_launch_off_cpu_ratio)):
                if v >= 0:      # -1: the scheduling probe did not see the launch threads
                    offc.add_metric([host, key, who], float(v))
            share = f(GaugeMetricFamily, "ridgeline_tp_rank_last_share_ratio", "Share of the group's "
                      "collectives at which this rank arrived last", ["gpu"])
            n = float(g.collectives) or 1.0
            for r in st.ranks:
                share.add_metric([host, key, str(r.device)], r.last_count / n)
        yield from fam.values()
        ev = CounterMetricFamily("ridgeline_tp_groups_evicted", "Tensor-parallel groups whose series were dropped "
                                 "past the group bound", labels=["Hostname"])
        ev.add_metric([host], float(self.evicted))
        yield ev
