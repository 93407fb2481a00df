"""The native per-kernel pass of the step cut (``rl_segment_scan`` in
aggregator/native/ridgeline_fold.c, called by aggregator.steps.segment_kernels) against its
numpy reference (``steps._scan_reference``, selected with ``fold_native.REFERENCE``): the
same gaps and kernel positions on adversarial records, and the same segmentation (step per
kernel, step spans, reasons) on the simulator's streams (the stream phaser's per-name
classes) and on the shared third-party Kineto traces (per-kernel classes; the A100
training trace exercises the optimizer rule, the B200 vLLM trace CUDA graphs)."""

import numpy as np
import pytest
from support.kineto_traces import TRACES

from ridgeline.aggregator import fold_native, steps
from ridgeline.aggregator.signatures import (
    GRID_TOKENS,
    ROLE_ATTENTION,
    ROLE_PER_TOKEN,
    STRONG,
    KernelClasses,
    classify_kernels,
)
from ridgeline.probes.events import KERNEL_DTYPE, NameTable, Trace, empty


def _random_kernels(rng, n: int, ordered: bool):
    k = empty(KERNEL_DTYPE, n)
    # a 1 us grid with 0-2 ns of jitter: gaps of 1 and 2 ns, touching and overlapping kernels
    st = rng.integers(0, 3 * n, n) * 1000 + rng.integers(0, 3, n) + 10**12
    k["start_ns"] = np.sort(st) if ordered else st
    k["end_ns"] = k["start_ns"] + rng.choice([-5, 0, 700, 2_000, 9_000_000], n)
    k["name_id"] = rng.integers(-2, 12, n)
    k["grid_x"] = rng.choice([-1, 0, 1, 32, 64], n)
    # graph launches: runs of one correlation id and graph id, ids repeating
    k["graph_id"] = np.where(rng.random(n) < 0.5, rng.integers(0, 4, n), -1)
    k["correlation_id"] = np.repeat(np.arange(n), 3)[:n] if n else k["correlation_id"]
    return k


def _random_classes(rng, n: int) -> KernelClasses:
    from ridgeline.aggregator.signatures import load_signatures
    sigs = load_signatures()
    opt = next(i for i, s in enumerate(sigs) if s.id == "optimizer")
    z = np.zeros(n, np.int64)
    return KernelClasses(
        signatures=sigs, sig=rng.choice([-1, 0, opt], n),
        role=rng.choice([0, ROLE_ATTENTION, ROLE_PER_TOKEN], n), hint=z,
        strength=rng.choice([0, STRONG], n), grid_rule=rng.choice([0, GRID_TOKENS], n), tile_min=z,
        step_end=rng.random(n) < 0.1, inference_only=z.astype(bool), tile_out=z, tile_tok=z, causal=z, block_m=z,
        grid_in_work_items=z, rows_per_block=z)


@pytest.mark.parametrize("seed", range(12))
def test_scan_equals_reference_on_adversarial_records(seed):
    """Overlapping and negative-duration kernels, unknown and out-of-range name ids, every
    flag combination, graph ids repeating within and across launches; every kernel or a
    subset (idx); starts out of order: None without idx, as the caller then sorts."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    k = _random_kernels(rng, n, ordered=bool(seed % 3))
    kc = _random_classes(rng, n)
    flags, by_name = steps._scan_flags(kc)
    assert not by_name and len(flags) == n
    opt = steps.optimizer_kernels(kc)
    idx = np.lexsort((np.arange(n), k["start_ns"]))
    if seed & 1:
        idx = idx[rng.random(n) < 0.6]
    got = fold_native.segment_scan(k, idx, flags, False)
    want = steps._scan_reference(k, idx, False, kc, opt)
    assert got is not None
    for i, (x, y) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(x, y, err_msg=f"field {i}")
    in_order = bool((k["start_ns"][1:] >= k["start_ns"][:-1]).all())
    whole = fold_native.segment_scan(k, None, flags, False)
    assert (whole is not None) == in_order
    if in_order:
        for i, (x, y) in enumerate(zip(whole, steps._scan_reference(k, np.arange(n), True, kc, opt))):
            np.testing.assert_array_equal(x, y, err_msg=f"field {i}")
    # the scan reads the flags: flipping one kernel's attention bit moves the positions
    if len(idx):
        f2 = flags.copy()
        f2[idx[0]] ^= steps.SEG_ATT
        assert not np.array_equal(fold_native.segment_scan(k, idx, f2, False)[1], got[1])


def _same_segmentation(a, b) -> None:
    np.testing.assert_array_equal(a.kernel_step, b.kernel_step)
    assert [(s.device, s.start_ns, s.end_ns, s.reasons) for s in a.segments] == \
        [(s.device, s.start_ns, s.end_ns, s.reasons) for s in b.segments]


def _both(fn, monkeypatch):
    native = fn()
    with monkeypatch.context() as m:
        m.setattr(fold_native, "REFERENCE", True)
        ref = fn()
    return native, ref


@pytest.mark.parametrize("gpus", [1, 4])
def test_stream_segmentation_equals_reference_on_simulated_streams(gpus, monkeypatch):
    """The stream phaser's cut (per-name classes, the native scan's by-name flags) of the
    simulator's batches, one GPU and four interleaved, and of the batches shuffled (the
    sort path): the same steps, spans and reasons."""
    from support.phase_traces import simulated_gpu_streams

    from ridgeline.aggregator.stream_phases import StreamPhaser
    parts = simulated_gpu_streams(gpus)
    names = parts[0].names
    k = np.concatenate([p.kernels for p in parts])
    a = np.concatenate([p.api for p in parts])
    k = k[np.argsort(k["start_ns"], kind="stable")]
    rng = np.random.default_rng(gpus)
    cuts = np.linspace(0, len(k), 9).astype(int)
    total = 0
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        for kb in (k[lo:hi], k[lo:hi][rng.permutation(hi - lo)]):
            t = Trace(kernels=kb, api=a[np.isin(a["correlation_id"], kb["correlation_id"])], names=names)
            ph = StreamPhaser(names)
            native, ref = _both(lambda: ph.segment(t)[1], monkeypatch)
            _same_segmentation(native, ref)
            total += len(native.segments)
    assert total > 8 * gpus          # steps were cut (the reasons compared are real ones)


@pytest.mark.parametrize("name", TRACES, ids=[t.split("/")[-1].split(".")[0] for t in TRACES])
def test_segmentation_equals_reference_on_shared_traces(name, trace_path, monkeypatch):
    """Whole third-party traces (per-kernel classes), every kernel and every other one (the
    masked path), and replayed through the stream phaser in eight batches."""
    from ridgeline.aggregator.stream_phases import StreamPhaser
    from ridgeline.probes.kineto import load_trace
    t = load_trace(trace_path(name))
    if not len(t.kernels):
        pytest.skip(f"{name}: no kernels")
    kc = classify_kernels(t)
    native, ref = _both(lambda: steps.segment_kernels(t, kc), monkeypatch)
    _same_segmentation(native, ref)
    assert len(native.segments) >= 1
    mask = np.arange(len(t.kernels)) % 2 == 0
    _same_segmentation(*_both(lambda: steps.segment_kernels(t, kc, mask=mask), monkeypatch))
    k = t.kernels[np.argsort(t.kernels["start_ns"], kind="stable")]
    cuts = np.linspace(0, len(k), 9).astype(int)
    ph = StreamPhaser(t.names)
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        b = Trace(kernels=k[lo:hi], names=t.names, devices=t.devices)
        _same_segmentation(*_both(lambda: ph.segment(b)[1], monkeypatch))


def test_names_unused_by_the_scan_are_never_gathered():
    """The stream phaser's classes hand the scan per-name rows; the per-kernel name slot is
    computed only when a per-kernel array is read (it was a pass over the kernels per batch)."""
    from ridgeline.aggregator.stream_phases import StreamPhaser
    names = NameTable(["flash_fwd_kernel", "reshape_and_cache_kernel"])
    k = empty(KERNEL_DTYPE, 4)
    k["name_id"] = [0, 1, -1, 7]
    kc = StreamPhaser(names).classes(k["name_id"])
    per = kc.per_name()
    assert len(per.role) == len(names) + 1 and kc._look is None
    np.testing.assert_array_equal(kc.role, per.role[[0, 1, 2, 2]])


def test_a_library_without_the_scan_is_refused_in_one_line(monkeypatch, tmp_path):
    """A library built from the previous source (every symbol but rl_segment_scan, the same
    layout) is refused as built from another version, one line saying what to build, not an
    AttributeError from ctypes at the first step cut."""
    import subprocess
    from pathlib import Path

    from ridgeline.probes.errors import RuntimeFailure
    native = Path(fold_native.__file__).parent / "native"
    src = (native / "ridgeline_fold.c").read_text()
    cut = src.index("EXPORT int64_t rl_segment_scan(")
    body_end = src.index("\n}\n", cut) + 3
    old = tmp_path / "old.c"
    old.write_text(src[:cut] + src[body_end:])
    lib = tmp_path / "libridgeline_fold.so"
    subprocess.run(["cc", "-O1", "-std=c11", "-fPIC", "-shared", "-I", str(native), "-o", str(lib), str(old)],
                   check=True)
    monkeypatch.setenv("RIDGELINE_FOLD_LIB", str(lib))
    fold_native.library.cache_clear()
    try:
        with pytest.raises(RuntimeFailure) as exc:
            fold_native.library()
        msg = str(exc.value)
        assert "another version" in msg and "rl_segment_scan" in msg and "\n" not in msg
    finally:
        fold_native.library.cache_clear()
