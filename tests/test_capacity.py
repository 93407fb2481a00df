"""Capacity planning: the quantitative example of the issue, model-derived footprints, the CLI."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ridgeline.agent.cli import main
from ridgeline.aggregator import capacity, model_config

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9


def test_quantitative_example_80gb_gpu_15gb_weights():
    pool = capacity.kv_pool_bytes(80 * GB, 15 * GB, reserve_bytes=5 * GB)   # "about 60 GB for KV"
    assert pool == pytest.approx(60 * GB)
    assert capacity.concurrency_ceiling(pool, 0.5 * GB) == 120
    assert capacity.concurrency_ceiling(pool, 2 * GB) == 30


def test_footprint_from_model_config_and_context():
    shape = model_config.load("llama-3-8b")
    per_tok = capacity.kv_bytes_per_token(shape)
    assert per_tok == 2 * 32 * 8 * 128 * 2          # K+V x layers x KV heads x head dim x bf16 = 128 KiB
    plan = capacity.plan(pool_bytes=60 * capacity.GiB, bytes_per_token=per_tok, context_tokens=[4096, 16384])
    # 4k tokens -> 0.5 GiB per request -> 120; 16k -> 2 GiB -> 30.
    assert [r["concurrency_ceiling"] for r in plan["rows"]] == [120, 30]
    assert plan["rows"][0]["kv_per_request_bytes"] == 0.5 * capacity.GiB


def test_longer_outputs_lower_the_ceiling():
    per_tok = capacity.kv_bytes_per_token(model_config.load("llama-3-8b"))
    ceil = [capacity.plan(pool_bytes=60 * GB, bytes_per_token=per_tok, context_tokens=[2048],
                          output_tokens=o)["rows"][0]["concurrency_ceiling"] for o in (256, 1024, 4096)]
    assert ceil[0] > ceil[1] > ceil[2]


def test_memory_fraction_and_engine_pool_tokens():
    assert capacity.kv_pool_bytes(80 * GB, 16 * GB, memory_fraction=0.9) == pytest.approx(56 * GB)
    assert capacity.kv_pool_bytes(16 * GB, 20 * GB) == 0.0          # model does not fit: no KV at all
    # The real vLLM 0.11 sample: 2452 blocks x 16 tokens.
    assert capacity.ceiling_from_pool_tokens(2452 * 16, 1024) == 38
    with pytest.raises(ValueError):
        capacity.kv_pool_bytes(80 * GB, 15 * GB, memory_fraction=1.5)
    with pytest.raises(ValueError):
        capacity.concurrency_ceiling(60 * GB, 0)


@pytest.mark.parametrize("text,bytes_", [("80GB", 80e9), ("0.5 GiB", 0.5 * 2**30), ("60", 60e9), ("512MiB", 2**29)])
def test_parse_size(text, bytes_):
    assert capacity.parse_size(text) == bytes_


def test_cli_json_example(capsys):
    assert main(["capacity", "--gpu-memory", "80GB", "--weights", "15GB", "--reserve", "5GB",
                 "--kv-per-request", "0.5GB", "--kv-per-request", "2GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_pool_bytes"] == pytest.approx(60e9)
    assert [r["concurrency_ceiling"] for r in out["rows"]] == [120, 30]


def test_cli_text_with_model(capsys):
    assert main(["capacity", "--kv-pool", "60GiB", "--model", "llama-3-8b", "--context", "4096"]) == 0
    text = capsys.readouterr().out
    assert "KV per token 128 KiB (llama-3-8b)" in text and text.rstrip().endswith("120")


@pytest.mark.parametrize("args,msg", [
    (["--kv-per-request", "1GB"], "give --kv-pool"),
    (["--kv-pool", "60XB", "--kv-per-request", "1GB"], "unknown size unit"),
    (["--kv-pool", "60GB", "--context", "4096"], "--context needs --model"),
])
def test_cli_errors_one_line_exit_2(args, msg):
    r = subprocess.run([sys.executable, "-m", "ridgeline", "capacity", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_pool_from_real_engine_sample(capsys):
    from support.engine_samples import V011, MetricsServer, sample_text
    with MetricsServer(sample_text(V011)) as srv:
        assert main(["capacity", "--engine", srv.url, "--context", "1024", "--context", "2048",
                     "--output-tokens", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # 2452 blocks x 16 tokens = 39,232 tokens: 38 requests of 1k tokens, 19 of 2k.
    assert out["kv_pool_tokens"] == 39232 and [r["concurrency_ceiling"] for r in out["rows"]] == [38, 19]


def test_cli_engine_without_pool_exit_2():
    from support.engine_samples import V026, MetricsServer, sample_text
    with MetricsServer(sample_text(V026)) as srv:
        r = subprocess.run([sys.executable, "-m", "ridgeline", "capacity", "--engine", srv.url, "--context", "512"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "does not expose its KV pool size" in r.stderr


def test_cli_gpu_short_name_as_demo_and_simulate_take_it(capsys):
    """`--gpu h100` is the SXM part, the same entry `demo --gpu h100` and `simulate` use."""
    from ridgeline.agent.simulator.hardware import gpu_spec
    from ridgeline.aggregator import ceilings
    assert main(["capacity", "--gpu", "h100", "--weights", "16GB", "--kv-per-request", "1GB", "--json"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert "--gpu h100 is h100-sxm (80 GB)" in cap.err
    assert out["gpu_memory_bytes"] == ceilings.lookup("h100-sxm").memory_bytes == gpu_spec("h100").memory_bytes
    assert out["warnings"] == []
    # A name that is no short name and matches several parts stays ambiguous.
    with pytest.raises(Exception, match="ambiguous"):
        ceilings.lookup("a100")          # 40 or 80 GB: the part must be named


def test_cli_weights_larger_than_the_gpu_warn(capsys):
    assert main(["capacity", "--gpu-memory", "80GB", "--weights", "100GB", "--kv-per-request", "1GB"]) == 0
    cap = capsys.readouterr()
    assert cap.out.rstrip().endswith(" 0")            # the ceiling is still printed as computed
    (line,) = [ln for ln in cap.err.splitlines() if "warning" in ln]
    assert "weights 100.0 GB" in line and "80.0 GB" in line and "does not fit" in line
    assert main(["capacity", "--gpu-memory", "80GB", "--weights", "100GB", "--kv-per-request", "1GB",
                 "--json"]) == 0
    assert "does not fit" in json.loads(capsys.readouterr().out)["warnings"][0]
