"""ModelConfig from config.json variants; rope frequencies against transformers; layer numerics."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedinfer.engine.config import RopeScaling
from pagedinfer.engine.models.config_loader import model_config_from_hf
from pagedinfer.engine.models.errors import UnsupportedModelError
from pagedinfer.engine.models.layers.rms_norm import RMSNorm
from pagedinfer.engine.models.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq

LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
}


def test_llama31_v4_style_config():
    config = model_config_from_hf(LLAMA31, "config.json", {"eos_token_id": [128001, 128009, 128004]})
    assert (config.architecture, config.head_dim, config.num_queries_per_kv) == ("llama", 128, 4)
    assert config.rope_theta == 500000.0 and config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert config.eos_token_ids == (128001, 128008, 128009, 128004) and config.bos_token_id == 128000
    assert not config.attention_bias and not config.tie_word_embeddings


def test_sliding_window_caps_the_context():
    mistral = {
        **LLAMA31,
        "architectures": ["MistralForCausalLM"],
        "rope_scaling": None,
        "sliding_window": 4096,
    }
    assert model_config_from_hf(mistral, "config.json").max_position_embeddings == 4096
    qwen = {**mistral, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False}
    assert model_config_from_hf(qwen, "config.json").max_position_embeddings == 131072


def test_qwen2_has_qkv_bias_and_unknown_archs_fail():
    qwen = {**LLAMA31, "architectures": ["Qwen2ForCausalLM"], "rope_scaling": None}
    assert model_config_from_hf(qwen, "config.json").attention_bias
    with pytest.raises(UnsupportedModelError, match="config.json: unsupported architecture"):
        model_config_from_hf({**LLAMA31, "architectures": ["FalconForCausalLM"]}, "config.json")


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "linear", "factor": 4.0},
    ],
)
def test_inv_freq_matches_transformers(rope):
    hf_config = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, rope_parameters={**rope, "rope_theta": 500000.0}
    )
    expected, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    assert attention_factor == 1.0
    config = model_config_from_hf({**LLAMA31, "rope_scaling": rope}, "config.json")
    ours = compute_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.allclose(ours, expected, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, compute_inv_freq(128, 500000.0, None))  # the scaling matters


def test_rotary_is_a_rotation_and_relative():
    rope = RotaryEmbedding(64, 10000.0, None, "cpu")
    q, k = torch.randn(1, 2, 64), torch.randn(1, 2, 64)
    scores = []
    for shift in (0, 37):
        cq, sq = rope(torch.tensor([5 + shift]))
        ck, sk = rope(torch.tensor([2 + shift]))
        rq, rk = apply_rotary(q, cq, sq), apply_rotary(k, ck, sk)
        assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
        scores.append((rq * rk).sum(-1))
    assert torch.allclose(scores[0], scores[1], atol=1e-4)  # depends only on the distance 3


def test_rms_norm_fused_residual():
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    h = x + residual
    expected = norm.weight * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    out, new_residual = norm(x, residual)
    assert torch.allclose(out, expected, atol=1e-6) and torch.equal(new_residual, h)
