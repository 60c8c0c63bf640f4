"""Build the speculative decoder an EngineConfig asks for (None when speculation is off).

Two phases so the draft model's memory counts against the engine's budget: `load_draft_model`
(weights, before the target's KV cache is sized) and `draft_block_bytes` (what one draft KV block
costs, sized together with the target's blocks); then `build_speculative_decoder`.
"""

from __future__ import annotations

import torch

from pagedinfer.engine.config import SpeculativeConfig
from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.spec_decode.controller import SpeculativeDecoder
from pagedinfer.engine.spec_decode.device_chain import DeviceNgramChain
from pagedinfer.engine.spec_decode.draft_model import (
    DraftModelError,
    DraftModelProposer,
    check_same_vocabulary,
)
from pagedinfer.engine.spec_decode.ngram import NgramProposer
from pagedinfer.engine.spec_decode.ngram_keys import MATCH_MODES, match_keys
from pagedinfer.engine.spec_decode.proposer import Proposer
from pagedinfer.engine.spec_decode.self_draft import SELF_PREFIX, LayerSubsetDraft, parse_layer_ids

METHODS = (None, "ngram", "draft")


def _check_method(config: SpeculativeConfig) -> None:
    if config.method not in METHODS:
        raise ValueError(f"unknown speculative method {config.method!r}; expected one of {METHODS}")
    if config.method is not None and config.num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {config.num_speculative_tokens}")
    if config.ngram_match not in MATCH_MODES:
        raise ValueError(
            f"unknown speculative ngram_match {config.ngram_match!r}; expected one of {MATCH_MODES}"
        )
    if config.device_chain_steps < 1:
        raise ValueError(f"speculative device_chain_steps must be >= 1, got {config.device_chain_steps}")


def load_draft_model(config: SpeculativeConfig, target_model, target_tokenizer):
    """The draft model of method 'draft' (carved out of the target, or loaded); None otherwise."""
    _check_method(config)
    if config.method != "draft":
        return None
    if not config.draft_model:
        raise DraftModelError("speculative method 'draft' needs speculative.draft_model")
    if config.draft_model.startswith(SELF_PREFIX):
        layer_ids = parse_layer_ids(config.draft_model, target_model.config.num_layers)
        return LayerSubsetDraft(target_model, layer_ids)
    from pagedinfer.engine.models.loader import load_model

    loaded = load_model(config.draft_model, target_model.device, target_model.dtype)
    check_same_vocabulary(target_tokenizer, loaded.tokenizer)
    return loaded.model


def draft_block_bytes(draft_model, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one draft KV block (all its layers, K and V); 0 without a draft model."""
    from pagedinfer.engine.worker.kv_cache import block_bytes

    return 0 if draft_model is None else block_bytes(draft_model.config, block_size, dtype)


def build_speculative_decoder(
    config: SpeculativeConfig,
    target_model,
    target_tokenizer,
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    attention_backend: str | None = None,
    draft_model=None,
) -> SpeculativeDecoder | None:
    """The engine's speculative collaborator; `num_blocks` caps the draft model's own KV pool.

    `draft_model`: from `load_draft_model` (loaded here when not given).
    """
    _check_method(config)
    if config.method is None:
        return None
    keys = None  # the prompt lookup's match keys (n-gram only: a draft model's chain searches not)
    if config.method == "ngram":
        keys = match_keys(config.ngram_match, target_tokenizer, int(target_model.config.vocab_size))
        proposer: Proposer = NgramProposer(
            config.ngram_min, config.ngram_max, config.num_speculative_tokens, match_keys=keys
        )
    else:
        draft = draft_model or load_draft_model(config, target_model, target_tokenizer)
        proposer = _draft_proposer(
            config, draft, target_model, num_blocks, block_size, max_model_len, attention_backend
        )
    # Greedy batches accept on the device and plan steps ahead; their drafts come from the
    # chain's prompt lookup (n-gram) or from the draft model run there (draft).
    chain = None
    if config.device_chain:
        chain = DeviceNgramChain(
            config.max_batch_size,
            max_model_len,
            config.num_speculative_tokens,
            config.ngram_min,
            config.ngram_max,
            torch.device(target_model.device),
            attention_backend,
            search=config.method == "ngram",
            match_keys=keys,
        )
    return SpeculativeDecoder(config, proposer, max_model_len, device_chain=chain)


def draft_blocks_per_seq(config: SpeculativeConfig, block_size: int, max_model_len: int) -> int:
    """Blocks one drafting sequence can need: its context plus K drafts."""
    return -(-(max_model_len + config.num_speculative_tokens) // block_size)


def _draft_proposer(
    config, draft, target_model, num_blocks, block_size, max_model_len, attention_backend
) -> DraftModelProposer:
    """Give the draft model its own paged KV cache (plus one scratch block for CUDA graphs)."""
    from pagedinfer.engine.worker.kv_cache import allocate_kv_caches

    # Only up to max_batch_size sequences draft at once; each needs room for its context + K.
    per_seq = draft_blocks_per_seq(config, block_size, max_model_len)
    num_blocks = max(min(num_blocks, config.max_batch_size * per_seq), 1)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    kv_caches = allocate_kv_caches(
        draft.config, num_blocks + 1, block_size, target_model.device, target_model.dtype
    )
    return DraftModelProposer(
        draft,
        kv,
        kv_caches,
        config.num_speculative_tokens,
        int(target_model.config.vocab_size),
        attention_backend,
        device_drafts=config.device_drafts,
    )
