"""One ``ridgeline top`` frame fitted to the terminal (pure: a window in, lines out).

Contract: :func:`frame(window, state, view, width, height)` returns at most ``height``
lines (``None``: as many as the window needs), none wider than ``width``, so the frame
fits an 80x24 terminal as htop's and nvtop's do. What an operator needs first stays when
lines must go: the header, each shown GPU's verdict with the number that rules out every
other face (the same lines as the report's, :func:`aggregator.answer.answer_lines`), the
engine's KV and queue, the agent's line and the keys. Then, as room allows: the phase
table, the device line (power, clocks and throttle reasons, memory, and Xid / ECC /
retired pages / remapped rows from NVML), the reasons after the first, the other GPUs one
line each, the joined requests. The rows left out are counted on the key line (g / p show the other GPUs).

Every figure is the one the other views show, in the same unit: percentages of peak and
TB/s / TFLOP/s as the report's phase table, KV as /metrics' ratio in %, latency
percentiles with their histogram bound where the window has no interpolated value
(``<=300 ms``, as ``ridgeline scrape`` prints them). ``launch call`` is the launch API
call's own duration; the report's "launch latency" (API call start to kernel start) is
another measure and is not shown here.
"""
from __future__ import annotations

import msgspec
from rich.text import Text

from ridgeline.aggregator.answer import answer_lines
from ridgeline.probes.records import (
    EngineFigures,
    GpuProcess,
    Health,
    PhaseFigures,
    ProbeCounters,
    VerdictRecord,
    Window,
    WindowRequests,
    WindowStragglers,
    window_sections_of,
)

from .top import KV_ALERT_RATIO, TopState, bar, engine_failures, engine_records
from .top_view import ViewState, pressure_pct, typed_verdicts

SPARK = " ▁▂▃▄▅▆▇█"
KEYS = "q quit  s sort  g GPU  p pid"
_FACE_ABBREV = {"bandwidth": "BW", "compute": "FL", "memory-capacity": "KV", "queue": "Q", "host": "H",
                "launch": "L", None: "?"}


def sparkline(values: list[float | None]) -> str:
    """One character per value (0..100 %, clipped); a blank where a window had none."""
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        else:
            out.append(SPARK[1 + min(len(SPARK) - 2, int(max(0.0, min(100.0, v)) / 100.0 * (len(SPARK) - 2) + 0.5))])
    return "".join(out)


def _num(v, scale: float = 1.0, digits: int = 1, unit: str = "") -> str:
    return "-" if not isinstance(v, (int, float)) else f"{v * scale:.{digits}f}{unit}"


def _amount_s(v: float) -> str:
    return f"{v * 1e3:.1f} ms" if v < 10 else f"{v:.1f} s"


def quantile_text(value_s, kind: str | None, lower_s, upper_s) -> str:
    """A latency percentile of the engine record (its ``<hist>_<p>_s``, ``_kind``,
    ``_lower_s`` and ``_upper_s``), or its bound when the window's histogram puts it in the
    first or past the last bucket (as ``scrape``)."""
    if isinstance(value_s, (int, float)):
        return _amount_s(value_s)
    if kind == "first_bucket" and isinstance(upper_s, (int, float)):
        return "<=" + _amount_s(upper_s)
    if kind == "above_last_bucket" and isinstance(lower_s, (int, float)):
        return ">" + _amount_s(lower_s)
    return "-"


def _latency_line(e: EngineFigures) -> Text:
    """Queue, TTFT and ITL, p50 and p99."""
    return Text(
        f"  queue p50 {quantile_text(e.queue_time_p50_s, e.queue_time_p50_kind, e.queue_time_p50_lower_s, e.queue_time_p50_upper_s)}"
        f" p99 {quantile_text(e.queue_time_p99_s, e.queue_time_p99_kind, e.queue_time_p99_lower_s, e.queue_time_p99_upper_s)}"
        f"  TTFT p50 {quantile_text(e.ttft_p50_s, e.ttft_p50_kind, e.ttft_p50_lower_s, e.ttft_p50_upper_s)}"
        f" p99 {quantile_text(e.ttft_p99_s, e.ttft_p99_kind, e.ttft_p99_lower_s, e.ttft_p99_upper_s)}"
        f"  ITL p50 {quantile_text(e.itl_p50_s, e.itl_p50_kind, e.itl_p50_lower_s, e.itl_p50_upper_s)}"
        f" p99 {quantile_text(e.itl_p99_s, e.itl_p99_kind, e.itl_p99_lower_s, e.itl_p99_upper_s)}")


def _device_figures(window: Window) -> dict:
    """GPU index -> the window's NVML figures (:func:`aggregator.device_metrics.window_figures`)."""
    from ridgeline.aggregator import device_metrics

    from .window_sections import device_samples
    out: dict = {}
    for recs in device_samples(window.device):
        out.update(device_metrics.window_figures(recs))
    return out


def _power_line(f: dict) -> Text:
    """Power against its limit, SM clock against its maximum, memory, temperature, and the
    clock-event reasons that cost throughput."""
    gib = 1 / 2**30
    slowed = [r for r in f.get("clock_event_reasons") or []
              if r not in ("gpu_idle", "applications_clocks_setting", "display_clock_setting")]
    t = Text(f"  power {_num(f.get('power_w'), digits=0)}/{_num(f.get('power_limit_w'), digits=0)} W  "
             f"SM {_num(f.get('sm_clock_mhz'), digits=0)}/{_num(f.get('sm_clock_max_mhz'), digits=0)} MHz  "
             f"mem {_num(f.get('memory_used_bytes'), gib)}/{_num(f.get('memory_total_bytes'), gib)} GiB  "
             f"{_num(f.get('temperature_c'), digits=0)} C  throttle ")
    t.append(", ".join(slowed) if slowed else "none", style="yellow" if slowed else None)
    return t


def _xid_ecc(f: dict) -> Text:
    """Xid errors of the window and the ECC counters (``unknown`` where NVML is silent)."""
    xc = f.get("xid_errors_count")
    t = Text("  XID ")
    if xc is None:
        t.append("unknown", style="dim")
    elif xc:
        t.append(f"{', '.join(str(x) for x in f.get('xid_errors') or [])} ({xc} in the window)", style="bold red")
    else:
        t.append("none")
    unc_v, unc_a = f.get("ecc_uncorrected_volatile_errors_total"), f.get("ecc_uncorrected_aggregate_errors_total")
    cor_v = f.get("ecc_corrected_volatile_errors_total")
    ecc = ("unknown" if unc_v is None and cor_v is None else
           f"uncorr {_num(unc_v, digits=0)} vol/{_num(unc_a, digits=0)} life, corr {_num(cor_v, digits=0)} vol")
    t.append(f"  ECC {ecc}", style="bold red" if unc_v else None)
    return t


def _pages_rows(f: dict) -> str:
    """Retired pages (pre-Ampere) and remapped rows (Ampere and later), where reported."""
    out = ""
    sbe, dbe = f.get("retired_pages_single_bit_count"), f.get("retired_pages_double_bit_count")
    if sbe is not None or dbe is not None:
        out += (f"  retired pages {_num(sbe, digits=0)}/{_num(dbe, digits=0)}"
                + (" pending" if f.get("retired_pages_pending") else ""))
    rc, ru = f.get("remapped_rows_correctable_count"), f.get("remapped_rows_uncorrectable_count")
    if rc is not None or ru is not None:
        out += (f"  remapped rows {_num(rc, digits=0)}/{_num(ru, digits=0)}"
                + (" pending" if f.get("remapped_rows_pending") else "")
                + (" FAILED" if f.get("remapped_rows_failed") else ""))
    return out


def device_lines(f: dict | None) -> list[Text]:
    """Power, clocks and throttle reasons, memory, temperature; then Xid / ECC / retired
    pages / remapped rows (``unknown`` where NVML does not report them, never 0)."""
    if not f:
        return [Text("  device: no NVML figures in this window", style="dim")]
    health = _xid_ecc(f)
    health.append(_pages_rows(f), style="bold red" if f.get("remapped_rows_failed") else None)
    return [_power_line(f), health]


_PHASE_HEAD = "  phase     time   TB/s  %peak  TFLOP/s  %peak  FLOP/B  roofline"


def _phase_row(ph: str, f: PhaseFigures, wide: bool) -> Text:
    t = Text(f"  {ph[:8]:<8} {_num(f.time_share_pct, digits=0, unit='%'):>5} "
             f"{_num(f.achieved_bytes_per_s, 1e-12, 2):>6} {_num(f.pct_of_peak_bytes, digits=0, unit='%'):>6} "
             f"{_num(f.achieved_flops_per_s, 1e-12, 1):>8} {_num(f.pct_of_peak_flops, digits=0, unit='%'):>6} "
             f"{_num(f.arithmetic_intensity):>7}  {str(f.verdict or '-'):<13}")
    if wide:
        pb, pf = f.pct_of_peak_bytes, f.pct_of_peak_flops
        t.append("  ")
        t.append_text(bar(None if pb is None else pb / 100))
        t.append("   ")
        t.append_text(bar(None if pf is None else pf / 100))
    return t


def phase_lines(g: GpuProcess, width: int) -> list[Text]:
    """The phase table, heaviest phase first: the report's columns in its units."""
    rows = sorted(g.phases.items(), key=lambda kv: -(kv[1].kernel_time_ns or 0))
    if not rows:
        return []
    wide = width >= 110
    out = [Text(_PHASE_HEAD + ("   TB/s of peak  TFLOP/s of peak" if wide else ""), style="bold")]
    out += [_phase_row(ph, f, wide) for ph, f in rows]
    return out


def _kv_line(ep: str, e: EngineFigures) -> Text:
    """KV against the alert line, with the running batch (and its cap) and the queue."""
    kv = e.kv_usage_ratio
    t = Text(f"engine {ep}  KV ")
    t.append_text(bar(kv, width=10, mark=KV_ALERT_RATIO))
    t.append(f" {_num(kv, 100, 1, '%')}")
    if isinstance(e.kv_usage_max_ratio, (int, float)) and e.kv_usage_max_ratio != kv:
        # The verdict weighs the window's highest usage: shown beside the latest.
        t.append(f" (max {_num(e.kv_usage_max_ratio, 100, 1, '%')})")
    t.append(f"  running {_num(e.num_running_requests, digits=0)}")
    if isinstance(e.max_running_requests, (int, float)):
        t.append(f"/{e.max_running_requests:.0f}")
    t.append(f" waiting {_num(e.num_waiting_requests, digits=0)}"
             f" swapped {_num(e.num_swapped_requests, digits=0)}")
    if isinstance(kv, (int, float)) and kv >= KV_ALERT_RATIO:
        t.append("  KV ALERT", style="bold red")
    return t


def engine_lines(engine: dict) -> list[tuple[int, Text]]:
    """Per endpoint: KV against the alert line with the batch, then the latency percentiles."""
    out: list[tuple[int, Text]] = []
    for ep, rec in engine_records(engine):
        try:
            e = msgspec.convert(rec, EngineFigures)
        except msgspec.ValidationError as exc:      # one endpoint's record of the wrong shape, said
            out.append((1, Text(f"engine {ep}: record not readable: {exc}", style="bold red")))
            continue
        out += [(1, _kv_line(ep, e)), (2, _latency_line(e))]
    shown = {ep for ep, _ in engine_records(engine)}
    for ep, err in engine_failures(engine).items():
        if ep not in shown:
            out.append((1, Text(f"engine {ep}: not answering: {err}", style="bold red")))
    return out


def _gpu_title(g: GpuProcess) -> str:
    busy = (g.busy_ns / g.span_ns) if g.span_ns else None
    pid = g.pid
    launch = g.launch.p50_ns if g.launch is not None else None
    return (f"GPU {g.device} {g.gpu or ''}  pid {pid if isinstance(pid, int) and pid >= 0 else '?'}"
            f"  [{g.source or ''}]  busy {_num(busy, 100, 0, '%')}  kernels {g.kernels:,}"
            f"  launch call p50 {_num(launch, 1e-3, 1, ' us')}")


#: A verdict record as the frame holds it: the record (for ``aggregator.answer``'s lines)
#: and what the frame reads of it, typed.
Verdict = tuple[dict, VerdictRecord]


def _verdict_head(v: Verdict | None, hist) -> Text:
    spark = sparkline([p for _, p in hist] if hist else [])
    t = Text(f"{spark:>12} " if hist else "")
    if v is None:
        t.append("verdict: -", style="dim")
        return t
    rec, typed = v
    pct = pressure_pct(typed)
    t.append(answer_lines(rec)[0].split(": ", 1)[-1], style="bold")
    if pct is not None:
        t.append(f"  [{_FACE_ABBREV.get(typed.face, '?')} {pct:.0f}%]")
    return t


def _probe_drops(a: Health) -> int:
    """The probes' drops, summed (a probe's counters of another shape count none)."""
    total = 0
    for c in a.probes.values():
        try:
            total += int(msgspec.convert(c, ProbeCounters).drops or 0)
        except msgspec.ValidationError:
            continue
    return total


def _agent_line(a: Health, state: TopState) -> Text:
    return Text(f"agent: {_num(a.cpu_pct, digits=1, unit='% CPU')}, RSS {_num(a.rss_bytes, 1 / 2**20, 0)} MiB,"
                f" probe drops {_probe_drops(a)}, stream drops {a.publisher_drops or 0}, gaps {sum(state.gaps.values())}"
                + (f", restarts {state.restarts}" if state.restarts else ""), style="dim")


def _header(window: Window, state: TopState) -> Text:
    sources = window.sources
    head = Text(f"ridgeline top  {window.host or ''}  window {window.duration_ns / 1e9:.2f} s"
                f"  #{state.windows}", style="bold")
    if any(s in ("simulated", "replay") or "sim" in s for s in sources):
        head.append(f"  {'/'.join(s.upper() for s in sources)} DATA", style="bold magenta")
    return head


def _pair_lines(g: GpuProcess, v: Verdict | None, hist, device: dict | None, width: int) -> list[tuple[int, Text]]:
    """The first GPU/process in full: title, verdict with sparkline, the other faces (the
    reasons after the first go early), the phase table, the device."""
    lines: list[tuple[int, Text]] = [(1, Text(_gpu_title(g))), (0, _verdict_head(v, hist))]
    for line in answer_lines(v[0])[1:] if v else []:
        lines.append((3 if line.lstrip().startswith("because") else 1, Text(line)))
    lines += [(2 if j < 2 else 3, t) for j, t in enumerate(phase_lines(g, width))]
    lines += [(2 if j == 0 else 3, t) for j, t in enumerate(device_lines(device))]
    return lines


def _no_pair_lines(window: Window, verdicts: dict[tuple, Verdict]) -> list[tuple[int, Text]]:
    lines = [(0, Text("no GPU events in this window" if not window.gpus else
                      "no GPU/process matches the selection (g / p to change)", style="dim"))]
    engine_only = verdicts.get((None, None))
    if engine_only is not None:
        lines += [(1, Text(x)) for x in answer_lines(engine_only[0])]
    return lines


def _requests_line(req: WindowRequests | None) -> list[tuple[int, Text]]:
    if req is None or not req.requests:
        return []
    return [(4, Text(f"requests {req.requests} joined; decode dragged {req.dragged_share_ratio:.0%};"
                     f" p99 e2e {req.e2e_p99_ns / 1e9:.2f} s  (ridgeline requests)"))]


def _stragglers_lines(s: WindowStragglers | None) -> list[tuple[int, Text]]:
    """Issue 23's one line per TP group, from the window's typed ``stragglers`` record."""
    from .straggler_view import stragglers_lines
    return [(2, t) for t in stragglers_lines(s)]


def frame_lines(window: Window, state: TopState, view: ViewState, width: int) -> list[tuple[int, Text]]:
    """Every line of the frame with its priority (0 always shown; higher goes first)."""
    lines: list[tuple[int, Text]] = [(0, _header(window, state))]
    verdicts = {(typed.device, typed.pid): (rec, typed) for rec, typed in typed_verdicts(window.verdict)}
    pairs = view.pick(window.gpus, {k: v[1] for k, v in verdicts.items()})
    if not pairs:
        lines += _no_pair_lines(window, verdicts)
    devices = _device_figures(window)
    for i, g in enumerate(pairs):
        key = (g.device, g.pid)
        if i == 0:
            lines += _pair_lines(g, verdicts.get(key), view.history.get(key), devices.get(g.device), width)
        else:      # the others: one line each, below the first in full
            lines.append((3, Text(f"GPU {g.device} pid {g.pid}: ").append_text(
                _verdict_head(verdicts.get(key), view.history.get(key)))))
    lines += engine_lines(window.engine)
    lines += _stragglers_lines(window.stragglers)
    lines += _requests_line(window.requests)
    lines.append((0, _agent_line(window.agent, state)))
    return lines


def _fit(lines: list[tuple[int, Text]], width: int, height: int | None) -> tuple[list[Text], int]:
    """Wrap each line to ``width`` (3 rows at most), then, while the frame is taller than
    ``height``, cut the cheapest thing first: a line of the highest priority, or a wrapped
    line back to one row (a priority-p line's wrap goes as if it were of priority p + 1.5,
    so the answer's figures stay whole until the tables are gone). Returns the rows and
    how many were left out."""
    from rich.console import Console
    console = Console(width=width, color_system=None, force_terminal=False)
    entries = []
    for prio, t in lines:
        rows = list(t.wrap(console, width))[:3] if t.cell_len > width else [t]
        entries.append([prio, t, rows])
    hidden = 0
    if height is not None:
        room = max(1, height)
        while sum(len(e[2]) for e in entries) > room:
            cands = [(e[0], 0, i) for i, e in enumerate(entries) if e[0] > 0]
            cands += [(e[0] + 1.5, 1, i) for i, e in enumerate(entries) if len(e[2]) > 1]
            if not cands:
                over = sum(len(e[2]) for e in entries) - room
                while over > 0 and entries:
                    last = entries[-1]
                    if len(last[2]) > over:
                        last[2] = last[2][:len(last[2]) - over]
                        hidden += over
                        break
                    over -= len(last[2])
                    hidden += len(last[2])
                    entries.pop()
                break
            _, shrink, i = max(cands, key=lambda c: (c[0], c[2]))
            if shrink:
                hidden += len(entries[i][2]) - 1
                one = entries[i][1].copy()
                one.truncate(width, overflow="ellipsis")
                entries[i][2] = [one]
            else:
                hidden += len(entries[i][2])
                del entries[i]
    out = []
    for e in entries:
        for r in e[2]:
            r = r.copy()
            r.rstrip()
            r.truncate(width, overflow="ellipsis")
            out.append(r)
    return out, hidden


def frame(window: dict | Window, state: TopState | None = None, view: ViewState | None = None,
          width: int = 80, height: int | None = 24) -> Text:
    """The frame as one rich Text: ``height`` rows at most (the key line last), none wider
    than ``width``. ``window``: a :class:`probes.records.Window`, or the decoded record
    (read with ``window_of``; one line says so when it is not a window record)."""
    state = state or TopState()
    view = view or ViewState()
    try:
        w, unreadable = window_sections_of(window)
    except msgspec.ValidationError as exc:      # not a map: said in one line
        return Text(f"window #{state.windows} not readable as a window record: {exc}", style="bold red")
    lines = frame_lines(w, state, view, width)
    # A producer's bug in one section loses that section only, said in one line each.
    lines[1:1] = [(1, Text(f"{name} record not readable: {why}", style="bold red")) for name, why in unreadable.items()]
    rows, hidden = _fit(lines, width, None if height is None else height - 1)
    keys = Text(f"{KEYS}  [{view.describe()}]", style="reverse")
    if hidden:
        keys.append(f"  +{hidden} rows hidden")
    keys.truncate(width, overflow="ellipsis")
    return Text("\n").join([*rows, keys])
