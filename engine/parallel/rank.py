"""What every rank does the same way: its device, its shard of the weights, its KV cache size."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from pagedinfer.engine.config import EngineConfig
from pagedinfer.engine.models.loader import ModelLoadPlan, resolve_dtype
from pagedinfer.engine.parallel.group import TPGroup
from pagedinfer.engine.parallel.model import TensorParallelLlama
from pagedinfer.engine.parallel.plan import ShardPlan
from pagedinfer.engine.parallel.weights import shard_weights
from pagedinfer.engine.worker.attn_metadata import AttentionMetadata
from pagedinfer.engine.worker.kv_cache import CompanionPool, allocate_kv_caches, determine_num_blocks

logger = logging.getLogger(__name__)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU after rank 0's (cuda:N -> cuda:N+r); the CPU for every rank."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def load_rank_model(
    config: EngineConfig, load_plan: ModelLoadPlan, group: TPGroup, device: torch.device
) -> TensorParallelLlama:
    """Allocate this rank's shard and read only its slices of the checkpoint."""
    start = time.perf_counter()
    shard = ShardPlan(load_plan.model_config, group.world_size, group.rank)
    model = TensorParallelLlama(shard, group, resolve_dtype(config.device.dtype, device), device)
    model.requires_grad_(False)
    model.load_weights(shard_weights(load_plan.checkpoint, shard))
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "rank %d/%d: loaded its shard of %s (%.1fM params) on %s in %.1f s",
        group.rank,
        group.world_size,
        config.model,
        num_params / 1e6,
        device,
        time.perf_counter() - start,
    )
    return model


def agree_num_blocks(
    model: TensorParallelLlama, config: EngineConfig, backend: str | None, companion: CompanionPool | None
) -> int:
    """Every rank sizes its own KV cache (its heads, its free memory after a profiling forward
    that all ranks run together), then all take the smallest count: the block tables are shared."""
    profile = _profile_fn(model, config, backend) if model.device.type == "cuda" else None
    num_blocks = determine_num_blocks(
        model.rank_config, config.cache, model.device, model.dtype, profile, companion=companion
    )
    return model.group.min_int(num_blocks)


def _profile_fn(model: TensorParallelLlama, config: EngineConfig, backend: str | None) -> Callable[[], None]:
    """One forward (collectives included) at the largest step the scheduler can send."""
    num_tokens = config.scheduler.max_num_batched_tokens
    block_size = config.cache.block_size
    num_blocks = -(-num_tokens // block_size)
    device, mc = model.device, model.rank_config

    @torch.inference_mode()
    def run() -> None:
        caches = allocate_kv_caches(mc, num_blocks, block_size, device, model.dtype)
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
