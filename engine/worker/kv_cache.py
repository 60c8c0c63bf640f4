"""Paged KV cache: per-layer K and V block pools, and how many blocks fit in memory.

Layout per layer: key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim]
(block = a page of block_size slots; slot = block_id * block_size + offset). With tensor
parallelism each rank holds its share of the KV heads: pass `tp_size` and every size below is
per rank (num_kv_heads // tp_size); nothing else changes.

Sizing: an explicit `CacheConfig.num_blocks` wins. On the CPU the budget is
`CacheConfig.cpu_kv_cache_bytes`. On CUDA `gpu_memory_utilization` is this instance's share of
the device (as in vLLM): `utilization * total` minus this process's torch peak after a profiling
forward pass (weights, peak activations), and never more than what is actually free minus a
headroom for the CUDA context and graphs. A second pool sized with it (a draft model's KV cache,
`CompanionPool`) comes out of the same budget. Other processes on the same GPU (a second engine, a
benchmark peer) therefore shrink the budget only when memory really runs short.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedinfer.engine.config import CacheConfig, EngineConfig, ModelConfig
from pagedinfer.engine.worker.attn_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
_CUDA_HEADROOM_BYTES = 512 * 2**20  # CUDA graphs, cuBLAS workspaces, allocator slack


@dataclass(frozen=True)
class CompanionPool:
    """Another KV pool paid from the same budget: one of its blocks per target block, up to
    `max_blocks` (a draft model's cache never needs more than its drafting sequences hold)."""

    block_bytes: int
    max_blocks: int | None = None


class KVCacheSizeError(ValueError):
    """The configuration leaves no room for even one KV block, or the request is malformed."""


def kv_heads_per_rank(model_config: ModelConfig, tp_size: int = 1) -> int:
    """KV heads one tensor-parallel rank stores (heads are split, never replicated, here)."""
    if tp_size < 1 or model_config.num_kv_heads % tp_size:
        raise KVCacheSizeError(
            f"num_kv_heads {model_config.num_kv_heads} is not divisible by tp_size {tp_size}"
        )
    return model_config.num_kv_heads // tp_size


def block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one block across all layers, K and V (per rank)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = block_size * kv_heads_per_rank(model_config, tp_size) * model_config.head_dim * elem
    return 2 * model_config.num_layers * per_layer


def allocate_kv_caches(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    tp_size: int = 1,
) -> KVCaches:
    """One (key_cache, value_cache) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim].

    Zero-filled so that a never-written slot reads as zeros rather than NaN garbage.
    """
    if num_blocks < 1 or block_size < 1:
        raise KVCacheSizeError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
    shape = (num_blocks, block_size, kv_heads_per_rank(model_config, tp_size), model_config.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(model_config.num_layers)
    ]


def _cuda_free_bytes_after(
    profile: Callable[[], None] | None, device: torch.device, utilization: float
) -> int:
    """The KV budget on a CUDA device: utilization * total minus everything in use at the peak."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    if profile is not None:
        profile()  # a forward pass at the largest batch the scheduler will send
        torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # activations of the profile go back to the device
    free, total = torch.cuda.mem_get_info(device)
    torch_peak = torch.cuda.max_memory_allocated(device)
    # Activations are freed again after the profile: the KV cache may use what they held only up
    # to the instance's share, and never more than is free now (minus headroom for graphs etc.).
    activations = torch_peak - torch.cuda.memory_allocated(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)  # context + other processes
    budget = min(int(utilization * total) - torch_peak, free - activations - _CUDA_HEADROOM_BYTES)
    logger.info(
        "KV budget on %s: %.2f GiB (total %.2f, torch peak %.2f, other %.2f, utilization %.2f)",
        device,
        budget / 2**30,
        total / 2**30,
        torch_peak / 2**30,
        non_torch / 2**30,
        utilization,
    )
    return budget


def determine_num_blocks(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    profile: Callable[[], None] | None = None,
    tp_size: int = 1,
    companion: CompanionPool | None = None,
) -> int:
    """How many KV blocks to allocate (see the module docstring for the policy).

    `profile` (CUDA only) runs one forward pass at peak batch size so the measured peak includes
    activations; without it only the current allocations (e.g. the weights) are subtracted.
    """
    if cache_config.num_blocks is not None:
        if cache_config.num_blocks < 1:
            raise KVCacheSizeError(f"CacheConfig.num_blocks must be >= 1, got {cache_config.num_blocks}")
        return cache_config.num_blocks
    device = torch.device(device)
    per_block = block_bytes(model_config, cache_config.block_size, dtype, tp_size)
    if device.type == "cuda":
        if not 0.0 < cache_config.gpu_memory_utilization <= 1.0:
            raise KVCacheSizeError(
                f"gpu_memory_utilization must lie in (0, 1], got {cache_config.gpu_memory_utilization}"
            )
        budget = _cuda_free_bytes_after(profile, device, cache_config.gpu_memory_utilization)
    else:
        budget = cache_config.cpu_kv_cache_bytes
    num_blocks = _split_budget(budget, per_block, companion)
    if num_blocks < 1:
        raise KVCacheSizeError(
            f"no room for the KV cache on {device}: budget {budget} bytes < one block of {per_block} bytes"
        )
    return int(num_blocks)


def _split_budget(budget: int, per_block: int, companion: CompanionPool | None) -> int:
    """Target blocks N with N * per_block + min(N, max) * companion bytes (+ its scratch) <= budget."""
    if companion is None or companion.block_bytes == 0:
        return budget // per_block
    budget -= companion.block_bytes  # the companion's scratch block
    num_blocks = budget // (per_block + companion.block_bytes)
    cap = companion.max_blocks
    if cap is not None and num_blocks > cap:  # the companion stops growing at its cap
        num_blocks = (budget - cap * companion.block_bytes) // per_block
    return num_blocks


def profiling_forward(
    model, mc: ModelConfig, config: EngineConfig, device, dtype, backend
) -> Callable[[], None]:
    """One forward at the largest step the scheduler can send, on a throwaway cache (a
    tensor-parallel rank's model runs its collectives in it too): what determine_num_blocks
    measures the peak memory of."""
    num_tokens = config.scheduler.max_num_batched_tokens
    block_size = config.cache.block_size
    num_blocks = -(-num_tokens // block_size)

    @torch.inference_mode()
    def run() -> None:
        caches = allocate_kv_caches(mc, num_blocks, block_size, device, dtype)
        md = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=device),
            positions=torch.arange(num_tokens, device=device) % mc.max_position_embeddings,
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
            logits_indices=torch.zeros(config.scheduler.max_num_seqs, dtype=torch.long, device=device),
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            is_pure_decode=False,
            backend=backend,
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        hidden = model(ids, md.positions, caches, md)
        model.compute_logits(hidden[md.logits_indices], backend=backend)
        del caches

    return run
