"""Per-rank traces of one job read together (``ridgeline analyze DIR``).

Distributed runs (vLLM with tensor parallelism, torch.distributed training) write one
trace per rank. :func:`together` takes the per-rank analysis documents and returns
``{"directory", "ranks": [doc, ...], "together": {...}}``: the per-rank documents
unchanged, and across ranks the kernel count and kernel time summed, per phase the
kernel time and kernels summed and the verdict of each rank, each rank's GPU busy
ratio, and the slowest rank (most kernel time: the one the others wait for at each
collective). Ranks run at the same time, so their spans are not added.

Only traces of one job compare that way: :func:`not_one_job` gives the reasons a set of
traces is not one (different GPU models, different declared world sizes, more traces than
the world size they declare). Then ``together.one_job`` is False, its reasons are in
``together.not_one_job``, and no slowest rank is named (a laptop's decode step is not
the straggler of a B200 tensor-parallel group); the sums and per-trace rows remain.
"""
from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET

from ridgeline.aggregator.analysis import Analysis


class RankRow(msgspec.Struct):
    """One trace of the folder."""
    rank: Any = None                # the declared rank, or the file's position
    trace: str = ""
    kernels: int = 0
    kernel_time_ns: int = 0
    span_ns: int = 0
    busy_ratio: float | None = None
    verdicts: dict[str, str | None] = {}     # per phase


class RanksPhase(msgspec.Struct):
    """One phase across the traces: sums, and how many traces gave each verdict."""
    kernel_time_ns: int = 0
    kernels: int = 0
    ranks: int = 0
    verdicts: dict[str, int] = {}


class Together(msgspec.Struct):
    """The traces of a folder compared (see the module docstring)."""
    ranks: int = 0
    one_job: bool = True
    not_one_job: list[str] = []
    kernels: int = 0
    kernel_time_ns: int = 0
    phases: dict[str, RanksPhase] = {}
    per_rank: list[RankRow] = []
    slowest_rank: Any = None
    slowest_over_mean_ratio: float | None = None


class RankReport(msgspec.Struct):
    """``ridgeline analyze DIR``'s document: the per-rank analyses and their comparison."""
    directory: str
    ranks: list[Analysis]
    together: Together


def _name(d: Analysis, i: int) -> str:
    from pathlib import Path
    return Path(d.trace or f"trace {i}").name


def _declared(value) -> Any:
    """A declared rank or world size (UNSET: the trace declares none) as None when absent."""
    return None if value is UNSET else value


def not_one_job(docs: list[Analysis]) -> list[str]:
    """Why these per-trace documents cannot be ranks of one job (empty: they may be)."""
    out = []
    gpus: dict[str, list[str]] = {}
    for i, d in enumerate(docs):
        name = d.gpu.device_name or d.gpu.key
        if name:
            gpus.setdefault(str(name), []).append(_name(d, i))
    if len(gpus) > 1:
        out.append("different GPUs: " + "; ".join(f"{g} ({', '.join(fs)})" for g, fs in gpus.items()))
    ws = [_declared(d.world_size) for d in docs]
    declared = {w for w in ws if isinstance(w, int) and not isinstance(w, bool)}
    if len(declared) > 1:
        out.append("different world sizes: " + "/".join("none" if w is None else str(w) for w in ws))
    elif declared:
        (w,) = declared
        n = sum(1 for x in ws if x == w)
        if n > w:
            out.append(f"{n} traces declare world size {w}: more than one job's ranks")
    return out


def _busy_ratio(doc: Analysis):
    span = busy = 0
    for g in doc.idle_gaps.values():
        span += g.span_ns or 0
        busy += g.busy_ns or 0
    return busy / span if span else None


def together(directory: str, docs: list[Analysis]) -> RankReport:
    """See the module docstring."""
    rows = []
    phases: dict[str, RanksPhase] = {}
    declared = [_declared(d.rank) for d in docs]
    use_declared = None not in declared and len(set(map(str, declared))) == len(declared)
    for i, d in enumerate(docs):
        rank = declared[i] if use_declared else i    # files' order when ranks are missing or repeat
        rows.append(RankRow(rank=rank, trace=d.trace, kernels=d.kernels, kernel_time_ns=d.kernel_time_ns,
                            span_ns=d.span_ns, busy_ratio=_busy_ratio(d),
                            verdicts={n: p.verdict for n, p in d.phases.items()}))
        for name, p in d.phases.items():
            acc = phases.setdefault(name, RanksPhase())
            acc.kernel_time_ns += p.kernel_time_ns or 0
            acc.kernels += p.kernels or 0
            acc.ranks += 1
            acc.verdicts[p.verdict] = acc.verdicts.get(p.verdict, 0) + 1
    times = [r.kernel_time_ns for r in rows]
    problems = not_one_job(docs)
    slowest = max(rows, key=lambda r: r.kernel_time_ns) if rows and not problems else None
    mean = sum(times) / len(times) if times else 0
    return RankReport(directory=directory, ranks=docs, together=Together(
        ranks=len(rows), one_job=not problems, not_one_job=problems, kernels=sum(r.kernels for r in rows),
        kernel_time_ns=sum(times), phases=phases, per_rank=rows,
        slowest_rank=slowest.rank if slowest else None,
        slowest_over_mean_ratio=(slowest.kernel_time_ns / mean) if slowest and mean else None))


def render_together(doc: RankReport, console=None) -> None:
    """Terminal table of :func:`together`'s ``together`` part."""
    from rich.console import Console
    from rich.table import Table
    c = console or Console()
    t = doc.together
    what = f"{t.ranks} ranks together" if t.one_job else f"{t.ranks} traces, not one job"
    c.print(f"[bold]{doc.directory}[/bold]: {what}, {t.kernels:,} kernels, "
            f"{t.kernel_time_ns / 1e6:,.2f} ms of kernel time", markup=True, highlight=False)
    for why in t.not_one_job:
        c.print(f"not one job ({why}): ranks are not compared, no slowest rank", markup=False, highlight=False)
    tab = Table(title="Ranks", title_justify="left")
    for col in ("rank", "kernels", "kernel time", "GPU busy", "verdicts"):
        tab.add_column(col)
    for r in t.per_rank:
        busy = f"{100 * r.busy_ratio:.0f}%" if r.busy_ratio is not None else "-"
        tab.add_row(str(r.rank), f"{r.kernels:,}", f"{r.kernel_time_ns / 1e6:,.2f} ms", busy,
                    ", ".join(f"{k}: {v}" for k, v in r.verdicts.items()))
    c.print(tab)
    if t.slowest_rank is not None and t.slowest_over_mean_ratio:
        c.print(f"slowest rank: {t.slowest_rank} ({t.slowest_over_mean_ratio:.2f}x the mean kernel time)")
