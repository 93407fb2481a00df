"""Each verdict rule alone (issue 19): one rule, one Evidence literal, the rule's answer.

The rules are the entries of ``verdict.RULES``, all with one signature
``(Evidence, Thresholds) -> (verdict, reasons) | None``. Each test builds the evidence a
window would give (the same H100 / Llama-3-8B literals as tests/test_verdict.py) and
checks that this rule, and only for the figures that concern it, holds or not.
"""
import dataclasses

import pytest

from ridgeline.aggregator import verdict as v

TH = v.DEFAULT_THRESHOLDS
DECODE_AT_BW = {"kernel_time_ns": 780_000_000, "achieved_flops_per_s": 1.08e14, "achieved_bytes_per_s": 2.60e12,
                "arithmetic_intensity": 41.4, "pct_of_peak_flops": 10.9, "pct_of_peak_bytes": 77.6,
                "verdict": "memory-bound"}
PREFILL_AT_COMPUTE = {"kernel_time_ns": 820_000_000, "achieved_flops_per_s": 6.80e14, "achieved_bytes_per_s": 6.2e11,
                      "arithmetic_intensity": 1094.0, "pct_of_peak_flops": 68.8, "pct_of_peak_bytes": 18.5,
                      "verdict": "compute-bound"}


def ev(**kw) -> v.Evidence:
    """A calm, busy GPU with decode at its bandwidth ceiling; every rule's figures overridable."""
    base = dict(window_ns=1_000_000_000, engine={"engine": "vllm"}, phase_name="decode", phase=DECODE_AT_BW,
                kv=0.52, pre=0.0, wchg=0.0, waiting=0.0, qmean=0.02, idle_ratio=0.04, idle_src="its span",
                lt=None, gpu_idles=False, ceilings_apply=True, at_bw=True, at_cp=False)
    base.update(kw)
    return v.Evidence(**base)


def test_the_rules_are_named_explicitly_and_share_one_signature():
    assert [r.__name__ for r in v.RULES] == ["kv_capacity_rule", "host_wait_rule", "launch_busy_rule",
                                             "idle_roofline_rule", "queue_rule", "bandwidth_rule", "compute_rule"]
    calm = ev(at_bw=False)
    assert [r(calm, TH) for r in v.RULES] == [None] * len(v.RULES)   # nothing holds on a calm window


@pytest.mark.parametrize("kw, reason", [
    ({"kv": 0.87}, "KV usage 87.0% >= watermark 85%"),
    ({"pre": 4.0, "engine": {"preemption_rate_per_s": 0.8}}, "4 preemptions in the window (0.80/s)"),
    ({"pre": None, "engine": {"retracted_requests_last_tick": 3}}, "3 requests retracted at the engine's last log tick"),
    ({"kv": 0.80, "wchg": 4.0, "waiting": 9.0}, "waiting requests +4 (now 9) while KV usage 80.0% >= 75%"),
])
def test_kv_capacity_rule_holds(kw, reason):
    assert v.kv_capacity_rule(ev(**kw), TH) == (v.KV_CAPACITY, [reason])


def test_kv_capacity_rule_not_below_the_watermark_nor_growth_with_room():
    assert v.kv_capacity_rule(ev(kv=0.84), TH) is None
    assert v.kv_capacity_rule(ev(kv=0.50, wchg=4.0, waiting=9.0), TH) is None   # growth, but the pool has room
    # Retractions count only for engines without a preemption counter.
    assert v.kv_capacity_rule(ev(pre=0.0, engine={"retracted_requests_last_tick": 3}), TH) is None


IDLE = dict(idle_ratio=0.45, gpu_idles=True)


def test_host_wait_rule():
    lt = {"on_cpu_ns": 100_000_000, "runq_wait_ns": 300_000_000, "blocked_ns": 200_000_000}
    name, why = v.host_wait_rule(ev(lt=lt, **IDLE), TH)
    assert name == v.HOST
    assert why == ["GPU idle 45% of its span",
                   "launch thread off-CPU 50% of the window (run queue 30%, blocked 20%) vs on-CPU 10%"]
    assert v.host_wait_rule(ev(lt=lt), TH) is None                                   # the GPU does not idle
    assert v.host_wait_rule(ev(lt=dict(lt, on_cpu_ns=600_000_000), **IDLE), TH) is None   # runs longer than it waits
    assert v.host_wait_rule(ev(lt=lt, window_ns=0, **IDLE), TH) is None


def test_launch_busy_rule():
    lt = {"on_cpu_ns": 700_000_000, "runq_wait_ns": 10_000_000, "blocked_ns": 50_000_000}
    assert v.launch_busy_rule(ev(lt=lt, **IDLE), TH) == (v.LAUNCH, [
        "GPU idle 45% of its span", "launch thread on-CPU 70% of the window (run queue 1%, blocked 5%)"])
    assert v.launch_busy_rule(ev(lt=dict(lt, on_cpu_ns=400_000_000), **IDLE), TH) is None
    assert v.launch_busy_rule(ev(lt=None, **IDLE), TH) is None


def test_idle_roofline_rule_only_without_the_scheduler_view():
    phase = dict(DECODE_AT_BW, verdict="launch-bound", evidence=["kernels 3 µs", "gaps 9 µs"])
    assert v.idle_roofline_rule(ev(phase=phase, **IDLE), TH) == (v.LAUNCH, [
        "GPU idle 45% of its span", "roofline verdict launch-bound: kernels 3 µs; gaps 9 µs"])
    assert v.idle_roofline_rule(ev(phase=dict(phase, verdict="host-bound"), **IDLE), TH)[0] == v.HOST
    lt = {"on_cpu_ns": 1, "runq_wait_ns": 0, "blocked_ns": 0}
    assert v.idle_roofline_rule(ev(phase=phase, lt=lt, **IDLE), TH) is None      # the scheduler view decides
    assert v.idle_roofline_rule(ev(phase=DECODE_AT_BW, **IDLE), TH) is None      # memory-bound: not a host call
    assert v.idle_roofline_rule(ev(phase=phase), TH) is None                     # GPU busy


def test_queue_rule_names_a_full_batch():
    e = {"num_running_requests": 255.0, "max_running_requests": 256.0}
    name, why = v.queue_rule(ev(engine=e, waiting=12.0, qmean=1.5, at_bw=False, phase=dict(DECODE_AT_BW,
                                pct_of_peak_bytes=30.0)), TH)
    assert name == v.QUEUE
    assert why == ["12 requests waiting, mean queue time 1.50 s",
                   "batch cap: running 255 of 256 (the engine's max_running_requests): the batch is full",
                   "KV usage 52.0% below watermark; decode at 30% of peak bytes/s and 11% of peak FLOP/s"]


def test_queue_rule_not_when_a_ceiling_or_the_pool_explains_the_wait():
    waiting = dict(waiting=12.0, qmean=1.5)
    assert v.queue_rule(ev(at_bw=True, **waiting), TH) is None
    assert v.queue_rule(ev(at_bw=False, at_cp=True, **waiting), TH) is None
    assert v.queue_rule(ev(at_bw=False, kv=0.9, **waiting), TH) is None
    assert v.queue_rule(ev(at_bw=False, waiting=12.0, qmean=0.1), TH) is None      # short waits
    assert v.queue_rule(ev(at_bw=False, phase=None, kv=None, **waiting), TH) == (
        v.QUEUE, ["12 requests waiting, mean queue time 1.50 s", "KV usage unknown"])


def test_bandwidth_rule():
    assert v.bandwidth_rule(ev(), TH) == (v.BANDWIDTH, [
        "decode: 78% of peak HBM bytes/s (2.60 TB/s), intensity 41.4 FLOP/B, roofline verdict memory-bound"])
    assert v.bandwidth_rule(ev(at_bw=False), TH) is None
    assert v.bandwidth_rule(ev(phase=None), TH) is None


def test_compute_rule():
    e = ev(phase_name="prefill", phase=PREFILL_AT_COMPUTE, at_bw=False, at_cp=True)
    assert v.compute_rule(e, TH) == (v.COMPUTE, [
        "prefill: 69% of peak FLOP/s (680.0 TFLOP/s), intensity 1094.0 FLOP/B, roofline verdict compute-bound"])
    assert v.compute_rule(dataclasses.replace(e, at_cp=False), TH) is None


def test_evidence_reduces_the_inputs_once():
    inp = v.VerdictInputs(window_ns=1_000_000_000, phases={"decode": DECODE_AT_BW, "prefill": dict(
        PREFILL_AT_COMPUTE, kernel_time_ns=10)}, gpu_busy_ns=400_000_000, gpu_idle_ns=600_000_000,
        engine={"kv_usage_ratio": 0.3, "kv_usage_max_ratio": 0.6})
    e = v.evidence(inp, TH)
    assert (e.phase_name, e.kv, e.idle_ratio, e.idle_src) == ("decode", 0.6, 0.6, "its span")
    # Idle 60% >= gpu_idle_bound_ratio: no ceiling can bind an idle GPU.
    assert e.gpu_idles and not e.ceilings_apply and not e.at_bw
    # Without busy/idle time, the dominant phase's idle_ratio stands in.
    e2 = v.evidence(dataclasses.replace(inp, gpu_busy_ns=None, phases={"decode": dict(DECODE_AT_BW, idle_ratio=0.1)}),
                    TH)
    assert (e2.idle_ratio, e2.idle_src, e2.at_bw) == (0.1, "the decode phase's time", True)


def test_judge_takes_its_rule_list():
    """The rule list is a parameter: without the KV rule a full pool no longer binds, and
    the next rule that holds (bandwidth) does."""
    inp = v.VerdictInputs(window_ns=1_000_000_000, phases={"decode": DECODE_AT_BW}, gpu_busy_ns=960_000_000,
                          gpu_idle_ns=40_000_000, engine={"kv_usage_ratio": 0.9})
    assert v.judge(inp)["verdict"] == v.KV_CAPACITY
    rules = tuple(r for r in v.RULES if r is not v.kv_capacity_rule)
    assert v.judge(inp, rules=rules)["verdict"] == v.BANDWIDTH
