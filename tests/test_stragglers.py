"""Tensor-parallel stragglers (issue 23): which rank arrives last at each collective, by how
much, what the others lose waiting, and why the late one is late.

Simulated TP groups, built kernel by kernel the way NCCL behaves: a rank's collective kernel
starts when that rank reaches it and spins until the last rank has arrived, so every rank
ends it together. The collective's name is NCCL's real one (ncclDevKernel_<Coll>_<Op>_<type>_
<algo>_<proto>, as in the shared A100 training trace's ncclKernel_SendRecv_RING_SIMPLE_* and
the B200 vLLM TP8 trace's ncclDevKernel_AllGather_RING_LL), matched by the `collective`
signature of aggregator/data/kernel_signatures.toml.
"""
from __future__ import annotations

import numpy as np
import pytest
from support.tp_groups import ALLREDUCE, GEMM, TP4, US, Builder, tp_group

from ridgeline.aggregator import stragglers as S


def test_a_slowed_rank_is_named_last_by_its_delay_and_kernel_bound():
    s, inst = S.analyse(tp_group(Builder(), TP4, slow={2: 120}).trace())
    assert len(s.groups) == 1
    g = s.groups[0]
    assert g.instances == 50 and g.misaligned == 0
    assert g.straggler == 2 and g.ranks[2].last_count == 50
    assert g.ranks[2].pid == 103 and g.ranks[2].device == 2
    assert g.ranks[2].late_by_p50_ns == pytest.approx(120 * US, abs=8 * US)
    assert g.ranks[2].cause == "kernel"
    # the three others wait ~120 us each per step; the late one hardly at all
    assert all(g.ranks[i].wait_ns == pytest.approx(50 * 120 * US, rel=0.1) for i in (0, 1, 3))
    assert g.ranks[2].wait_ns < 50 * 10 * US
    step = 400 + 120 + 2 + 30 + 20
    assert g.waiting_share == pytest.approx(3 * 120 / (4 * step), rel=0.15)
    assert (inst["late_rank"] == 2).all() and (inst["cause"] == S.CAUSE_KERNEL).all()


def test_a_late_launch_is_host_bound():
    s, _ = S.analyse(tp_group(Builder(), TP4, idle_before={1: 150}).trace())
    g = s.groups[0]
    assert g.straggler == 1 and g.ranks[1].cause == "host"
    assert g.ranks[1].late_by_p50_ns == pytest.approx(150 * US, abs=8 * US)


def test_a_rank_held_by_a_copy_is_copy_bound():
    s, _ = S.analyse(tp_group(Builder(), TP4, copy_before={3: 200}).trace())
    g = s.groups[0]
    assert g.straggler == 3 and g.ranks[3].cause == "copy"


def test_balanced_ranks_have_no_dominant_straggler_and_little_waiting():
    s, _ = S.analyse(tp_group(Builder(), TP4).trace())
    g = s.groups[0]
    assert max(r.last_share for r in g.ranks) < 0.6          # jitter only: who is last varies
    assert g.waiting_share < 0.02
    assert all(r.late_by_p99_ns < 10 * US for r in g.ranks)


def test_two_tp_groups_on_one_host_are_told_apart():
    b = Builder()
    tp_group(b, [(201, 0), (202, 1)], slow={1: 80}, t0=1_000_000, compute_us=300)
    tp_group(b, [(301, 2), (302, 3)], slow={0: 60}, t0=1_137_000, compute_us=450, seed=1)
    s, _ = S.analyse(b.trace())
    assert len(s.groups) == 2
    by_pids = {tuple(r.pid for r in g.ranks): g for g in s.groups}
    assert by_pids[(201, 202)].ranks[by_pids[(201, 202)].straggler].pid == 202
    assert by_pids[(301, 302)].ranks[by_pids[(301, 302)].straggler].pid == 301


def test_a_rank_that_missed_a_collective_is_counted_not_paired_wrongly():
    b = tp_group(Builder(), TP4, slow={0: 100}, steps=20)
    t = b.trace()
    k = t.kernels
    ar = np.flatnonzero((k["pid"] == 104) & (t.names.names_of(k["name_id"]) == np.array(ALLREDUCE)))
    t.kernels = np.delete(k, ar[5])                            # rank 3 lost its 6th all-reduce record
    s, _ = S.analyse(t)
    g = s.groups[0]
    assert g.instances == 19 and g.misaligned == 1             # one lost record costs one instance
    assert g.ranks[g.straggler].pid == 101 and g.ranks[0].last_count == 19


def test_no_collectives_no_groups():
    b = Builder()
    b.kernel(1, 0, GEMM, 0, 1000)
    s, inst = S.analyse(b.trace())
    assert s.groups == [] and len(inst) == 0 and s.ranks_seen == 0


def test_the_analysis_and_its_report_name_the_straggler(capsys):
    from rich.console import Console

    from ridgeline.aggregator.analysis import analyze_trace
    from ridgeline.aggregator.report import render
    doc = analyze_trace(tp_group(Builder(), TP4, slow={2: 120}).trace())
    (g,) = doc.stragglers
    assert g.straggler == 2 and g.ranks[2].cause == "kernel"
    console = Console(width=160, record=True)
    render(doc, console)
    text = console.export_text()
    assert "Collectives of TP/PP group 0: 50 collectives" in text
    row = next(line for line in text.splitlines() if "* 2 " in line)
    assert "103" in row and "kernel" in row and "50 (100%)" in row


def test_a_real_single_rank_trace_has_no_group():
    """The B200 vLLM TP8 trace holds rank 0 only: its 74 collectives (multimem all-reduce,
    NCCL all-gather) are seen, and no group is claimed from one rank."""
    from conftest import shared_trace

    from ridgeline.probes.kineto import load_trace
    t = load_trace(shared_trace("nvidia-inference/tracelens_b200_vllm_gptoss_tp8_prefill888.json.gz"))
    s, inst = S.analyse(t)
    assert s.groups == [] and len(inst) == 0 and s.ranks_seen == 1
