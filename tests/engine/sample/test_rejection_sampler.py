"""Rejection sampler: exact distribution preservation, greedy matching, seeding, mutation checks.

Statistical tests use Pearson's chi-square at significance ALPHA = 1e-3 over N = 100,000 seeded
trials (one batch row per trial). The same test must reject the sampler when its residual step is
replaced by sampling from p or from q: that proves the test has the power to catch the bug it
guards against.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from pagedinfer.engine.sample.rejection_sampler import (
    RejectionInputs,
    RejectionSampler,
    residual_distribution,
    sample_from_probs,
)

ALPHA = 1e-3
NUM_TRIALS = 100_000
VOCAB = 6
K = 3

# Fixed, deliberately different target (p) and draft (q) distributions per position.
P = torch.tensor(
    [
        [0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
        [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
        [0.50, 0.02, 0.08, 0.10, 0.20, 0.10],
        [0.16, 0.17, 0.17, 0.16, 0.17, 0.17],  # the bonus position
    ]
)
Q = torch.tensor(
    [
        [0.05, 0.10, 0.15, 0.20, 0.25, 0.25],
        [0.40, 0.30, 0.10, 0.10, 0.05, 0.05],
        [0.10, 0.40, 0.10, 0.10, 0.10, 0.20],
    ]
)


def _batch(with_draft_probs: bool, variable_k: bool, seed: int = 0) -> RejectionInputs:
    gen = torch.Generator().manual_seed(seed)
    # Drafts drawn from Q: a draft model samples them so; for a deterministic proposer (n-gram)
    # Q stands for how its proposals vary with the context, while its q is a point mass.
    draft = torch.stack([torch.multinomial(Q[i], NUM_TRIALS, True, generator=gen) for i in range(K)], 1)
    draft_probs = Q.unsqueeze(0).expand(NUM_TRIALS, K, VOCAB) if with_draft_probs else None
    if variable_k:
        num_draft = torch.randint(0, K + 1, (NUM_TRIALS,), generator=gen)
    else:
        num_draft = torch.full((NUM_TRIALS,), K)
    return RejectionInputs(
        target_logits=P.log().unsqueeze(0).expand(NUM_TRIALS, K + 1, VOCAB),
        draft_token_ids=draft,
        num_draft_tokens=num_draft,
        is_greedy=torch.zeros(NUM_TRIALS, dtype=torch.bool),
        draft_probs=draft_probs,
    )


def _position_pvalue(sampler: RejectionSampler, inputs: RejectionInputs, position: int) -> float:
    """Chi-square p-value of the tokens emitted at `position` against the target's P[position].

    Position j is emitted when the row's first j drafts were accepted; since p and q do not depend
    on earlier tokens here, the emitted token there must still be distributed as P[j] (or P[K_b]).
    """
    torch.manual_seed(1234)
    out = sampler(inputs)
    emitted = out.num_tokens > position
    tokens = out.token_ids[emitted, position]
    # Rows whose bonus lands at `position` (K_b == position) sample from P[position] too.
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    target = P[position].double() / P[position].double().sum()
    expected = target * counts.sum()
    assert expected.min() >= 5, "too few samples at this position for the chi-square approximation"
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft-model", "point-mass"])
def test_emitted_tokens_follow_the_target_distribution(with_draft_probs):
    inputs = _batch(with_draft_probs, variable_k=True)
    sampler = RejectionSampler()
    for position in range(K + 1):
        pvalue = _position_pvalue(sampler, inputs, position)
        assert pvalue > ALPHA, (position, pvalue)


def _residual_from_p(p, q, x):
    return p


def _residual_from_q(p, q, x):
    return q if q is not None else torch.nn.functional.one_hot(x, p.shape[1]).float()


@pytest.mark.parametrize(
    ("with_draft_probs", "mutant"),
    [(True, _residual_from_p), (True, _residual_from_q), (False, _residual_from_p)],
    ids=["draft-model/from-p", "draft-model/from-q", "point-mass/from-p"],
)
def test_chi_square_rejects_a_wrong_residual_step(with_draft_probs, mutant):
    inputs = _batch(with_draft_probs, variable_k=False)
    assert _position_pvalue(RejectionSampler(), inputs, 0) > ALPHA
    pvalue = _position_pvalue(RejectionSampler(residual_fn=mutant), inputs, 0)
    assert pvalue < ALPHA, f"the chi-square test failed to catch the mutant (p-value {pvalue})"


def test_acceptance_rate_matches_theory():
    # P(accept at position 0) = sum_x min(p(x), q(x)).
    inputs = _batch(with_draft_probs=True, variable_k=False)
    torch.manual_seed(7)
    out = RejectionSampler()(inputs)
    rate = (out.num_accepted >= 1).double().mean().item()
    expected = torch.minimum(P[0], Q[0]).sum().item()
    stderr = (expected * (1 - expected) / NUM_TRIALS) ** 0.5
    assert abs(rate - expected) < 5 * stderr, (rate, expected)


def test_greedy_rows_match_the_argmax_exactly():
    gen = torch.Generator().manual_seed(3)
    num_rows, k, vocab = 64, 5, 50
    logits = torch.randn(num_rows, k + 1, vocab, generator=gen)
    argmax = logits.argmax(-1)
    first_wrong = torch.randint(0, k + 1, (num_rows,), generator=gen)  # k: all drafts right
    draft = argmax[:, :k].clone()
    for row in range(num_rows):
        if first_wrong[row] < k:
            draft[row, first_wrong[row]] = (argmax[row, first_wrong[row]] + 1) % vocab
    num_draft = torch.randint(0, k + 1, (num_rows,), generator=gen)
    inputs = RejectionInputs(
        target_logits=logits,
        draft_token_ids=draft,
        num_draft_tokens=num_draft,
        is_greedy=torch.ones(num_rows, dtype=torch.bool),
        draft_probs=torch.softmax(torch.randn(num_rows, k, vocab, generator=gen), -1),
    )
    out = RejectionSampler()(inputs)
    for row, tokens in enumerate(out.to_lists()):
        accepted = min(int(first_wrong[row]), int(num_draft[row]))
        assert len(tokens) == accepted + 1
        assert tokens == argmax[row, : accepted + 1].tolist()


def test_padding_past_the_emitted_tokens_is_zero_and_no_drafts_means_one_sample():
    logits = torch.randn(4, 3, 10)
    inputs = RejectionInputs(
        target_logits=logits,
        draft_token_ids=torch.full((4, 2), 9),
        num_draft_tokens=torch.zeros(4, dtype=torch.int64),
        is_greedy=torch.tensor([True, False, True, False]),
    )
    out = RejectionSampler()(inputs)
    assert out.num_tokens.tolist() == [1, 1, 1, 1]
    assert (out.token_ids[:, 1:] == 0).all()
    assert out.token_ids[0, 0] == logits[0, 0].argmax()


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 5, 20, generator=gen)
    draft = torch.randint(0, 20, (3, 4), generator=gen)
    seeds = torch.tensor([-1, 42, -1])
    positions = torch.tensor([3, 7, 0])

    def run(rows, noise_seed):
        torch.manual_seed(noise_seed)
        return RejectionSampler()(
            RejectionInputs(
                target_logits=logits[rows],
                draft_token_ids=draft[rows],
                num_draft_tokens=torch.full((len(rows),), 4),
                is_greedy=torch.zeros(len(rows), dtype=torch.bool),
                seeds=seeds[rows],
                positions=positions[rows],
            )
        ).to_lists()

    alone = run([1], noise_seed=0)[0]
    assert run([0, 1, 2], noise_seed=1)[1] == alone
    assert run([2, 1], noise_seed=2)[1] == alone
    # Unseeded rows do follow the device RNG.
    assert any(run([0, 1, 2], noise_seed=s)[0] != run([0, 1, 2], noise_seed=s + 10)[0] for s in range(5))


def test_seeded_rows_follow_the_target_distribution():
    inputs = _batch(with_draft_probs=True, variable_k=True)
    seeded = RejectionInputs(
        target_logits=inputs.target_logits,
        draft_token_ids=inputs.draft_token_ids,
        num_draft_tokens=inputs.num_draft_tokens,
        is_greedy=inputs.is_greedy,
        draft_probs=inputs.draft_probs,
        seeds=torch.arange(NUM_TRIALS, dtype=torch.int64) * 7919,
        positions=torch.full((NUM_TRIALS,), 5, dtype=torch.int64),
    )
    for position in range(K + 1):
        assert _position_pvalue(RejectionSampler(), seeded, position) > ALPHA, position


def test_residual_distribution_is_normalized_and_never_gives_back_the_draft():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.5, 0.5, 0.0], [0.4, 0.1, 0.5], [1.0, 0.0, 0.0]])
    res = residual_distribution(p, q, torch.tensor([0, 0, 0]))
    # zero residual mass (p == q: reached with probability 0): p without the rejected draft, or
    # p where the draft is all of it
    assert torch.allclose(res[0], torch.tensor([0.0, 1.0, 0.0]))
    assert torch.allclose(res[2], p[2])
    assert torch.allclose(res[1], torch.tensor([0.0, 1.0, 0.0]))
    point = residual_distribution(p[:2], None, torch.tensor([0, 2]))
    assert torch.allclose(point, torch.tensor([[0.0, 1.0, 0.0], [0.4, 0.6, 0.0]]))


def test_sample_from_probs_never_picks_a_zero_probability_token():
    probs = torch.zeros(1000, 8)
    probs[:, 3] = 0.4
    probs[:, 6] = 0.6
    torch.manual_seed(0)
    tokens = sample_from_probs(probs)
    assert set(tokens.tolist()) == {3, 6}
