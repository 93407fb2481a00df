"""The window's tensor-parallel stragglers in words, for ``ridgeline top`` (issue 23).

One line per group of the window record's ``stragglers`` (``aggregator.straggler_window``):
its GPUs, the straggler (GPU and process), how often it arrived last and by how much, why,
and the share of the group's time the others spent waiting for it. Groups without a
collective this window are left out; at most :data:`MAX_LINES` lines.
"""
from __future__ import annotations

from rich.text import Text

MAX_LINES = 4


def _us(ns) -> str:
    ns = float(ns or 0)
    return f"{ns / 1e6:.2f} ms" if ns >= 1e6 else f"{ns / 1e3:.0f} us"


def stragglers_lines(s) -> list[Text]:
    if not isinstance(s, dict):
        return []
    groups = [g for g in (s.get("groups") or []) if isinstance(g, dict) and g.get("collectives")]
    out = []
    for g in groups[:MAX_LINES]:
        gpus = ",".join(str(r.get("device")) for r in g.get("ranks") or [])
        share = float(g.get("waiting_share_ratio") or 0.0)
        line = (f"TP group GPUs {gpus}: {g['collectives']} collectives; straggler GPU {g.get('straggler_device')} "
                f"(pid {g.get('straggler_pid')}) last in {float(g.get('straggler_last_share_ratio') or 0):.0%}, "
                f"late by {_us(g.get('late_by_p50_ns'))} (p99 {_us(g.get('late_by_p99_ns'))}), "
                f"{g.get('cause') or '?'}-bound; ranks waiting {share:.0%} of the time")
        mine, others = g.get("straggler_launch_off_cpu_ratio"), g.get("others_launch_off_cpu_ratio")
        if isinstance(mine, (int, float)) and mine >= 0:
            line += f"; its launch thread off-CPU {mine:.0%}"
            if isinstance(others, (int, float)) and others >= 0:
                line += f" (others {others:.0%})"
        out.append(Text(line, style="yellow" if share >= 0.05 else ""))
    if len(groups) > MAX_LINES:
        out.append(Text(f"... and {len(groups) - MAX_LINES} more TP groups", style="dim"))
    return out
