"""Triton kernel: a chained n-gram step's inputs (ids, positions, slots, context lengths) from
the previous step's packed output (ngram_propose.launch_packed, layout in ngram_layout.py) and
the token histories, written on the device so the step launches without the host. Its torch
path and reference is engine/spec_decode/device_chain.py's feed_inputs_torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.kernels.ngram_layout import COL_NUM_EMITTED, PACKED_FIXED

NUM_EMITTED = tl.constexpr(COL_NUM_EMITTED)
FIXED = tl.constexpr(PACKED_FIXED)


@triton.jit(do_not_specialize=["stride_prev", "stride_bt", "block_size"])
def _chain_feed_kernel(
    prev_ptr,  # [B, PACKED_FIXED + K_PREV + 1 + K] int64: the previous step's packed output
    hist_len_ptr,  # [B] int32 tokens known per sequence after that step (its bonus token last)
    ids_ptr,  # [B * (K + 1)] int64 -> bonus token + drafts
    pos_ptr,  # [B * (K + 1)] int64 -> the bonus token's position onwards
    slots_ptr,  # [B * (K + 1)] int64 -> from the block table at those positions
    lens_ptr,  # [B] int32 -> context lengths
    bt_ptr,  # [B, M] int32 block tables
    stride_prev,
    stride_bt,
    block_size,
    K_PREV: tl.constexpr,
    K: tl.constexpr,
    Q: tl.constexpr,  # power of two >= K + 1
):
    seq = tl.program_id(0).to(tl.int64)
    row = prev_ptr + seq * stride_prev
    num_emitted = tl.load(row + NUM_EMITTED)
    bonus = tl.load(row + FIXED + num_emitted - 1)
    start = tl.load(hist_len_ptr + seq).to(tl.int64) - 1  # the bonus token's position
    j = tl.arange(0, Q)
    inside = j < K + 1
    drafts = tl.load(row + FIXED + K_PREV + j, mask=inside & (j >= 1), other=0)  # next draft j - 1
    base = seq * (K + 1)
    tl.store(ids_ptr + base + j, tl.where(j == 0, bonus, drafts), mask=inside)
    pos = start + j
    tl.store(pos_ptr + base + j, pos, mask=inside)
    block = tl.load(bt_ptr + seq * stride_bt + pos // block_size, mask=inside, other=0)
    tl.store(slots_ptr + base + j, block.to(tl.int64) * block_size + pos % block_size, mask=inside)
    tl.store(lens_ptr + seq, (start + K + 1).to(tl.int32))


def launch_chain_feed(
    prev: torch.Tensor,  # [B, PACKED_FIXED + K_prev + 1 + K] int64
    k_prev: int,
    history_len: torch.Tensor,  # [>= B] int32
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
) -> None:
    """A chained step's inputs from the previous step's packed output and the token histories
    (device_chain.feed_inputs_torch is the torch path)."""
    num_seqs = prev.shape[0]
    k = prev.shape[1] - PACKED_FIXED - k_prev - 1
    _chain_feed_kernel[(num_seqs,)](
        prev,
        history_len,
        input_ids,
        positions,
        slot_mapping,
        seq_lens,
        block_tables,
        prev.stride(0),
        block_tables.stride(0),
        block_size,
        K_PREV=k_prev,
        K=k,
        Q=triton.next_power_of_2(k + 1),
        num_warps=1,
    )
