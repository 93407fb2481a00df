"""A GEMM width estimated from the launch grid x the tile of the kernel name cannot pass
for a vocabulary-wide LM head when it is a token-tile count times a narrow N.

Real case (third-party, tests/THIRD_PARTY.md): the OWLv2 detection transformer (H100, kernels only)
projects its 5184 vision tokens with [5184, 1024] x [1024, 768] on
``sm90_xmma_gemm_..._tilesize256x128x64`` grid [126,1,1]; read as 126 x 256 = 32256 output
columns it passed for an LM head in any stretch of the forward without the patch
convolution (a live window closing mid-forward), and the stretch came out prefill.
"""
from __future__ import annotations

import numpy as np
from conftest import third_party

from ridgeline.aggregator.phases import PREFILL, _gemm_rows, _gemm_width, map_phases
from ridgeline.aggregator.signatures import ROLE_GEMM, classify_kernels
from ridgeline.probes.events import NameTable, Trace
from ridgeline.probes.kineto import load_trace

OWLV2 = "traces/tracelens_h100_owlv2_zero_shot_detection.json.gz"      # third_party(OWLV2)
H100 = ["traces/tracelens_h100_bert_small_fill_mask.json.gz", "traces/tracelens_h100_vit_image_classification.json.gz",
        "traces/tracelens_h100_timesformer_video_classification.json.gz", OWLV2]
CUTLASS2_256x128 = ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_256x128_64x3_tn_align2>"
                    "(cutlass_80_tensorop_bf16_s16816gemm_bf16_256x128_64x3_tn_align2::Params)")


def _owlv2_stretch(rename_to: str | None = None) -> Trace:
    """Kernels only, in time order: the 100 kernels before the first vision projection and
    the 20 after it (text-tower eager attention, the vision tower's last layer norms over
    5185 and 5184 rows, the projection), as a window closing mid-forward would hold them."""
    t = load_trace(third_party(OWLV2))
    k = t.kernels[np.argsort(t.kernels["start_ns"], kind="stable")]
    proj = next(i for i in range(len(t.names)) if t.names[i].startswith("sm90_xmma") and "tilesize256x128" in t.names[i])
    at = int(np.flatnonzero(k["name_id"] == proj)[0])
    frag = k[at - 100:at + 20].copy()
    names = t.names
    if rename_to is not None:
        names = NameTable([t.names[i] for i in range(len(t.names))])
        frag["name_id"][frag["name_id"] == proj] = names.intern(rename_to)
    return Trace(kernels=frag, names=names, devices=t.devices)


def test_persistent_sm90_gemm_grid_gives_no_width():
    """Hopper sm90_xmma GEMMs launch at most one block per SM (132 on an H100), looping over
    tiles: on the real H100 traces 852 of their 857 launches linked to an operator match
    neither reading of the tile (first side over N, or over M); the other 5 are the OWLv2
    projection, whose 126 blocks are 21 x 6 tiles with the 256 side over the 5184 rows, not
    over N (so 126 x 256 is no width either). No width is estimated from them."""
    mismatched = checked = 0
    first_side_over_rows = 0
    for name in H100:
        tr = load_trace(third_party(name))
        kc = classify_kernels(tr)
        rows, _, _, _, cols = _gemm_rows(tr)
        est, from_grid = _gemm_width(tr, kc, np.full(len(tr.kernels), -1, dtype=np.int64))
        k = tr.kernels
        sm90 = np.array([tr.names[int(i)].startswith("sm90_xmma") for i in k["name_id"].tolist()])
        sel = np.flatnonzero(sm90 & (kc.role == ROLE_GEMM) & (rows > 0) & (cols > 0))
        for i in sel.tolist():
            a, b = int(kc.tile_out[i]), int(kc.tile_tok[i])
            m, n = int(rows[i]), int(cols[i])
            blocks = int(k["grid_x"][i]) * int(k["grid_y"][i])
            mismatched += blocks not in (-(-n // a) * -(-m // b), -(-n // b) * -(-m // a))
            first_side_over_rows += a != b and blocks == -(-m // a) * -(-n // b)
            checked += 1
        assert not from_grid[sm90].any() and (est[sm90] == -1).all(), name
    assert (checked, mismatched, first_side_over_rows) == (857, 852, 5)


def test_owlv2_stretch_without_the_convolution_is_not_prefill():
    pm = map_phases(_owlv2_stretch(), use_annotations=False)
    assert pm.steps and not (pm.kernel_phase == PREFILL).any(), [s.evidence[:3] for s in pm.steps]
    assert not any(": LM head, " in e for s in pm.steps for e in s.evidence)


def test_grid_width_over_many_token_tiles_is_not_an_lm_head():
    """The same stretch with the projection spelled as CUTLASS 2.x's 256x128 kernel, a family
    that launches one block per tile (so the grid width is kept): the step's layer norms run
    on 5185 rows, 41 tiles of 128, so 32256 columns can be 786 columns over all of them (the
    real N is 768): not decoder evidence, and the stretch is not prefill."""
    pm = map_phases(_owlv2_stretch(CUTLASS2_256x128), use_annotations=False)
    assert pm.steps and not (pm.kernel_phase == PREFILL).any(), [s.evidence[:3] for s in pm.steps]
    ev = " | ".join(e for s in pm.steps for e in s.evidence)
    assert ("32256 columns from its launch grid and tile, but the step runs on 5185 rows per GEMM (over 41 tiles "
            "of 128): as likely 786 columns over all of them; not decoder evidence") in ev, ev
    assert ": LM head, " not in ev
