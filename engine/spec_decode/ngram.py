"""Prompt-lookup (n-gram) proposer: drafts what followed an earlier occurrence of the sequence's
last n tokens, n from ngram_max down to ngram_min. No model, no device memory.

Among equally long matches it ranks the latest MAX_RANKED_TIES of them by how many of their
preceding `context_window` tokens occur in the window before the sequence's own suffix, and takes
the best ranked, then the latest. Why: after an edit (an inserted comma, a changed word) only the
last token matches, and it occurs in many places; the right one is where the text copied so far
came from, whose context still resembles the recent output (the latest occurrence alone chose
worse: bench/NOTES.md, n-gram on CPU).

Matching is vectorized with numpy over the candidate positions: candidates are the earlier
occurrences of the last token, extended backwards one token at a time (at most ngram_max
rounds), so one sequence costs O(num_tokens + num_candidates * ngram_max). The proposer runs
that over all its sequences at once (`find_ngram_drafts`) on int32 token arrays it keeps per
sequence and extends by the new outputs only, so a step costs a fixed number of numpy calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedinfer.engine.spec_decode.proposer import DraftProposals, DraftRequest

# Tokens before a match compared with those before the suffix, to rank equally long matches.
CONTEXT_WINDOW = 8
# At most this many equally long matches, the latest, are ranked per sequence; older ones are
# never chosen. Why: repetitive text (one token repeated, a short period) ties at nearly every
# position, and ranking all ties ([C, W, W] compares) cost ~5-10x the matching itself (B 64 x
# 4096 constant tokens: ~113 ms against ~21 ms capped, bench/NOTES.md), while such ties have
# alike contexts anyway. 32: when copying a text, a token's source lies about (its count in the
# text) ties back; the bench's editing texts hold at most 20 of any word ("the").
MAX_RANKED_TIES = 32


def context_overlap(
    tokens: np.ndarray, a_ends: np.ndarray, b_ends: np.ndarray, lows: np.ndarray, window: int
) -> np.ndarray:
    """How many of the `window` tokens ending at a_ends[c] occur among those ending at b_ends[c].

    tokens [T] int; a_ends, b_ends, lows [C] int: positions below lows[c] (the sequence's start)
    are outside the windows. Returns [C] int64 in [0, window].
    """
    steps = np.arange(window - 1, -1, -1)  # [W]
    a_pos = a_ends[:, None] - steps[None, :]  # [C, W]
    b_pos = b_ends[:, None] - steps[None, :]  # [C, W]
    a_ok = a_pos >= lows[:, None]
    b_ok = b_pos >= lows[:, None]
    a_tok = tokens[np.where(a_ok, a_pos, 0)]
    b_tok = tokens[np.where(b_ok, b_pos, 0)]
    seen = ((a_tok[:, :, None] == b_tok[:, None, :]) & b_ok[:, None, :]).any(axis=2)  # [C, W]
    return (seen & a_ok).sum(axis=1)


def _latest_per_group(items: np.ndarray, group: np.ndarray, num_groups: int, limit: int) -> np.ndarray:
    """The last `limit` items of each group.

    items [N], group [N] int in [0, num_groups), sorted by group (items keep their order).
    Returns [<= N] items.
    """
    group_end = np.cumsum(np.bincount(group, minlength=num_groups))  # [G] one past each group
    return items[np.arange(items.shape[0]) >= group_end[group] - limit]


def find_ngram_draft(
    tokens: np.ndarray,
    ngram_min: int,
    ngram_max: int,
    max_draft: int,
    context_window: int = CONTEXT_WINDOW,
) -> np.ndarray:
    """Up to `max_draft` tokens following the longest earlier match of a suffix.

    tokens [L] int: the sequence so far. A match of length n in [ngram_min, ngram_max] ending at
    position j < L - 1 means tokens[j - n + 1 : j + 1] == tokens[L - n :]; the draft is
    tokens[j + 1 :] extended periodically to `max_draft` tokens. Empty when nothing matches.
    Equally long matches: of the latest MAX_RANKED_TIES, the one with the most `context_overlap`
    between the windows ending just before the match and just before the suffix, then the latest
    (context_window 0: the latest).
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
    longest = np.flatnonzero(match_len == best)[-MAX_RANKED_TIES:]  # ascending positions
    if context_window > 0 and longest.size > 1:
        cands = ends[longest]
        b_ends = np.full(cands.shape, num_tokens - 1 - best)
        overlap = context_overlap(tokens, cands - best, b_ends, np.zeros_like(cands), context_window)
        longest = longest[overlap == overlap.max()]
    end = int(ends[longest[-1]])  # the latest of the best
    # What followed the match runs up to the end of the sequence; past it the draft repeats
    # with period L - 1 - end, since the suffix itself is what repeats (e.g. "5 5 5" -> "5 5").
    return np.resize(tokens[end + 1 :], max_draft)


def find_ngram_drafts(
    flat: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    ngram_min: int,
    ngram_max: int,
    max_drafts: np.ndarray,
    context_window: int = CONTEXT_WINDOW,
) -> list[list[int]]:
    """`find_ngram_draft` for B sequences at once, concatenated in `flat`.

    flat [T] int: all sequences back to back; sequence b is flat[starts[b] : starts[b] + lengths[b]].
    max_drafts [B] int. Same result per sequence as `find_ngram_draft`, in a fixed number of
    numpy calls: candidates (earlier occurrences of each sequence's last token) of all sequences
    are matched backwards together, then each sequence keeps its longest, then (among the latest
    MAX_RANKED_TIES of those) most similar in context, then latest match.
    """
    num_seqs = int(lengths.shape[0])
    if flat.shape[0] == 0:
        return [[] for _ in range(num_seqs)]
    ends = starts + lengths  # [B] one past each sequence's last token
    ok = (lengths >= ngram_min + 1) & (max_drafts > 0)  # [B]
    seq_of = np.repeat(np.arange(num_seqs), lengths)  # [T] owning sequence of each token
    last = flat[ends - 1]  # [B] (lengths >= 1 where ok; masked below otherwise)
    pos = np.arange(flat.shape[0])  # [T]
    is_cand = (flat == last[seq_of]) & (pos < ends[seq_of] - 1) & ok[seq_of]
    cand = np.flatnonzero(is_cand)  # [C] candidate ends (flat positions)
    cand_seq = seq_of[cand]  # [C]
    match_len = np.ones(cand.shape, dtype=np.int64)  # [C]
    alive = np.ones(cand.shape, dtype=bool)  # [C]
    # Offsets 1 .. min(ngram_max, L - 1) - 1 per sequence, as in the one-sequence loop.
    max_offset = np.minimum(ngram_max, lengths - 1)[cand_seq]  # [C]
    for offset in range(1, ngram_max):
        src = cand - offset  # [C]
        alive &= (offset < max_offset) & (src >= starts[cand_seq])
        idx = np.flatnonzero(alive)
        alive[idx] = flat[src[idx]] == flat[ends[cand_seq[idx]] - 1 - offset]
        if not alive.any():
            break
        match_len += alive
    # Longest, then most context overlap, then latest: one key per candidate, max per sequence.
    rank = match_len * (context_window + 1)  # [C]
    if context_window > 0 and cand.size:
        longest = np.zeros(num_seqs, dtype=np.int64)  # [B]
        np.maximum.at(longest, cand_seq, match_len)
        tied = np.flatnonzero(match_len == longest[cand_seq])  # only these can be chosen
        # Unranked older ties keep rank = match_len * (W + 1), which never beats a ranked later tie.
        tied = _latest_per_group(tied, cand_seq[tied], num_seqs, MAX_RANKED_TIES)
        if tied.size > np.count_nonzero(longest):  # some sequence has a tie to break
            seq, n = cand_seq[tied], match_len[tied]
            rank[tied] += context_overlap(
                flat, cand[tied] - n, ends[seq] - 1 - n, starts[seq], context_window
            )
    scale = flat.shape[0] + 1
    best = np.full(num_seqs, -1, dtype=np.int64)  # [B]
    np.maximum.at(best, cand_seq, rank * scale + cand)
    has = (best >= 0) & (best // scale // (context_window + 1) >= ngram_min)  # [B]
    end = best % scale  # [B] flat position of the chosen match's end
    out: list[list[int]] = [[] for _ in range(num_seqs)]
    rows = np.flatnonzero(has)
    if rows.size == 0:
        return out
    width = int(max_drafts[rows].max())
    period = ends[rows] - 1 - end[rows]  # [R] >= 1: what follows the match, repeated
    steps = np.arange(width)  # [W]
    drafts = flat[end[rows, None] + 1 + steps[None, :] % period[:, None]]  # [R, W]
    for r, k, row in zip(rows.tolist(), max_drafts[rows].tolist(), drafts.tolist(), strict=True):
        out[r] = row[:k]
    return out


# Up to this many sequences the one-sequence path is cheaper (~35 us a sequence against ~80 us
# of fixed cost for the batched one, measured on the CPU machine).
_MAX_ONE_BY_ONE = 2


class _TokenCache:
    """Each sequence's tokens as an int32 array, grown by its new outputs only (outputs are
    append-only; a sequence whose prompt object changed, or whose cached tail disagrees, is
    rebuilt)."""

    def __init__(self) -> None:
        self._arrays: dict[int, tuple[list[int], np.ndarray, int]] = {}  # seq_id -> (prompt, buf, n)

    def tokens(self, request: DraftRequest) -> np.ndarray:
        row = request.row
        prompt, out = row.prompt_token_ids, row.output_token_ids
        num_tokens = len(prompt) + len(out)
        entry = self._arrays.get(row.seq_id)
        if entry is not None:
            cached_prompt, buf, n = entry
            num_prompt = len(prompt)
            if (
                cached_prompt is not prompt
                or n > num_tokens
                or (n > num_prompt and buf[n - 1] != out[n - 1 - num_prompt])
            ):
                entry = None
        if entry is None:
            buf = np.empty(max(2 * num_tokens, 64), dtype=np.int32)
            buf[: len(prompt)] = prompt
            n = len(prompt)
        if num_tokens > buf.shape[0]:
            grown = np.empty(2 * num_tokens, dtype=np.int32)
            grown[:n] = buf[:n]
            buf = grown
        if n < num_tokens:
            buf[n:num_tokens] = out[n - len(prompt) :]
        self._arrays[row.seq_id] = (prompt, buf, num_tokens)
        return buf[:num_tokens]

    def free(self, seq_id: int) -> None:
        self._arrays.pop(seq_id, None)


class NgramProposer:
    """Proposer over the sequence's own tokens (prompt lookup decoding), batched over sequences."""

    def __init__(
        self,
        ngram_min: int,
        ngram_max: int,
        num_speculative_tokens: int,
        context_window: int = CONTEXT_WINDOW,
    ) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if context_window < 0:
            raise ValueError(f"context_window must be >= 0, got {context_window}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.num_speculative_tokens = num_speculative_tokens
        self.context_window = context_window
        self._cache = _TokenCache()

    def propose(self, requests: Sequence[DraftRequest]) -> DraftProposals:
        if not requests:
            return DraftProposals(token_ids=[], probs=None)
        arrays = [self._cache.tokens(r) for r in requests]
        k = self.num_speculative_tokens
        if len(requests) <= _MAX_ONE_BY_ONE:  # fewer numpy calls one sequence at a time
            return DraftProposals(
                token_ids=[
                    find_ngram_draft(
                        a, self.ngram_min, self.ngram_max, min(r.max_draft_tokens, k), self.context_window
                    ).tolist()
                    for a, r in zip(arrays, requests, strict=True)
                ],
                probs=None,
            )
        lengths = np.fromiter((a.shape[0] for a in arrays), np.int64, len(arrays))  # [B]
        starts = np.cumsum(lengths) - lengths  # [B]
        max_drafts = np.fromiter((min(r.max_draft_tokens, k) for r in requests), np.int64, len(requests))
        flat = np.concatenate(arrays)  # [T] int32
        drafts = find_ngram_drafts(
            flat, starts, lengths, self.ngram_min, self.ngram_max, max_drafts, self.context_window
        )
        return DraftProposals(token_ids=drafts, probs=None)

    def free(self, seq_id: int) -> None:
        """Forget the sequence's cached tokens."""
        self._cache.free(seq_id)
