"""Exact verification of drafted tokens: speculative rejection sampling.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and
Chen et al. 2023 ("Accelerating LLM Decoding with Speculative Sampling"): drafted token x at
position i is accepted with probability min(1, p_i(x) / q_i(x)); at the first rejection the
emitted token is sampled from normalize(max(0, p_i - q_i)); when all drafts are accepted a bonus
token is sampled from p_K. The emitted tokens are then distributed exactly as if sampled from
the target one by one. Greedy rows reduce to exact argmax matching. For proposers without a
distribution (n-gram) q is a point mass on the drafted token.

Everything is vectorized over the batch on the logits' device, with no host sync. Seeded rows
draw from `rng.hash_uniform` (a function of seed, output position and token only), like the
non-speculative sampler, so given the same drafts their tokens do not depend on the batch they
run in. Whether a step drafts does, for a draft model: an accepted draft is a draw from q, a step
without drafts a draw from p (both exact samples, not the same one), and drafting switches off
with load (a step above max_batch_size) and for a sequence the acceptance policy pauses. So a
seeded draft-model request reproduces under the same load and scheduling mode, not across them
(found by a review, 2026-12-06). Prompt lookup (a point-mass q) emits the plain draw at every
position: the same tokens with speculation on or off.

Shapes: B = sequences verified, K = max drafts per sequence in the batch, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedinfer.engine.sample.rng import hash_uniform
from pagedinfer.kernels.argmax import argmax_rows

# (target probs at the rejected position [B, V], draft probs there [B, V] or None for a point
# mass, the rejected draft token [B]) -> the distribution to sample the replacement from [B, V]
ResidualFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]

_TINY = 1e-30  # floor for exponential draws: probs / 0 would turn a zero-probability token into NaN
# Acceptance uniforms of a seeded row come from a stream keyed by seed ^ salt, independent of the
# noise that samples tokens at the same output position (keyed by the seed itself).
_ACCEPT_SALT = 0x5DEECE66D


def residual_distribution(
    target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_token_ids: torch.Tensor
) -> torch.Tensor:
    """normalize(max(0, p - q)) row by row; q is a point mass on the draft token when None.

    A row whose residual mass is zero (p == q up to rounding) can only be reached with
    probability zero; it falls back to p without the rejected draft (p itself if that is all of
    p), so the result is always a distribution and never gives back the draft it replaces (a
    chained step's accept kernel relies on that: chained_sampling.ChainedSampling._chain_rejection).
    """
    without_draft = target_probs.clone().scatter_(1, draft_token_ids.unsqueeze(1), 0.0)  # [B, V]
    if draft_probs is None:
        residual = without_draft
    else:
        residual = (target_probs - draft_probs).clamp_(min=0.0)  # [B, V]
    mass = residual.sum(dim=1, keepdim=True)  # [B, 1]
    rest = without_draft.sum(dim=1, keepdim=True)  # [B, 1]
    fallback = torch.where(rest > 0, without_draft / rest.clamp(min=_TINY), target_probs)
    return torch.where(mass > 0, residual / mass.clamp(min=_TINY), fallback)


@dataclass(frozen=True)
class RejectionInputs:
    """One verification batch, padded to K drafts per row.

    `target_logits` are the target's logits at the K + 1 verification positions of each row
    (the position after the last accepted token, then one per draft), already processed with
    the row's sampling parameters exactly as the non-speculative sampler would: penalties,
    temperature, top-k / top-p / min-p masking to -inf. Greedy rows use their argmax.
    `draft_probs` must have been processed with the same parameters (None: point mass).
    Drafts past `num_draft_tokens[b]` are padding and ignored.
    """

    target_logits: torch.Tensor  # [B, K + 1, V] float
    draft_token_ids: torch.Tensor  # [B, K] int64
    num_draft_tokens: torch.Tensor  # [B] int64 in [0, K]
    is_greedy: torch.Tensor  # [B] bool
    draft_probs: torch.Tensor | None = None  # [B, K, V] float, or None for a point mass
    seeds: torch.Tensor | None = None  # [B] int64 >= 0 seeded, < 0 unseeded; None: all unseeded
    positions: torch.Tensor | None = None  # [B] int64 output position of the row's first token
    all_greedy: bool = False  # host-side: every row is greedy (argmax matching only, fewer kernels)

    def check(self) -> None:
        """Shape contract between the proposer, the runner and this sampler (internal)."""
        num_rows, k_plus_1, _ = self.target_logits.shape
        assert self.draft_token_ids.shape == (num_rows, k_plus_1 - 1), self.draft_token_ids.shape
        assert self.num_draft_tokens.shape == (num_rows,)
        assert self.is_greedy.shape == (num_rows,)
        if self.draft_probs is not None:
            assert self.draft_probs.shape == (num_rows, k_plus_1 - 1, self.target_logits.shape[2])
        if self.seeds is not None:
            assert self.seeds.shape == (num_rows,) and self.positions is not None
            assert self.positions.shape == (num_rows,)


@dataclass(frozen=True)
class RejectionOutput:
    """Tokens each row emits this step: its accepted drafts, then one corrected or bonus token.

    Row b's tokens are `token_ids[b, :num_tokens[b]]`; entries past that are zero padding.
    """

    token_ids: torch.Tensor  # [B, K + 1] int64
    num_tokens: torch.Tensor  # [B] int64 in [1, num_draft_tokens[b] + 1]

    @property
    def num_accepted(self) -> torch.Tensor:
        return self.num_tokens - 1  # [B]

    def to_lists(self) -> list[list[int]]:
        """Host copy, one list per row (one device sync)."""
        token_ids = self.token_ids.tolist()
        return [row[:n] for row, n in zip(token_ids, self.num_tokens.tolist(), strict=True)]


class RejectionSampler:
    """Decides accepted drafts and the next token for a batch of speculating sequences.

    `residual_fn` is injectable so the test suite can prove that its statistical test catches a
    wrong residual step (sampling from p or from q instead of normalize(max(0, p - q)).
    """

    def __init__(self, residual_fn: ResidualFn = residual_distribution) -> None:
        self._residual_fn = residual_fn

    def __call__(self, inputs: RejectionInputs) -> RejectionOutput:
        inputs.check()
        if inputs.all_greedy:
            return self._greedy(inputs)
        target_logits = inputs.target_logits
        num_rows, k_plus_1, _ = target_logits.shape
        num_drafts = k_plus_1 - 1
        device = target_logits.device
        draft_ids = inputs.draft_token_ids.to(device=device, dtype=torch.int64)  # [B, K]
        num_draft_tokens = inputs.num_draft_tokens.to(device=device, dtype=torch.int64)  # [B]
        is_greedy = inputs.is_greedy.to(device)  # [B]
        target_probs = torch.softmax(target_logits.float(), dim=-1)  # [B, K + 1, V]
        target_argmax = _argmax_last(target_logits)  # [B, K + 1]

        # Acceptance per draft position.
        p_draft = target_probs[:, :num_drafts].gather(2, draft_ids.unsqueeze(2)).squeeze(2)  # [B, K]
        if inputs.draft_probs is None:
            q_draft = torch.ones_like(p_draft)
        else:
            q_draft = inputs.draft_probs.float().gather(2, draft_ids.unsqueeze(2)).squeeze(2)  # [B, K]
        uniform = _uniform((num_rows, num_drafts), device, inputs.seeds, inputs.positions)  # [B, K]
        # u < p / q without dividing: accepts surely when p >= q, never when p == 0.
        is_accepted = torch.where(
            is_greedy.unsqueeze(1), draft_ids == target_argmax[:, :num_drafts], uniform * q_draft < p_draft
        )
        positions = torch.arange(num_drafts, device=device)  # [K]
        is_accepted &= positions.unsqueeze(0) < num_draft_tokens.unsqueeze(1)
        num_accepted = is_accepted.int().cumprod(dim=1).sum(dim=1)  # [B] leading accepts

        final_ids = self._final_tokens(inputs, target_probs, target_argmax, draft_ids, num_accepted)
        token_ids = torch.zeros((num_rows, k_plus_1), dtype=torch.int64, device=device)
        token_ids[:, :num_drafts] = draft_ids
        token_ids.scatter_(1, num_accepted.unsqueeze(1), final_ids.unsqueeze(1))
        keep = torch.arange(k_plus_1, device=device).unsqueeze(0) <= num_accepted.unsqueeze(1)
        return RejectionOutput(token_ids=token_ids * keep, num_tokens=num_accepted + 1)

    def _greedy(self, inputs: RejectionInputs) -> RejectionOutput:
        """All rows greedy: drafts are accepted while they equal the argmax, and the emitted
        tokens are exactly the argmaxes up to and including the first mismatch (or the bonus)."""
        target_argmax = _argmax_last(inputs.target_logits)  # [B, K + 1]
        device = target_argmax.device
        num_drafts = target_argmax.shape[1] - 1
        draft_ids = inputs.draft_token_ids.to(device=device, dtype=torch.int64)  # [B, K]
        num_draft_tokens = inputs.num_draft_tokens.to(device=device, dtype=torch.int64)  # [B]
        positions = torch.arange(num_drafts + 1, device=device)  # [K + 1]
        is_accepted = (draft_ids == target_argmax[:, :num_drafts]) & (
            positions[:num_drafts].unsqueeze(0) < num_draft_tokens.unsqueeze(1)
        )  # [B, K]
        num_accepted = is_accepted.int().cumprod(dim=1).sum(dim=1)  # [B]
        keep = positions.unsqueeze(0) <= num_accepted.unsqueeze(1)  # [B, K + 1]
        return RejectionOutput(token_ids=target_argmax * keep, num_tokens=num_accepted + 1)

    def _final_tokens(
        self,
        inputs: RejectionInputs,
        target_probs: torch.Tensor,  # [B, K + 1, V]
        target_argmax: torch.Tensor,  # [B, K + 1]
        draft_ids: torch.Tensor,  # [B, K]
        num_accepted: torch.Tensor,  # [B]
    ) -> torch.Tensor:
        """The token at position num_accepted: residual sample after a rejection, bonus otherwise."""
        num_rows, k_plus_1, vocab = target_probs.shape
        device = target_probs.device
        num_draft_tokens = inputs.num_draft_tokens.to(device=device, dtype=torch.int64)
        is_bonus = num_accepted >= num_draft_tokens  # [B]
        pos = num_accepted.view(num_rows, 1, 1).expand(num_rows, 1, vocab)
        p_row = target_probs.gather(1, pos).squeeze(1)  # [B, V]
        # Clamp keeps the gathers in range for bonus rows (their residual is discarded).
        draft_pos = num_accepted.clamp(max=max(k_plus_1 - 2, 0))
        if k_plus_1 > 1:
            rejected_ids = draft_ids.gather(1, draft_pos.unsqueeze(1)).squeeze(1)  # [B]
            q_row = None
            if inputs.draft_probs is not None:
                q_pos = draft_pos.view(num_rows, 1, 1).expand(num_rows, 1, vocab)
                q_row = inputs.draft_probs.float().gather(1, q_pos).squeeze(1)  # [B, V]
            residual = self._residual_fn(p_row, q_row, rejected_ids)  # [B, V]
            dist = torch.where(is_bonus.unsqueeze(1), p_row, residual)
        else:
            dist = p_row
        positions = None if inputs.positions is None else inputs.positions.to(device) + num_accepted
        sampled = sample_from_probs(dist, inputs.seeds, positions)  # [B]
        greedy_ids = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [B]
        return torch.where(inputs.is_greedy.to(device), greedy_ids, sampled)


def greedy_num_accepted(
    target_argmax: np.ndarray,  # [B, K + 1] int
    draft_token_ids: np.ndarray,  # [B, K] int, padding past num_draft_tokens ignored
    num_draft_tokens: np.ndarray,  # [B] int in [0, K]
) -> np.ndarray:
    """Host (numpy) form of `RejectionSampler._greedy`: leading drafts equal to the argmax [B].

    Row b then emits target_argmax[b, : result[b] + 1].
    """
    num_drafts = draft_token_ids.shape[1]
    is_accepted = (draft_token_ids == target_argmax[:, :num_drafts]) & (
        np.arange(num_drafts)[None, :] < num_draft_tokens[:, None]
    )  # [B, K]
    return np.cumprod(is_accepted, axis=1).sum(axis=1)  # [B]


def sample_from_probs(
    probs: torch.Tensor, seeds: torch.Tensor | None = None, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row of `probs` [B, V] by the exponential race argmax(p / E), E ~ Exp(1).

    Equivalent to a categorical draw, with no cumulative sums and no host sync. Rows with a seed
    >= 0 take their noise from hash_uniform(seed, position), exactly as `Sampler.draw` does.
    """
    noise = torch.empty_like(probs, dtype=torch.float32).exponential_()  # [B, V]
    if seeds is not None:
        seeds = seeds.to(probs.device)
        u = hash_uniform(seeds.clamp(min=0), positions.to(probs.device), probs.shape[1])  # [B, V]
        noise = torch.where((seeds >= 0).unsqueeze(1), -torch.log(u), noise)
    return argmax_rows(probs.float() / noise.clamp_(min=_TINY))  # [B]


def _argmax_last(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) through kernels/argmax.py (one launch on a GPU, the same ids)."""
    return argmax_rows(x.reshape(-1, x.shape[-1])).view(x.shape[:-1])


def _uniform(
    shape: tuple[int, int],
    device: torch.device,
    seeds: torch.Tensor | None,
    positions: torch.Tensor | None,
) -> torch.Tensor:
    """Acceptance uniforms [B, K] in [0, 1); seeded rows are a function of (seed, position)."""
    uniform = torch.rand(shape, device=device)
    num_rows, num_drafts = shape
    if seeds is None or num_drafts == 0:
        return uniform
    seeds = seeds.to(device)
    salted = (seeds.clamp(min=0) ^ _ACCEPT_SALT).repeat_interleave(num_drafts)  # [B * K]
    steps = torch.arange(num_drafts, device=device)  # [K]
    pos = (positions.to(device).unsqueeze(1) + steps.unsqueeze(0)).reshape(-1)  # [B * K]
    seeded = hash_uniform(salted, pos, 1).view(num_rows, num_drafts)  # [B, K] in (0, 1)
    return torch.where((seeds >= 0).unsqueeze(1), seeded, uniform)
