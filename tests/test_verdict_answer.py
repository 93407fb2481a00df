"""The answer's caveat near a threshold and the limit that binds (issue 24.1, bullets 3-4),
through the words every view prints (aggregator.answer.answer_lines over
verdict.verdict_record, as report, top, tail and analyze do).

The figures are the issue's own: a phase "compute-bound" at 296 FLOP/B against a ridge of
295 and 48% of both peaks; and the simulator at --rate 60, where the queue verdict named the
KV watermark while 255 requests ran against a batch cap of 256 that was never named.
"""
from ridgeline.aggregator import verdict as v
from ridgeline.aggregator.answer import answer_lines

WINDOW_NS = 1_000_000_000


def _words(inp):
    return answer_lines(v.verdict_record(v.judge(inp)))


def test_a_call_at_the_ridge_point_says_it_is_a_coin_toss():
    prefill = {"kernel_time_ns": 900_000_000, "kernels": 9_000, "flops": 4.3e14, "bytes": 1.45e12,
               "achieved_flops_per_s": 4.75e14, "achieved_bytes_per_s": 1.61e12, "arithmetic_intensity": 296.0,
               "ridge_point": 295.0, "pct_of_peak_flops": 48.0, "pct_of_peak_bytes": 48.0,
               "verdict": "compute-bound"}
    lines = _words(v.VerdictInputs(window_ns=WINDOW_NS, device=0, pid=1, phases={"prefill": prefill},
                                   gpu_busy_ns=990_000_000, gpu_idle_ns=10_000_000))
    text = "\n".join(lines)
    assert "caveat: prefill intensity 296 FLOP/B is within 0% of the ridge point 295: compute- vs " \
           "memory-bound is a coin toss" in text
    assert "caveat: prefill at 48% of peak FLOP/s and 48% of peak bytes/s: both ceilings about equally near" in text
    # neither face reached its 50% threshold: the call is the roofline's, and says so
    assert any(x.startswith("  caveat: no face reached its threshold") for x in lines)


def test_a_full_batch_names_the_batch_cap_as_the_limit():
    decode = {"kernel_time_ns": 600_000_000, "kernels": 40_000, "flops": 1.1e13, "bytes": 1.0e12,
              "achieved_flops_per_s": 1.8e13, "achieved_bytes_per_s": 1.7e12, "arithmetic_intensity": 11.0,
              "ridge_point": 295.0, "pct_of_peak_flops": 2.0, "pct_of_peak_bytes": 45.0, "verdict": "memory-bound"}
    engine = {"engine": "vllm", "kv_usage_ratio": 0.31, "kv_usage_max_ratio": 0.33, "preemptions": 0.0,
              "preemption_rate_per_s": 0.0, "num_waiting_requests": 180.0, "num_waiting_change": 12.0,
              "queue_time_mean_s": 3.4, "num_running_requests": 255.0}
    inp = v.VerdictInputs(window_ns=WINDOW_NS, device=0, pid=1, phases={"decode": decode},
                          gpu_busy_ns=950_000_000, gpu_idle_ns=50_000_000, engine=engine)
    # vLLM's /metrics does not carry --max-num-seqs: the configured cap (verdict.max_num_seqs)
    th = v.Thresholds(max_num_seqs=256)
    rec = v.verdict_record(v.judge(inp, th))
    assert rec["verdict"] == v.QUEUE
    lines = answer_lines(rec)
    cap = "batch cap: running 255 of 256 (max_num_seqs (configured)): the batch is full"
    assert lines[1] == f"  because {cap}"           # the cap is the reason, before the KV figure
    assert f"  limit: {cap}" in lines
    # without the cap known, no limit is invented
    assert not any(x.startswith("  limit: batch cap") for x in _words(inp))
