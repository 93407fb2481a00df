"""Terminal rendering of an analysis (:class:`aggregator.analysis.Analysis`, from
:func:`aggregator.analysis.analyze_trace` or a recording's combined segments).

:func:`render` prints with rich: a header naming the GPU and its ceilings (with the
datasheet), a per-phase table (share of GPU time, kernels, achieved TFLOP/s and TB/s
against the ceilings, intensity vs ridge, verdict), the evidence per phase, the steps,
idle gaps, launch latency and copy traffic. Pure formatting: no figure is computed here.
"""
from __future__ import annotations

from msgspec import UNSET
from rich.console import Console
from rich.table import Table

from .analysis import Analysis
from .phase_figures import duration_text


def _fmt(x, scale=1.0, digits=1, unit=""):
    if x is None:
        return "-"
    return f"{x / scale:,.{digits}f}{unit}"


def _ns(x):
    # one duration format for the report's tables and the phases' evidence (issue 24.2)
    return "-" if x is None else duration_text(x)


def _rate(bps):
    """Bytes per second in the unit that shows its digits (a 48 MB/s copy is not 0.0 GB/s)."""
    if bps is None:
        return "-"
    for unit, s in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= s:
            return f"{bps / s:.2f} {unit}"
    return f"{bps:.0f} B/s"


def _bytes(x):
    if x is None:
        return "-"
    for unit, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= s:
            return f"{x / s:.2f} {unit}"
    return f"{x:.0f} B"


VERDICT_STYLE = {"memory-bound": "bold blue", "compute-bound": "bold green",
                 "latency/launch-bound": "bold yellow", "host-bound": "bold red",
                 "undetermined": "dim"}


def render_answer(records, c: Console, title: str) -> None:
    """The binding face with its reasons, the other faces' figures, caveats and limits
    (:func:`aggregator.answer.answer_lines`), one block per verdict."""
    from rich.markup import escape

    from .answer import answer_lines, verdict_records
    recs = verdict_records(records)
    if not recs:
        return
    c.print(f"[bold]{title}[/bold]")
    for rec in recs:
        for i, line in enumerate(answer_lines(rec)):
            c.print(("  " if i == 0 else "  ") + escape(line), style="bold" if i == 0 else None)


def render(doc: Analysis, console: Console | None = None) -> None:
    """The whole report, section by section, in this order."""
    c = console or Console()
    if console is None and not c.is_terminal:
        c = Console(width=120)      # piped or captured: a fixed, readable width
    for section in (_header, _phases, _top_kernels, _steps, _idle_and_launch, _stragglers, _copies):
        section(doc, c)


def _header(doc: Analysis, c: Console) -> None:
    """The trace, its GPU and ceilings, the totals and the answer."""
    g = doc.gpu
    c.print(f"[bold]{doc.trace or 'trace'}[/bold]"
            + (" [yellow](SIMULATED: workload generator, not a measurement)[/yellow]" if doc.simulated else ""))
    if g.has_ceilings:
        peak = g.flops_per_s
        c.print(f"GPU: {g.device_name or g.name} -> ceilings [bold]{g.name}[/bold] "
                f"({g.ceilings_from}): {g.hbm_bytes_per_s / 1e12:.2f} TB/s, "
                + ", ".join(f"{k} {v / 1e12:,.0f} TF/s" for k, v in peak.items() if k in ("fp32", "bf16", "fp8", "fp4")))
        # the datasheet the table entry quotes (a user's TOML entry may leave it out)
        c.print(f"  source: {g.source.get('document', '?')} ({g.source.get('date', 'undated')})",
                style="dim")
    else:
        c.print(f"GPU: {g.device_name or '?'}: no ceilings ({g.ceilings_from})", style="yellow")
    c.print(f"{doc.kernels:,} kernels, {_ns(doc.kernel_time_ns)} of kernel time in a "
            f"{_ns(doc.span_ns)} span")

    if not doc.kernels:
        c.print("no GPU kernels in this trace: nothing to place on the roofline", style="yellow")
    render_answer(doc.answer, c, doc.answer_title if doc.answer_title is not UNSET else "Answer (the whole trace)")


def _phases(doc: Analysis, c: Console) -> None:
    """The per-phase table and each phase's evidence."""
    t = Table(title="Phases", title_justify="left")
    for col, w in (("phase", 7), ("GPU time", 8), ("kernels", 7), ("TFLOP/s", 7), ("TB/s", 6),
                   ("FLOP/B", 6), ("idle", 4), ("verdict", 12)):
        t.add_column(col, justify="left" if col in ("phase", "verdict") else "right", min_width=w)
    for name, p in doc.phases.items():
        est = "~" if p.work_estimated else ""     # figures over token counts from kernel grids
        t.add_row(
            name, f"{_ns(p.busy_ns)} ({_fmt(p.share_of_gpu_time_ratio, 0.01, 0, '%')})", f"{p.kernels:,}",
            f"{est}{_fmt(p.achieved_flops_per_s, 1e12, 1)} ({_fmt(p.pct_of_peak_flops, 1, 0, '%')})",
            f"{_fmt(p.achieved_bytes_per_s, 1e12, 2)} ({_fmt(p.pct_of_peak_bytes, 1, 0, '%')})",
            f"{_fmt(p.arithmetic_intensity, 1, 1)} ({_fmt(p.ridge_point, 1, 0)})",
            _fmt(p.idle_ratio, 0.01, 0, "%"),
            f"[{VERDICT_STYLE.get(p.verdict, '')}]{p.verdict}[/]")
    t.caption = "TFLOP/s and TB/s over busy time (% of peak); FLOP/B (ridge point); idle = GPU idle in the phase's steps"
    # The GPU's own idle share beside it: idle between steps is in no phase (issue 24.2).
    whole = [f"GPU {dev} idle {_fmt(d.idle_ratio, 0.01, 0, '%')} of its span"
             for dev, d in doc.idle_gaps.items() if d.idle_ratio is not None]
    if whole:
        t.caption += "; " + ", ".join(whole) + " (between steps too: see the idle gaps)"
    c.print(t)
    if any(p.work_estimated for p in doc.phases.values()):
        c.print("~ = estimate: the model's work over token counts read from kernel grids (no engine annotation)")
    for name, p in doc.phases.items():
        c.print(f"[bold]{name}[/bold] [{VERDICT_STYLE.get(p.verdict, '')}]{p.verdict}[/]: "
                + "; ".join(p.evidence))


def _top_kernels(doc: Analysis, c: Console) -> None:
    """Each phase's kernels of the most time."""
    for name, p in doc.phases.items():
        tk = p.top_kernels
        if not tk:
            continue
        kt = Table(title=f"Top kernels: {name}", title_justify="left")
        # Per-kernel work comes from the operators' input shapes only; where no kernel of
        # the phase has any, the columns would be all "-": said once instead (issue 24.2).
        per_kernel = any(r.category or r.achieved_flops_per_s is not None
                         or r.achieved_bytes_per_s is not None for r in tk)
        cols = [("kernel", "left"), ("count", "right"), ("time", "right"), ("share", "right")]
        if per_kernel:
            cols += [("kind", "left"), ("TFLOP/s", "right"), ("TB/s", "right")]
        for col, j in cols:
            kt.add_column(col, justify=j, no_wrap=True)
        for r in tk:
            nm = r.name if len(r.name) <= 56 else r.name[:55] + "…"
            row = [nm, f"{r.count:,}", _ns(r.time_ns),
                   _fmt(r.time_ns / p.kernel_time_ns if p.kernel_time_ns else None, 0.01, 0, "%")]
            if per_kernel:
                row += [r.category or "-", _fmt(r.achieved_flops_per_s, 1e12, 1),
                        _fmt(r.achieved_bytes_per_s, 1e12, 2)]
            kt.add_row(*row)
        if not per_kernel:
            kt.caption = ("per-kernel kind, TFLOP/s and TB/s need the operators' input shapes (a trace "
                          "recorded with record_shapes); this one has none: the phase figures come from the model")
        c.print(kt)


def _steps(doc: Analysis, c: Console) -> None:
    """The steps (the first and last 10 of more than 20)."""
    steps = doc.steps
    if steps:
        st = Table(title=f"Steps ({len(steps)})", title_justify="left")
        for col, w in (("#", 3), ("phase", 7), ("start", 9), ("duration", 9), ("kernels", 7),
                       ("busy", 9), ("tokens p/d", 10)):
            st.add_column(col, no_wrap=True, min_width=w)
        st.add_column("evidence", no_wrap=True, overflow="ellipsis", max_width=60)
        t0 = min(s.start_ns for s in steps)
        shown = steps if len(steps) <= 20 else steps[:10] + steps[-10:]
        for s in shown:
            tok = s.tokens
            tok_s = "-" if tok is UNSET else f"{tok.prefill if tok.prefill is not None else '?'}/" \
                                           f"{tok.decode if tok.decode is not None else '?'}"
            st.add_row(str(s.index), s.phase, _ns(s.start_ns - t0), _ns(s.end_ns - s.start_ns),
                       str(s.kernels), _ns(s.busy_ns), tok_s, "; ".join(s.evidence))
        if len(steps) > 20:
            st.caption = f"first and last 10 of {len(steps)} steps; all in --json"
        c.print(st)


def _idle_and_launch(doc: Analysis, c: Console) -> None:
    """Idle gaps per device, and launch latency."""
    it = Table(title="GPU idle gaps (between kernels)", title_justify="left")
    for col in ("dev", "span", "idle", "gaps", "p50", "p90", "p99", "max"):
        it.add_column(col, no_wrap=True)
    for dev, d in doc.idle_gaps.items():
        it.add_row(dev, _ns(d.span_ns), f"{_ns(d.idle_ns)} ({_fmt(d.idle_ratio, 0.01, 0, '%')})",
                   str(d.gaps), _ns(d.gap_p50_ns), _ns(d.gap_p90_ns), _ns(d.gap_p99_ns), _ns(d.gap_max_ns))
        it.caption = "gaps by length: " + ", ".join(f"{k} {v}" for k, v in d.gap_histogram.items())
    c.print(it)
    ll = doc.launch_latency
    if ll.kernels:
        c.print(f"Launch latency (API call start -> kernel start, {ll.kernels:,} kernels): "
                f"p50 {_ns(ll.p50_ns)}, p90 {_ns(ll.p90_ns)}, p99 {_ns(ll.p99_ns)}")
    else:
        c.print("Launch latency: no kernel has a launch API record", style="dim")


def _stragglers(doc: Analysis, c: Console) -> None:
    """Each TP/PP group's collectives and its straggler."""
    for g in doc.stragglers:
        gt = Table(title=f"Collectives of TP/PP group {g.group}: {g.instances:,} collectives, the others wait "
                         f"{_fmt(g.waiting_share, 0.01, 1, '%')} of their time for the last rank",
                   title_justify="left")
        for col in ("rank", "pid", "dev", "last", "late by p50", "p99", "waits", "why late"):
            gt.add_column(col, no_wrap=True)
        for i, r in enumerate(g.ranks):
            gt.add_row(("* " if i == g.straggler else "") + str(i), str(r.pid), str(r.device),
                       f"{r.last_count:,} ({_fmt(r.last_share, 0.01, 0, '%')})",
                       _ns(r.late_by_p50_ns) if r.last_count else "-",
                       _ns(r.late_by_p99_ns) if r.last_count else "-", _ns(r.wait_ns), r.cause or "-")
        if g.misaligned:
            gt.caption = f"{g.misaligned} collectives left out: their ends did not agree across the ranks"
        c.print(gt)


def _copies(doc: Analysis, c: Console) -> None:
    """Copy traffic by kind and direction."""
    if doc.copies:
        ct = Table(title="Copy traffic", title_justify="left")
        for col in ("kind", "direction", "count", "bytes", "time", "achieved"):
            ct.add_column(col)
        for r in doc.copies:
            ct.add_row(r.kind, r.direction, f"{r.count:,}", _bytes(r.bytes), _ns(r.time_ns),
                       _rate(r.achieved_bytes_per_s))
        c.print(ct)
