"""Assemble an EngineCore from an EngineConfig: load, size and allocate the KV cache, capture graphs.

Startup phases are reported through `on_phase` ("loading_weights", "allocating_kv_cache",
"capturing_graphs") so servers can show progress while a large model loads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedinfer.engine.config import EngineConfig
from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.core.scheduler import Scheduler
from pagedinfer.engine.engine_core import EngineCore
from pagedinfer.engine.spec_decode.factory import (
    build_speculative_decoder,
    draft_block_bytes,
    draft_blocks_per_seq,
    load_draft_model,
)
from pagedinfer.engine.structured.compiler import GrammarCompiler
from pagedinfer.engine.structured.masks import GrammarMasker
from pagedinfer.engine.worker.model_runner import ModelRunner
from pagedinfer.engine.worker.step_types import RunnerConfig
from pagedinfer.kernels import ops

logger = logging.getLogger(__name__)


@dataclass
class BuiltEngine:
    core: EngineCore
    model_config: object
    tokenizer: object
    max_model_len: int
    device: torch.device


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_engine(config: EngineConfig, on_phase: Callable[[str], None] = lambda phase: None) -> BuiltEngine:
    """Load the model and everything around it; blocking (call it off the event loop)."""
    from pagedinfer.engine.models.loader import load_model

    torch.manual_seed(config.seed)
    device = resolve_device(config.device.device)
    on_phase("loading_weights")
    if config.tensor_parallel_size > 1:
        from pagedinfer.engine.parallel.driver import start_tensor_parallel

        tp = start_tensor_parallel(config, device, on_phase)
        try:
            return assemble_engine(config, tp.model, tp.tokenizer, on_phase, parallel=tp)
        except BaseException:  # (no room for the KV cache, a draft model that fails to load, ...)
            tp.model.workers.close()  # the workers and the process group go with the failed build
            tp.model.shard.group.close()
            raise
    loaded = load_model(config.model, device, config.device.dtype, config.revision)
    return assemble_engine(config, loaded.model, loaded.tokenizer, on_phase)


def assemble_engine(
    config: EngineConfig,
    model,
    tokenizer=None,
    on_phase: Callable[[str], None] = lambda phase: None,
    parallel=None,
) -> BuiltEngine:
    """Everything around an already loaded model (benchmarks pass random-weight models here).

    `parallel` (a parallel.driver.TensorParallelEngine, `model` its DriverModel): the workers
    size their KV caches with rank 0, which holds only its heads; steps run eagerly.
    """
    from pagedinfer.engine.worker.kv_cache import (
        CompanionPool,
        allocate_kv_caches,
        determine_num_blocks,
        profiling_forward,
    )

    mc = model.config
    device, dtype = model.device, model.dtype
    sched_cfg, spec_cfg = config.scheduler, config.speculative
    max_model_len = min(sched_cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    block_size = config.cache.block_size
    backend = ops.select_backend(device, config.device.attention_backend)

    on_phase("allocating_kv_cache")
    # The draft model (weights now, KV blocks with the target's) comes out of the same budget.
    draft = load_draft_model(spec_cfg, model, tokenizer)
    per_seq = draft_blocks_per_seq(spec_cfg, block_size, max_model_len)
    draft_pool = CompanionPool(draft_block_bytes(draft, block_size, dtype), spec_cfg.max_batch_size * per_seq)
    if parallel is None:
        profile = (
            profiling_forward(model, mc, config, device, dtype, backend) if device.type == "cuda" else None
        )
        num_blocks = determine_num_blocks(mc, config.cache, device, dtype, profile, companion=draft_pool)
        kv_config, runner_class = mc, ModelRunner
    else:
        num_blocks = parallel.agree_num_blocks(config, backend, draft_pool)
        kv_config, runner_class = parallel.rank_config, parallel.runner_class
    num_blocks -= 1  # the target's scratch block
    if num_blocks < 1:
        raise ValueError("no room for the KV cache")
    kv_caches = allocate_kv_caches(kv_config, num_blocks + 1, block_size, device, dtype)
    eos = tuple(dict.fromkeys([*mc.eos_token_ids, *(getattr(tokenizer, "stop_token_ids", ()) or ())]))
    runner = runner_class(
        model,
        kv_caches,
        RunnerConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=sched_cfg.max_num_seqs,
            max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
            max_model_len=max_model_len,
            device=device,
            attention_backend=backend,
            enable_cuda_graphs=config.device.enable_cuda_graphs and parallel is None,
            eos_token_ids=eos,
            num_speculative_tokens=spec_cfg.num_speculative_tokens if spec_cfg.method else 0,
            max_verify_seqs=spec_cfg.max_batch_size,
        ),
    )
    if tokenizer is not None:  # structured outputs compile against the tokenizer's vocabulary
        runner.grammar = GrammarMasker(GrammarCompiler(tokenizer, mc.vocab_size, eos), device)
    on_phase("capturing_graphs")
    runner.capture_cuda_graphs()
    watermark = int(num_blocks * sched_cfg.watermark_blocks_fraction)
    kv = KVCacheManager(
        num_blocks,
        block_size,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        watermark_blocks=watermark,
    )
    scheduler = Scheduler(sched_cfg, kv, max_model_len)
    spec = build_speculative_decoder(
        config.speculative,
        model,
        tokenizer,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        attention_backend=backend,
        draft_model=draft,
    )
    if spec is not None and runner.graphs is not None:
        spec.capture_cuda_graphs(sched_cfg.max_num_seqs)  # the draft model's steps
    core = EngineCore(
        scheduler,
        runner,
        tokenizer,
        eos_token_ids=eos,
        vocab_size=mc.vocab_size,
        seed=config.seed,
        spec_decoder=spec,
        # With a speculative decoder, steps whose batch drafts stay synchronous (EngineCore)
        async_scheduling=(
            sched_cfg.async_scheduling if sched_cfg.async_scheduling is not None else device.type == "cuda"
        ),
    )
    logger.info(
        "engine ready: %d KV blocks of %d slots, max_model_len %d on %s",
        num_blocks,
        block_size,
        max_model_len,
        device,
    )
    return BuiltEngine(core, mc, tokenizer, max_model_len, device)
