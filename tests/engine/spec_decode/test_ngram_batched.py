"""The batched n-gram path (`find_ngram_drafts`, the proposer's token cache) against the
one-sequence general path `find_ngram_draft`."""

from __future__ import annotations

import numpy as np
import pytest

from pagedinfer.engine.core.scheduler_output import SamplingRow
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.spec_decode.ngram import NgramProposer, find_ngram_draft, find_ngram_drafts
from pagedinfer.engine.spec_decode.proposer import DraftRequest


@pytest.mark.parametrize("window", [0, 3, 8])
@pytest.mark.parametrize("vocab", [2, 5, 50])
def test_batched_equals_one_sequence_path(vocab, window):
    rng = np.random.default_rng(vocab)
    for _ in range(150):
        num_seqs = int(rng.integers(1, 7))
        seqs = [rng.integers(0, vocab, int(rng.integers(0, 40))).astype(np.int32) for _ in range(num_seqs)]
        ngram_min = int(rng.integers(1, 4))
        ngram_max = ngram_min + int(rng.integers(0, 3))
        max_drafts = rng.integers(0, 6, num_seqs)
        lengths = np.array([len(s) for s in seqs], dtype=np.int64)
        starts = np.cumsum(lengths) - lengths
        flat = np.concatenate(seqs) if seqs else np.zeros(0, np.int32)
        got = find_ngram_drafts(flat, starts, lengths, ngram_min, ngram_max, max_drafts, window)
        want = [
            find_ngram_draft(s.astype(np.int64), ngram_min, ngram_max, int(k), window).tolist()
            for s, k in zip(seqs, max_drafts, strict=True)
        ]
        assert got == want, (seqs, ngram_min, ngram_max, max_drafts)


def _request(seq_id: int, prompt: list[int], out: list[int], k: int) -> DraftRequest:
    row = SamplingRow(seq_id, SamplingParams(), None, len(out), prompt, out)
    return DraftRequest(row, k)


@pytest.mark.parametrize("num_seqs", [2, 4])  # the one-by-one and the batched path
def test_proposer_cache_follows_growing_and_replaced_sequences(num_seqs):
    rng = np.random.default_rng(0)
    proposer = NgramProposer(1, 3, 4)
    prompts = {i: rng.integers(0, 6, 20).tolist() for i in range(num_seqs)}
    outs: dict[int, list[int]] = {i: [] for i in range(num_seqs)}
    for step in range(30):
        for i in outs:  # outputs grow by 1..5 tokens a step, as after verification
            outs[i].extend(rng.integers(0, 6, int(rng.integers(1, 6))).tolist())
        if step == 10:  # a different sequence under a reused id, and one with a rewritten tail
            prompts[1] = rng.integers(0, 6, 15).tolist()
            outs[1] = rng.integers(0, 6, 3).tolist()
            outs[0][-1] = (outs[0][-1] + 1) % 6
        if step == 20:
            proposer.free(num_seqs - 1)
        requests = [_request(i, prompts[i], outs[i], 4) for i in outs]
        got = proposer.propose(requests).token_ids
        want = [
            find_ngram_draft(np.asarray(prompts[i] + outs[i], dtype=np.int64), 1, 3, 4).tolist() for i in outs
        ]
        assert got == want
