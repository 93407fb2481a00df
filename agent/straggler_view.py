"""The window's tensor-parallel stragglers in words, for ``ridgeline top`` (issue 23).

One line per group of the window record's ``stragglers`` (``aggregator.straggler_window``),
read as the typed :class:`probes.records.WindowStragglers`:
its GPUs, the straggler (GPU and process), how often it arrived last and by how much, why,
and the share of the group's time the others spent waiting for it. Groups without a
collective this window are left out; at most :data:`MAX_LINES` lines.
"""
from __future__ import annotations

from rich.text import Text

from ridgeline.probes.records import WindowStragglers

MAX_LINES = 4


def _us(ns: int) -> str:
    ns = float(ns)
    return f"{ns / 1e6:.2f} ms" if ns >= 1e6 else f"{ns / 1e3:.0f} us"


def stragglers_lines(s: WindowStragglers | None) -> list[Text]:
    if s is None:
        return []
    groups = [g for g in s.groups if g.collectives]
    out = []
    for g in groups[:MAX_LINES]:
        gpus = ",".join(str(r.device) for r in g.ranks)
        share = g.waiting_share_ratio
        line = (f"TP group GPUs {gpus}: {g.collectives} collectives; straggler GPU {g.straggler_device} "
                f"(pid {g.straggler_pid}) last in {g.straggler_last_share_ratio:.0%}, "
                f"late by {_us(g.late_by_p50_ns)} (p99 {_us(g.late_by_p99_ns)}), "
                f"{g.cause or '?'}-bound; ranks waiting {share:.0%} of the time")
        mine, others = g.straggler_launch_off_cpu_ratio, g.others_launch_off_cpu_ratio
        if mine >= 0:      # -1: the scheduling probe did not see the launch threads
            line += f"; its launch thread off-CPU {mine:.0%}"
            if others >= 0:
                line += f" (others {others:.0%})"
        out.append(Text(line, style="yellow" if share >= 0.05 else ""))
    if len(groups) > MAX_LINES:
        out.append(Text(f"... and {len(groups) - MAX_LINES} more TP groups", style="dim"))
    return out
