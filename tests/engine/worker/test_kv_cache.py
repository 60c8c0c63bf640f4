"""KV cache allocation and sizing (CPU budget, explicit count, tensor-parallel shares, CUDA profile)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedinfer.engine.config import CacheConfig, ModelConfig
from pagedinfer.engine.worker.kv_cache import (
    CompanionPool,
    KVCacheSizeError,
    allocate_kv_caches,
    block_bytes,
    determine_num_blocks,
    kv_heads_per_rank,
)

SMOLLM2 = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
)


def test_allocate_shapes_dtype_and_zeros():
    caches = allocate_kv_caches(SMOLLM2, num_blocks=7, block_size=16, device="cpu", dtype=torch.bfloat16)
    assert len(caches) == 30
    for key, value in caches:
        assert key.shape == value.shape == (7, 16, 3, 64)
        assert key.dtype == torch.bfloat16 and not key.any() and key.data_ptr() != value.data_ptr()


def test_block_bytes():
    # 2 (K, V) * 30 layers * 16 slots * 3 heads * 64 dims * 4 bytes
    assert block_bytes(SMOLLM2, 16, torch.float32) == 2 * 30 * 16 * 3 * 64 * 4 == 737_280
    assert block_bytes(SMOLLM2, 16, torch.bfloat16) == 737_280 // 2


def test_cpu_budget_and_explicit_count():
    config = CacheConfig(block_size=16, cpu_kv_cache_bytes=100 * 737_280 + 5)
    assert determine_num_blocks(SMOLLM2, config, "cpu", torch.float32) == 100
    assert determine_num_blocks(SMOLLM2, config, "cpu", torch.bfloat16) == 200
    explicit = dataclasses.replace(config, num_blocks=12)
    assert determine_num_blocks(SMOLLM2, explicit, "cpu", torch.float32) == 12


def test_draft_pool_comes_out_of_the_same_budget():
    per_block = 737_280  # SmolLM2 fp32 block
    draft = per_block // 10  # a 3-layer draft of the same heads
    config = CacheConfig(block_size=16, cpu_kv_cache_bytes=100 * per_block)
    # One draft block per target block (and its scratch block): N (t + d) + d <= budget.
    n = determine_num_blocks(SMOLLM2, config, "cpu", torch.float32, companion=CompanionPool(draft))
    assert n == (100 * per_block - draft) // (per_block + draft) == 90
    assert n * per_block + (n + 1) * draft <= 100 * per_block
    # A capped draft pool (few sequences draft at once) leaves the rest to the target.
    capped = CompanionPool(draft, max_blocks=20)
    n = determine_num_blocks(SMOLLM2, config, "cpu", torch.float32, companion=capped)
    assert n == (100 * per_block - 21 * draft) // per_block == 97
    assert determine_num_blocks(SMOLLM2, config, "cpu", torch.float32, companion=CompanionPool(0)) == 100


def test_sizing_errors():
    with pytest.raises(KVCacheSizeError, match="no room"):
        determine_num_blocks(SMOLLM2, CacheConfig(cpu_kv_cache_bytes=1000), "cpu", torch.float32)
    with pytest.raises(KVCacheSizeError, match="num_blocks must be >= 1"):
        determine_num_blocks(SMOLLM2, CacheConfig(num_blocks=0), "cpu", torch.float32)
    with pytest.raises(KVCacheSizeError, match=">= 1"):
        allocate_kv_caches(SMOLLM2, 0, 16, "cpu", torch.float32)


def test_tensor_parallel_share():
    assert kv_heads_per_rank(SMOLLM2, 3) == 1
    caches = allocate_kv_caches(SMOLLM2, 2, 16, "cpu", torch.float32, tp_size=3)
    assert caches[0][0].shape == (2, 16, 1, 64)
    assert block_bytes(SMOLLM2, 16, torch.float32, tp_size=3) == 737_280 // 3
    with pytest.raises(KVCacheSizeError, match="not divisible"):
        kv_heads_per_rank(SMOLLM2, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_budget_subtracts_profiled_peak():
    config = CacheConfig(block_size=16, gpu_memory_utilization=0.5)
    idle = determine_num_blocks(SMOLLM2, config, "cuda", torch.bfloat16)
    per_block = block_bytes(SMOLLM2, 16, torch.bfloat16)

    def profile():  # a 2 GiB activation peak
        torch.empty(2 << 30, dtype=torch.uint8, device="cuda")

    busy = determine_num_blocks(SMOLLM2, config, "cuda", torch.bfloat16, profile=profile)
    assert abs((idle - busy) * per_block - (2 << 30)) <= 2 * per_block + (64 << 20)
