"""engine/parallel/plan.py: who holds which heads, columns and vocabulary rows; clear errors."""

from __future__ import annotations

import dataclasses

import pytest

from pagedinfer.engine.config import ModelConfig
from pagedinfer.engine.parallel.plan import (
    ShardPlan,
    TensorParallelConfigError,
    WeightSlice,
    check_tensor_parallel,
)

SMOLLM2 = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 8192, tie_word_embeddings=True)
LLAMA3_8B = ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 8192)


def test_head_count_tp_does_not_divide_names_the_numbers():
    with pytest.raises(
        TensorParallelConfigError, match="size 2 does not divide the model's 9 attention heads"
    ):
        check_tensor_parallel(SMOLLM2, 2)
    with pytest.raises(TensorParallelConfigError, match="6 is larger than the model's 4 KV heads"):
        check_tensor_parallel(dataclasses.replace(SMOLLM2, num_heads=12, num_kv_heads=4), 6)
    with pytest.raises(TensorParallelConfigError, match="intermediate size 1000"):
        check_tensor_parallel(dataclasses.replace(LLAMA3_8B, intermediate_size=1000, num_kv_heads=8), 16)
    check_tensor_parallel(SMOLLM2, 3)
    check_tensor_parallel(LLAMA3_8B, 8)


def test_kv_heads_split_then_replicated():
    # 8 KV heads over 2 ranks: 4 each; over 16 ranks: each head on 2 consecutive ranks
    assert [(p.kv_head_start, p.num_kv_heads) for p in (ShardPlan(LLAMA3_8B, 2, r) for r in range(2))] == [
        (0, 4),
        (4, 4),
    ]
    wide = dataclasses.replace(LLAMA3_8B, num_heads=64)
    starts = [ShardPlan(wide, 16, r).kv_head_start for r in range(16)]
    assert starts == [r // 2 for r in range(16)]
    # every rank's query heads read exactly its KV heads (GQA group = heads // kv_heads)
    for r in range(16):
        plan = ShardPlan(wide, 16, r)
        group = wide.num_heads // wide.num_kv_heads
        assert {h // group for h in range(plan.head_start, plan.head_start + plan.num_heads)} == {
            plan.kv_head_start
        }


def test_weight_slices_and_vocab_padding():
    config = dataclasses.replace(SMOLLM2, vocab_size=49153)
    last = ShardPlan(config, 3, 2)
    assert last.vocab_size == 16385 and (last.vocab_start, last.vocab_end) == (32770, 49153)
    assert last.weight_slice("model.embed_tokens.weight") == WeightSlice(0, 32770, 49153, pad_to=16385)
    d = config.head_dim
    assert last.weight_slice("model.layers.0.self_attn.q_proj.weight") == WeightSlice(0, 6 * d, 9 * d)
    assert last.weight_slice("model.layers.0.self_attn.k_proj.bias") == WeightSlice(0, 2 * d, 3 * d)
    assert last.weight_slice("model.layers.3.self_attn.o_proj.weight") == WeightSlice(1, 6 * d, 9 * d)
    assert last.weight_slice("model.layers.3.mlp.up_proj.weight") == WeightSlice(0, 1024, 1536)
    assert last.weight_slice("model.layers.3.mlp.down_proj.weight") == WeightSlice(1, 1024, 1536)
    assert last.weight_slice("model.layers.3.input_layernorm.weight") is None
    rank = last.rank_config()
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate_size, rank.vocab_size) == (3, 1, 512, 16385)
