"""The live terminal view of the agent's windows (``ridgeline top``), built with rich.

Contract: :func:`render(window, state)` turns one decoded window record (and the
subscriber's :class:`TopState`: gaps, last health) into a rich renderable; it never
reads a socket, so it is tested with literal windows. Per GPU and served process, per
phase: time share, achieved TB/s and TFLOP/s as bars against the GPU's ceilings,
arithmetic intensity, verdict; the engine's KV-cache watermark as a bar with the 85%
alert line, queue time, TTFT and ITL, latency by segment (queue / prefill / decode, the
share of TTFT that is queue), swapped requests, prefix-cache hits (local, external),
KV eviction (or "unknown"), preemption episodes and recovery time; the launch threads' on-CPU / run-queue / blocked
time; the agent's own cost and drops. Every source that is simulated or replayed says so
in the header.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from rich.console import Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ridgeline.agent.window_sections import engine_failures, engine_records, verdict_text
from ridgeline.agent.window_sections import sched_threads as _sched_threads
from ridgeline.probes.records import Ceilings, EngineFigures, GpuProcess, Health, SchedThread, WindowRequests, window_of

KV_ALERT_RATIO = 0.85
BAR_WIDTH = 12


@dataclass
class TopState:
    windows: int = 0
    gaps: dict = field(default_factory=dict)
    restarts: int = 0
    bad: int = 0
    endpoint: str = ""


def bar(fraction: float | None, width: int = BAR_WIDTH, mark: float | None = None) -> Text:
    """A horizontal bar of ``fraction`` (0..1, clipped) with an optional marker line."""
    t = Text()
    if fraction is None:
        return Text("n/a".ljust(width), style="dim")
    f = max(0.0, min(1.0, fraction))
    filled = int(round(f * width))
    mark_at = int(round(mark * width)) if mark is not None else -1
    for i in range(width):
        ch = "█" if i < filled else "·"
        style = "green" if f < 0.5 else ("yellow" if f < (mark or 0.85) else "red")
        if i == mark_at:
            t.append("│", style="bold red")
        else:
            t.append(ch, style=style if i < filled else "dim")
    return t


def _fmt(v, unit: str = "", scale: float = 1.0, digits: int = 1) -> str:
    if v is None:
        return "-"
    try:
        return f"{v * scale:.{digits}f}{unit}"
    except (TypeError, ValueError):
        return str(v)


def _ms(s) -> str:
    return _fmt(s, " ms", 1e3, 1) if isinstance(s, (int, float)) else "-"


def _peak_flops(ceil: Ceilings | None) -> float | None:
    if ceil is None:
        return None
    f = ceil.flops_per_s
    return f.get("bf16") or f.get("fp16") or (max(f.values()) if f else None)


def gpu_table(g: GpuProcess) -> Table:
    peak_bw = g.ceilings.hbm_bytes_per_s if g.ceilings is not None else None
    peak_fl = _peak_flops(g.ceilings)
    span = g.span_ns
    busy = (g.busy_ns / span) if span else None
    pid = g.pid if isinstance(g.pid, int) and g.pid >= 0 else "?"
    title = (f"GPU {g.device} {g.gpu or ''}  pid {pid}  "
             f"[{g.source or ''}]  kernels {g.kernels}  busy {_fmt(busy, '%', 100, 0)}  "
             f"launch p50 {_fmt(g.launch.p50_ns if g.launch is not None else None, ' µs', 1e-3)}")
    t = Table(title=escape(title), title_justify="left", expand=False, pad_edge=False)
    t.add_column("phase")
    t.add_column("time", justify="right")
    t.add_column(f"TB/s (peak {_fmt(peak_bw, '', 1e-12, 2)})")
    t.add_column("TB/s", justify="right")
    t.add_column(f"TFLOP/s (peak {_fmt(peak_fl, '', 1e-12, 0)})")
    t.add_column("TFLOP/s", justify="right")
    t.add_column("FLOP/B", justify="right")
    t.add_column("verdict")
    for ph, f in sorted(g.phases.items(), key=lambda kv: -kv[1].kernel_time_ns):
        bw = f.achieved_bytes_per_s
        fl = f.achieved_flops_per_s
        t.add_row(ph, _fmt(f.time_share_pct, "%", 1, 0),
                  bar(bw / peak_bw if (bw is not None and peak_bw) else None), _fmt(bw, "", 1e-12, 2),
                  bar(fl / peak_fl if (fl is not None and peak_fl) else None), _fmt(fl, "", 1e-12, 1),
                  _fmt(f.arithmetic_intensity, "", 1, 1), verdict_text(f.verdict))
    return t


def engine_panel(engine: dict) -> Panel | None:
    rows = []
    for src, rec in engine_records(engine):
        try:
            e = msgspec.convert(rec, EngineFigures)
        except msgspec.ValidationError as exc:      # one endpoint's record of the wrong shape, said
            rows.append(Text(f"{src}: engine record not readable: {exc}", style="bold red"))
            continue
        kv = e.kv_usage_ratio
        line = Text(f"{src}: KV ")
        line.append_text(bar(kv, mark=KV_ALERT_RATIO))
        line.append(f" {_fmt(kv, '%', 100, 0)} (alert at {KV_ALERT_RATIO:.0%})")
        alerts = [n for n, st in e.alerts.items() if st.firing]
        if kv is not None and kv >= KV_ALERT_RATIO or alerts:
            line.append(f"  ALERT {', '.join(str(a) for a in alerts if a) or 'KV'}", style="bold red")
        rows.append(line)
        rows.append(Text(
            f"  queue p50 {_ms(e.queue_time_p50_s)} p99 {_ms(e.queue_time_p99_s)}   "
            f"TTFT p50 {_ms(e.ttft_p50_s)} p99 {_ms(e.ttft_p99_s)}   "
            f"ITL p50 {_ms(e.itl_p50_s)} p99 {_ms(e.itl_p99_s)}   "
            f"running {_fmt(e.num_running_requests, '', 1, 0)} waiting {_fmt(e.num_waiting_requests, '', 1, 0)}"
            f" swapped {_fmt(e.num_swapped_requests, '', 1, 0)}"
            f"   preemptions/s {_fmt(e.preemption_rate_per_s, '', 1, 2)}"))
        rows.append(segments_line(e))
        rows.append(kv_line(e))
    # Configured or discovered endpoints that do not answer: their absence shown, with why.
    shown = {ep for ep, _ in engine_records(engine)}
    for ep, err in engine_failures(engine).items():
        if ep not in shown:
            rows.append(Text(f"{ep}: not answering: {err}", style="bold red"))
    if not rows:
        return None
    return Panel(Group(*rows), title="engine", title_align="left")


def segments_line(e: EngineFigures) -> Text:
    """Mean latency per segment (queue / prefill / decode, e2e) beside TTFT, and the share
    of TTFT that is queue; a derived segment (SGLang: TTFT - queue, e2e - TTFT) is marked *."""
    kinds = e.segment_kinds

    def seg(name, value):
        mark = "*" if kinds.get(name) == "derived" else ""
        return f"{name}{mark} {_ms(value)}"
    t = Text("  segments (mean): " + " | ".join(seg(n, v) for n, v in (
        ("queue", e.queue_mean_s), ("prefill", e.prefill_mean_s), ("decode", e.decode_mean_s))))
    t.append(f"   e2e {_ms(e.e2e_mean_s)}   TTFT {_ms(e.ttft_mean_s)}"
             f" (queue {_fmt(e.queue_share_of_ttft_ratio, '%', 100, 0)} of it)")
    if "derived" in kinds.values():
        t.append("   * derived from means", style="dim")
    return t


def kv_line(e: EngineFigures) -> Text:
    """Prefix cache (local, external, cached prompt tokens), KV eviction (or unknown),
    preemption episode and last recovery time, engine work estimate."""
    t = Text(f"  prefix hit {_fmt(e.prefix_cache_hit_ratio, '%', 100, 0)}"
             f" external {_fmt(e.external_prefix_cache_hit_ratio, '%', 100, 0)}"
             f" cached prompt {_fmt(e.prompt_tokens_cached_ratio, '%', 100, 0)}   eviction ")
    if e.kv_eviction_source:
        t.append(f"{_fmt(e.kv_eviction_rate_tokens_per_s, ' tok/s', 1, 0)}")
    else:
        t.append("unknown (not exported)", style="dim")
    if e.preemption_episode_active:
        t.append(f"   preemption episode open {_fmt(e.preemption_episode_elapsed_s, ' s', 1, 0)}"
                 f" ({_fmt(e.preemption_episode_preemptions, '', 1, 0)} preemptions)", style="yellow")
    if e.preemption_last_recovery_s is not None:
        t.append(f"   last recovery {_fmt(e.preemption_last_recovery_s, ' s', 1, 1)}")
    if e.work_estimate_source:
        t.append(f"   est. {_fmt(e.estimated_flops_per_gpu_per_s, ' TFLOP/s', 1e-12, 1)}"
                 f" {_fmt(e.estimated_bytes_per_gpu_per_s, ' TB/s', 1e-12, 2)} [engine estimate]")
    return t


def sched_panel(sched: dict) -> Panel | None:
    threads = []
    for row in _sched_threads(sched):
        try:
            threads.append(msgspec.convert(row, SchedThread))
        except msgspec.ValidationError:      # a row of the wrong shape is not shown
            continue
    if not threads:
        return None
    t = Table(expand=False, pad_edge=False)
    for c in ("pid", "tid", "comm", "on-CPU", "run-queue", "blocked"):
        t.add_column(c)
    def runq(x: SchedThread):
        return x.runq_wait_ns or x.runq_ns or 0
    busy = [th for th in threads if (th.on_cpu_ns or 0) or runq(th)]
    for th in sorted(busy or threads, key=lambda x: -((x.on_cpu_ns or 0) + runq(x)))[:8]:
        t.add_row(str(th.pid if th.pid is not None else ""), str(th.tid if th.tid is not None else ""),
                  str(th.comm if th.comm is not None else ""),
                  _fmt(th.on_cpu_ns or th.oncpu_ns, " ms", 1e-6),
                  _fmt(runq(th), " ms", 1e-6),
                  _fmt(th.blocked_ns or th.off_cpu_ns, " ms", 1e-6))
    return Panel(t, title="launch threads (per window)", title_align="left")


def agent_line(a: Health, state: TopState) -> Text:
    gaps = sum(state.gaps.values())
    drops = ", ".join(f"{n} {c.get('drops', 0)}" for n, c in a.probes.items()) or "none"
    t = Text(f"agent: {_fmt(a.cpu_pct, '% CPU', 1, 1)}, RSS {_fmt(a.rss_bytes, ' MiB', 1 / 2**20, 0)}, "
             f"{_fmt(a.records_per_s, ' rec/s', 1, 0)}; drops: {drops}; stream drops "
             f"{a.publisher_drops if a.publisher_drops is not None else 0}; gaps seen {gaps}")
    if a.bpf_run_time_ns is not None:
        t.append(f"; BPF run time {_fmt(a.bpf_run_time_ns, ' ms', 1e-6)}")
    if state.restarts:
        t.append(f"; agent restarts seen {state.restarts}", style="yellow")
    return t


def render(window: dict, state: TopState | None = None):
    state = state or TopState()
    try:
        w = window_of(window)
    except msgspec.ValidationError as exc:      # a producer's bug, said in one line
        return Text(f"window #{state.windows} not readable as a window record: {exc}", style="bold red")
    sources = w.sources
    head = Text(f"ridgeline top — {w.host if w.host is not None else ''}  window {w.duration_ns / 1e9:.2f} s  "
                f"#{state.windows}  verdict: {verdict_text(w.verdict)}", style="bold")
    if any(s in ("simulated", "replay") or "sim" in s for s in sources):
        head.append(f"   [{'/'.join(s.upper() for s in sources)} DATA — not a live GPU]", style="bold magenta")
    parts = [head]
    gpus = w.gpus
    if not gpus:
        parts.append(Text("no GPU events in this window", style="dim"))
    for g in gpus[:8]:
        parts.append(gpu_table(g))
    if len(gpus) > 8:
        parts.append(Text(f"... and {len(gpus) - 8} more GPU/process pairs", style="dim"))
    for p in (engine_panel(w.engine), sched_panel(w.sched)):
        if p is not None:
            parts.append(p)
    req = requests_line(w.requests)
    if req is not None:
        parts.append(req)
    from .straggler_view import stragglers_lines  # issue 23
    parts.extend(stragglers_lines(w.stragglers))
    parts.append(agent_line(w.agent, state))
    return Group(*parts)


def requests_line(r: WindowRequests | None) -> Text | None:
    """The window's joined requests (issue 22): how many, the dragged share, the top culprit."""
    if r is None or not r.requests:
        return None
    from ridgeline.probes.untrusted_text import for_log
    line = (f"requests: {r.requests} joined; decode dragged {r.dragged_share_ratio:.0%} "
            f"({r.dragged_source}); p99 e2e {r.e2e_p99_ns / 1e9:.2f} s, "
            f"queue {r.queue_p99_ns / 1e9:.2f} s")
    if r.top_culprit_id:
        line += (f"; top culprit {for_log(r.top_culprit_id, 40)} +{r.top_culprit_added_ns / 1e9:.2f} s "
                 f"({r.top_culprit_tokens} tokens)")   # its prompt, or prompt + generated when re-prefilling
    return Text(line + "   (ridgeline requests / why ID)")
