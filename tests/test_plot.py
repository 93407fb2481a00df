"""Roofline plot: both roofs, the ridge point and one point per phase, as a PNG."""
import matplotlib.pyplot as plt
import msgspec
import numpy as np
import pytest

from ridgeline.aggregator import ceilings
from ridgeline.aggregator.analysis import Analysis, GpuCeilings
from ridgeline.aggregator.plot import build_figure, plot_roofline
from ridgeline.probes.errors import InputError


def _doc():
    c = ceilings.lookup("h100-sxm")
    g = c.to_dict()
    g["ceilings_from"] = "--gpu h100-sxm"
    phase = lambda ai, f, v: {"arithmetic_intensity": ai, "achieved_flops_per_s": f, "verdict": v,  # noqa: E731
                              "work_source": "shapes", "ceiling_dtype": "bf16"}
    return msgspec.convert({"gpu": g, "phases": {"prefill": phase(400.0, 5e14, "compute-bound"),
                                                 "decode": phase(2.0, 5e12, "memory-bound"),
                                                 "unknown": {"arithmetic_intensity": None,
                                                             "achieved_flops_per_s": None}}}, Analysis)


def test_figure_has_roofs_ridge_and_phase_points():
    fig = build_figure(_doc())
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    mem = next(v for k, v in lines.items() if k.startswith("memory roof"))
    x, y = mem.get_data()
    assert np.allclose(y, x * 3.35e12)
    comp = next(v for k, v in lines.items() if k.startswith("compute roof bf16"))
    assert np.allclose(comp.get_ydata(), 989.4e12)
    ridge = next(v for k, v in lines.items() if k.startswith("ridge point"))
    assert ridge.get_xdata()[0] == pytest.approx(989.4e12 / 3.35e12)
    pts = [k for k in lines if k.startswith(("prefill:", "decode:"))]
    assert len(pts) == 2 and not any(k.startswith("unknown") for k in lines)
    assert fig.axes[0].get_xscale() == "log" and fig.axes[0].get_yscale() == "log"
    plt.close(fig)


def test_png_written(tmp_path):
    out = plot_roofline(_doc(), tmp_path / "r.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_errors(tmp_path):
    doc = _doc()
    with pytest.raises(InputError, match="cannot write"):
        plot_roofline(doc, tmp_path / "missing" / "r.png")
    doc.gpu = GpuCeilings(ceilings_from="device 'X' is not in the ceilings table")
    with pytest.raises(InputError, match="not in the ceilings table"):
        plot_roofline(doc, tmp_path / "r.png")


def test_close_phases_labels_do_not_overprint():
    """Issue 24.7: the demo's roofline.png printed "prefill" over "mixed". The figures are
    the demo's own (report.txt of `make demo`: prefill 444 FLOP/B at 510 TFLOP/s, 0% of GPU
    time; decode 11.4 at 26.9, 91%; mixed 381 at 495, 9%)."""
    doc = msgspec.to_builtins(_doc())
    mk = lambda ai, f, v, share: {"arithmetic_intensity": ai, "achieved_flops_per_s": f,  # noqa: E731
                                  "verdict": v, "work_source": "model", "ceiling_dtype": "bf16",
                                  "time_share_pct": share}
    doc["phases"] = {"prefill": mk(444.4, 510.4e12, "compute-bound", 0.07),
                     "decode": mk(11.4, 26.9e12, "memory-bound", 90.6),
                     "mixed": mk(381.1, 495.3e12, "compute-bound", 9.4)}
    fig = build_figure(msgspec.convert(doc, Analysis))
    ax = fig.axes[0]
    r = fig.canvas.get_renderer()
    boxes = {t.get_text(): t.get_window_extent(r) for t in ax.texts}
    assert set(boxes) == {"prefill", "decode", "mixed"}
    names = sorted(boxes)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not boxes[a].overlaps(boxes[b]), (a, b)
        assert not boxes[a].overlaps(ax.get_legend().get_window_extent(r)), a
    # marker area carries the time share
    size = {ln.get_label().split(":")[0]: ln.get_markersize() for ln in ax.get_lines() if ":" in ln.get_label()}
    assert size["prefill"] < size["mixed"] < size["decode"]
    plt.close(fig)
