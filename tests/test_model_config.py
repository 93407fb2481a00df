"""Model shapes from Hugging Face configs: weights, KV bytes per token, FLOPs per token."""
import json

import pytest

from ridgeline.aggregator import model_config
from ridgeline.probes.errors import InputError


def test_llama3_8b_weights_and_kv():
    m = model_config.builtin("llama-3-8b")
    # Meta-Llama-3-8B has 8.03 B parameters.
    assert m.param_count == pytest.approx(8.03e9, rel=0.01)
    assert m.weight_bytes == pytest.approx(2 * m.param_count)
    # 2 (K,V) x 32 layers x 8 kv heads x 128 dim x 2 bytes = 131072 bytes per token.
    assert m.kv_bytes_per_token == 131072
    assert m.head_dim == 128


def test_qwen15_05b():
    m = model_config.builtin("qwen1.5-0.5b")
    assert m.param_count == pytest.approx(464e6, rel=0.01)      # 0.46 B with tied embeddings
    assert m.kv_bytes_per_token == 2 * 24 * 16 * 64 * 2
    # Per layer: q,k,v,o 4*1024^2 + MLP 3*1024*2816 -> 2 FLOPs per weight per token.
    per_layer = 4 * 1024 * 1024 + 3 * 1024 * 2816 + 3 * 1024   # + qkv bias
    assert m.linear_flops_per_token() == 2 * 24 * per_layer


def test_qwen3_head_dim_and_gqa():
    m = model_config.builtin("qwen3-0.6b")
    assert (m.num_heads, m.num_kv_heads, m.head_dim) == (16, 8, 128)
    assert m.q_dim == 2048 and m.kv_dim == 1024
    assert m.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2


def test_gpt_oss_120b_moe_mxfp4():
    m = model_config.builtin("gpt-oss-120b")
    assert m.is_moe and m.num_experts == 128 and m.experts_per_token == 4
    assert m.param_count == pytest.approx(117e9, rel=0.02)       # "117B parameters"
    # MXFP4 experts: ~4.25 bits per parameter -> about 63 GB of weights in all.
    assert 55e9 < m.weight_bytes < 70e9
    # A decode token touches 4 of 128 experts: far fewer FLOPs than all parameters.
    assert m.linear_flops_per_token() < 2 * 6e9
    assert m.experts_touched(1) == pytest.approx(4.0)
    assert m.experts_touched(10_000) == pytest.approx(128.0)
    # Weights read per step grow with the experts the tokens touch.
    assert m.weight_bytes_read(1) < m.weight_bytes_read(64) < m.weight_bytes_read(4096)


def test_mixtral_from_hf_config(tmp_path):
    cfg = dict(model_config.BUILTIN["mixtral-8x7b"])
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    m = model_config.load(tmp_path)        # folder holding config.json
    assert m.param_count == pytest.approx(46.7e9, rel=0.01)
    assert m.expert_params == 3 * 4096 * 14336


def test_multimodal_text_config_and_defaults():
    m = model_config.from_hf_config({"text_config": {"hidden_size": 512, "num_hidden_layers": 2,
                                                     "num_attention_heads": 8, "vocab_size": 1000,
                                                     "intermediate_size": 1024}, "torch_dtype": "float16"})
    assert m.num_kv_heads == 8 and m.head_dim == 64 and m.dtype == "float16"


@pytest.mark.parametrize("content,msg", [
    ("{not json", "not JSON"),
    ('{"hidden_size": 1}', "needs hidden_size"),
    ("[1, 2]", "expected a JSON object"),
    ('{"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 10, '
     '"num_local_experts": 8}', "num_experts_per_tok"),
])
def test_bad_configs(tmp_path, content, msg):
    f = tmp_path / "config.json"
    f.write_text(content)
    with pytest.raises(InputError, match=msg):
        model_config.load(f)


def test_unknown_model_name():
    with pytest.raises(InputError, match="no such model config"):
        model_config.load("llama-9000")
