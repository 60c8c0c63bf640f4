"""Triton kernel: accept + propose of n-gram speculative decoding in one launch.

One program per sequence: greedy acceptance of its drafts against the argmax rows of its group,
the emitted tokens written to its history row, then the n-gram search over the updated history
in tiles of BLOCK candidate ends, and the next drafts. Same results as ngram_reference.py.

The program never reads back the history it wrote: a token at position p of the updated history
comes from the history row when p < the old length and from the argmax rows otherwise
(`_token_at`), so no barrier is needed between the history write and the search. The one
read-back is the tie ranking's scratch row, after a barrier (`_rank_ties`). With a key table
(KEYED) a sequence whose ids match nowhere is searched again with every token the search and the
ranking compare looked up as its key (`_key_of`, one gather from a table that stays in L2); the
drafts are the tokens themselves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.kernels.ngram_layout import (
    COL_HAS_MATCH,
    COL_NUM_DRAFTS,
    COL_NUM_EMITTED,
    COL_NUM_SLOTS,
    PACKED_FIXED,
)
from pagedinfer.kernels.ngram_reference import AcceptProposeOutput

# Candidate ends per tile, and warps. In a CUDA graph on an H100 with the engine's tie ranking
# (context 8; bench/NOTES.md, session 26): 512 x 8 warps 7.0 us on a 420-token copy history and
# 9.7 at 1,500 tokens, against 8.2-11.5 for the other tiles of 512-2048 x 8-16; without the
# ranking every tile is within ~1 us of the others (4.3-7.4 us).
BLOCK = 512
NUM_WARPS = 8


@triton.jit
def _token_at(hist_row, emit_row, pos, old_len, new_len, emit_max, mask):
    """Token at pos of the updated history: old ones from the row, appended ones from argmax."""
    is_old = pos < old_len
    old = tl.load(hist_row + pos, mask=mask & is_old, other=0)
    emit_idx = tl.minimum(pos - old_len, emit_max)  # in range even for garbage inputs
    new = tl.load(emit_row + emit_idx, mask=mask & (pos >= old_len) & (pos < new_len), other=0)
    return tl.where(is_old, old, new.to(tl.int32))


@triton.jit
def _key_of(tok, keys_ptr, num_keys, KEYED: tl.constexpr):
    """What the search compares for tok: its key (id clamped into the table), or tok itself."""
    if KEYED:
        return tl.load(keys_ptr + tl.minimum(tl.maximum(tok, 0), num_keys - 1))
    return tok


# ... as the kernels see them (globals a Triton kernel reads must be constexpr)
_NUM_SLOTS = tl.constexpr(COL_NUM_SLOTS)
_NUM_DRAFTS = tl.constexpr(COL_NUM_DRAFTS)
_NUM_EMITTED = tl.constexpr(COL_NUM_EMITTED)
_HAS_MATCH = tl.constexpr(COL_HAS_MATCH)
_FIXED = tl.constexpr(PACKED_FIXED)


@triton.jit(
    do_not_specialize=[
        "window",
        "max_ties",
        "stride_drafts",
        "stride_num_drafts",
        "drafts_scale",
        "stride_hist",
        "stride_out",
        "num_rows",
        "hist_cap",
        "ngram_min",
        "num_next",
        "num_keys",
    ]
)
def _accept_propose_kernel(
    argmax_ptr,  # [R] int64
    first_rows_ptr,  # [B] (unused when DENSE_ROWS)
    drafts_ptr,  # [B, K]
    num_drafts_ptr,  # [B] (times drafts_scale)
    hist_ptr,  # [B, L] int32, in/out
    hist_len_ptr,  # [B] int32, in/out
    out_ptr,  # [B, _FIXED + K + 1 + N] int64
    ties_ptr,  # [B, TIES] int32 scratch: the ends of the latest max_ties ties (CTX > 0)
    keys_ptr,  # [num_keys] int32: each id's key (KEYED)
    stride_drafts,
    stride_num_drafts,
    drafts_scale,
    stride_hist,
    stride_out,
    num_rows,
    hist_cap,
    ngram_min,
    num_next,
    window,  # context tokens compared when ranking equally long matches (CTX > 0)
    max_ties,  # the latest this many equally long matches are ranked
    num_keys,
    max_drafts: tl.constexpr,  # K
    NGRAM_MAX: tl.constexpr,
    CTX: tl.constexpr,  # 0: no ranking (the latest); else a power of two >= window
    STEPS: tl.constexpr,  # power of two >= K + 1
    NEXT: tl.constexpr,  # power of two >= N
    BLOCK: tl.constexpr,
    TIES: tl.constexpr,  # power of two >= max_ties (CTX > 0)
    DENSE_ROWS: tl.constexpr,  # every group has K + 1 rows (a chained step): first row b (K + 1)
    SEARCH: tl.constexpr,  # False: acceptance only (drafts made elsewhere; next drafts = filler)
    KEYED: tl.constexpr,  # where the ids match nowhere, search again on keys_ptr[token]
):
    seq = tl.program_id(0).to(tl.int64)
    out_row = out_ptr + seq * stride_out
    # Acceptance: the leading drafts equal to their row's argmax.
    if DENSE_ROWS:
        first = tl.minimum(seq * (max_drafts + 1), num_rows - 1)
    else:
        first = tl.minimum(tl.maximum(tl.load(first_rows_ptr + seq).to(tl.int64), 0), num_rows - 1)
    num_draft = tl.load(num_drafts_ptr + seq * stride_num_drafts).to(tl.int64) * drafts_scale
    num_draft = tl.minimum(tl.maximum(num_draft, 0), max_drafts)
    if DENSE_ROWS:
        tl.store(out_row + _NUM_SLOTS, tl.full([], max_drafts, tl.int64))
    else:
        tl.store(out_row + _NUM_SLOTS, num_draft)
    tl.store(out_row + _NUM_DRAFTS, num_draft)
    emit_row = argmax_ptr + first
    emit_max = num_rows - 1 - first  # last argmax row this sequence may read, from first
    steps = tl.arange(0, STEPS)
    target = tl.load(emit_row + tl.minimum(steps, emit_max), mask=steps <= max_drafts, other=0)
    draft = tl.load(drafts_ptr + seq * stride_drafts + steps, mask=steps < num_draft, other=0)
    is_rejected = (steps >= num_draft) | (draft != target)  # step num_draft always is
    num_accepted = tl.min(tl.where(is_rejected, steps, STEPS), axis=0)
    is_emitted = steps <= num_accepted
    tl.store(out_row + _FIXED + steps, tl.where(is_emitted, target, 0), mask=steps <= max_drafts)
    tl.store(out_row + _NUM_EMITTED, (num_accepted + 1).to(tl.int64))

    # Append what fits (a clamp, never an out-of-bounds write).
    hist_row = hist_ptr + seq * stride_hist
    old_len = tl.minimum(tl.maximum(tl.load(hist_len_ptr + seq), 0), hist_cap)
    new_len = tl.minimum(old_len + num_accepted + 1, hist_cap)
    tl.store(hist_row + old_len + steps, target.to(tl.int32), mask=is_emitted & (old_len + steps < hist_cap))
    tl.store(hist_len_ptr + seq, new_len.to(tl.int32))

    # Search on the ids; where they match nowhere and KEYED, again on the tokens' keys.
    last = new_len - 1
    best_key = tl.full([], -1, tl.int64)
    if SEARCH:
        ties_row = ties_ptr + seq * TIES
        best_key = _search(
            hist_row, emit_row, ties_row, old_len, new_len, emit_max, last, hist_cap, ngram_min,
            window, max_ties, keys_ptr, num_keys, NGRAM_MAX, BLOCK, CTX, TIES, False,
        )  # fmt: skip
        if KEYED:  # noqa: SIM102 (a constexpr test, then a runtime one: two ifs for Triton)
            if best_key < 0:
                best_key = _search(
                    hist_row, emit_row, ties_row, old_len, new_len, emit_max, last, hist_cap, ngram_min,
                    window, max_ties, keys_ptr, num_keys, NGRAM_MAX, BLOCK, CTX, TIES, True,
                )  # fmt: skip

    # Next drafts: what followed the match, periodic with period n - 1 - j; no match: the last
    # emitted token repeated.
    has_match = best_key >= 0
    end = tl.where(has_match, best_key % hist_cap, 0)
    period = tl.maximum(last - end, 1)
    nexts = tl.arange(0, NEXT)
    pos = end + 1 + nexts % period
    # (a where, not `scalar & vector`: the interpreter turns that into an int32 mask)
    is_read = tl.where(has_match, nexts < num_next, False)
    tok = _token_at(hist_row, emit_row, pos, old_len, new_len, emit_max, is_read)
    fill = tl.load(emit_row + tl.minimum(num_accepted, emit_max))
    next_drafts = tl.where(has_match, tok.to(tl.int64), fill)
    tl.store(out_row + _FIXED + max_drafts + 1 + nexts, next_drafts, mask=nexts < num_next)
    tl.store(out_row + _HAS_MATCH, has_match.to(tl.int64))


@triton.jit
def _search(
    hist_row,
    emit_row,
    ties_row,
    old_len,
    new_len,
    emit_max,
    last,
    hist_cap,
    ngram_min,
    window,
    max_ties,
    keys_ptr,
    num_keys,
    NGRAM_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
    CTX: tl.constexpr,
    TIES: tl.constexpr,
    KEYED: tl.constexpr,
):
    """The key (length * L + end) of the chosen match, -1: none. A key per candidate end j < n - 1,
    length * L + j, so the max is the longest match, then the latest; with CTX, equally long
    matches ranked by context (`_rank_ties`). Tokens compared as their keys where KEYED."""
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], -1, tl.int64)
    # per lane: the longest match among its ends so far, and how many ends have that length
    lane_len = tl.zeros([BLOCK], tl.int32)
    lane_count = tl.zeros([BLOCK], tl.int32)
    for start in range(0, last, BLOCK):
        ends = start + lanes
        match_len = _match_lengths(
            hist_row, emit_row, ends, last, old_len, new_len, emit_max, keys_ptr, num_keys, NGRAM_MAX, KEYED
        )
        is_match = match_len >= ngram_min
        key = tl.where(is_match, match_len.to(tl.int64) * hist_cap + ends, -1)
        best = tl.maximum(best, key)
        found = tl.where(is_match, match_len, 0)
        lane_count = tl.where(found > lane_len, 1, tl.where(found == lane_len, lane_count + 1, lane_count))
        lane_len = tl.maximum(lane_len, found)
    best_key = tl.max(best, axis=0)
    best_len = tl.max(lane_len, axis=0)
    num_longest = tl.sum(tl.where((lane_len == best_len) & (best_len > 0), lane_count, 0), axis=0)
    # Rank equally long matches by their context, as the host proposer does. A unique longest
    # match (the usual case when copying text) is its own ranking: the second pass over the
    # tiles, most of this kernel's time, is skipped.
    if CTX > 0:  # noqa: SIM102 (a constexpr test, then a runtime one: two ifs for Triton)
        if num_longest > 1:
            best_key = _rank_ties(
                ties_row,
                hist_row,
                emit_row,
                old_len,
                new_len,
                emit_max,
                last,
                best_key,
                hist_cap,
                ngram_min,
                window,
                max_ties,
                keys_ptr,
                num_keys,
                NGRAM_MAX,
                BLOCK,
                CTX,
                TIES,
                KEYED,
            )
    return best_key


@triton.jit
def _match_lengths(
    hist_row,
    emit_row,
    ends,
    last,
    old_len,
    new_len,
    emit_max,
    keys_ptr,
    num_keys,
    NGRAM_MAX: tl.constexpr,
    KEYED: tl.constexpr,
):
    """[BLOCK] int32: how many of the suffix's last tokens (up to NGRAM_MAX) end at each candidate
    end j < last (keys compared where KEYED). All NGRAM_MAX loads are independent (masked by
    bounds only), so they issue together; the run of equal tokens is cut afterwards."""
    run = ends < last
    match_len = tl.zeros(ends.shape, tl.int32)
    for t in tl.static_range(NGRAM_MAX):
        suffix_t = _token_at(hist_row, emit_row, last - t, old_len, new_len, emit_max, last - t >= 0)
        suffix_t = _key_of(suffix_t, keys_ptr, num_keys, KEYED)
        src = ends - t
        tok = _token_at(hist_row, emit_row, src, old_len, new_len, emit_max, (ends < last) & (src >= 0))
        tok = _key_of(tok, keys_ptr, num_keys, KEYED)
        run = run & (src >= 0) & (tok == suffix_t)
        match_len += run.to(tl.int32)
    return match_len


@triton.jit
def _rank_ties(
    ties_row,
    hist_row,
    emit_row,
    old_len,
    new_len,
    emit_max,
    last,
    best_key,
    hist_cap,
    ngram_min,
    window,
    max_ties,
    keys_ptr,
    num_keys,
    NGRAM_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
    CTX: tl.constexpr,
    TIES: tl.constexpr,
    KEYED: tl.constexpr,
):
    """The key (length * L + end) of the match find_ngram_draft chooses among the longest: of the
    latest max_ties ends with the best length, the most of the `window` tokens before the match
    that occur among the `window` before the suffix, then the latest.

    A second pass over the tiles, latest first, writes the ends of the latest max_ties ties to
    the program's scratch row (in order, the latest first) and stops once it has them; only those
    ends are then ranked, [TIES] wide. (Ranking every lane of every tile, [BLOCK] x CTX x CTX
    compares a tile, cost 3-8x the search alone; H200, bench/NOTES.md session 26.)"""
    best_len = tl.where(best_key >= 0, best_key // hist_cap, -1)
    lanes = tl.arange(0, BLOCK)
    num_tiles = tl.cdiv(tl.maximum(last, 0), BLOCK)
    ties_later = tl.full([], 0, tl.int32)
    i = tl.full([], 0, tl.int32)
    while (i < num_tiles) & (ties_later < max_ties):
        start = (num_tiles - 1 - i) * BLOCK
        ends = start + lanes
        match_len = _match_lengths(
            hist_row, emit_row, ends, last, old_len, new_len, emit_max, keys_ptr, num_keys, NGRAM_MAX, KEYED
        )
        is_tie = tl.where(best_len >= ngram_min, match_len == best_len, False)
        tie = is_tie.to(tl.int32)
        # ties at this end or later: the later tiles', then this tile's from here to its end
        rank = ties_later + tl.sum(tie, axis=0) - tl.cumsum(tie, axis=0) + tie
        tl.store(ties_row + rank - 1, ends.to(tl.int32), mask=is_tie & (rank <= max_ties))
        ties_later += tl.sum(tie, axis=0)
        i += 1
    tl.debug_barrier()  # the scratch row's stores, visible to every thread of the program
    # The ranking, over the collected ends only.
    slots = tl.arange(0, TIES)
    is_slot = slots < tl.minimum(ties_later, max_ties)
    tie_end = tl.load(ties_row + slots, mask=is_slot, other=0).to(tl.int64)
    ctx = tl.arange(0, CTX)
    b_pos = last - best_len - ctx
    # (wheres, not `scalar & vector`: the interpreter turns that into an int32 mask)
    b_ok = tl.where(best_len >= 0, (ctx < window) & (b_pos >= 0), False)
    b_tok = _token_at(hist_row, emit_row, b_pos, old_len, new_len, emit_max, b_ok)
    b_tok = tl.where(b_ok, _key_of(b_tok, keys_ptr, num_keys, KEYED), -1)  # -1: no token
    overlap = tl.zeros([TIES], tl.int64)
    for w in tl.static_range(CTX):
        a_pos = tie_end - best_len - w
        a_ok = tl.where(w < window, is_slot & (a_pos >= 0), False)
        a_tok = _key_of(
            _token_at(hist_row, emit_row, a_pos, old_len, new_len, emit_max, a_ok), keys_ptr, num_keys, KEYED
        )
        seen = tl.max((a_tok[:, None] == b_tok[None, :]).to(tl.int32), axis=1)
        overlap += tl.where(a_ok, seen, 0).to(tl.int64)
    ranked_key = tl.max(tl.where(is_slot, overlap * hist_cap + tie_end, -1), axis=0)
    return tl.where(ranked_key >= 0, best_len.to(tl.int64) * hist_cap + ranked_key % hist_cap, best_key)


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
    block: int = BLOCK,
    search: bool = True,
    num_warps: int = NUM_WARPS,
    match_keys: torch.Tensor | None = None,
) -> AcceptProposeOutput:
    """Shapes and dtypes as ngram_reference.accept_and_propose (checked by ngram_ops); `block`
    (a power of two) sets the candidate ends per tile. Views of one packed output."""
    num_seqs, max_drafts = drafts.shape
    packed = launch_packed(
        argmax,
        first_rows,
        drafts,
        num_drafts,
        1,
        history,
        history_len,
        ngram_min,
        ngram_max,
        num_next,
        block,
        context_window=context_window,
        max_ties=max_ties,
        search=search,
        num_warps=num_warps,
        match_keys=match_keys,
    )
    return unpack(packed, max_drafts)


def unpack(packed: torch.Tensor, max_drafts: int) -> AcceptProposeOutput:
    """The packed columns as AcceptProposeOutput (views; has_match as a new bool tensor)."""
    emitted = packed[:, PACKED_FIXED : PACKED_FIXED + max_drafts + 1]
    return AcceptProposeOutput(
        packed[:, COL_NUM_EMITTED],
        emitted,
        packed[:, PACKED_FIXED + max_drafts + 1 :],
        packed[:, COL_HAS_MATCH].bool(),
    )


def launch_packed(
    argmax: torch.Tensor,  # [R] int64
    first_rows: torch.Tensor | None,  # [B] int64; None: dense groups of K + 1 rows (a chained step)
    drafts: torch.Tensor,  # [B, K] int64 (row stride free: a previous packed output's next column)
    num_drafts: torch.Tensor,  # [B] (any stride), times drafts_scale
    drafts_scale: int,
    history: torch.Tensor,
    history_len: torch.Tensor,
    ngram_min: int,
    ngram_max: int,
    num_next: int,
    block: int = BLOCK,
    out: torch.Tensor | None = None,
    context_window: int = 0,
    max_ties: int = 32,
    search: bool = True,
    num_warps: int = NUM_WARPS,
    match_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel with every output in one [B, PACKED_FIXED + K + 1 + num_next] int64 tensor
    (columns COL_*, then emitted, then next drafts): one host copy a step, no packing ops.

    A chained step passes the previous step's packed output: its next-drafts columns as `drafts`,
    its has-match column as `num_drafts` with drafts_scale K (no match: filler, not verified).
    match_keys [V] int32 (optional): each id's key, compared by a second search where the ids
    match nowhere."""
    num_seqs, max_drafts = drafts.shape
    width = PACKED_FIXED + max_drafts + 1 + num_next
    if out is None:
        out = torch.empty((num_seqs, width), dtype=torch.int64, device=argmax.device)
    if num_seqs == 0:
        return out
    dense = first_rows is None
    ctx = triton.next_power_of_2(context_window) if context_window > 0 else 0
    ties = triton.next_power_of_2(max(max_ties, 1))
    # scratch of the tie ranking (a program writes, then reads, only its own row)
    scratch = (
        torch.empty((num_seqs, ties), dtype=torch.int32, device=argmax.device) if ctx and search else out
    )
    _accept_propose_kernel[(num_seqs,)](
        argmax,
        argmax if dense else first_rows,
        drafts,
        num_drafts,
        history,
        history_len,
        out,
        scratch,
        out if match_keys is None else match_keys,
        drafts.stride(0),
        num_drafts.stride(0),
        drafts_scale,
        history.stride(0),
        out.stride(0),
        argmax.shape[0],
        history.shape[1],
        ngram_min,
        num_next,
        context_window,
        max_ties,
        1 if match_keys is None else match_keys.shape[0],
        max_drafts=max_drafts,
        NGRAM_MAX=ngram_max,
        CTX=ctx,
        STEPS=triton.next_power_of_2(max_drafts + 1),
        NEXT=triton.next_power_of_2(num_next),
        BLOCK=block,
        TIES=ties,
        DENSE_ROWS=dense,
        SEARCH=search,
        KEYED=match_keys is not None,
        num_warps=num_warps,
    )
    return out
