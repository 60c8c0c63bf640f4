"""Named model shapes that benchmarks and GPU tests build with random weights (no checkpoint)."""

from __future__ import annotations

from pagedinfer.engine.config import ModelConfig

# Llama-3-8B: 32 layers, hidden 4096, GQA 32 query / 8 KV heads of 128, vocab 128256, untied head.
LLAMA3_8B = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
)
