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
    for i, (name, p) in enumerate(pts):
        ax.plot([p.arithmetic_intensity], [p.achieved_flops_per_s], marker="o", ms=9,
                color=PHASE_COLORS.get(name, "tab:cyan"), zorder=6, ls="none",
                label=f"{name}: {p.verdict} ({p.work_source})")
        ax.annotate(name, (p.arithmetic_intensity, p.achieved_flops_per_s),
                    textcoords="offset points", xytext=(6, 6 if i % 2 == 0 else -14), fontsize=9)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(title or f"Roofline: {g.name}", fontsize=11)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="lower right")
    if not pts:
        ax.text(0.5, 0.5, "no phase has FLOP and byte figures\n(no operator shapes; try --model)",
                transform=ax.transAxes, ha="center", va="center", fontsize=10, color="gray")
    return fig
