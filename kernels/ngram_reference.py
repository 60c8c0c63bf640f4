"""Pure-PyTorch accept + propose of n-gram speculative decoding; the CPU production path and the
oracle of the Triton kernel (ngram_propose.py). Same signature as its launcher (minus `backend`).

One engine step on the device, no host round trip: greedy acceptance of step N's drafts against
the target's argmax, the emitted tokens appended to each sequence's history, then the n-gram
draft of step N + 1 from the updated history with the rule of
engine.spec_decode.ngram.find_ngram_draft(context_window=0): the longest match of a suffix of
length m in [ngram_min, ngram_max] ending at an earlier position j < n - 1, among those the
latest, and the tokens after it extended periodically (period n - 1 - j). With `match_keys` (a
[V] table, engine.spec_decode.ngram_keys) a sequence whose ids match nowhere is searched again on
its tokens' keys; the drafts are still the tokens after the match.

Vectorized over sequences and history positions ([B, L] work per n-gram offset; on the CPU only
up to the longest sequence), no `.item()` off the CPU, no boolean indexing: nothing synchronizes
a CUDA device. Indices that garbage inputs could push out of range are clamped, so nothing is
read or written out of bounds. No match: next_drafts repeats the last emitted token (any valid
id would do; the target rejects a wrong draft, and a repeat is right for runs of one token).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# The largest max_ties (equally long matches ranked by context) either backend takes: the Triton
# kernel ranks them as one vector of next_power_of_2(max_ties) ends. The engine ranks 32.
MAX_TIES_LIMIT = 1024


class AcceptProposeOutput(NamedTuple):
    """num_emitted [B] int64 in 1..K + 1; emitted [B, K + 1] int64 (0 past num_emitted);
    next_drafts [B, num_next] int64; has_match [B] bool (False: next_drafts is the row filled
    with the last emitted token, a valid id the target simply rejects when wrong)."""

    num_emitted: torch.Tensor
    emitted: torch.Tensor
    next_drafts: torch.Tensor
    has_match: torch.Tensor


def accept_and_propose(
    argmax: torch.Tensor,
    first_rows: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    history: torch.Tensor,
    history_len: torch.Tensor,
    ngram_min: int,
    ngram_max: int,
    num_next: int,
    context_window: int = 0,
    max_ties: int = 32,
    search: bool = True,
    match_keys: torch.Tensor | None = None,
) -> AcceptProposeOutput:
    """argmax [R] int64, first_rows [B] int64, drafts [B, K] int64, num_drafts [B] int64,
    history [B, L] int32 and history_len [B] int32 (both updated in place). See the module doc.
    context_window > 0: equally long matches are ranked as find_ngram_draft ranks them (of the
    latest `max_ties`, the most context overlap, then the latest). search False: acceptance only
    (no match: the next drafts are the filler), for drafts made elsewhere. match_keys [V] int32
    (optional): each id's key, matched where the ids match nowhere (ids outside [0, V) clamped)."""
    num_accepted, target = _accept(argmax, first_rows, drafts, num_drafts)
    steps = torch.arange(target.shape[1], device=target.device)  # [K + 1]
    emitted = torch.where(steps <= num_accepted[:, None], target, 0)  # [B, K + 1]
    new_len = _append(history, history_len, target, num_accepted)  # [B]
    fill = target.gather(1, num_accepted[:, None])  # [B, 1] the last emitted token
    if search:
        next_drafts, has_match = _propose(
            history, new_len, ngram_min, ngram_max, num_next, fill, context_window, max_ties, match_keys
        )
    else:
        next_drafts, has_match = (
            fill.expand(-1, num_next).clone(),
            torch.zeros_like(num_accepted, dtype=torch.bool),
        )
    history_len.copy_(new_len)
    return AcceptProposeOutput(num_accepted + 1, emitted, next_drafts, has_match)


def _accept(
    argmax: torch.Tensor, first_rows: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> num_accepted [B] int64 (leading drafts equal to their row's argmax), target [B, K + 1]
    int64 (argmax of the group's rows; rows past the group hold whatever follows, never used)."""
    max_drafts = drafts.shape[1]
    steps = torch.arange(max_drafts + 1, device=argmax.device)  # [K + 1]
    rows = (first_rows[:, None] + steps).clamp_(0, argmax.shape[0] - 1)  # [B, K + 1]
    target = argmax[rows]  # [B, K + 1]
    is_ok = (steps[:max_drafts] < num_drafts[:, None]) & (drafts == target[:, :max_drafts])  # [B, K]
    # cumprod keeps the leading run of matches: acceptance stops at the first mismatch.
    num_accepted = is_ok.long().cumprod(dim=1).sum(dim=1)  # [B]
    return num_accepted, target


def _append(
    history: torch.Tensor, history_len: torch.Tensor, target: torch.Tensor, num_accepted: torch.Tensor
) -> torch.Tensor:
    """Write target[b, :num_accepted[b] + 1] at history[b, history_len[b]:] (what fits in L);
    returns the new lengths [B] int64 (clamped to L)."""
    hist_cap = history.shape[1]
    old_len = history_len.long().clamp(0, hist_cap)  # [B]
    # Index of the last emitted token that fits; below 0: none does (the row is full).
    last_k = torch.minimum(num_accepted, hist_cap - 1 - old_len)  # [B]
    steps = torch.arange(target.shape[1], device=target.device)  # [K + 1]
    # Steps past last_k repeat its write (same position, same value): duplicates are harmless,
    # so one fixed-shape scatter serves every row without a [B, L] mask.
    k = torch.minimum(steps, last_k[:, None]).clamp_(min=0)  # [B, K + 1]
    pos = (old_len[:, None] + k).clamp_(max=hist_cap - 1)  # [B, K + 1]
    values = torch.where(last_k[:, None] >= 0, target.gather(1, k).to(history.dtype), history.gather(1, pos))
    history.scatter_(1, pos, values)
    return old_len + last_k.clamp(min=-1) + 1


def _propose(
    tokens: torch.Tensor,
    num_tokens: torch.Tensor,
    ngram_min: int,
    ngram_max: int,
    num_next: int,
    fill: torch.Tensor,
    context_window: int = 0,
    max_ties: int = 32,
    match_keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, L], num_tokens [B] int64 (n), fill [B, 1] int64 -> next_drafts [B, num_next]
    int64, has_match [B] bool."""
    hist_cap = tokens.shape[1]
    last = num_tokens - 1  # [B] the suffix ends here
    end = _match_end(tokens, last, ngram_min, ngram_max, context_window, max_ties)  # [B]
    # Keys where the ids match nowhere (on the CPU only if some row needs them: no device to wait for)
    if match_keys is not None and (tokens.device.type != "cpu" or bool((end < 0).any())):
        keyed = _match_end(tokens, last, ngram_min, ngram_max, context_window, max_ties, match_keys)
        end = torch.where(end >= 0, end, keyed)
    has_match = end >= 0
    end = end.clamp(min=0)
    period = (last - end).clamp(min=1)  # [B] what follows the match repeats with this period
    steps = torch.arange(num_next, device=tokens.device)  # [N]
    pos = (end[:, None] + 1 + steps % period[:, None]).clamp_(max=hist_cap - 1)  # [B, N]
    next_drafts = torch.where(has_match[:, None], tokens.gather(1, pos).long(), fill)
    return next_drafts, has_match


def _search_width(tokens: torch.Tensor, last: torch.Tensor) -> int:
    """Columns to search: candidate ends lie below max(last). Reading it costs nothing on the CPU
    (no device to wait for) and skips the unused capacity; elsewhere every column is searched."""
    if tokens.device.type != "cpu" or last.numel() == 0:
        return tokens.shape[1]
    return min(max(int(last.max()), 1), tokens.shape[1])


def _match_end(
    tokens: torch.Tensor,
    last: torch.Tensor,
    ngram_min: int,
    ngram_max: int,
    context_window: int = 0,
    max_ties: int = 32,
    match_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B] int64: where the longest, then (context_window > 0: of the latest max_ties, the most
    context overlap, then) latest match of the suffix ending at last ends; -1: none. Matched on
    match_keys[token] where given."""
    num_seqs, hist_cap = tokens.shape
    device = tokens.device
    offsets = torch.arange(ngram_max, device=device)  # [M]
    suffix = tokens.gather(1, (last[:, None] - offsets).clamp(0, hist_cap - 1))  # [B, M]
    width = _search_width(tokens, last)
    tokens = tokens[:, :width]
    if match_keys is not None:
        suffix, tokens = _keys_of(suffix, match_keys), _keys_of(tokens, match_keys)
    cols = torch.arange(width, device=device)  # [W]
    # run[b, j]: tokens j - t .. j equal the suffix's last t + 1 tokens, for t = 0 .. ngram_max - 1;
    # match_len counts the steps the run survives (so it is capped at ngram_max). Ends j < n - 1
    # only; then j - t >= 0 also keeps the suffix (n - 1 - t > j - t) inside the sequence.
    run = cols < last[:, None]  # [B, W]
    match_len = torch.zeros((num_seqs, width), dtype=torch.uint8, device=device)  # [B, W]
    for t in range(min(ngram_max, width)):
        run[:, :t] = False  # j - t < 0: the match would start before the sequence
        run[:, t:] &= tokens[:, : width - t] == suffix[:, t : t + 1]
        match_len += run.view(torch.uint8)  # (a uint8 add: ~5x cheaper than int64 += bool)
    # Longest, then latest: one key per end, its max per sequence.
    key = torch.where(match_len >= ngram_min, match_len.long() * width + cols, -1)  # [B, W]
    best = key.amax(dim=1)  # [B] (values only: max with indices is ~6x slower on the CPU)
    if context_window > 0:
        best = _rank_ties(tokens, last, match_len, best, width, context_window, max_ties)
    return torch.where(best >= 0, best % width, -1)


def _keys_of(tokens: torch.Tensor, match_keys: torch.Tensor) -> torch.Tensor:
    """match_keys[tokens] (ids clamped into the table: garbage reads no memory outside it)."""
    return match_keys[tokens.long().clamp(0, match_keys.shape[0] - 1)]


def _rank_ties(
    tokens: torch.Tensor,  # [B, W]
    last: torch.Tensor,  # [B] the suffix's last position
    match_len: torch.Tensor,  # [B, W]
    best: torch.Tensor,  # [B] longest-then-latest key (length * W + end), -1: none
    width: int,
    window: int,
    max_ties: int,
) -> torch.Tensor:
    """The key of the tie find_ngram_draft chooses: among the latest `max_ties` ends with the best
    length, the most tokens of the `window` before the match that occur among the `window` before
    the suffix (positions >= 0 only), then the latest."""
    cols = torch.arange(width, device=tokens.device)  # [W]
    best_len = torch.where(best >= 0, best // width, -1)  # [B]
    is_tie = match_len.long() == best_len[:, None]  # [B, W] (none where best_len is -1)
    rank = is_tie.flip(1).long().cumsum(1).flip(1)  # [B, W] ties at this end or later
    eligible = is_tie & (rank <= max_ties)
    steps = torch.arange(window, device=tokens.device)  # [C]
    b_pos = (last - best_len)[:, None] - steps  # [B, C] the window before the suffix
    b_tok = tokens.gather(1, b_pos.clamp(0, width - 1))
    b_tok = torch.where(b_pos >= 0, b_tok, -1)  # -1: no token (ids are >= 0)
    overlap = torch.zeros_like(match_len, dtype=torch.int64)  # [B, W]
    a_end = cols - best_len[:, None]  # [B, W] the token before each match
    for w in range(window):
        a_pos = a_end - w
        a_tok = tokens.gather(1, a_pos.clamp(0, width - 1))  # [B, W]
        seen = (a_tok[:, :, None] == b_tok[:, None, :]).any(dim=2)  # [B, W]
        overlap += seen & (a_pos >= 0)
    key = torch.where(eligible, overlap * width + cols, -1)  # most overlap, then latest
    ranked = key.amax(dim=1) % width  # [B]
    return torch.where(best >= 0, best_len * width + ranked, best)
