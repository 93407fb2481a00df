"""aggregator/native/libridgeline_fold.so, the per-kernel passes of the per-phase fold and of
the stream phaser, against their numpy references (``fold_native.REFERENCE``: phase_figures.py's
fold pass, launch join and host intervals, stream_phases.py's step-shape hash and order test):
the same sums, histograms, units, hashes and joins on adversarial records, on the simulator's
streams through the live windows, and on the shared third-party traces analysed whole and
replayed in batches."""

import msgspec
import numpy as np
import pytest
from support.kineto_traces import TRACES
from support.window_replay import fold_windows

from ridgeline.aggregator import analysis, fold_native, phase_figures
from ridgeline.aggregator.phase_figures import PhaseSums, fold_kernels, group_key, host_intervals
from ridgeline.probes.events import API_DTYPE, API_LAUNCH, API_SYNC, KERNEL_DTYPE, empty


class _Step:
    def __init__(self, phase, start_ns, end_ns):
        self.phase, self.start_ns, self.end_ns = phase, start_ns, end_ns
        self.evidence = [f"step of phase {phase}"]


def _same_sums(a: PhaseSums, b: PhaseSums) -> None:
    for f in ("keys", "ints", "floats", "hists", "dtype_flops"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    assert a.notes == b.notes and a.evidence == b.evidence


def _same_units(a, b) -> None:
    for f in phase_figures.Units.__slots__:
        if f != "gap_log2_by_group":
            np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)), err_msg=f)
    # The gaps' log2 histograms a native pass bins per group: those of the gaps themselves.
    from ridgeline.aggregator.windows import HIST_BINS, log2_bins
    for u in (a, b):
        if u.gap_log2_by_group is None:
            continue
        g_of_gap = np.asarray(u.gkey)[u.gap_unit]
        assert set(g_of_gap.tolist()) <= set(u.gap_log2_by_group)
        for gk, h in u.gap_log2_by_group.items():
            np.testing.assert_array_equal(h, np.bincount(log2_bins(u.gap_ns[g_of_gap == gk]), minlength=HIST_BINS))


def _random_fold(seed: int, groups: int):
    """Kernels that stress every rule of the pass: overlapping and nested kernels, zero and
    negative durations (end before start), kernels in no step, steps of mixed phases,
    unknown launch latencies, several groups, and launch and sync calls over the gaps."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    nsteps = int(rng.integers(1, 40))
    step = np.sort(rng.integers(-1, nsteps, n))
    start = np.empty(n, np.int64)
    t = 1_000_000_000 + int(rng.integers(0, 10**6))
    for i in range(n):                        # in (step, start) order, as the callers pass them
        if i and step[i] != step[i - 1]:
            t += int(rng.integers(0, 50_000))
        t += int(rng.choice([0, 1, 5, 200, 3_000, 40_000]))
        start[i] = t
    end = start + rng.choice([-5, 0, 1, 10, 400, 9_000, 120_000], n)
    phase = rng.integers(0, 5, n)
    # runs of one phase inside a step (a unit breaks where the phase does)
    phase = np.repeat(phase[::7], 7)[:n]
    lat = np.where(rng.random(n) < 0.1, -1, rng.integers(0, 80_000, n))
    steps = [_Step(int(rng.integers(0, 5)), int(start.min()) + 10 * j, int(start.min()) + 10 * j + 5_000_000)
             for j in range(nsteps)]
    gkey = int(group_key(0, 4242)) if groups == 1 else group_key(np.sort(rng.integers(0, groups, n)), 4242)
    na = int(rng.integers(0, 2 * n))
    a = empty(API_DTYPE, na)
    a["start_ns"] = rng.integers(int(start.min()) - 10_000, int(end.max()) + 10_000, na)
    a["end_ns"] = a["start_ns"] + rng.integers(0, 20_000, na)
    a["category"] = rng.choice([API_LAUNCH, API_SYNC], na)
    return dict(start_ns=start, end_ns=end, phase=phase, step=step, gkey=gkey, steps=steps, latency_ns=lat,
                host=host_intervals(a))


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("seed", range(12))
def test_native_pass_equals_reference(seed, groups):
    kw = _random_fold(seed, groups)
    a, b = PhaseSums(), PhaseSums()
    _same_units(fold_kernels(a, **kw), fold_kernels(b, reference=True, **kw))
    _same_sums(a, b)
    assert a.ints[:, phase_figures.I["gap_launch_ns"]].any() or not len(kw["host"][0][0])


def test_native_pass_counts_every_kernel_once():
    """Not only equal to the reference: the kernels, their time and the busy union are the
    plain sums (a pass that dropped or doubled kernels in both would still be 'equal')."""
    kw = _random_fold(3, 1)
    sums = PhaseSums()
    fold_kernels(sums, **kw)
    e = np.maximum(kw["end_ns"], kw["start_ns"])
    assert sums.ints[:, phase_figures.I["kernels"]].sum() == len(e)
    assert sums.ints[:, phase_figures.I["kernel_time_ns"]].sum() == int((e - kw["start_ns"]).sum())
    assert sums.hists[:, phase_figures.H_KERNEL].sum() == len(e)
    assert sums.hists[:, phase_figures.H_LAUNCH].sum() == int((kw["latency_ns"] >= 0).sum())


def _cuts(lo: int, hi: int, n: int) -> list[int]:
    """n + 1 integer cut points from lo to hi (float linspace rounds epoch nanoseconds)."""
    return [lo + (hi - lo) * i // n for i in range(n + 1)]


def _random_records(rng, n: int, dtype, sorted_starts: bool):
    """Records on a 1 us grid with durations of whole microseconds (and some negative
    ones), so that intervals touch, nest and overlap."""
    r = empty(dtype, n)
    st = rng.integers(1000, 1000 + 4 * n, n) * 1000
    r["start_ns"] = np.sort(st) if sorted_starts else st
    r["end_ns"] = r["start_ns"] + rng.choice([-3, 0, 1000, 2000, 7000], n)
    return r


@pytest.mark.parametrize("seed", range(16))
def test_native_joins_equal_reference(seed, monkeypatch):
    """Launch latency (records aligned with their kernels or not, ids out of order, negative
    ids) and the host's call intervals (in start order or not, launch and sync calls): native
    and reference answers are equal (the step-shape hash and the (step, start) order test
    are rl_map_runs', checked in tests/test_stream_map_native.py).
    The seed's bits choose: 1 aligned ids, 2 launch records only, 4 starts in order, 8
    negative ids."""
    from ridgeline.probes.events import API_GRAPH_LAUNCH, API_MEMCPY
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 500))
    ordered = bool(seed & 4)
    k = _random_records(rng, n, KERNEL_DTYPE, sorted_starts=ordered)
    k["correlation_id"] = np.arange(n) + 7
    if seed & 8:
        k["correlation_id"][rng.random(n) < 0.05] = -1
    k["grid_x"] = rng.integers(-2, 3000, n)
    a = _random_records(rng, n, API_DTYPE, sorted_starts=ordered)
    a["correlation_id"] = k["correlation_id"] if seed & 1 else rng.permutation(k["correlation_id"])
    a["category"] = API_LAUNCH if seed & 2 else rng.choice([API_LAUNCH, API_GRAPH_LAUNCH, API_SYNC, API_MEMCPY], n)
    native = (phase_figures.launch_latency_ns(k, a), host_intervals(a))
    with monkeypatch.context() as m:
        m.setattr(fold_native, "REFERENCE", True)
        ref = (phase_figures.launch_latency_ns(k, a), host_intervals(a))
    np.testing.assert_array_equal(native[0], ref[0])
    # the join alone (what SourceFold._ingest calls after its native pass) is that reference
    np.testing.assert_array_equal(phase_figures.launch_latency_join_ns(k, a), ref[0])
    for (xs, xe), (ys, ye) in zip(native[1], ref[1]):
        np.testing.assert_array_equal(xs, ys)
        np.testing.assert_array_equal(xe, ye)
    order = rng.permutation(n)
    # the column readers of the packed records
    np.testing.assert_array_equal(fold_native.gather(k, "start_ns", order), k["start_ns"][order])
    np.testing.assert_array_equal(fold_native.gather(a, "end_ns"), a["end_ns"])
    assert fold_native.field_range(k, "grid_x") == (int(k["grid_x"].min()), int(k["grid_x"].max()))
    assert fold_native.field_range(a[1:], "pid") == (int(a["pid"][1:].min()), int(a["pid"][1:].max()))


def _windows(batches, names, devices, reference: bool, monkeypatch) -> list:
    """The live windows of ``batches`` as builtins (close() gives typed Windows)."""
    return fold_windows(batches, names, devices, reference=reference, monkeypatch=monkeypatch, every=7,
                        encode=False)


def _simulated_batches(gpus: int):
    from support.phase_traces import simulated_gpu_streams

    from ridgeline.probes.events import Device
    parts = simulated_gpu_streams(gpus)
    k = np.concatenate([p.kernels for p in parts])
    a = np.concatenate([p.api for p in parts])
    k = k[np.argsort(k["start_ns"], kind="stable")]
    a = a[np.argsort(a["start_ns"], kind="stable")]
    cuts = _cuts(int(k["start_ns"].min()), int(k["end_ns"].max()) + 1, 39)
    batches = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        km = (k["start_ns"] >= lo) & (k["start_ns"] < hi)
        am = (a["start_ns"] >= lo) & (a["start_ns"] < hi)
        batches.append((k[km], a[am]))
    return batches, parts[0].names, [Device(d, "NVIDIA H100 80GB HBM3") for d in range(gpus)]


@pytest.mark.parametrize("gpus,records", [(1, "all"), (1, "launch"), (1, "launch+sync"), (4, "all")],
                         ids=["1gpu", "1gpu-launch-records", "1gpu-launch-and-sync-records", "4gpus"])
def test_live_windows_equal_on_simulated_streams(gpus, records, monkeypatch):
    batches, names, devices = _simulated_batches(gpus)
    if records != "all":
        # a kernel stream's API records: launches of one thread (the native histogram's
        # case), or launches and syncs (not its case)
        cats = [API_LAUNCH] + ([API_SYNC] if records == "launch+sync" else [])
        batches = [(k, a[np.isin(a["category"], cats)]) for k, a in batches]
        assert records == "launch" or any((a["category"] == API_SYNC).any() for _, a in batches)
    native = _windows(batches, names, devices, False, monkeypatch)
    ref = _windows(batches, names, devices, True, monkeypatch)
    assert sum(g["kernels"] for w in native for g in w.get("gpus", ())) == sum(len(k) for k, _ in batches)
    assert native == ref


@pytest.mark.parametrize("name", TRACES, ids=[t.split("/")[-1].split(".")[0] for t in TRACES])
def test_shared_traces_equal_analysed_and_replayed(name, trace_path, monkeypatch):
    from ridgeline.probes.kineto import load_trace
    t = load_trace(trace_path(name))
    if not len(t.kernels):
        pytest.skip(f"{name}: no kernels")
    whole = analysis.analyze_trace(t)
    with monkeypatch.context() as m:
        m.setattr(fold_native, "REFERENCE", True)
        whole_ref = analysis.analyze_trace(t)
    assert whole.phases and msgspec.to_builtins(whole.phases) == msgspec.to_builtins(whole_ref.phases)
    # The accumulator itself (a figure read from a histogram can hide a changed bin):
    # analyze's whole-trace fold, with the trace's operator shapes, native and reference.
    from ridgeline.aggregator.phases import map_phases
    from ridgeline.aggregator.roofline import phase_sums
    from ridgeline.aggregator.work import kernel_work_from_shapes
    pm = map_phases(t)
    args = (t, np.asarray(pm.kernel_phase), list(pm.steps), kernel_work_from_shapes(t))
    sums = phase_sums(*args, kernel_step=np.asarray(pm.kernel_step))
    with monkeypatch.context() as m:
        m.setattr(fold_native, "REFERENCE", True)
        sums_ref = phase_sums(*args, kernel_step=np.asarray(pm.kernel_step))
    assert len(sums)
    _same_sums(sums, sums_ref)
    # Replayed as a kernel stream (what CUPTI sends: kernels in start order with their
    # launch records, in batches cut by time) through the live windows.
    k = t.kernels[np.argsort(t.kernels["start_ns"], kind="stable")]
    a = t.api[np.argsort(t.api["start_ns"], kind="stable")] if len(t.api) else t.api
    cuts = _cuts(int(k["start_ns"].min()), int(k["end_ns"].max()) + 1, 11)
    batches = [(k[(k["start_ns"] >= lo) & (k["start_ns"] < hi)],
                a[(a["start_ns"] >= lo) & (a["start_ns"] < hi)] if len(a) else a) for lo, hi in zip(cuts[:-1], cuts[1:])]
    native = _windows(batches, t.names, t.devices, False, monkeypatch)
    assert sum(g["kernels"] for w in native for g in w.get("gpus", ())) == len(k)
    assert native == _windows(batches, t.names, t.devices, True, monkeypatch)


def test_library_layout_is_the_fold_s():
    """The layout the loader checks the library against is phase_figures.py's."""
    n = len(fold_native.WRITTEN_FIELDS)
    assert fold_native.LAYOUT == (phase_figures.SUB_BITS, phase_figures.FINE_BINS, n)
    assert phase_figures.INT_FIELDS[:n] == fold_native.WRITTEN_FIELDS
    assert fold_native.library().rl_fold_abi() == (3 << 32) | (384 << 8) | n


def test_missing_library_is_one_clear_line(monkeypatch, tmp_path):
    """No fallback: without the library the fold refuses, saying what to build, and the
    agent refuses to start (the CLI prints RuntimeFailure's one line and exits 1)."""
    from ridgeline.agent import config as config_mod
    from ridgeline.agent.daemon import Agent
    from ridgeline.probes.errors import RuntimeFailure
    monkeypatch.setenv("RIDGELINE_FOLD_LIB", str(tmp_path / "libridgeline_fold.so"))
    fold_native.library.cache_clear()
    try:
        with pytest.raises(RuntimeFailure) as exc:
            fold_kernels(PhaseSums(), **_random_fold(0, 1))
        msg = str(exc.value)
        assert "native fold library" in msg and str(tmp_path) in msg and "make -C" in msg and "\n" not in msg
        cfg = config_mod.defaults()
        cfg.publisher.endpoint = f"ipc://{tmp_path}/pub"
        cfg.prometheus.enabled = False
        with pytest.raises(RuntimeFailure, match="native fold library"):
            Agent(cfg, probes=[]).start()
    finally:
        fold_native.library.cache_clear()


@pytest.mark.parametrize("groups", [1, 3, 90])
@pytest.mark.parametrize("seed", range(8))
def test_one_pass_fold_of_records_equals_general_path_and_reference(seed, groups, monkeypatch):
    """phase_figures.fold_records (rl_fold_batch: units, gaps and row sums in one pass read
    from the packed records through the order) against the general native path (gathered
    columns, rl_fold_units + rl_fold_rows) and the numpy reference: the same units, sums,
    histograms, evidence and step log. Adversarial records as _random_fold's, shuffled in the
    batch (read through ``order``), negative pids, and up to 90 groups x 5 phases (over the
    pass's first 8 rows: passed again with more room)."""
    kw = _random_fold(seed, 1)
    n = len(kw["start_ns"])
    rng = np.random.default_rng(100 + seed)
    perm = rng.permutation(n)                  # record perm[q] holds the q-th kernel in order
    k = empty(KERNEL_DTYPE, n)
    k["start_ns"][perm], k["end_ns"][perm] = kw["start_ns"], kw["end_ns"]
    dev = np.sort(rng.integers(0, groups, n)) if groups > 1 else np.zeros(n, np.int64)
    k["device"][perm] = dev % 8
    k["pid"][perm] = np.where(dev % 2, -4242 - dev, 4242 + dev)
    phase = np.empty(n, np.uint8)
    step = np.empty(n, np.int64)
    lat = np.empty(n, np.int64)
    phase[perm], step[perm], lat[perm] = kw["phase"], kw["step"], kw["latency_ns"]
    out = []
    for how in ("one-pass", "general", "reference"):
        with monkeypatch.context() as m:
            if how == "general":                   # every fold over the pass's rows
                m.setattr(fold_native, "BATCH_ROWS", 0)
                m.setattr(fold_native, "BATCH_ROWS_MAX", 0)
            sums, log = PhaseSums(), []
            u = phase_figures.fold_records(sums, k, perm, phase=phase, step=step, steps=kw["steps"], latency_ns=lat,
                                           host=kw["host"], on_steps=lambda s, g: log.extend(zip(s, g.tolist())),
                                           reference=how == "reference")
            out.append((u, sums, log))
    (u1, s1, l1), (u2, s2, l2), (u3, s3, l3) = out
    for u, s, lg in ((u2, s2, l2), (u3, s3, l3)):
        _same_units(u1, u)
        _same_sums(s1, s)
        assert l1 == lg
    assert s1.ints[:, phase_figures.I["kernels"]].sum() == n
    assert groups < 90 or len(s1) > fold_native.BATCH_ROWS     # the pass was run again with more rows


@pytest.mark.parametrize("seed", range(6))
def test_host_intervals_one_pass_equals_reference_when_one_kind_is_out_of_order(seed, monkeypatch):
    """rl_host_unions reads both kinds of host call in one pass: launches in start order
    with sync calls in order (merged, touching, nested) or not (seed odd: one sync call
    moved back), other calls interleaved anywhere; the answer is the reference's."""
    from ridgeline.probes.events import API_GRAPH_LAUNCH, API_MEMCPY
    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 400))
    a = _random_records(rng, n, API_DTYPE, sorted_starts=True)
    a["category"] = rng.choice([API_LAUNCH, API_GRAPH_LAUNCH, API_MEMCPY, API_SYNC, 0], n)
    sync = np.flatnonzero(a["category"] == API_SYNC)
    if seed & 1 and len(sync) > 2:
        a["start_ns"][sync[-1]] = a["start_ns"][sync[0]] - 1
    native = host_intervals(a)
    with monkeypatch.context() as m:
        m.setattr(fold_native, "REFERENCE", True)
        ref = host_intervals(a)
    for (xs, xe), (ys, ye) in zip(native, ref):
        np.testing.assert_array_equal(xs, ys)
        np.testing.assert_array_equal(xe, ye)
    assert len(ref[1][0]) and len(ref[0][0])


@pytest.mark.parametrize("seed", range(16))
def test_ingest_pass_equals_the_separate_passes_and_reference(seed):
    """rl_ingest_pass (the batch's device range, launch-call histogram and aligned launch
    latency in one pass) against each on its own: field_range, SourceFold._ingest's general
    path (windows.api_call_figures) and the reference join (launch_latency_join_ns); records aligned or not, launches only or mixed
    calls, one thread or two, as many API records as kernels or not, none of either. The
    seed's bits choose: 1 aligned ids, 2 launch records only, 4 two threads, 8 fewer records."""
    from ridgeline.aggregator.windows import _API_WHAT_U8
    from ridgeline.probes.events import API_GRAPH_LAUNCH, API_MEMCPY
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 400)) if seed != 5 else 0
    k = _random_records(rng, n, KERNEL_DTYPE, sorted_starts=True)
    k["correlation_id"] = np.arange(n) + 3
    k["correlation_id"][:int(rng.integers(0, 3))] = -1        # unknown ids first: still in order
    k["device"] = rng.integers(-1, 3, n) if seed % 3 else 2
    na = n if not seed & 8 else max(0, n - int(rng.integers(1, 5)))
    a = _random_records(rng, na, API_DTYPE, sorted_starts=True)
    a["correlation_id"] = k["correlation_id"][:na] if seed & 1 else rng.permutation(k["correlation_id"][:na])
    a["category"] = (rng.choice([API_LAUNCH, API_GRAPH_LAUNCH], na) if seed & 2
                     else rng.choice([API_LAUNCH, API_GRAPH_LAUNCH, API_SYNC, API_MEMCPY], na))
    a["pid"], a["tid"] = 77, np.where(rng.random(na) < 0.5, 8, 9) if seed & 4 else 8
    if seed == 11:
        # one record per kernel with the same ids, but not in id order: not the aligned case
        a = _random_records(rng, n, API_DTYPE, sorted_starts=True)
        a["category"], a["pid"], a["tid"] = API_LAUNCH, 77, 8
        a["correlation_id"] = k["correlation_id"] = rng.permutation(k["correlation_id"])
    dev, hist, lat = fold_native.ingest_pass(k, a, _API_WHAT_U8, phase_figures.LAUNCH_RECORD_U8)
    assert dev == (fold_native.field_range(k, "device") if n else None)
    # The fast case: one process and thread, every record a launch. There the native
    # histogram, process and thread are all SourceFold._ingest's general path gives
    # (windows.api_call_figures, the function _ingest calls): one launch histogram, one thread.
    from ridgeline.aggregator.windows import api_call_figures
    fast = bool(na and not _API_WHAT_U8[a["category"]].any()
                and len(set(zip(a["pid"].tolist(), a["tid"].tolist()))) == 1)
    assert (hist is None) == (not fast)
    if fast:
        general = api_call_figures(a)
        pid, tid = int(a["pid"][0]), int(a["tid"][0])
        assert list(general.hist) == [(pid, "launch")] and general.launch_threads == [(pid, tid)]
        np.testing.assert_array_equal(hist[0], general.hist[(pid, "launch")])
        assert hist[1:] == (pid, tid)
    ref = phase_figures.launch_latency_join_ns(k, a)
    if lat is not None:
        np.testing.assert_array_equal(lat, ref)
    # aligned exactly when each kernel's launch record is the record at its index, in order
    aligned = (n > 0 and na == n and bool(phase_figures.LAUNCH_RECORD_U8[a["category"]].all())
               and np.array_equal(a["correlation_id"], k["correlation_id"])
               and bool((np.diff(a["correlation_id"]) >= 0).all()))
    assert (lat is not None) == aligned
    assert seed not in (3, 7) or aligned or n < 2
    assert seed not in (2, 3, 11) or hist is not None
    assert seed != 11 or lat is None
