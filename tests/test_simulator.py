"""Unit tests of the simulated continuous-batching server (agent/simulator)."""
from __future__ import annotations

import gzip
import json
import math

import httpx
import numpy as np
import pytest

from ridgeline.agent.cli import main as cli_main
from ridgeline.agent.simulator.conventions import evaluate, load_engine
from ridgeline.agent.simulator.cost import CLASSES, Efficiency, StepShape, plan_step
from ridgeline.agent.simulator.engine import SimConfig, SimEngine
from ridgeline.agent.simulator.hardware import gpu_spec
from ridgeline.agent.simulator.kineto_writer import write_kineto
from ridgeline.agent.simulator.kvpool import KvPool
from ridgeline.agent.simulator.model import load_model
from ridgeline.agent.simulator.probe import SimulatorProbe, make_probe
from ridgeline.agent.simulator.scheduler import Request, Scheduler, SchedulerConfig
from ridgeline.agent.simulator.workload import Workload, draw
from ridgeline.probes.errors import InputError
from ridgeline.probes.events import API_DTYPE, API_LAUNCH, API_SYNC, KERNEL_DTYPE


def small_engine(**kw) -> SimEngine:
    w = kw.pop("workload", Workload(rate_per_s=20, duration_s=1, prompt_mean=128, prompt_max=256,
                                    output_mean=32, output_max=64))
    return SimEngine(SimConfig(model=kw.pop("model", "llama-3-8b"), workload=w, **kw), seed=kw.pop("seed", 7))


# ---- workload ------------------------------------------------------------------------

def test_workload_is_deterministic_per_seed_and_poisson():
    w = Workload(rate_per_s=50, duration_s=20)
    a, b, c = draw(w, 1), draw(w, 1), draw(w, 2)
    assert np.array_equal(a.arrival_ns, b.arrival_ns) and np.array_equal(a.prompt_len, b.prompt_len)
    assert not np.array_equal(a.arrival_ns[:10], c.arrival_ns[:10])
    n = len(a.arrival_ns)
    assert abs(n - 1000) < 4 * math.sqrt(1000)                 # Poisson count around rate x duration
    assert np.all(np.diff(a.arrival_ns) >= 0)
    gaps = np.diff(a.arrival_ns) / 1e9
    assert abs(gaps.mean() - 1 / 50) < 0.004                    # exponential inter-arrival mean
    assert a.prompt_len.min() >= 1 and a.prompt_len.max() <= w.prompt_max
    assert abs(a.prompt_len.mean() - w.prompt_mean) / w.prompt_mean < 0.1


def test_recorded_rate_segments_shape_the_arrivals():
    w = Workload(recorded_rate=((10.0, 1.0), (10.0, 30.0)), duration_s=20)
    r = draw(w, 0)
    first = (r.arrival_ns < 10e9).sum()
    second = (r.arrival_ns >= 10e9).sum()
    assert second > 10 * first


@pytest.mark.parametrize("bad", [dict(rate_per_s=0), dict(duration_s=-1), dict(prompt_mean=0),
                                 dict(shared_prefix_tokens=5000)])
def test_workload_rejects_bad_input(bad):
    with pytest.raises(InputError):
        draw(Workload(**bad), 0)


# ---- KV pool and scheduler ----------------------------------------------------------------

def test_pool_sized_from_memory_minus_weights():
    m = load_model("llama-3-8b")
    g = gpu_spec("h100")
    pool = KvPool.sized(g.memory_bytes, m.weight_bytes, m.kv_bytes_per_token, gpu_memory_utilization=0.9,
                        activation_reserve_bytes=2e9, block_size=16)
    expect = (80e9 * 0.9 - m.weight_bytes - 2e9) / (m.kv_bytes_per_token * 16)
    assert pool.total_blocks == int(expect)
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2         # K and V, 32 layers, 8 KV heads, dim 128, bf16
    with pytest.raises(InputError):
        KvPool.sized(16e9, m.weight_bytes, m.kv_bytes_per_token)  # an 8B model leaves no room on 16 GB


def test_scheduler_budget_chunking_and_batch_limit():
    pool = KvPool(total_blocks=10_000, block_size=16)
    s = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=1000, chunked_prefill=True), pool)
    for i in range(5):
        s.waiting.append(Request(i, 0, 700, 10))
    batch, pre = s.schedule(0)
    assert pre == 0
    assert [(r.rid, n) for r, n in batch] == [(0, 700), (1, 300)]   # budget 1000: second prompt chunked
    for r, n in batch:
        r.computed += n
    batch, _ = s.schedule(1)
    # running first: request 1 finishes its prompt (400), request 0 has no token yet (sampled
    # only after a step in which it finished its prompt: here it did, so generated stays 0
    # until the engine samples; the scheduler asks for seq_len - computed = 0 -> skipped)
    assert (1, 400) in [(r.rid, n) for r, n in batch]
    assert len(s.running) <= 3


def test_scheduler_without_chunking_does_not_split_prompts():
    pool = KvPool(total_blocks=10_000, block_size=16)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1000, chunked_prefill=False), pool)
    for i in range(3):
        s.waiting.append(Request(i, 0, 700, 10))
    batch, _ = s.schedule(0)
    assert [(r.rid, n) for r, n in batch] == [(0, 700)]


def test_scheduler_preempts_last_running_when_pool_full():
    pool = KvPool(total_blocks=6, block_size=16)           # 96 tokens
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096), pool)
    a, b = Request(0, 0, 32, 100), Request(1, 0, 32, 100)
    s.waiting.extend([a, b])
    batch, _ = s.schedule(0)
    assert len(batch) == 2 and pool.used_blocks == 4
    for r, n in batch:                                       # prompts done, each sampled one token
        r.computed += n
        r.generated += 1
    # Grow both until the pool cannot hold the next token of the first: the last admitted goes.
    for _ in range(40):
        batch, pre = s.schedule(1)
        if pre:
            break
        for r, n in batch:
            r.computed += n
            r.generated += 1
    assert pre == 1 and s.preemptions_total == 1
    assert s.waiting[0] is b and b.computed == 0 and b.blocks == 0 and b.preemptions == 1
    assert pool.used_blocks == a.blocks


# ---- conventions and cost ----------------------------------------------------------------

def test_expressions_and_unknown_engine():
    dims = {"hidden": 4096, "dtype": 2, "q_dim": 4096}
    assert evaluate("4*hidden*dtype + 8", dims) == 4 * 4096 * 2 + 8
    with pytest.raises(InputError):
        evaluate("hidden/2", dims)
    with pytest.raises(InputError):
        load_engine("tensorrt", load_model("llama-3-8b").dims())


def _plan(engine, q, ctx, model="llama-3-8b", gpu="h100"):
    m = load_model(model)
    c = load_engine(engine, m.dims())
    shape = StepShape(np.asarray(q), np.asarray(ctx), np.ones(len(q), dtype=bool))
    return plan_step(c, m, gpu_spec(gpu), Efficiency(), shape), m


def test_vllm_per_token_kernels_have_grid_x_tokens():
    plan, m = _plan("vllm", [300, 200, 1], [0, 0, 50])
    names = [plan.names[i] for i in plan.name_idx]
    for key in ("reshape_and_cache_flash_kernel", "rotary_embedding_kernel", "fused_add_rms_norm_kernel",
                "act_and_mul_kernel"):
        sel = [i for i, n in enumerate(names) if key in n]
        assert sel, key
        assert set(plan.grid[sel, 0].tolist()) == {501}, key
    att = [i for i, n in enumerate(names) if "flash_fwd_kernel" in n]
    assert len(att) == m.layers                                    # one varlen launch per layer
    assert plan.grid[att[0]].tolist() == [math.ceil(300 / 128), 3, m.heads]


def test_decode_uses_splitkv_with_combine_and_small_gemm_tiles():
    plan, m = _plan("vllm", [1] * 2, [2000] * 2)      # 2 x 32 heads under-fill 132 SMs: split the KV
    names = [plan.names[i] for i in plan.name_idx]
    split = [i for i, n in enumerate(names) if "flash_fwd_splitkv_kernel" in n]
    comb = [i for i, n in enumerate(names) if "splitkv_combine" in n]
    assert len(split) == m.layers and len(comb) == m.layers
    g = plan.grid[split[0]]
    assert g[0] == 1 and g[1] > 1 and g[2] == 2 * m.heads           # (1, splits, b*h)
    wide, _ = _plan("vllm", [1] * 8, [2000] * 8)                 # 8 x 32 heads fill the GPU: no split
    assert not any("combine" in wide.names[i] for i in wide.name_idx)
    gemms = {n for n in names if n.startswith("nvjet")}
    assert gemms == {"nvjet_tst_64x16_64x16_2x1_v_bz_splitK_TNT"}
    big, _ = _plan("vllm", [4096], [0])
    big_gemms = [big.names[i] for i in big.name_idx if big.names[i].startswith("nvjet")]
    # the layers' GEMMs see M = 4096 tokens; the LM head only the one sampled position
    assert set(big_gemms[:-1]) == {"nvjet_tst_144x128_64x6_2x1_v_bz_TNN"}
    assert big_gemms[-1] == "nvjet_tst_64x16_64x16_2x1_v_bz_splitK_TNT"


def test_roofline_durations_are_max_of_flop_and_byte_time_plus_floor():
    plan, m = _plan("vllm", [4096], [0])
    g, eff = gpu_spec("h100"), Efficiency()
    expect = np.maximum(plan.flops / (g.flops_per_s * eff.gemm_flops_ratio),
                        plan.bytes / (g.hbm_bytes_per_s * eff.bytes_ratio)) * 1e9 + eff.kernel_fixed_ns
    gemm = plan.cls == CLASSES.index("gemm")
    assert np.allclose(plan.dur_ns[gemm], expect[gemm], atol=1)
    # A 4096-token step is compute-heavy, a decode step of 4 sequences is byte-heavy.
    dec, _ = _plan("vllm", [1] * 4, [2000] * 4)
    g_ = gpu_spec("h100")
    assert plan.flops.sum() / plan.bytes.sum() > g_.ridge_flops_per_byte
    assert dec.flops.sum() / dec.bytes.sum() < g_.ridge_flops_per_byte / 10


def test_hf_conventions_follow_the_recorded_op_list():
    plan, m = _plan("hf", [559] * 16, [0] * 16, model="qwen1.5-0.5b")
    names = [plan.names[i] for i in plan.name_idx]
    att = [i for i, n in enumerate(names) if "pytorch_flash::flash_fwd_kernel" in n]
    assert len(att) == 24 and plan.grid[att[0]].tolist() == [5, 16, 16]   # as in the real H100 trace
    assert sum("sm90_xmma_gemm" in n for n in names) == 24 * 7


# ---- engine ---------------------------------------------------------------------------

def test_engine_is_deterministic_and_emits_consistent_columns():
    a, b = small_engine(), small_engine()
    a.run(), b.run()
    ta, tb = a.drain(), b.drain()
    assert len(ta.kernels) > 1000
    assert np.array_equal(ta.kernels, tb.kernels) and np.array_equal(ta.api, tb.api)
    k, api = ta.kernels, ta.api
    assert k.dtype == KERNEL_DTYPE and api.dtype == API_DTYPE
    assert np.all(k["end_ns"] > k["start_ns"])
    assert np.all(np.diff(k["start_ns"]) >= 0) and np.all(k["start_ns"][1:] >= k["end_ns"][:-1])  # one stream
    launches = api[api["category"] == API_LAUNCH]
    assert len(launches) == len(k)
    # Each kernel starts after the launch call that carries its correlation id.
    order = np.argsort(launches["correlation_id"])
    kk = k[np.argsort(k["correlation_id"])]
    assert np.array_equal(launches["correlation_id"][order], kk["correlation_id"])
    assert np.all(kk["start_ns"] >= launches["start_ns"][order])
    assert (api["category"] == API_SYNC).sum() == a.step_index
    assert ta.meta["simulated"] is True and ta.meta["source"] == "simulated"
    assert len(a.finished) == len(a.requests.arrival_ns)
    assert all(r.generated == r.output for r in a.finished)


def test_engine_bounded_buffer_counts_drops():
    e = small_engine(max_buffer_kernels=5000)
    e.run()
    assert e.dropped_kernels > 0
    assert len(e.drain().kernels) <= 5000
    assert e.emitted_kernels + e.dropped_kernels == sum(s.kernels for s in e.steps)


def test_metrics_have_vllm_v1_names_and_are_labelled_simulated():
    e = small_engine()
    e.run()
    text = e.metrics.text().decode()
    for fam in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                "vllm:request_queue_time_seconds_count", "vllm:e2e_request_latency_seconds_sum",
                "vllm:iteration_tokens_total_bucket", "vllm:cache_config_info"):
        assert fam in text, fam
    for line in text.splitlines():
        if line.startswith("# HELP vllm:"):
            assert "[simulated]" in line
        elif line.startswith("vllm:"):
            assert 'simulated="true"' in line
    gen = [l for l in text.splitlines() if l.startswith("vllm:generation_tokens_total{")]
    assert float(gen[0].rsplit(" ", 1)[1]) == sum(r.generated for r in e.finished)


def test_prefix_cache_hits_with_a_shared_prefix():
    w = Workload(rate_per_s=20, duration_s=1, prompt_mean=600, prompt_max=1000, output_mean=8, output_max=16,
                 shared_prefix_tokens=512)
    e = small_engine(workload=w)
    e.run()
    s = e.sched
    assert s.prefix_hits_total > 0 and s.prefix_hits_total < s.prefix_queries_total
    assert s.prefix_hits_total % 512 == 0


def test_metrics_served_on_loopback():
    e = small_engine()
    e.run()
    port = e.metrics.serve(0)
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert r.status_code == 200 and "vllm:kv_cache_usage_perc" in r.text
        assert e.metrics._server.server_address[0] == "127.0.0.1"
    finally:
        e.metrics.close()


# ---- trace file -------------------------------------------------------------------------

def test_kineto_trace_round_trips_through_the_importer(tmp_path):
    from ridgeline.probes.kineto import load_trace
    e = small_engine(workload=Workload(rate_per_s=10, duration_s=0.5, prompt_mean=128, prompt_max=256,
                                       output_mean=16, output_max=32))
    e.run()
    t = e.drain()
    p = write_kineto(t, tmp_path / "sim.json.gz")
    doc = json.load(gzip.open(p))
    assert doc["metadata"]["simulated"] is True and "simulated" in doc["traceName"]
    back = load_trace(p)
    assert len(back.kernels) == len(t.kernels)
    assert np.array_equal(np.sort(back.kernels["grid_x"]), np.sort(t.kernels["grid_x"]))
    d_in = (t.kernels["end_ns"] - t.kernels["start_ns"]).sum()
    d_out = (back.kernels["end_ns"] - back.kernels["start_ns"]).sum()
    assert abs(int(d_in) - int(d_out)) <= len(t.kernels)          # microsecond floats keep the ns
    names_in = sorted(t.names[i] for i in t.kernels["name_id"][:500])
    names_out = sorted(back.names[i] for i in back.kernels["name_id"][:500])
    assert names_in == names_out
    assert (back.api["category"] == API_LAUNCH).sum() == len(t.kernels)


# ---- probe -------------------------------------------------------------------------------

def test_probe_streams_events_and_engine_scrapes():
    p = make_probe({"gpu": "H100-SXM", "model": "llama-3-8b", "rate_per_s": 8.0, "seed": 0, "speed": 4.0})
    assert p.check().ok and "SIMULATED" in p.check().reason
    p.start()
    try:
        import time
        got_events = got_scrape = 0
        end = time.monotonic() + 30               # until both came (30 polls in 1.5 s before)
        while time.monotonic() < end and not (got_events and got_scrape):
            time.sleep(0.05)
            d = p.poll()
            if not d:
                continue
            if "trace" in d:
                got_events += len(d["trace"].kernels)
                assert d["trace"].meta["source"] == "simulated"
            if "engine" in d or "scrapes" in d:
                got_scrape += 1
                for sc in (d.get("engine") or d)["scrapes"]:
                    # The simulated server's process, as the GPU events carry: engine and
                    # phase series join on it.
                    assert sc["pid"] == p.engine.cfg.pid and sc["pid"]
        assert got_events > 0 and got_scrape > 0
        c = p.counters()
        assert c["records"] >= got_events and c["drops"] == 0 and c["simulated"] is True
    finally:
        p.stop()
        p.stop()


def test_probe_check_reports_bad_config():
    p = SimulatorProbe(gpu="no-such-gpu")
    av = p.check()
    assert not av.ok and "no-such-gpu" in av.reason


# ---- CLI -------------------------------------------------------------------------------

def test_cli_writes_a_trace_and_summary(tmp_path, capsys):
    out = tmp_path / "t.json.gz"
    assert cli_main(["simulate", "--duration", "1", "--rate", "10", "--output-mean", "16",
                     "--trace", str(out)]) == 0
    text = capsys.readouterr().out
    assert "SIMULATED" in text and out.exists()


def test_cli_forward_mode(capsys):
    assert cli_main(["simulate", "--forward", "16x559", "--engine", "hf", "--model", "qwen1.5-0.5b"]) == 0
    assert "1018 kernels" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--gpu", "nope"], ["--model", "/no/such/config.json"], ["--engine", "trt"],
                                  ["--forward", "16by5"], ["--rate", "0"], ["--recorded-rate", "/no/file"],
                                  ["--model", "mixtral-8x7b"]])
def test_cli_bad_input_is_one_line(argv, capsys):
    assert cli_main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ridgeline: error:") and err.count("\n") == 1


def test_served_metrics_parse_as_a_vllm_v1_engine():
    from ridgeline.aggregator import engine_metrics
    from ridgeline.probes import prom_text
    e = small_engine()
    e.run()
    snap = engine_metrics.snapshot(prom_text.parse(e.metrics.text().decode()), 1, "simulated")
    assert snap["engine"] == "vllm"
    assert snap["version_hint"] == "vllm-v1>=0.11"           # kv_cache_usage_perc + inter_token_latency
    assert snap["gauges"]["kv_pool_tokens"] == e.pool.capacity_tokens   # from cache_config_info
    assert snap["counters"]["generation_tokens"] == sum(r.generated for r in e.finished)


def test_simulated_trace_through_ridgeline_analyze(tmp_path, capsys):
    out = tmp_path / "sim.json.gz"
    assert cli_main(["simulate", "--duration", "0.5", "--rate", "10", "--output-mean", "16", "--trace", str(out)]) == 0
    capsys.readouterr()
    assert cli_main(["analyze", "--json", "--model", "llama-3-8b", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["phases"]["decode"]["verdict"] == "memory-bound"
    assert doc["phases"]["prefill"]["verdict"] == "compute-bound"
