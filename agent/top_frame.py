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

from ridgeline.aggregator.answer import answer_lines, verdict_records
from ridgeline.probes.records import WindowStragglers

from .top import KV_ALERT_RATIO, TopState, bar, engine_failures, engine_records
from .top_view import ViewState, pressure_pct

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


def quantile_text(e: dict, base: str, p: str) -> str:
    """A latency percentile of the engine record (``queue_time``, ``p50``), or its bound when
    the window's histogram puts it in the first or past the last bucket (as ``scrape``)."""
    v = e.get(f"{base}_{p}_s")
    if isinstance(v, (int, float)):
        return _amount_s(v)
    kind = e.get(f"{base}_{p}_kind")
    if kind == "first_bucket" and isinstance(e.get(f"{base}_{p}_upper_s"), (int, float)):
        return "<=" + _amount_s(e[f"{base}_{p}_upper_s"])
    if kind == "above_last_bucket" and isinstance(e.get(f"{base}_{p}_lower_s"), (int, float)):
        return ">" + _amount_s(e[f"{base}_{p}_lower_s"])
    return "-"


def _device_figures(window: dict) -> dict:
    """GPU index -> the window's NVML figures (:func:`aggregator.device_metrics.window_figures`)."""
    from ridgeline.aggregator import device_metrics
    out: dict = {}
    for data in (window.get("device") or {}).values():
        recs = data.get("devices") if isinstance(data, dict) else None
        if isinstance(recs, list):
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


def phase_lines(g: dict, width: int) -> list[Text]:
    """The phase table, heaviest phase first: the report's columns in its units."""
    rows = sorted((g.get("phases") or {}).items(), key=lambda kv: -(kv[1].get("kernel_time_ns") or 0))
    if not rows:
        return []
    wide = width >= 110
    out = [Text(_PHASE_HEAD + ("   TB/s of peak  TFLOP/s of peak" if wide else ""), style="bold")]
    for ph, f in rows:
        t = Text(f"  {ph[:8]:<8} {_num(f.get('time_share_pct'), digits=0, unit='%'):>5} "
                 f"{_num(f.get('achieved_bytes_per_s'), 1e-12, 2):>6} {_num(f.get('pct_of_peak_bytes'), digits=0, unit='%'):>6} "
                 f"{_num(f.get('achieved_flops_per_s'), 1e-12, 1):>8} {_num(f.get('pct_of_peak_flops'), digits=0, unit='%'):>6} "
                 f"{_num(f.get('arithmetic_intensity')):>7}  {str(f.get('verdict') or '-'):<13}")
        if wide:
            t.append("  ")
            pb, pf = f.get("pct_of_peak_bytes"), f.get("pct_of_peak_flops")
            t.append_text(bar(None if pb is None else pb / 100))
            t.append("   ")
            t.append_text(bar(None if pf is None else pf / 100))
        out.append(t)
    return out


def engine_lines(engine: dict) -> list[tuple[int, Text]]:
    """Per endpoint: KV against the alert line with the batch, then the latency percentiles."""
    out: list[tuple[int, Text]] = []
    for ep, e in engine_records(engine):
        kv = e.get("kv_usage_ratio")
        t = Text(f"engine {ep}  KV ")
        t.append_text(bar(kv, width=10, mark=KV_ALERT_RATIO))
        t.append(f" {_num(kv, 100, 1, '%')}")
        kv_max = e.get("kv_usage_max_ratio")
        if isinstance(kv_max, (int, float)) and kv_max != kv:
            # The verdict weighs the window's highest usage: shown beside the latest.
            t.append(f" (max {_num(kv_max, 100, 1, '%')})")
        t.append(f"  running {_num(e.get('num_running_requests'), digits=0)}")
        cap = e.get("max_running_requests")
        if isinstance(cap, (int, float)):
            t.append(f"/{cap:.0f}")
        t.append(f" waiting {_num(e.get('num_waiting_requests'), digits=0)}"
                 f" swapped {_num(e.get('num_swapped_requests'), digits=0)}")
        if isinstance(kv, (int, float)) and kv >= KV_ALERT_RATIO:
            t.append("  KV ALERT", style="bold red")
        out.append((1, t))
        out.append((2, Text(f"  queue p50 {quantile_text(e, 'queue_time', 'p50')} p99 {quantile_text(e, 'queue_time', 'p99')}"
                            f"  TTFT p50 {quantile_text(e, 'ttft', 'p50')} p99 {quantile_text(e, 'ttft', 'p99')}"
                            f"  ITL p50 {quantile_text(e, 'itl', 'p50')} p99 {quantile_text(e, 'itl', 'p99')}")))
    shown = {ep for ep, _ in engine_records(engine)}
    for ep, err in engine_failures(engine).items():
        if ep not in shown:
            out.append((1, Text(f"engine {ep}: not answering: {err}", style="bold red")))
    return out


def _gpu_title(g: dict) -> str:
    span = g.get("span_ns") or 0
    busy = (g.get("busy_ns", 0) / span) if span else None
    pid = g.get("pid")
    launch = (g.get("launch") or {}).get("p50_ns")
    return (f"GPU {g.get('device')} {g.get('gpu') or ''}  pid {pid if isinstance(pid, int) and pid >= 0 else '?'}"
            f"  [{g.get('source', '')}]  busy {_num(busy, 100, 0, '%')}  kernels {g.get('kernels', 0):,}"
            f"  launch call p50 {_num(launch, 1e-3, 1, ' us')}")


def _verdict_head(rec: dict | None, hist) -> Text:
    spark = sparkline([p for _, p in hist] if hist else [])
    t = Text(f"{spark:>12} " if hist else "")
    if rec is None:
        t.append("verdict: -", style="dim")
        return t
    pct = pressure_pct(rec)
    t.append(answer_lines(rec)[0].split(": ", 1)[-1], style="bold")
    if pct is not None:
        t.append(f"  [{_FACE_ABBREV.get(rec.get('face'), '?')} {pct:.0f}%]")
    return t


def _agent_line(a: dict, state: TopState) -> Text:
    probes = a.get("probes") or {}
    drops = sum(int(c.get("drops", 0) or 0) for c in probes.values() if isinstance(c, dict))
    return Text(f"agent: {_num(a.get('cpu_pct'), digits=1, unit='% CPU')}, RSS {_num(a.get('rss_bytes'), 1 / 2**20, 0)} MiB,"
                f" probe drops {drops}, stream drops {a.get('publisher_drops', 0)}, gaps {sum(state.gaps.values())}"
                + (f", restarts {state.restarts}" if state.restarts else ""), style="dim")


def _header(window: dict, state: TopState) -> Text:
    sources = window.get("sources") or []
    head = Text(f"ridgeline top  {window.get('host', '')}  window {(window.get('duration_ns') or 0) / 1e9:.2f} s"
                f"  #{state.windows}", style="bold")
    if any(s in ("simulated", "replay") or "sim" in s for s in sources):
        head.append(f"  {'/'.join(s.upper() for s in sources)} DATA", style="bold magenta")
    return head


def _pair_lines(g: dict, rec: dict | None, hist, device: dict | None, width: int) -> list[tuple[int, Text]]:
    """The first GPU/process in full: title, verdict with sparkline, the other faces (the
    reasons after the first go early), the phase table, the device."""
    lines: list[tuple[int, Text]] = [(1, Text(_gpu_title(g))), (0, _verdict_head(rec, hist))]
    for line in answer_lines(rec)[1:] if rec else []:
        lines.append((3 if line.lstrip().startswith("because") else 1, Text(line)))
    lines += [(2 if j < 2 else 3, t) for j, t in enumerate(phase_lines(g, width))]
    lines += [(2 if j == 0 else 3, t) for j, t in enumerate(device_lines(device))]
    return lines


def _no_pair_lines(window: dict, verdicts: dict) -> list[tuple[int, Text]]:
    lines = [(0, Text("no GPU events in this window" if not window.get("gpus") else
                      "no GPU/process matches the selection (g / p to change)", style="dim"))]
    engine_only = verdicts.get((None, None))
    if engine_only is not None:
        lines += [(1, Text(x)) for x in answer_lines(engine_only)]
    return lines


def _requests_line(req) -> list[tuple[int, Text]]:
    if not (isinstance(req, dict) and req.get("requests")):
        return []
    return [(4, Text(f"requests {req['requests']} joined; decode dragged {req.get('dragged_share_ratio') or 0:.0%};"
                     f" p99 e2e {(req.get('e2e_p99_ns') or 0) / 1e9:.2f} s  (ridgeline requests)"))]


def _stragglers_lines(s) -> list[tuple[int, Text]]:
    """Issue 23's one line per TP group, from the window's typed ``stragglers`` record."""
    from .straggler_view import stragglers_lines
    try:
        typed = None if s is None else msgspec.convert(s, WindowStragglers)
    except msgspec.ValidationError as exc:      # a producer's bug, said in one line
        return [(2, Text(f"stragglers record not readable: {exc}", style="bold red"))]
    return [(2, t) for t in stragglers_lines(typed)]


def frame_lines(window: dict, state: TopState, view: ViewState, width: int) -> list[tuple[int, Text]]:
    """Every line of the frame with its priority (0 always shown; higher goes first)."""
    lines: list[tuple[int, Text]] = [(0, _header(window, state))]
    verdicts = {(r.get("device"), r.get("pid")): r for r in verdict_records(window.get("verdict"))}
    pairs = view.pick(window.get("gpus") or [], verdicts)
    if not pairs:
        lines += _no_pair_lines(window, verdicts)
    devices = _device_figures(window)
    for i, g in enumerate(pairs):
        key = (g.get("device"), g.get("pid"))
        if i == 0:
            lines += _pair_lines(g, verdicts.get(key), view.history.get(key), devices.get(g.get("device")), width)
        else:      # the others: one line each, below the first in full
            lines.append((3, Text(f"GPU {g.get('device')} pid {g.get('pid')}: ").append_text(
                _verdict_head(verdicts.get(key), view.history.get(key)))))
    lines += engine_lines(window.get("engine") or {})
    lines += _stragglers_lines(window.get("stragglers"))
    lines += _requests_line(window.get("requests"))
    lines.append((0, _agent_line(window.get("agent") or {}, state)))
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


def frame(window: dict, state: TopState | None = None, view: ViewState | None = None,
          width: int = 80, height: int | None = 24) -> Text:
    """The frame as one rich Text: ``height`` rows at most (the key line last), none wider
    than ``width``."""
    state = state or TopState()
    view = view or ViewState()
    rows, hidden = _fit(frame_lines(window, state, view, width), width, None if height is None else height - 1)
    keys = Text(f"{KEYS}  [{view.describe()}]", style="reverse")
    if hidden:
        keys.append(f"  +{hidden} rows hidden")
    keys.truncate(width, overflow="ellipsis")
    return Text("\n").join([*rows, keys])
