"""N-gram (prompt lookup) proposer against a brute-force reference."""

from __future__ import annotations

import numpy as np
import pytest

from pagedinfer.engine.core.scheduler_output import SamplingRow
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.spec_decode.ngram import NgramProposer, find_ngram_draft
from pagedinfer.engine.spec_decode.proposer import DraftRequest


def _reference(tokens: list[int], ngram_min: int, ngram_max: int, k: int, window: int) -> list[int]:
    num_tokens = len(tokens)
    for n in range(ngram_max, ngram_min - 1, -1):
        if n >= num_tokens:
            continue
        suffix = tokens[num_tokens - n :]
        ends = [end for end in range(n - 1, num_tokens - 1) if tokens[end - n + 1 : end + 1] == suffix]
        if not ends:
            continue
        # the `window` tokens before the suffix vs before each match: how many of the latter occur
        before = {tokens[i] for i in range(num_tokens - n - window, num_tokens - n) if i >= 0}

        def overlap(end: int, n: int = n, before: set = before) -> int:
            return sum(tokens[i] in before for i in range(end - n - window + 1, end - n + 1) if i >= 0)

        end = max(ends, key=lambda e: (overlap(e), e))  # most overlap, then latest
        follow = tokens[end + 1 :]
        return [follow[i % len(follow)] for i in range(k)]
    return []


@pytest.mark.parametrize("window", [0, 2, 8])
@pytest.mark.parametrize("vocab", [2, 5, 50])
def test_matches_the_brute_force_reference(vocab, window):
    rng = np.random.default_rng(vocab)
    for _ in range(400):
        length = int(rng.integers(0, 40))
        tokens = rng.integers(0, vocab, length).tolist()
        ngram_min = int(rng.integers(1, 4))
        ngram_max = ngram_min + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        array = np.asarray(tokens, dtype=np.int64)
        got = find_ngram_draft(array, ngram_min, ngram_max, k, context_window=window).tolist()
        want = _reference(tokens, ngram_min, ngram_max, k, window)
        assert got == want, (tokens, ngram_min, ngram_max, k, window)


def test_equally_long_matches_prefer_the_one_in_a_similar_context():
    """After an edit only the last token matches; the occurrence in the context the copy came
    from wins over the latest one."""
    source = [10, 11, 12, 5, 20, 21, 30, 31, 32, 5, 40, 41]
    copy = [10, 11, 12, 99, 5]  # copying the source's start, with one inserted token (99)
    tokens = np.array(source + copy)
    assert find_ngram_draft(tokens, 1, 3, 2, context_window=3).tolist() == [20, 21]
    assert find_ngram_draft(tokens, 1, 3, 2, context_window=0).tolist() == [40, 41]  # latest


def test_prefers_the_longest_match():
    tokens = np.array([7, 1, 2, 8, 3, 2, 9, 1, 2])
    # Suffix [1, 2] occurs at 1..2 (followed by 8); [2] alone occurs later at 5 (followed by 9).
    assert find_ngram_draft(tokens, 1, 3, 2).tolist() == [8, 3]
    assert find_ngram_draft(tokens, 1, 1, 2).tolist() == [9, 1]
    assert find_ngram_draft(tokens, 3, 3, 2).tolist() == []  # [9, 1, 2] never occurred before


def test_repetition_is_extended_periodically():
    assert find_ngram_draft(np.array([4, 5, 6, 4, 5, 6, 4]), 1, 3, 5).tolist() == [5, 6, 4, 5, 6]


def _request(prompt, output, max_draft=8):
    row = SamplingRow(
        seq_id=3,
        sampling_params=SamplingParams(temperature=0.0),
        seed=0,
        output_position=len(output),
        prompt_token_ids=prompt,
        output_token_ids=output,
    )
    return DraftRequest(row=row, max_draft_tokens=max_draft)


def test_proposer_uses_prompt_and_output_and_caps_the_length():
    proposer = NgramProposer(ngram_min=2, ngram_max=3, num_speculative_tokens=3)
    requests = [
        _request([10, 11, 12, 13, 14, 15], [10, 11]),  # matches the prompt: 12, 13, 14
        _request([1, 2, 3], [4], max_draft=2),  # no match
        _request([1, 2, 3, 1], [2], max_draft=2),  # capped by the scheduler's limit
    ]
    out = proposer.propose(requests)
    assert out.probs is None
    assert out.token_ids == [[12, 13, 14], [], [3, 1]]
    proposer.free(3)


def test_rejects_bad_configuration():
    with pytest.raises(ValueError):
        NgramProposer(ngram_min=0, ngram_max=2, num_speculative_tokens=2)
    with pytest.raises(ValueError):
        NgramProposer(ngram_min=3, ngram_max=2, num_speculative_tokens=2)
    with pytest.raises(ValueError):
        NgramProposer(ngram_min=1, ngram_max=2, num_speculative_tokens=0)
    with pytest.raises(ValueError):
        NgramProposer(ngram_min=1, ngram_max=2, num_speculative_tokens=2, context_window=-1)
