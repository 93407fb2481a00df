"""Stragglers on a real multi-rank trace: two ranks of one job, recorded by others.

HTA's test traces ``trace_filter/sampled_rank-0.json.gz`` and ``sampled_rank-1.json.gz``
(facebookresearch/HolisticTraceAnalysis; tests/THIRD_PARTY.md, ``hta/``): ranks 0 and 1 of
a 128-rank NCCL job (their ``distributedInfo``), one clock, two profiler steps, each with
ten ``ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t`` kernels (pipeline-parallel sends and
receives: about half of each rank's go to the other rank, the rest to ranks not recorded).

Checked here against what nobody here wrote:

* the kernels as the Kineto JSON holds them (read with the standard library: ``ts``/``dur``
  in microseconds), for every instance the analysis pairs and every wait it sums;
* HTA 0.5.0's own answer on the same two ranks (``TraceAnalysis.get_potential_stragglers``,
  hta/analyzers/straggler.py ``find_stragglers_with_late_start_comm_kernels``: the rank whose
  last long communication kernel of the step starts latest), where HTA is installed (the
  ``bench`` extra); HTA keeps the step ProfilerStep#551 (it leaves out the last step).

Both paths: :func:`aggregator.stragglers.analyse` over the two ranks merged (offline), and
the agent's live path (:class:`aggregator.straggler_window.LiveStragglers` in the window
builder), each rank's kernels arriving as its own process's batches, 100 ms a window.
"""
from __future__ import annotations

import gzip
import json

import msgspec
import numpy as np
import pytest
from conftest import third_party

from ridgeline.aggregator import stragglers as S

RANKS = ("hta/sampled_rank-0.json.gz", "hta/sampled_rank-1.json.gz")
COLLECTIVE = "ncclKernel_SendRecv"


def _raw_kernels(path, prefix: str = "") -> list[tuple[int, int]]:
    """(start_ns, end_ns) of the trace's kernels named ``prefix...``, straight from the JSON
    (ts, dur in us)."""
    d = json.loads(gzip.decompress(path.read_bytes()))
    out = []
    for e in d["traceEvents"]:
        if e.get("cat") == "kernel" and e.get("name", "").startswith(prefix):
            s = round(float(e["ts"]) * 1000)
            out.append((s, s + round(float(e["dur"]) * 1000)))
    return sorted(out)


def _raw_collectives(path) -> list[tuple[int, int]]:
    return _raw_kernels(path, COLLECTIVE)


#: The Kineto reader takes ``ts`` (us since the epoch, ~1.7e15) through a double: a start is
#: the JSON's to within a microsecond.
US = 1_000


def _at(raw: list[tuple[int, int]], start_ns: int) -> tuple[int, int]:
    """The one kernel of ``raw`` that starts at ``start_ns`` (within a microsecond)."""
    (k,) = [k for k in raw if abs(k[0] - start_ns) <= US]
    return k


@pytest.fixture(scope="module")
def pair():
    from ridgeline.agent.recording import merge_traces
    from ridgeline.probes.kineto import load_trace
    paths = [third_party(r) for r in RANKS]
    traces = [load_trace(p) for p in paths]
    return paths, traces, merge_traces(traces)


def test_the_offline_analysis_names_rank_1_and_every_figure_is_the_traces_own(pair):
    paths, traces, merged = pair
    summary, inst = S.analyse(merged)
    (g,) = summary.groups                           # the two ranks, joined by their shared sends
    assert [r.device for r in g.ranks] == [0, 1]
    raw = [_raw_collectives(p) for p in paths]
    assert len(raw[0]) == len(raw[1]) == 10
    # every instance: a kernel of each rank that really ends with the other's, the later
    # start being rank 1's
    for row in inst:
        s0, e0 = _at(raw[0], int(row["start_ns"]))
        s1, e1 = _at(raw[1], int(row["late_start_ns"]))
        assert row["late_rank"] == 1 and s1 > s0
        assert row["late_by_ns"] == pytest.approx(s1 - s0, abs=2 * US)
        assert row["wait_ns"] == pytest.approx(s1 - s0, abs=2 * US)
        assert abs(e0 - e1) <= max(S.END_TOLERANCE_NS, S.END_TOLERANCE_SHARE * (e0 - s0)) + 2 * US
    assert g.instances == 5 and g.misaligned == 10     # half of each rank's sends go to ranks not recorded
    assert g.straggler == 1 and g.ranks[1].last_share == 1.0
    assert g.ranks[0].wait_ns == pytest.approx(sum(_at(raw[1], int(r["late_start_ns"]))[0]
                                                   - _at(raw[0], int(r["start_ns"]))[0] for r in inst), abs=10 * US)
    assert g.ranks[1].wait_ns == 0
    every = [_raw_kernels(p) for p in paths]              # the group's span: all its kernels
    span = max(max(e for _, e in r) for r in every) - min(min(s for s, _ in r) for r in every)
    assert g.span_ns == pytest.approx(span, abs=2 * US)
    assert g.waiting_share == pytest.approx(g.ranks[0].wait_ns / (2 * span), rel=1e-3)
    print(f"\nHTA sampled ranks 0/1: {g.instances} paired SendRecv, {g.misaligned} with a peer not recorded; "
          f"rank 1 last at {g.ranks[1].last_count}; late p50 {g.ranks[1].late_by_p50_ns / 1e6:.2f} ms, p99 "
          f"{g.ranks[1].late_by_p99_ns / 1e6:.2f} ms; rank 0 waited {g.ranks[0].wait_ns / 1e6:.2f} ms "
          f"({g.waiting_share:.4f} of the ranks' time); cause {g.ranks[1].cause}")


def test_the_live_path_reports_the_same_collectives_once(pair):
    from ridgeline.aggregator.windows import WindowBuilder
    _, traces, merged = pair
    _, inst = S.analyse(merged)
    t0 = min(int(t.kernels["start_ns"].min()) for t in traces)
    t1 = max(int(t.kernels["end_ns"].max()) for t in traces)
    step = 100_000_000
    wb = WindowBuilder(host="h")
    groups = []
    for w, lo in enumerate(range(t0, t1 + 3 * step, step)):
        for i, t in enumerate(traces):               # each rank its own process, its own name table
            k = t.kernels
            sel = (k["end_ns"] >= lo) & (k["end_ns"] < lo + step)
            c = t.copies[(t.copies["end_ns"] >= lo) & (t.copies["end_ns"] < lo + step)]
            if sel.any() or len(c):
                from ridgeline.probes.events import Trace
                wb.add_events(Trace(kernels=k[sel], copies=c, names=t.names, meta={"source": "cupti"}),
                              source=f"cupti:{i}")
        rec = msgspec.to_builtins(wb.close(w * 10**9, (w + 1) * 10**9))   # the typed Window as the wire has it
        groups += (rec.get("stragglers") or {}).get("groups", [])
    assert sum(g["collectives"] for g in groups) == len(inst) == 5       # each once
    for g in groups:
        assert (g["straggler_device"], g["straggler_last_share_ratio"]) == (1, 1.0)
    live_wait = sum(r["wait_ns"] for g in groups for r in g["ranks"] if r["device"] == 0)
    assert live_wait == pytest.approx(int(inst["wait_ns"].sum()), abs=US)


def test_hta_names_the_same_straggler(pair, tmp_path):
    pytest.importorskip("hta", reason="HolisticTraceAnalysis (the bench extra: holistictraceanalysis==0.5.0) "
                                      "is not installed")
    import shutil

    from hta.trace_analysis import TraceAnalysis
    paths, _, merged = pair
    for p in paths:
        shutil.copy(p, tmp_path / p.name)
    ta = TraceAnalysis(trace_dir=str(tmp_path))
    steps = ta.get_profiler_steps()
    assert [int(s) for s in steps] == [551]
    hta_late = [int(r) for r in ta.get_potential_stragglers(profiler_steps=steps, num_candidates=1, visualize=False)]
    assert hta_late == [1]
    # HTA's kernels of that step (its own parse: ts relative to the earliest, in us), and
    # ours in the same step: the same SendRecv kernels, and rank 1 last at each we pair
    sym = ta.t.symbol_table.get_sym_table()
    hta_k = {}
    for r in (0, 1):
        df = ta.t.get_trace(r)
        k = df[df["name"].map(lambda i: sym[i].startswith(COLLECTIVE))]
        hta_k[r] = sorted(zip(k["ts"].astype(np.int64), (k["ts"] + k["dur"]).astype(np.int64)))
    base_us = min(s for s, _ in _raw_collectives(paths[0]) + _raw_collectives(paths[1])) // 1000 - \
        min(s for r in (0, 1) for s, _ in hta_k[r])
    _, inst = S.analyse(merged)
    step_end_us = max(e for r in (0, 1) for _, e in hta_k[r]) + base_us
    ours = inst[inst["end_ns"] / 1000 <= step_end_us + 1]                 # within the reader's microsecond
    assert len(ours) == 3
    for row in ours:
        assert min(abs(row["start_ns"] / 1000 - base_us - s) for s, _ in hta_k[0]) <= 1
        assert min(abs(row["late_start_ns"] / 1000 - base_us - s) for s, _ in hta_k[1]) <= 1
        assert row["late_rank"] == hta_late[0]
