"""Prompt-lookup (n-gram) proposer: drafts what followed the latest earlier occurrence of the
sequence's last n tokens, n from ngram_max down to ngram_min. No model, no device memory.

Matching is vectorized with numpy over the candidate positions: candidates are the earlier
occurrences of the last token, extended backwards one token at a time (at most ngram_max
rounds), so one sequence costs O(num_tokens + num_candidates * ngram_max).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedinfer.engine.spec_decode.proposer import DraftProposals, DraftRequest


def find_ngram_draft(tokens: np.ndarray, ngram_min: int, ngram_max: int, max_draft: int) -> np.ndarray:
    """Up to `max_draft` tokens following the longest (then latest) earlier match of a suffix.

    tokens [L] int: the sequence so far. A match of length n in [ngram_min, ngram_max] ending at
    position j < L - 1 means tokens[j - n + 1 : j + 1] == tokens[L - n :]; the draft is
    tokens[j + 1 :] extended periodically to `max_draft` tokens. Empty when nothing matches.
    """
    num_tokens = int(tokens.shape[0])
    if num_tokens < ngram_min + 1 or max_draft <= 0:
        return tokens[:0]
    ends = np.flatnonzero(tokens[: num_tokens - 1] == tokens[num_tokens - 1])  # [C] candidate ends
    if ends.size == 0:
        return tokens[:0]
    match_len = np.ones(ends.shape, dtype=np.int64)  # [C]
    alive = np.ones(ends.shape, dtype=bool)  # [C] still matching at the current offset
    for offset in range(1, min(ngram_max, num_tokens - 1)):
        starts = ends - offset  # [C]
        alive &= starts >= 0
        alive[alive] = tokens[starts[alive]] == tokens[num_tokens - 1 - offset]
        if not alive.any():
            break
        match_len += alive
    best = match_len.max()
    if best < ngram_min:
        return tokens[:0]
    end = int(ends[np.flatnonzero(match_len == best)[-1]])  # latest of the longest
    # What followed the match runs up to the end of the sequence; past it the draft repeats
    # with period L - 1 - end, since the suffix itself is what repeats (e.g. "5 5 5" -> "5 5").
    return np.resize(tokens[end + 1 :], max_draft)


class NgramProposer:
    """Proposer over the sequence's own tokens (prompt lookup decoding)."""

    def __init__(self, ngram_min: int, ngram_max: int, num_speculative_tokens: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, requests: Sequence[DraftRequest]) -> DraftProposals:
        drafts = []
        for request in requests:
            tokens = np.asarray(request.token_ids(), dtype=np.int64)  # [L]
            k = min(request.max_draft_tokens, self.num_speculative_tokens)
            drafts.append(find_ngram_draft(tokens, self.ngram_min, self.ngram_max, k).tolist())
        return DraftProposals(token_ids=drafts, probs=None)

    def free(self, seq_id: int) -> None:
        """Stateless: nothing to forget."""
