"""Tensor-parallel stragglers in the live window (issue 23): aggregator.straggler_window over
the window builder, with the ranks' batches arriving as CUPTI sends them (one process each,
its own name table, a rank's buffer a window late), each collective reported once."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
from support.tp_groups import TP4, US, Builder, tp_group

from ridgeline.aggregator import straggler_window as SW
from ridgeline.aggregator import wire
from ridgeline.aggregator.windows import WindowBuilder
from ridgeline.probes.events import NameTable, Trace
from ridgeline.probes.records import window_of


def per_rank_batches(trace: Trace, pieces: int):
    """Each rank's kernels as its own process would send them: its own name table (ids
    shifted, so that tables disagree), cut into ``pieces`` batches in time order."""
    out = {}
    for pid in np.unique(trace.kernels["pid"]):
        k = trace.kernels[trace.kernels["pid"] == pid].copy()
        c = trace.copies[trace.copies["pid"] == pid].copy()
        names = NameTable([f"pad-{pid}-{i}" for i in range(int(pid) % 5)] + list(trace.names.strings))
        k["name_id"] += int(pid) % 5
        cuts = np.array_split(np.arange(len(k)), pieces)
        batches = []
        for ix in cuts:
            lo, hi = k["start_ns"][ix].min(), k["end_ns"][ix].max()
            cs = c[(c["start_ns"] >= lo) & (c["start_ns"] < hi)]
            batches.append(Trace(kernels=k[ix], copies=cs, names=names, meta={"source": "cupti"}))
        out[int(pid)] = batches
    return out


def run_windows(batches: dict, lag: dict | None = None, windows: int = 8):
    """Feed window w the w-th batch of each rank (a rank in ``lag`` sends its first batch on
    time, then each later one that many windows late); returns the window records."""
    lag = lag or {}
    b = WindowBuilder(host="h")
    out = []
    for w in range(windows):
        for pid, bs in batches.items():
            for i, bt in enumerate(bs):
                if (i if i == 0 else i + lag.get(pid, 0)) == w:
                    b.add_events(bt, source=f"cupti:{pid}")
        out.append(b.close(w * 10**9, (w + 1) * 10**9))
    return out


def test_live_window_names_the_slowed_rank_and_reports_each_collective_once():
    t = tp_group(Builder(), TP4, steps=60, slow={2: 120}).trace()
    recs = run_windows(per_rank_batches(t, 4), lag={104: 1})
    groups = [g for r in recs for g in (r.stragglers.groups if r.stragglers is not None else [])]
    assert sum(g.collectives for g in groups) == 60          # every all-reduce, once
    # window 1: rank 104's second buffer has not come, its collectives wait for it
    assert sum(g.collectives for g in recs[1].stragglers.groups) == 0
    for g in groups:
        assert [(r.pid, r.device) for r in g.ranks] == TP4
        assert (g.straggler_pid, g.straggler_device) == (103, 2)
        assert g.straggler_last_share_ratio == 1.0 and g.cause == "kernel"
        assert g.late_by_p50_ns == pytest.approx(120 * US, abs=8 * US)
        # the three others wait ~120 us per collective, the late one hardly at all
        waits = [r.wait_ns for r in g.ranks]
        assert all(waits[i] == pytest.approx(g.collectives * 120 * US, rel=0.1) for i in (0, 1, 3))
        assert waits[2] < g.collectives * 10 * US
    step = 400 + 120 + 2 + 30 + 20
    big = max(groups, key=lambda g: g.collectives)
    assert big.waiting_share_ratio == pytest.approx(3 * 120 / (4 * step), rel=0.2)


def test_a_late_launch_is_host_bound_live():
    t = tp_group(Builder(), TP4, steps=40, idle_before={1: 150}).trace()
    recs = run_windows(per_rank_batches(t, 2), windows=4)
    groups = [g for r in recs for g in (r.stragglers.groups if r.stragglers is not None else [])]
    assert sum(g.collectives for g in groups) == 40
    assert all((g.straggler_pid, g.cause) == (102, "host") for g in groups)


def test_no_collectives_nothing_held_and_no_record():
    b = Builder()
    b.kernel(1, 0, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 0, 1000)
    wb = WindowBuilder(host="h")
    wb.add_events(b.trace(), source="cupti:1")
    rec = wb.close(0, 10**9)
    assert rec.stragglers is None and wb.stragglers._held == 0


def test_a_table_that_gains_a_collective_name_is_held_from_then_on():
    # The early return for a table without collective names must see the table grow.
    from support.tp_groups import ALLREDUCE

    from ridgeline.probes.events import KERNEL_DTYPE, empty
    names = NameTable(["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"])
    k = empty(KERNEL_DTYPE, 1)
    k["name_id"], k["pid"], k["start_ns"], k["end_ns"] = 0, 7, 0, 1000
    live = SW.LiveStragglers()
    live.add(Trace(kernels=k, names=names), "cupti:7")
    assert live._held == 0 and not live._with_collectives
    k2 = k.copy()
    k2["name_id"] = names.intern(ALLREDUCE)
    live.add(Trace(kernels=k2, names=names), "cupti:7")
    assert live._with_collectives == {"cupti:7"} and live._held == 1
    live.add(Trace(kernels=k, names=names), "cupti:7")     # its other kernels are held too now
    assert live._held == 2


def test_held_kernels_are_bounded_and_the_drop_counted(monkeypatch):
    monkeypatch.setattr(SW, "MAX_HELD_KERNELS", 500)
    t = tp_group(Builder(), TP4, steps=200).trace()
    live = SW.LiveStragglers()
    for i, bt in enumerate(per_rank_batches(t, 4)[101] + per_rank_batches(t, 4)[102]):
        live.add(bt, "cupti:101" if i < 4 else "cupti:102")
    assert live._held <= 500 and live.kernels_dropped == 2 * 400 - live._held
    assert live.close().straggler_kernels_dropped == live.kernels_dropped


def test_window_stragglers_travel_as_numbers():
    t = tp_group(Builder(), TP4, steps=30, slow={0: 90}).trace()
    rec = run_windows(per_rank_batches(t, 1), windows=1)[0]
    raw = wire.encode_window(rec)
    for key in ("straggler_last_share_ratio", "waiting_share_ratio", "late_by_p50_ns", "stragglers"):
        assert key.encode() not in raw
    assert window_of(wire.decode_window(raw)).stragglers == rec.stragglers
    for cls in (SW.WindowStragglers, SW.GroupStragglers, SW.RankStragglers):
        assert set(cls.__struct_fields__) <= set(wire.FIELDS), cls


def _live_records():
    t = tp_group(Builder(), TP4, steps=60, slow={2: 120}).trace()
    return run_windows(per_rank_batches(t, 4), lag={104: 1})


def test_stragglers_on_metrics_bounded_and_promtool_clean():
    import subprocess

    from support.metrics_windows import exposition, families, thread, window
    from support.prometheus_server import PROMTOOL
    recs = _live_records()
    ws = []
    for r in recs:
        w = window([thread(8)])
        if r.stragglers is not None:
            w["stragglers"] = msgspec.to_builtins(r.stragglers)
        ws.append(w)
    text = exposition(ws)
    val = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families(text).values() for s in f.samples}
    h, g = ("Hostname", "node-a"), ("group", "0,1,2,3")

    def v(name, *labels):
        return val[(name, tuple(sorted((h, g) + labels)))]
    assert v("ridgeline_tp_collectives_total") == 60
    assert v("ridgeline_tp_straggler_gpu") == 2
    assert v("ridgeline_tp_straggler_cause", ("cause", "kernel")) == 1
    assert v("ridgeline_tp_straggler_cause", ("cause", "host")) == 0
    assert v("ridgeline_tp_straggler_late_seconds", ("percentile", "p50")) == pytest.approx(120e-6, abs=8e-6)
    assert v("ridgeline_tp_rank_last_share_ratio", ("gpu", "2")) == 1.0
    assert v("ridgeline_tp_wait_seconds_total") == pytest.approx(3 * 60 * 120e-6, rel=0.1)
    if PROMTOOL:
        r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def test_straggler_series_are_bounded_by_groups():
    from ridgeline.agent import straggler_metrics as SM
    m = SM.StragglerMetrics()
    for i in range(3 * SM.MAX_GROUPS):
        g = {"ranks": [{"pid": i, "device": i, "last_count": 1, "wait_ns": 0},
                       {"pid": i + 1000, "device": i + 1000, "last_count": 0, "wait_ns": 5}],
             "collectives": 1, "waiting_share_ratio": 0.1, "straggler_pid": i, "straggler_device": i,
             "straggler_last_share_ratio": 1.0, "late_by_p50_ns": 5, "late_by_p99_ns": 5, "cause": "copy"}
        m.observe(window_of({"stragglers": {"groups": [g]}}))
    fams = list(m.families("h"))
    groups = {s.labels["group"] for f in fams for s in f.samples if "group" in s.labels}
    assert len(groups) == SM.MAX_GROUPS and m.evicted == 2 * SM.MAX_GROUPS
    series = sum(len(f.samples) for f in fams)
    assert series <= SM.MAX_GROUPS * (2 + 3 + 2 + 3 + 2) + 1


def test_top_names_the_straggler():
    from rich.console import Console

    from ridgeline.agent.top import render
    rec = next(r for r in _live_records() if r.stragglers is not None and r.stragglers.groups)
    c = Console(width=220, record=True)
    c.print(render(rec))
    text = c.export_text()
    assert "TP group GPUs 0,1,2,3:" in text
    assert "straggler GPU 2 (pid 103) last in 100%, late by 1" in text and "kernel-bound" in text


def test_a_real_single_rank_trace_is_held_but_no_group_is_claimed_live():
    """The B200 vLLM TP8 trace's rank 0 (its multimem all-reduce and NCCL all-gather seen as
    collectives) through the window builder: its kernels are held for the analysis, and
    no group is claimed from one rank."""
    from conftest import shared_trace

    from ridgeline.probes.kineto import load_trace
    t = load_trace(shared_trace("nvidia-inference/tracelens_b200_vllm_gptoss_tp8_prefill888.json.gz"))
    wb = WindowBuilder(host="h")
    wb.add_events(t, source="replay")
    rec = wb.close(0, 10**9)
    assert wb.stragglers._held == len(t.kernels)
    assert rec.stragglers.groups == []


def test_a_host_bound_straggler_with_its_launch_thread_off_cpu():
    """Rank 1's launches come late (its GPU idles before each collective) and the scheduling
    probe saw its launch thread in the run queue most of the window: the group says host,
    and the straggler's launch thread off-CPU share against the others'."""
    t = tp_group(Builder(), TP4, steps=30, idle_before={1: 150}).trace()
    wb = WindowBuilder(host="h")
    for pid, (bt,) in per_rank_batches(t, 1).items():
        wb.add_events(bt, source=f"cupti:{pid}")
    off = {101: 0.02, 102: 0.6, 103: 0.05, 104: 0.04}
    wb.add_sched({"threads": [{"tgid": pid, "tid": pid + 7, "comm": "python", "launches": 100,
                               "on_cpu_ns": (1 - f) * 1e9, "runq_wait_ns": f * 0.8e9, "blocked_ns": f * 0.2e9}
                              for pid, f in off.items()]})
    rec = wb.close(0, 10**9)
    (g,) = rec.stragglers.groups
    assert (g.straggler_pid, g.cause) == (102, "host")
    assert g.straggler_launch_off_cpu_ratio == pytest.approx(0.6)
    assert g.others_launch_off_cpu_ratio == pytest.approx(0.04)
    assert window_of(wire.decode_window(wire.encode_window(rec))).stragglers == rec.stragglers
    from rich.console import Console

    from ridgeline.agent.top import render
    c = Console(width=260, record=True)
    c.print(render(rec))
    text = c.export_text()
    assert "host-bound; ranks waiting" in text and "its launch thread off-CPU 60% (others 4%)" in text
    from support.metrics_windows import exposition, families
    w = msgspec.structs.replace(rec, host="node-a")
    val = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in families(exposition([w])).values() for s in f.samples}
    assert val[("ridgeline_tp_launch_off_cpu_ratio", (("Hostname", "node-a"), ("group", "0,1,2,3"),
                                                       ("rank", "straggler")))] == pytest.approx(0.6)


def test_no_scheduling_rows_leave_the_launch_figures_unknown():
    t = tp_group(Builder(), TP4, steps=10, slow={0: 50}).trace()
    rec = run_windows(per_rank_batches(t, 1), windows=1)[0]
    (g,) = rec.stragglers.groups
    assert g.straggler_launch_off_cpu_ratio == -1.0 and g.others_launch_off_cpu_ratio == -1.0


@pytest.mark.parametrize("groups,ranks,series", [(4, 2, 53), (4, 8, 77)])
def test_straggler_series_per_host_layout(groups, ranks, series):
    """docs/metrics.md, "Cardinality budget": the ridgeline_tp_* series of a host's TP groups
    (4 served processes of TP=2, or of TP=8), counted as the real renderer emits them."""
    from support.metrics_windows import exposition, families, thread, window
    w = window([thread(8)])
    w["stragglers"] = {"groups": [{
        "ranks": [{"pid": 100 * g + r, "device": g * ranks + r, "last_count": 1, "wait_ns": 5} for r in range(ranks)],
        "collectives": 10, "waiting_share_ratio": 0.1, "straggler_pid": 100 * g, "straggler_device": g * ranks,
        "straggler_last_share_ratio": 0.5, "late_by_p50_ns": 1000, "late_by_p99_ns": 2000, "cause": "host",
        "straggler_launch_off_cpu_ratio": 0.3, "others_launch_off_cpu_ratio": 0.1} for g in range(groups)],
        "straggler_kernels_dropped": 0}
    n = sum(len(f.samples) for name, f in families(exposition([w])).items() if name.startswith("ridgeline_tp_"))
    assert n == series
