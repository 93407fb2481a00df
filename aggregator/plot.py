"""Roofline plot (PNG) of an analysis (:class:`aggregator.analysis.Analysis`), with matplotlib's Agg backend.

:func:`plot_roofline` draws, log-log, the memory roof (bytes/s x intensity) and the
compute roof (peak FLOP/s of the dtype the phases ran), the ridge point where they meet,
and one point per phase that has FLOP and byte figures, labelled with its verdict.
Raises :class:`InputError` when the GPU has no ceilings or the file cannot be written.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # no display on servers; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ridgeline.probes.errors import InputError  # noqa: E402

from .analysis import Analysis  # noqa: E402

PHASE_COLORS = {"prefill": "tab:green", "decode": "tab:blue", "mixed": "tab:purple",
                "other": "tab:gray", "unknown": "tab:orange"}


def plot_roofline(doc: Analysis, path: str | Path, title: str | None = None) -> Path:
    """Write the roofline PNG of ``doc`` to ``path`` and return the path."""
    fig = build_figure(doc, title)
    out = Path(path)
    from ridgeline.probes.output_file import open_output
    try:
        with open_output(out, "plot") as f:      # never through another user's link
            fig.savefig(f, format="png", bbox_inches="tight")
    except OSError as exc:
        raise InputError(f"{out}: cannot write plot: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return out


def marker_size(share_pct: float | None) -> float:
    """Marker diameter (points) whose area grows with the phase's share of GPU time: 5 for
    none, 22 for all of it."""
    if share_pct is None:
        return 9.0
    return 5.0 + 17.0 * float(np.sqrt(min(max(share_pct, 0.0), 100.0) / 100.0))


# Offsets (points) tried in turn for a phase label: right-above, right-below, left-above,
# left-below, then further out.
_LABEL_OFFSETS = [(8, 6), (8, -14), (-8, 6), (-8, -14), (8, 20), (8, -28), (-8, 20), (-8, -28), (8, 34), (8, -42)]


def place_labels(fig, ax, points: list[tuple[str, float, float, float]]) -> list:
    """Label each phase point where its text overlaps no other label and no legend: the
    first free offset of :data:`_LABEL_OFFSETS`, measured on the rendered figure (two
    phases at nearly the same intensity and FLOP/s, as prefill and mixed often are, got
    one label printed over the other). ``points``: (name, x, y, marker diameter in points);
    the offsets start at the marker's edge. Returns the annotations."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    taken = []
    leg = ax.get_legend()
    if leg is not None:
        taken.append(leg.get_window_extent(renderer))
    out = []
    for name, x, y, ms in points:
        ann = None
        r = max(ms / 2.0 - 4.0, 0.0)
        for dx, dy in _LABEL_OFFSETS:
            if ann is not None:
                ann.remove()
            ann = ax.annotate(name, (x, y), textcoords="offset points", fontsize=9,
                              xytext=(dx + (r if dx > 0 else -r), dy + (r if dy > 0 else -r)),
                              ha="left" if dx > 0 else "right", zorder=7)
            box = ann.get_window_extent(renderer)
            if not any(box.overlaps(t) for t in taken):
                break
        taken.append(ann.get_window_extent(renderer))
        out.append(ann)
    return out


def build_figure(doc: Analysis, title: str | None = None):
    """The roofline figure; lines carry labels ``memory roof``, ``compute roof <dtype>``,
    ``ridge point``, and one ``<phase>: ...`` marker per phase with figures."""
    g = doc.gpu
    if not g.has_ceilings:
        raise InputError(f"cannot plot a roofline: {g.ceilings_from}")
    bw = float(g.hbm_bytes_per_s)
    pts = [(n, p) for n, p in doc.phases.items() if p.arithmetic_intensity and p.achieved_flops_per_s]
    dtypes = {p.ceiling_dtype for _, p in pts} - {None} or {"bf16"}
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    ais = [p.arithmetic_intensity for _, p in pts]
    lo = min([0.05] + [a / 4 for a in ais])
    hi = max([1e4] + [a * 4 for a in ais])
    x = np.logspace(np.log10(lo), np.log10(hi), 400)
    # The memory roof ends where the highest compute roof begins: above it no kernel can go.
    top_peak = max((g.flops_per_s.get(dt) or g.flops_per_s.get("bf16") or 0.0) for dt in dtypes)
    xm = x[x * bw <= top_peak] if top_peak else x
    if top_peak:
        xm = np.concatenate([xm, [top_peak / bw]])
    ax.plot(xm, xm * bw, color="black", lw=1.5, ls="-", label=f"memory roof {bw / 1e12:.2f} TB/s")
    for dt in sorted(dtypes):
        peak = g.flops_per_s.get(dt) or g.flops_per_s.get("bf16")
        ridge = peak / bw
        xs = x[x >= ridge]
        ax.plot(np.concatenate([[ridge], xs]), np.full(len(xs) + 1, peak), color="black", lw=1.5,
                ls="--", label=f"compute roof {dt} {peak / 1e12:,.0f} TFLOP/s")
        ax.plot([ridge], [peak], marker="D", color="red", ms=7, zorder=5,
                label=f"ridge point {ridge:.0f} FLOP/B ({dt})")
    for name, p in pts:
        share = p.time_share_pct
        ax.plot([p.arithmetic_intensity], [p.achieved_flops_per_s], marker="o", ms=marker_size(share),
                color=PHASE_COLORS.get(name, "tab:cyan"), zorder=6, ls="none", alpha=0.85,
                label=f"{name}: {p.verdict} ({p.work_source}" +
                      (f", {share:.0f}% of GPU time)" if share is not None else ")"))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(title or f"Roofline: {g.name}", fontsize=11)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="lower right")
    # the legend's own markers at one size: the plotted size is the time share
    for h in ax.get_legend().legend_handles:
        if hasattr(h, "set_markersize"):
            h.set_markersize(min(h.get_markersize(), 8))
    place_labels(fig, ax, [(name, p.arithmetic_intensity, p.achieved_flops_per_s, marker_size(p.time_share_pct))
                           for name, p in pts])
    if not pts:
        ax.text(0.5, 0.5, "no phase has FLOP and byte figures\n(no operator shapes; try --model)",
                transform=ax.transAxes, ha="center", va="center", fontsize=10, color="gray")
    return fig
