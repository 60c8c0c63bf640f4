"""Batched token sampling: penalties, logit_bias, temperature, top-k / top-p / min-p, seeded draws, logprobs.

One pass over [N, V] logits for the whole batch; no per-row Python loop. Seeded rows draw
their exponential noise from `rng.hash_uniform` (a function of seed, position and token
only), so their tokens do not depend on batch composition; other rows use the device RNG.
Sampling uses the exponential-race form of Gumbel-max: argmax(probs / Exp(1)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedinfer.engine.sample.metadata import SamplingMetadata
from pagedinfer.engine.sample.penalties import apply_penalties, ban_tokens
from pagedinfer.engine.sample.rng import hash_uniform
from pagedinfer.engine.structured.masks import apply_token_bitmask
from pagedinfer.kernels.argmax import argmax_rows

_TINY = 1e-30


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None = None  # [N] fp32 logprob of the sampled token
    top_token_ids: torch.Tensor | None = None  # [N, K] int64
    top_logprobs: torch.Tensor | None = None  # [N, K] fp32


def apply_top_k_top_p_min_p(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Mask filtered-out tokens to -inf. logits [N, V] are already temperature-scaled."""
    if meta.any_min_p:
        probs = logits.softmax(dim=-1)  # [N, V]
        threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p[:, None]  # [N, 1]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if not (meta.any_top_k or meta.any_top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    vocab = logits.shape[-1]
    if meta.any_top_k:
        ranks = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
        sorted_logits = sorted_logits.masked_fill(ranks >= meta.top_k[:, None], float("-inf"))
    if meta.any_top_p:
        probs = sorted_logits.softmax(dim=-1)  # [N, V]
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # strictly before it already does. The top token is always kept.
        mass_before = probs.cumsum(dim=-1) - probs  # [N, V]
        drop = mass_before >= meta.top_p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def is_plain_greedy(meta: SamplingMetadata) -> bool:
    """All rows greedy with nothing that edits logits: the tokens are the raw logits' argmax.

    Exact on half-precision logits too: upcasting to fp32 keeps the order and the first maximum,
    so such a batch needs neither LlamaForCausalLM.compute_logits' upcast nor process()'s copy.
    """
    return (
        meta.all_greedy
        and meta.penalties is None
        and meta.ban_rows is None
        and meta.bias_rows is None
        and meta.grammar_bitmask is None
    )


class Sampler:
    """`process()` gives the logits the tokens are drawn from (shared with speculative
    verification); `forward()` samples them and gathers logprobs."""

    def process(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits [N, V] -> penalized, banned, temperature-scaled and filtered [N, V] fp32."""
        # Penalties, biases and bans write in place: copy then; otherwise nothing below writes into it.
        edits = meta.penalties is not None or meta.ban_rows is not None or meta.bias_rows is not None
        logits = logits.float().clone() if edits else logits.float()
        if meta.penalties is not None:
            p = meta.penalties
            logits = apply_penalties(
                logits, p.prompt_ids, p.output_ids, p.repetition, p.presence, p.frequency
            )
        if meta.bias_rows is not None:  # OpenAI's logit_bias: added before the bans and temperature
            logits.index_put_((meta.bias_rows, meta.bias_token_ids), meta.bias_values, accumulate=True)
        if meta.ban_rows is not None:
            logits = ban_tokens(logits, meta.ban_rows, meta.ban_token_ids)
        if meta.grammar_bitmask is not None:  # structured outputs: what the grammar forbids is -inf
            logits = apply_token_bitmask(logits, meta.grammar_bitmask)
        if meta.all_greedy:
            return logits
        logits = logits / meta.temperature[:, None]
        return apply_top_k_top_p_min_p(logits, meta)

    def draw(self, processed: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Tokens [N] from processed logits [N, V]: argmax for greedy rows, a race otherwise."""
        if meta.all_greedy:
            return argmax_rows(processed)  # [N]
        probs = processed.softmax(dim=-1)  # [N, V]
        noise = torch.empty_like(probs).exponential_()  # [N, V]
        if meta.seeded_rows is not None:
            u = hash_uniform(meta.seeds, meta.positions, probs.shape[-1])  # [S, V]
            noise[meta.seeded_rows] = -torch.log(u)
        sampled = argmax_rows(probs / noise.clamp_min(_TINY))  # [N]
        if not meta.any_greedy:  # (a batch of sampled rows: no argmax to merge in)
            return sampled
        return torch.where(meta.is_greedy, argmax_rows(processed), sampled)

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of logits [N, V]; logprobs are the model's raw ones."""
        if is_plain_greedy(meta):  # argmax straight on the GEMM output: no [N, V] copies
            token_ids = argmax_rows(logits)  # [N]
        else:
            token_ids = self.draw(self.process(logits, meta), meta)
        if meta.max_num_logprobs < 0:
            return SamplerOutput(token_ids)
        logprobs = logits.float().log_softmax(dim=-1)  # [N, V]
        sampled_lp = logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [N]
        top_lp, top_ids = logprobs.topk(max(meta.max_num_logprobs, 0), dim=-1)  # [N, K]
        return SamplerOutput(token_ids, sampled_lp, top_ids, top_lp)

    __call__ = forward
