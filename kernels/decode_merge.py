"""Merging the split-K partials of the decode kernel (kernels/decode_attention.py).

Split s of a (sequence, query head) leaves a normalized partial output o_s and its base-2
log-sum-exp lse_s; out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse). Three ways to
run the merge (SplitMerge):
- KERNEL: a second kernel, one program per (sequence, query head);
- PDL: that kernel launched with programmatic dependent launch: it is scheduled while the split
  kernel's last programs still run and waits in-kernel (griddepcontrol.wait) for their results,
  so its launch latency leaves the dependent chain;
- FUSED: no second kernel: the split program that arrives last in its (sequence, KV head) group,
  found by an atomic counter, merges the group's query heads and resets its counter to 0.
  Counters are therefore zero between calls: one zeroed buffer per device (CounterPool) serves
  every call and every CUDA-graph replay, with no memset per call.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

try:  # griddepcontrol (Hopper+); Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL is never chosen (pdl_supported)
    gdc_launch_dependents = gdc_wait = None

# Elements of one [group, chunk, head_dim] fp32 tile the fused merge loads at once (64 registers
# a thread at 4 warps).
FUSED_TILE_ELEMENTS = 8192


class SplitMerge(enum.Enum):
    """How the split-K partials are merged (see the module docstring)."""

    KERNEL = "kernel"
    PDL = "pdl"
    FUSED = "fused"


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs a CUDA device of compute capability >= 9.0."""
    if gdc_wait is None or device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


class CounterPool:
    """One zeroed int32 counter buffer per device for the fused merge, allocated once.

    Every fused call leaves the counters it used at 0 again (the merger resets its own), so the
    buffer never needs clearing. A buffer is never freed or replaced: CUDA graphs keep its address.
    Calls on concurrent streams of one device must not share it (the engine decodes on one stream).
    """

    SIZE = 4096

    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, num_counters: int) -> torch.Tensor | None:
        """The device's buffer, or None when num_counters exceed it (callers fall back to KERNEL)."""
        if num_counters > self.SIZE:
            return None
        if device.type == "cuda" and device.index is None:  # one key per physical device
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._buffers:
            self._buffers[device] = torch.zeros(self.SIZE, dtype=torch.int32, device=device)
        return self._buffers[device]


@triton.jit
def _merge_row(part_out_ptr, part_lse_ptr, o_base, row, head_dim, num_splits, SPLITS_PAD: tl.constexpr,
               D_PAD: tl.constexpr):  # fmt: skip
    """out[row] = sum_p w_p * part_out[row, p] / sum_p w_p with w_p = 2^(lse_p - max lse)."""
    p = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    p_mask = p < num_splits
    # .cg: read through L2, never a stale L1 line (partials come from other programs)
    lse = tl.load(part_lse_ptr + row * num_splits + p, mask=p_mask, other=float("-inf"), cache_modifier=".cg")
    # both loads issued before the reduction (its barrier would hold the second one back a round trip)
    parts_ptrs = part_out_ptr + (row * num_splits + p[:, None]) * D_PAD + d[None, :]
    parts = tl.load(parts_ptrs, mask=p_mask[:, None], other=0.0, cache_modifier=".cg")  # [SPLITS_PAD, D_PAD]
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)  # [SPLITS_PAD]; 0 for empty splits
    denom = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(o_base + d, out.to(o_base.dtype.element_ty), mask=d < head_dim)


@triton.jit
def merge_group(
    part_out_ptr,  # fp32 [S, H, num_splits, D_PAD]
    part_lse_ptr,  # fp32 [S, H, num_splits]
    out_ptr,  # [S, H, D]
    seq,
    kv_head,
    num_heads,
    stride_os,
    stride_oh,
    head_dim,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """The decode kernel's fused merge: all GROUP query heads of one KV head."""
    g = tl.arange(0, GROUP_P2)
    heads = kv_head * GROUP + g
    rows = seq.to(tl.int64) * num_heads + heads  # [GROUP_P2]
    o_rows = out_ptr + seq.to(tl.int64) * stride_os + heads * stride_oh
    merge_rows(
        part_out_ptr,
        part_lse_ptr,
        rows,
        g < GROUP,
        o_rows,
        head_dim,
        num_splits,
        SPLITS_PAD,
        SPLIT_CHUNK,
        D_PAD,
    )


@triton.jit
def merge_rows(
    part_out_ptr,  # fp32 [rows, num_splits, D_PAD]
    part_lse_ptr,  # fp32 [rows, num_splits]
    rows,  # [R] int64: the partial rows to merge
    row_ok,  # [R] bool: rows that exist
    o_rows,  # [R] pointers: where each merged row goes
    head_dim,
    num_splits,
    SPLITS_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """A fused merge (the split program that arrived last): R rows, SPLIT_CHUNK splits per load."""
    d = tl.arange(0, D_PAD)
    p = tl.arange(0, SPLITS_PAD)
    lse_mask = row_ok[:, None] & (p < num_splits)[None, :]
    lse_ptrs = part_lse_ptr + rows[:, None] * num_splits + p[None, :]
    lse = tl.load(lse_ptrs, mask=lse_mask, other=float("-inf"), cache_modifier=".cg")  # [R, SPLITS_PAD]
    lse_max = tl.max(lse, 1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # [R]
    denom = tl.sum(tl.exp2(lse - lse_max[:, None]), 1)  # [R]
    acc = tl.zeros([rows.shape[0], D_PAD], tl.float32)
    c = tl.arange(0, SPLIT_CHUNK)
    for p0 in range(0, num_splits, SPLIT_CHUNK):
        pc = p0 + c  # [SPLIT_CHUNK]
        mask = row_ok[:, None] & (pc < num_splits)[None, :]  # [R, SPLIT_CHUNK]
        rows_c = rows[:, None] * num_splits + pc[None, :]  # [R, SPLIT_CHUNK]
        lse_c = tl.load(part_lse_ptr + rows_c, mask=mask, other=float("-inf"), cache_modifier=".cg")
        w = tl.exp2(lse_c - lse_max[:, None])  # 0 for empty splits
        parts_ptrs = part_out_ptr + rows_c[:, :, None] * D_PAD + d[None, None, :]
        parts = tl.load(parts_ptrs, mask=mask[:, :, None], other=0.0, cache_modifier=".cg")  # [R, C, D_PAD]
        acc += tl.sum(parts * w[:, :, None], 1)
    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    o_ptrs = o_rows[:, None] + d[None, :]
    tl.store(o_ptrs, out.to(o_rows.dtype.element_ty), mask=row_ok[:, None] & (d < head_dim)[None, :])


def fused_split_chunk(num_rows: int, d_pad: int, splits_pad: int) -> int:
    """Splits per fused-merge load: the [rows, chunk, head_dim] tile stays <= FUSED_TILE_ELEMENTS."""
    return max(2, min(splits_pad, triton.next_power_of_2(max(1, FUSED_TILE_ELEMENTS // (num_rows * d_pad)))))


@triton.jit
def _reduce_kernel(
    part_out_ptr,  # fp32 [S, H, num_splits, D_PAD]
    part_lse_ptr,  # fp32 [S, H, num_splits]
    out_ptr,  # [S, H, D]
    stride_os,
    stride_oh,
    head_dim,
    num_splits,
    SPLITS_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        # A PDL kernel after us (the next layer's decode with pdl_prologue) may start its prologue
        # now: gdc_wait there waits for our completion, hence for the split kernel's too.
        gdc_launch_dependents()
        gdc_wait()  # the split kernel's partials are complete and visible past this point
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    o_base = out_ptr + seq * stride_os + head * stride_oh
    _merge_row(part_out_ptr, part_lse_ptr, o_base, row, head_dim, num_splits, SPLITS_PAD, D_PAD)


def reduce_splits(
    part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, use_pdl: bool = False
) -> None:
    """Merge split partials part_out fp32 [S, H, P, D_PAD] / part_lse [S, H, P] into out [S, H, D].

    use_pdl: launch as a programmatic dependent of the split kernel (which must have called
    gdc_launch_dependents); needs pdl_supported(out.device).
    """
    num_seqs, num_heads, num_splits, d_pad = part_out.shape
    extra = {"launch_pdl": True} if use_pdl else {}
    _reduce_kernel[(num_seqs, num_heads)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        out.shape[2],
        num_splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        D_PAD=d_pad,
        USE_PDL=use_pdl,
        num_warps=4,
        **extra,
    )
