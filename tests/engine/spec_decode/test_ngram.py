"""N-gram (prompt lookup) proposer against a brute-force reference."""

from __future__ import annotations

import numpy as np
import pytest

from pagedinfer.engine.core.scheduler_output import SamplingRow
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.spec_decode import ngram
from pagedinfer.engine.spec_decode.ngram import (
    MAX_RANKED_TIES,
    NgramProposer,
    find_ngram_draft,
    find_ngram_drafts,
    grouped_context_overlap,
)
from pagedinfer.engine.spec_decode.proposer import DraftRequest


def _reference(
    tokens: list[int], ngram_min: int, ngram_max: int, k: int, window: int, max_ranked: int | None
) -> list[int]:
    """The documented rule, plainly: the longest n; among its matches the latest `max_ranked`
    (None: all); of those the most context overlap, then the latest."""
    num_tokens = len(tokens)
    for n in range(ngram_max, ngram_min - 1, -1):
        if n >= num_tokens:
            continue
        suffix = tokens[num_tokens - n :]
        ends = [end for end in range(n - 1, num_tokens - 1) if tokens[end - n + 1 : end + 1] == suffix]
        if not ends:
            continue
        if max_ranked is not None:
            ends = ends[len(ends) - max_ranked :] if len(ends) > max_ranked else ends
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
        want = _reference(tokens, ngram_min, ngram_max, k, window, MAX_RANKED_TIES)
        assert got == want, (tokens, ngram_min, ngram_max, k, window)


@pytest.mark.parametrize("high", [5, 2**31 - 1])  # small vocab (many hits); ids near int32's top
def test_grouped_context_overlap_matches_a_plain_count(high):
    rng = np.random.default_rng(high % 97)
    for _ in range(200):
        lengths = rng.integers(0, 30, int(rng.integers(1, 5)))
        lengths[0] = max(lengths[0], 1)  # some group has candidates
        starts = np.cumsum(lengths) - lengths
        tokens = rng.integers(0, high, int(lengths.sum()) + 1).astype(np.int32)
        window = int(rng.integers(1, 20))
        group = np.sort(rng.choice(np.flatnonzero(lengths), int(rng.integers(1, 12))))  # [C]
        a_ends = starts[group] + rng.integers(-1, lengths[group])  # -1: an empty window
        b_ends = starts + rng.integers(0, np.maximum(lengths, 1))  # [G]
        got = grouped_context_overlap(tokens, a_ends, group, b_ends, starts, window)
        for c, g in enumerate(group.tolist()):
            low = int(starts[g])
            before = {int(tokens[i]) for i in range(b_ends[g] - window + 1, b_ends[g] + 1) if i >= low}
            want = sum(
                int(tokens[i]) in before for i in range(a_ends[c] - window + 1, a_ends[c] + 1) if i >= low
            )
            assert got[c] == want, (tokens, a_ends[c], b_ends[g], low, window)


def test_long_windows_and_ngrams_match_the_reference():
    """Windows and n-gram lengths past the precomputed offsets (16) take the general branch."""
    rng = np.random.default_rng(16)
    for _ in range(60):
        seqs = [
            np.resize(rng.integers(0, 4, int(rng.integers(1, 9))), int(rng.integers(0, 80))) for _ in range(3)
        ]
        ngram_min = int(rng.integers(1, 18))
        ngram_max = ngram_min + int(rng.integers(0, 4))
        window = int(rng.choice([8, 17, 24]))
        lengths = np.array([len(s) for s in seqs], dtype=np.int64)
        flat = np.concatenate(seqs).astype(np.int32)
        got = find_ngram_drafts(
            flat, np.cumsum(lengths) - lengths, lengths, ngram_min, ngram_max, np.full(3, 4), window
        )
        for s, row in zip(seqs, got, strict=True):
            want = _reference(s.tolist(), ngram_min, ngram_max, 4, window, MAX_RANKED_TIES)
            assert find_ngram_draft(s, ngram_min, ngram_max, 4, window).tolist() == want
            assert row == want


def _periodic(rng: np.random.Generator, period: np.ndarray, length: int, noise: float) -> np.ndarray:
    """`period` repeated to `length` tokens, a `noise` fraction of them replaced at random."""
    tokens = np.resize(period, length)
    noisy = rng.random(length) < noise
    tokens[noisy] = rng.integers(0, 1000, int(noisy.sum()))
    return tokens


def _sequence(rng: np.random.Generator) -> list[int]:
    """Random small-vocab, constant or noisy periodic text (0-300 tokens), or an edited copy:
    a text, a stretch where its token t recurs in other contexts, then the 8 tokens before t in
    the text, one new token and t. The copy's best context is then behind many newer ties,
    where the cap decides."""
    length = int(rng.integers(0, 300))
    kind = int(rng.integers(0, 4))
    if kind == 0:
        return rng.integers(0, int(rng.integers(2, 6)), length).tolist()
    if kind == 1:
        return [int(rng.integers(0, 1000))] * length
    if kind == 2:
        tokens = np.resize(rng.integers(0, 1000, int(rng.integers(1, 7))), length)
        noisy = rng.random(length) < rng.choice([0.0, 0.05, 0.2])
        tokens[noisy] = rng.integers(0, 1000, int(noisy.sum()))
        return tokens.tolist()
    text = rng.integers(0, 1000, int(rng.integers(10, 40))).tolist()
    t_pos = int(rng.integers(8, len(text)))
    stretch = rng.integers(0, 1000, int(rng.integers(30, 250)))
    stretch[rng.random(stretch.shape[0]) < 0.3] = text[t_pos]
    return text + stretch.tolist() + text[t_pos - 8 : t_pos] + [int(rng.integers(0, 1000)), text[t_pos]]


@pytest.mark.parametrize("max_ranked", [MAX_RANKED_TIES, 3])
@pytest.mark.parametrize("window", [2, 8])
def test_batches_of_repetitive_text_match_the_reference(monkeypatch, window, max_ranked):
    """Both paths against the reference on batches of mixed kinds and lengths; the cases are
    checked to include some where the cap changes the choice."""
    monkeypatch.setattr(ngram, "MAX_RANKED_TIES", max_ranked)
    rng = np.random.default_rng(1000 * window + max_ranked)
    num_capped = 0
    for _ in range(60):
        seqs = [_sequence(rng) for _ in range(int(rng.integers(1, 9)))]
        ngram_min = int(rng.integers(1, 3))
        ngram_max = ngram_min + int(rng.integers(0, 3))
        max_drafts = rng.integers(1, 6, len(seqs))
        lengths = np.array([len(s) for s in seqs], dtype=np.int64)
        starts = np.cumsum(lengths) - lengths
        flat = np.array([t for s in seqs for t in s], dtype=np.int32)
        got = find_ngram_drafts(flat, starts, lengths, ngram_min, ngram_max, max_drafts, window)
        for s, k, row in zip(seqs, max_drafts.tolist(), got, strict=True):
            want = _reference(s, ngram_min, ngram_max, k, window, max_ranked)
            one = find_ngram_draft(np.array(s, dtype=np.int64), ngram_min, ngram_max, k, window)
            assert row == want, (s, ngram_min, ngram_max, k)
            assert one.tolist() == want, (s, ngram_min, ngram_max, k)
            num_capped += want != _reference(s, ngram_min, ngram_max, k, window, None)
    assert num_capped >= 5  # the cap is exercised, not only present


@pytest.mark.parametrize("num_fillers", [MAX_RANKED_TIES - 1, MAX_RANKED_TIES])
def test_the_best_context_counts_only_among_the_latest_ties(num_fillers):
    """An old match in the suffix's context wins while it is among the latest MAX_RANKED_TIES
    matches, and the latest match wins once newer ones push it out."""
    source = [*range(10, 18), 0, 100]  # 0 after 10..17: the context the suffix resembles
    spacer = list(range(500, 508))  # keeps the source's tokens out of the fillers' windows
    fillers = [t for i in range(num_fillers) for t in (300 + i, 0, 200 + i)]  # 0 in other contexts
    tail = [*range(16, 9, -1), 99, 0]  # only the last token matches; 10..16 before it
    tokens = source + spacer + fillers + tail
    want = [100, 500] if num_fillers < MAX_RANKED_TIES else [200 + num_fillers - 1, 16]
    assert find_ngram_draft(np.array(tokens), 1, 3, 2, context_window=8).tolist() == want
    others = [[7, 7, 7, 7], [1, 2, 1, 2, 1]]
    flat = np.array(tokens + others[0] + others[1])
    lengths = np.array([len(tokens), 4, 5])
    got = find_ngram_drafts(flat, np.cumsum(lengths) - lengths, lengths, 1, 3, np.array([2, 2, 2]), 8)
    assert got == [want, [7, 7], [2, 1]]


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
