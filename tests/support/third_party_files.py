"""Where the third-party fixtures listed in tests/THIRD_PARTY.md are found.

Plain functions without pytest, so that bench/ and scripts/ can use the same lookup as the
tests (tests/conftest.py ``third_party`` skips a test when a file is absent).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
THIRD_PARTY_DOC = "tests/THIRD_PARTY.md"


def _shared() -> Path:
    return Path(os.environ.get("RIDGELINE_SHARED", ROOT.parent / "shared"))


def third_party_candidates(rel: str) -> list[Path]:
    """Where the third-party file ``rel`` (a path relative to a third-party folder, e.g.
    ``traces/LICENSE.TraceLens``) is looked for, in order: ``$RIDGELINE_THIRD_PARTY/rel`` when
    that variable is set, then ``SHARED/third-party/rel``. Read at call time, never at import,
    so collection works whether or not the files are present. Never skips: bench/input_bounds.py
    uses it outside a test."""
    roots = [Path(v) for v in [os.environ.get("RIDGELINE_THIRD_PARTY")] if v]
    return [root / rel for root in roots + [_shared() / "third-party"]]


def third_party_missing(rel: str) -> str:
    """One line saying that ``rel`` is absent and where it was looked for."""
    tried = " or ".join(str(p) for p in third_party_candidates(rel))
    return (f"third-party file {rel} not present (looked for {tried}; set RIDGELINE_THIRD_PARTY; "
            f"{THIRD_PARTY_DOC} says where it comes from)")


def third_party_path(rel: str) -> Path | None:
    """The first existing candidate for ``rel``, or None."""
    return next((p for p in third_party_candidates(rel) if p.exists()), None)


DOC = Path(__file__).resolve().parent.parent / "THIRD_PARTY.md"


def listed_sha256() -> dict[str, str]:
    """The ``sha256sum`` block of tests/THIRD_PARTY.md: path under third-party/ -> digest."""
    return {path: digest for digest, path in re.findall(r"^([0-9a-f]{64})  (\S+)$", DOC.read_text(), re.M)}


# The TraceLens serving-engine traces (tests/test_phases_serving_traces.py), by name.
SGLANG_DECODE = "tracelens_mi300_sglang_qwen3_8b_decode.json.gz"
SGLANG_EXTEND = "tracelens_mi300_sglang_qwen3_8b_extend.json.gz"
VLLM_DECODE = "tracelens_mi300_vllm_gptoss_decode_full.json.gz"
VLLM_MIXED = "tracelens_mi300_vllm_gptoss_mixed_piecewise.json.gz"
SERVING = [SGLANG_DECODE, SGLANG_EXTEND, VLLM_DECODE, VLLM_MIXED]
