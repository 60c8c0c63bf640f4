"""Tiny random Hugging Face checkpoints for parity tests (built from a config, saved as safetensors)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

BASE = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

# name -> (HF config class, HF model class, config overrides)
VARIANTS = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-mha": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 1, "rope_theta": 1000000.0}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None, "head_dim": 32}),
}


def build_hf_model(variant: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random HF model whose weights are far from the tiny init (logits spread over several units)."""
    config_cls, model_cls, extra = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**{**BASE, **extra, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, 0.15)
    return model


def save_hf_model(model: transformers.PreTrainedModel, folder: Path, **kwargs) -> Path:
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


@torch.no_grad()
def hf_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """Logits [len, vocab] fp32 of every position of one unpadded sequence."""
    return model(torch.tensor([token_ids])).logits[0].float()
