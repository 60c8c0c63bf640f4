"""Verification of drafts without a distribution (n-gram: q is a point mass on the draft):
every row drawn as the plain sampler draws it, drafts accepted while they equal the draws.

Pearson's chi-square at significance ALPHA = 1e-3 over N = 100,000 groups (one verification
each, unseeded): the tokens emitted at each position must follow the target's p there. The same
test must reject a verifier that, at a rejection, emits a fresh draw from p instead of the draw
that rejected the draft (that fresh draw may be the rejected draft again).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedinfer.engine.sample.metadata import SamplingMetadata
from pagedinfer.engine.sample.sampler import Sampler
from pagedinfer.engine.spec_decode import verifier as verifier_module
from pagedinfer.engine.spec_decode.verifier import SpecVerifier
from pagedinfer.engine.worker.step_types import VerifyGroup

ALPHA = 1e-3
NUM_GROUPS = 100_000
VOCAB = 5
K = 2
P = torch.tensor(  # target per position; the last row is the bonus position
    [
        [0.40, 0.25, 0.15, 0.15, 0.05],
        [0.05, 0.10, 0.20, 0.30, 0.35],
        [0.20, 0.20, 0.20, 0.20, 0.20],
    ]
)
Q = torch.tensor(  # how the proposer's drafts vary (each one a point mass)
    [
        [0.10, 0.50, 0.10, 0.20, 0.10],
        [0.30, 0.10, 0.10, 0.40, 0.10],
    ]
)


def _metadata(num_rows: int) -> SamplingMetadata:
    """Temperature 1, no filters, unseeded: the draw is a sample of softmax(logits)."""
    return SamplingMetadata(
        temperature=torch.ones(num_rows),
        is_greedy=torch.zeros(num_rows, dtype=torch.bool),
        top_k=torch.full((num_rows,), VOCAB, dtype=torch.int64),
        top_p=torch.ones(num_rows),
        min_p=torch.zeros(num_rows),
        seeded_rows=None,
        seeds=None,
        positions=None,
        all_greedy=False,
        any_top_k=False,
        any_top_p=False,
        any_min_p=False,
        max_num_logprobs=-1,
        num_logprobs=[None] * num_rows,
    )


def _verify(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(Q[i], NUM_GROUPS, True, generator=gen) for i in range(K)], 1)
    groups = [VerifyGroup(b, b * (K + 1), row) for b, row in enumerate(drafts.tolist())]
    logits = P.log().repeat(NUM_GROUPS, 1)  # [B * (K + 1), V]
    torch.manual_seed(seed + 1)
    out = SpecVerifier(Sampler()).sample(logits, _metadata(logits.shape[0]), groups)
    return [s.token_ids for s in out.sampled]


def _pvalue(token_lists: list[list[int]], position: int) -> float:
    tokens = [t[position] for t in token_lists if len(t) > position]
    counts = np.bincount(tokens, minlength=VOCAB).astype(np.float64)
    target = P[position].double().numpy()
    expected = target / target.sum() * counts.sum()
    assert expected.min() >= 5, "too few samples at this position for the chi-square approximation"
    return float(chisquare(counts, expected).pvalue)


def test_emitted_tokens_follow_the_target_distribution():
    token_lists = _verify()
    lengths = np.bincount([len(t) for t in token_lists], minlength=K + 2)
    assert lengths[1] and lengths[2] and lengths[K + 1]  # rejections at each draft and bonuses occur
    for position in range(K + 1):
        pvalue = _pvalue(token_lists, position)
        assert pvalue > ALPHA, (position, pvalue)


def test_acceptance_rate_is_p_of_the_draft():
    """A point-mass draft x survives with probability min(1, p(x) / 1) = p(x)."""
    token_lists = _verify(seed=3)
    rate = sum(len(t) > 1 for t in token_lists) / NUM_GROUPS
    expected = float((P[0] * Q[0]).sum())  # drafts drawn from Q[0]
    stderr = (expected * (1 - expected) / NUM_GROUPS) ** 0.5
    assert abs(rate - expected) < 5 * stderr, (rate, expected)


@pytest.mark.parametrize("max_listed", [0, NUM_GROUPS])  # acceptance in numpy, in Python lists
def test_chi_square_rejects_a_fresh_draw_at_the_rejection(max_listed, monkeypatch):
    monkeypatch.setattr(verifier_module, "MAX_LISTED_GROUPS", max_listed)
    assert _pvalue(_verify(), 0) > ALPHA
    matched_tokens, matched_token_lists = verifier_module.matched_tokens, verifier_module.matched_token_lists
    fresh = torch.multinomial(P[0], NUM_GROUPS, True, generator=torch.Generator().manual_seed(9)).tolist()

    def redraw(token_lists: list[list[int]]) -> list[list[int]]:
        # At a rejection of the first draft, emit a new sample of p in place of the one that rejected it.
        return [[fresh[b]] if len(t) == 1 else t for b, t in enumerate(token_lists)]

    monkeypatch.setattr(verifier_module, "matched_tokens", lambda *a: redraw(matched_tokens(*a)))
    monkeypatch.setattr(verifier_module, "matched_token_lists", lambda *a: redraw(matched_token_lists(*a)))
    pvalue = _pvalue(_verify(), 0)
    assert pvalue < ALPHA, f"the chi-square test failed to catch the mutant (p-value {pvalue})"
