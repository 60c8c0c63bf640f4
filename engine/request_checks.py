"""The checks a request must pass before it is queued, shared by EngineCore.validate (limits read
from its scheduler) and RemoteCore.validate (limits the core process reported at startup)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What bounds a servable request: the engine's context, vocabulary, KV pool and batch."""

    max_model_len: int
    vocab_size: int | None  # None: token ids are not range-checked
    block_size: int
    num_blocks: int
    max_num_seqs: int


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits) -> None:
    """Raise InvalidRequestError for a request the engine can never serve."""
    num = len(prompt_token_ids)
    if num == 0:
        raise InvalidRequestError("the prompt is empty")
    if num >= limits.max_model_len:
        raise InvalidRequestError(
            f"the prompt has {num} tokens; this model's context is {limits.max_model_len} "
            f"(prompt + at least one output token must fit)"
        )
    vocab_size = limits.vocab_size
    # min/max run in C: a long prompt costs far less than a Python-level any() over its ids.
    if vocab_size is not None and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size):
        raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab_size})")
    stops = params.stop_token_ids
    if stops and (min(stops) < 0 or (vocab_size is not None and max(stops) >= vocab_size)):
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise InvalidRequestError(f"stop_token_ids must lie in {bound}, got {list(stops)}")
    bias_ids = [t for t, _ in params.logit_bias]  # sorted by id
    if bias_ids and (bias_ids[0] < 0 or (vocab_size is not None and bias_ids[-1] >= vocab_size)):
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise InvalidRequestError(f"logit_bias token ids must lie in {bound}")
    # The prompt plus its first output token must fit in the whole pool.
    num_blocks_needed = -(-(num + 1) // limits.block_size)
    if num_blocks_needed > limits.num_blocks:
        raise InvalidRequestError(
            f"the prompt needs {num_blocks_needed} KV blocks; the cache has {limits.num_blocks}"
        )
    if params.n > limits.max_num_seqs:
        raise InvalidRequestError(f"n={params.n} exceeds max_num_seqs={limits.max_num_seqs}")
    _check_outputs_fit(num, params, limits)


def _check_outputs_fit(num_prompt: int, params: SamplingParams, limits: RequestLimits) -> None:
    """Refuse a prompt that fits the KV pool when prompt + max_tokens (for each of the n
    sequences, which share the prompt's full blocks) cannot: it would end with an error half-way.
    A sequence holds KV for all its tokens but the last (which is sampled, never fed)."""
    if params.max_tokens is None or params.max_tokens <= 1:
        return  # None: up to the context; a sequence that outgrows the pool ends with its error message
    block_size, n = limits.block_size, params.n
    num_kv_tokens = num_prompt + params.max_tokens - 1
    shared = num_prompt // block_size  # the prompt's full blocks; a partial one is copied on write
    need = shared + n * (-(-num_kv_tokens // block_size) - shared)
    if need <= limits.num_blocks:
        return
    fit = max((limits.num_blocks - shared) // n * block_size - num_prompt % block_size + 1, 0)
    raise InvalidRequestError(
        f"the prompt ({num_prompt} tokens) plus max_tokens ({params.max_tokens}) for n={n} "
        f"sequences needs {need} KV blocks of {block_size} tokens; the cache has {limits.num_blocks}: "
        f"at most {fit} new tokens per sequence fit (lower max_tokens)"
    )
