"""Kernel names are peer text: every regex applied to them runs in time linear in the name.

Issue 18.1: a 4 kB name built to match the start of the ``fmhaSm...Kernel...`` signatures
took Python's backtracking ``re`` seconds (``fmhaSm1Kernel`` x300: 2.5 s for one pattern),
and ``StreamPhaser.classes()`` re-classified the whole table each time it grew, on the
agent's main loop. The signatures now run on RE2 (no backtracking), each name is classified
once, and these tests fail on the old code (the fuzz run and the analyze run exceed their
bounds by far; the classification count is quadratic).

The bounds below are hang bounds (tens of times what the run takes), not speed targets.
"""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import re2
from support import adversarial_names as A

from ridgeline.aggregator import signatures as S
from ridgeline.aggregator import stream_phases
from ridgeline.aggregator.stream_phases import StreamPhaser
from ridgeline.probes.events import KERNEL_DTYPE, NameTable, Trace, empty

ROOT = Path(__file__).resolve().parent.parent


def test_every_name_pattern_is_compiled_by_re2():
    """The engine is the guarantee: RE2 compiles every table pattern and every helper."""
    for s in S.load_signatures():
        for p in (s.pattern, s.causal_pattern):
            if p:
                assert isinstance(S.name_regex(p), re2._Regexp), s.id
    for rx in [S._SOFTMAX_LOG2, S._GRID_IN_WORK_ITEMS, S._TRAITS_BLOCK_M, S._TEMPLATE_NAME, *S._TILE_PATTERNS]:
        assert isinstance(rx, re2._Regexp)


def test_a_signatures_file_with_look_behind_is_refused_in_one_line(tmp_path):
    f = tmp_path / "sigs.toml"
    f.write_text('[[signature]]\nid = "x"\npattern = \'(?<!fb)gemm\'\nrole = "gemm"\nphase = "neutral"\n'
                 'strength = "weak"\nlabel = "x"\nsource = "x"\n')
    with pytest.raises(S.InputError, match=r"bad pattern \(RE2 syntax, no look-around"):
        S.load_signatures(f)


@pytest.mark.parametrize("name, fbgemm", [("fbgemm_gpu::split_embedding_codegen_forward", True),
                                          ("FBGEMM::bounds_check", True), ("void gemm_kernel<float>", False),
                                          ("gemm", False), ("xgemm", False), ("fbxgemm", False),
                                          ("ampere_sgemm_128x64_tn", False)])
def test_gemm_without_look_behind_keeps_the_fbgemm_exclusion(name, fbgemm):
    """The table's one look-behind, ``(?i)(?<!fb)gemm``, rewritten for RE2: same answers."""
    import re
    gemm = next(s for s in S.load_signatures() if s.id == "gemm")
    old = re.compile(r"(?i)(?<!fb)gemm|nvjet|Cijk_|^bmm_|matmul_ogs|cutlass.*tensorop|xmma_")
    assert bool(S.name_regex(gemm.pattern).search(name)) == bool(old.search(name)) == (not fbgemm)


def test_re2_and_the_old_engine_classify_every_real_name_alike(trace_path):
    """Every kernel name of the shared real traces: same first signature under RE2 as
    under Python's re (the translation keeps the table's meaning)."""
    import gzip
    import json
    import re
    names = set()
    for rel in ("nvidia-inference/tracelens_b200_vllm_gptoss_tp8_prefill888.json.gz",
                "nvidia-inference/tracelens_h100_hf_qwen1.5-0.5b_forward_bs16_seq559.json.gz",
                "nvidia-training/hta_a100_rank0_training.json.gz"):
        with gzip.open(trace_path(rel), "rt") as fh:
            names.update(e["name"] for e in json.load(fh)["traceEvents"] if isinstance(e.get("name"), str))
    sigs = S.load_signatures()
    old = [re.compile(s.pattern.replace("(?:^|^[\\s\\S]|[^f][\\s\\S]|[\\s\\S][^b])gemm", "(?<!fb)gemm"))
           for s in sigs]
    for n in names:
        a = next((k for k, rx in enumerate(old) if rx.search(n)), -1)
        b = next((k for k, s in enumerate(sigs) if S.name_regex(s.pattern).search(n)), -1)
        assert a == b, n


FUZZ = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from support import adversarial_names as A
from ridgeline.aggregator.signatures import classify_kernels, load_signatures, short_name
from ridgeline.probes.events import KERNEL_DTYPE, NameTable, Trace, empty
sigs = load_signatures()
names = A.corpus([p for s in sigs for p in (s.pattern, s.causal_pattern) if p], int(sys.argv[2]))
# and the nested-star family at 16 kB (a demangled name may reach 64 kB)
names += [n for s in sigs if s.id.startswith("trtllm_gen_fmha") for n in A.names_for(s.pattern, int(sys.argv[3]))]
names = list(dict.fromkeys(names))
t = NameTable(names)
k = empty(KERNEL_DTYPE, len(names))
k["name_id"] = np.arange(len(names))
t0 = time.perf_counter()
kc = classify_kernels(Trace(kernels=k, names=t))
for n in names:
    short_name(n)
print(len(names), sum(map(len, names)), time.perf_counter() - t0)
"""


def test_fuzz_every_signature_with_adversarial_4k_names():
    """Every signature (and the tile/softmax/traits helpers), each with names built to match
    its start: about 1,100 names of 4 kB and the fmha family's at 16 kB, classified in about
    a second with RE2; the old engine took 9 s for the 4 kB corpus (2.5 s for one fmha name)
    and, cubic in the name, minutes for one of 16 kB. Run in a child so the old code fails at
    the bound instead of holding the suite."""
    try:
        r = subprocess.run([sys.executable, "-c", FUZZ, str(ROOT / "tests"), "4096", "16384"],
                           capture_output=True,
                           text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("classifying the adversarial names ran past 60 s (backtracking)")
    assert r.returncode == 0, r.stderr
    n, chars, _ = r.stdout.split()
    assert int(n) > 1000 and int(chars) > 4_000_000


def test_stream_phaser_classifies_each_name_once(monkeypatch):
    """A table growing by one name per batch: each name is matched once (it was
    re-classified whole at every growth: 20,300 names matched for 200)."""
    matched = []
    real = stream_phases.classify_kernels

    def counting(trace, *a, **kw):
        matched.append(len(trace.kernels))
        return real(trace, *a, **kw)
    monkeypatch.setattr(stream_phases, "classify_kernels", counting)
    names = NameTable()
    ph = StreamPhaser(names)
    for i in range(200):
        names.intern(f"void flash_fwd_kernel<{i}>(Flash_fwd_params)" if i % 2 else f"ampere_sgemm_{i}x64_tn")
        kc = ph.classes(np.array([i, -1, i + 5]))
        assert kc.role[0] in (S.ROLE_ATTENTION, S.ROLE_GEMM) and kc.role[1] == kc.role[2] == S.ROLE_NONE
    assert sum(matched) == 200 * 2           # each new name once, plus the "no name" row per call
    # the answers equal a classification of the whole table at once
    k = empty(KERNEL_DTYPE, len(names))
    k["name_id"] = np.arange(len(names))
    whole = S.classify_kernels(Trace(kernels=k, names=names))
    got = ph.classes(np.arange(len(names)))
    for f in ("sig", "role", "hint", "tile_out", "tile_tok", "causal"):
        assert np.array_equal(getattr(got, f), getattr(whole, f)), f


def test_analyze_a_trace_of_adversarial_names_stays_fast(tmp_path):
    """`analyze` on a Kineto trace whose kernels carry the adversarial names (about 400 kB
    of names): the issue saw 57 s for 193 kB; a bound of 90 s here, where it now takes
    the command's start-up plus well under a second of matching."""
    sigs = S.load_signatures()
    names = [n for s in sigs if s.id.startswith("trtllm_gen_fmha") for n in A.names_for(s.pattern, 4096)]
    names += A.corpus([s.pattern for s in sigs], 1024)[:200]
    f = tmp_path / "adversarial.json"
    f.write_text(A.kineto_trace(names))
    try:
        r = subprocess.run([sys.executable, "-m", "ridgeline", "analyze", str(f), "--json"], cwd=ROOT,
                           capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("analyze of adversarial names ran past 90 s (backtracking)")
    assert r.returncode == 0, r.stderr[-500:]
    assert '"kernels"' in r.stdout
