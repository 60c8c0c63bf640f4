"""What every rank does the same way: its device, its shard of the weights, its KV cache size."""

from __future__ import annotations

import logging
import time

import torch

from pagedinfer.engine.config import EngineConfig
from pagedinfer.engine.models.loader import ModelLoadPlan, resolve_dtype
from pagedinfer.engine.parallel.group import TPGroup
from pagedinfer.engine.parallel.model import TensorParallelLlama
from pagedinfer.engine.parallel.plan import ShardPlan
from pagedinfer.engine.parallel.weights import shard_weights
from pagedinfer.engine.worker.kv_cache import CompanionPool, determine_num_blocks, profiling_forward

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
    profile = (
        profiling_forward(model, model.rank_config, config, model.device, model.dtype, backend)
        if model.device.type == "cuda"
        else None
    )
    num_blocks = determine_num_blocks(
        model.rank_config, config.cache, model.device, model.dtype, profile, companion=companion
    )
    return model.group.min_int(num_blocks)
