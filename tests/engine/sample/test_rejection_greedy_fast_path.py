"""The all-greedy fast path of the rejection sampler gives exactly the general path's output."""

from __future__ import annotations

import dataclasses

import torch

from pagedinfer.engine.sample.rejection_sampler import RejectionInputs, RejectionSampler


def test_all_greedy_fast_path_equals_the_general_path():
    gen = torch.Generator().manual_seed(5)
    num_rows, k, vocab = 64, 4, 40
    logits = torch.randn(num_rows, k + 1, vocab, generator=gen)
    argmax = logits.argmax(-1)
    draft = torch.where(
        torch.rand(num_rows, k, generator=gen) < 0.7, argmax[:, :k], (argmax[:, :k] + 1) % vocab
    )
    inputs = RejectionInputs(
        target_logits=logits,
        draft_token_ids=draft,
        num_draft_tokens=torch.randint(0, k + 1, (num_rows,), generator=gen),
        is_greedy=torch.ones(num_rows, dtype=torch.bool),
    )
    general = RejectionSampler()(inputs)
    fast = RejectionSampler()(dataclasses.replace(inputs, all_greedy=True))
    assert torch.equal(fast.num_tokens, general.num_tokens)
    assert torch.equal(fast.token_ids, general.token_ids)
    # Not vacuous: some rows accept drafts, some reject early, some take the bonus.
    accepted = general.num_accepted
    assert (accepted == 0).any() and (accepted > 0).any() and (accepted == inputs.num_draft_tokens).any()
    for row, tokens in enumerate(fast.to_lists()):
        assert tokens == argmax[row, : len(tokens)].tolist()
