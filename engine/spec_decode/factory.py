"""Build the speculative decoder an EngineConfig asks for (None when speculation is off)."""

from __future__ import annotations

from pagedinfer.engine.config import SpeculativeConfig
from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.spec_decode.controller import SpeculativeDecoder
from pagedinfer.engine.spec_decode.draft_model import (
    DraftModelError,
    DraftModelProposer,
    check_same_vocabulary,
)
from pagedinfer.engine.spec_decode.ngram import NgramProposer
from pagedinfer.engine.spec_decode.proposer import Proposer
from pagedinfer.engine.spec_decode.self_draft import SELF_PREFIX, LayerSubsetDraft, parse_layer_ids

METHODS = (None, "ngram", "draft")


def build_speculative_decoder(
    config: SpeculativeConfig,
    target_model,
    target_tokenizer,
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    attention_backend: str | None = None,
) -> SpeculativeDecoder | None:
    """The engine's speculative collaborator; `num_blocks` sizes the draft model's own KV pool."""
    if config.method not in METHODS:
        raise ValueError(f"unknown speculative method {config.method!r}; expected one of {METHODS}")
    if config.method is None:
        return None
    if config.method == "ngram":
        proposer: Proposer = NgramProposer(config.ngram_min, config.ngram_max, config.num_speculative_tokens)
    else:
        proposer = build_draft_proposer(
            config, target_model, target_tokenizer, num_blocks, block_size, max_model_len, attention_backend
        )
    return SpeculativeDecoder(config, proposer, max_model_len)


def build_draft_proposer(
    config: SpeculativeConfig,
    target_model,
    target_tokenizer,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    attention_backend: str | None = None,
) -> DraftModelProposer:
    """Load (or carve out of the target) the draft model and give it its own paged KV cache."""
    from pagedinfer.engine.worker.kv_cache import allocate_kv_caches

    if not config.draft_model:
        raise DraftModelError("speculative method 'draft' needs speculative.draft_model")
    if config.draft_model.startswith(SELF_PREFIX):
        draft = LayerSubsetDraft(
            target_model, parse_layer_ids(config.draft_model, target_model.config.num_layers)
        )
    else:
        from pagedinfer.engine.models.loader import load_model

        loaded = load_model(config.draft_model, target_model.device, target_model.dtype)
        check_same_vocabulary(target_tokenizer, loaded.tokenizer)
        draft = loaded.model
    # Only up to max_batch_size sequences draft at once; each needs room for its context + K.
    per_seq = -(-(max_model_len + config.num_speculative_tokens) // block_size)
    num_blocks = max(min(num_blocks, config.max_batch_size * per_seq), 1)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    kv_caches = allocate_kv_caches(
        draft.config, num_blocks, block_size, target_model.device, target_model.dtype
    )
    return DraftModelProposer(
        draft,
        kv,
        kv_caches,
        config.num_speculative_tokens,
        int(target_model.config.vocab_size),
        attention_backend,
    )
