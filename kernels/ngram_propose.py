"""Triton kernel: accept + propose of n-gram speculative decoding in one launch.

One program per sequence: greedy acceptance of its drafts against the argmax rows of its group,
the emitted tokens written to its history row, then the n-gram search over the updated history
in tiles of BLOCK candidate ends, and the next drafts. Same results as ngram_reference.py.

The program never reads back what it wrote: a token at position p of the updated history comes
from the history row when p < the old length and from the argmax rows otherwise (`_token_at`),
so no barrier is needed between the history write and the search.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.kernels.ngram_reference import AcceptProposeOutput

BLOCK = 2048  # candidate ends per tile (8 KiB of int32 tokens per n-gram offset)
NUM_WARPS = 8  # 74 registers, no spills at BLOCK 2048 (ptxas, sm_90a); not timed on a GPU yet


@triton.jit
def _token_at(hist_row, emit_row, pos, old_len, new_len, emit_max, mask):
    """Token at pos of the updated history: old ones from the row, appended ones from argmax."""
    is_old = pos < old_len
    old = tl.load(hist_row + pos, mask=mask & is_old, other=0)
    emit_idx = tl.minimum(pos - old_len, emit_max)  # in range even for garbage inputs
    new = tl.load(emit_row + emit_idx, mask=mask & (pos >= old_len) & (pos < new_len), other=0)
    return tl.where(is_old, old, new.to(tl.int32))


@triton.jit
def _accept_propose_kernel(
    argmax_ptr,  # [R] int64
    first_rows_ptr,  # [B]
    drafts_ptr,  # [B, K]
    num_drafts_ptr,  # [B]
    hist_ptr,  # [B, L] int32, in/out
    hist_len_ptr,  # [B] int32, in/out
    num_emitted_ptr,  # [B] int64
    emitted_ptr,  # [B, K + 1] int64
    next_ptr,  # [B, N] int64
    has_match_ptr,  # [B] bool
    stride_drafts,
    stride_hist,
    stride_emitted,
    stride_next,
    num_rows,
    max_drafts,
    hist_cap,
    ngram_min,
    num_next,
    NGRAM_MAX: tl.constexpr,
    STEPS: tl.constexpr,  # power of two >= K + 1
    NEXT: tl.constexpr,  # power of two >= N
    BLOCK: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    # Acceptance: the leading drafts equal to their row's argmax.
    first = tl.minimum(tl.maximum(tl.load(first_rows_ptr + seq).to(tl.int64), 0), num_rows - 1)
    num_draft = tl.minimum(tl.maximum(tl.load(num_drafts_ptr + seq), 0), max_drafts)
    emit_row = argmax_ptr + first
    emit_max = num_rows - 1 - first  # last argmax row this sequence may read, from first
    steps = tl.arange(0, STEPS)
    target = tl.load(emit_row + tl.minimum(steps, emit_max), mask=steps <= max_drafts, other=0)
    draft = tl.load(drafts_ptr + seq * stride_drafts + steps, mask=steps < num_draft, other=0)
    is_rejected = (steps >= num_draft) | (draft != target)  # step num_draft always is
    num_accepted = tl.min(tl.where(is_rejected, steps, STEPS), axis=0)
    is_emitted = steps <= num_accepted
    tl.store(
        emitted_ptr + seq * stride_emitted + steps, tl.where(is_emitted, target, 0), mask=steps <= max_drafts
    )
    tl.store(num_emitted_ptr + seq, (num_accepted + 1).to(tl.int64))

    # Append what fits (a clamp, never an out-of-bounds write).
    hist_row = hist_ptr + seq * stride_hist
    old_len = tl.minimum(tl.maximum(tl.load(hist_len_ptr + seq), 0), hist_cap)
    new_len = tl.minimum(old_len + num_accepted + 1, hist_cap)
    tl.store(hist_row + old_len + steps, target.to(tl.int32), mask=is_emitted & (old_len + steps < hist_cap))
    tl.store(hist_len_ptr + seq, new_len.to(tl.int32))

    # Search: a key per candidate end j < n - 1, length * L + j, so the max is the longest match,
    # then the latest. All NGRAM_MAX loads of a tile are independent (masked by bounds only), so
    # they issue together; the run of equal tokens is cut afterwards.
    last = new_len - 1
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], -1, tl.int64)
    for start in range(0, last, BLOCK):
        ends = start + lanes
        run = ends < last
        match_len = tl.zeros([BLOCK], tl.int32)
        for t in tl.static_range(NGRAM_MAX):
            suffix_t = _token_at(hist_row, emit_row, last - t, old_len, new_len, emit_max, last - t >= 0)
            src = ends - t
            tok = _token_at(hist_row, emit_row, src, old_len, new_len, emit_max, (ends < last) & (src >= 0))
            run = run & (src >= 0) & (tok == suffix_t)
            match_len += run.to(tl.int32)
        key = tl.where(match_len >= ngram_min, match_len.to(tl.int64) * hist_cap + ends, -1)
        best = tl.maximum(best, key)
    best_key = tl.max(best, axis=0)

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
    tl.store(next_ptr + seq * stride_next + nexts, next_drafts, mask=nexts < num_next)
    tl.store(has_match_ptr + seq, has_match)


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
    block: int = BLOCK,
) -> AcceptProposeOutput:
    """Shapes and dtypes as ngram_reference.accept_and_propose (checked by ngram_ops); `block`
    (a power of two) sets the candidate ends per tile. Outputs are allocated here, once."""
    num_seqs, max_drafts = drafts.shape
    device = argmax.device
    out = AcceptProposeOutput(
        torch.empty(num_seqs, dtype=torch.int64, device=device),
        torch.empty((num_seqs, max_drafts + 1), dtype=torch.int64, device=device),
        torch.empty((num_seqs, num_next), dtype=torch.int64, device=device),
        torch.empty(num_seqs, dtype=torch.bool, device=device),
    )
    if num_seqs == 0:
        return out
    _accept_propose_kernel[(num_seqs,)](
        argmax,
        first_rows,
        drafts,
        num_drafts,
        history,
        history_len,
        *out,
        drafts.stride(0),
        history.stride(0),
        out.emitted.stride(0),
        out.next_drafts.stride(0),
        argmax.shape[0],
        max_drafts,
        history.shape[1],
        ngram_min,
        num_next,
        NGRAM_MAX=ngram_max,
        STEPS=triton.next_power_of_2(max_drafts + 1),
        NEXT=triton.next_power_of_2(num_next),
        BLOCK=block,
        num_warps=NUM_WARPS,
    )
    return out
