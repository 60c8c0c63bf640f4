"""Triton kernels: y = x @ W.T (+ b) for a few rows of x, streaming W once (decode at small batch).

At one to a few tokens a step every linear layer is a matrix-vector product: its time is the
weight bytes over the memory bandwidth. The GEMM library's kernel for this shape keeps too few
bytes in flight per SM on the H200 (bench/gemv.py measures it against the device-to-device copy
bandwidth). These kernels give each program BLOCK_N weight rows and walk K in BLOCK_K tiles that
the compiler pipelines (num_stages copies in flight); there is no split-K, so there is no second
kernel and no atomics, and the result is deterministic.

Two variants of the same contract:
- `reduce`: multiply-and-accumulate into a [BLOCK_N, BLOCK_K] fp32 tile, one reduction at the end
  (CUDA cores; a row of x at a time, for 1-2 rows);
- `dot`: `tl.dot` of a [BLOCK_M, BLOCK_K] tile of x with the [BLOCK_K, BLOCK_N] weight tile (tensor
  cores; rows of x padded to 16, 32 or 64), for up to 64 rows. With `block_m` set the rows are
  split over row blocks: each (row block, column tile) program takes that many rows, the row
  blocks of one column tile launch side by side and share its weight tile through L2;
Accumulation is fp32, the output is rounded once to x's dtype (as cuBLAS does); only the order of
the sum differs from torch's GEMM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedinfer.kernels.linear_shapes import SMALL_MODEL_MAX_K


@dataclass(frozen=True)
class GemvConfig:
    variant: str  # "reduce" or "dot"
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # dot only: rows a program takes (16, 32 or 64); 0 puts every row in one tile. A latency-bound
    # layer's time is its K loop, whatever the tile's rows: SmolLM2's qkv, o and down at 40 rows
    # as 16-row blocks run within 0.1-0.2 us of 16 rows (bench/NOTES.md, session 23).
    block_m: int = 0


@triton.jit
def _gemv_reduce_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] or a dummy
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    for m in range(0, M):
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            k_mask = k < K
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptr + m * stride_xm + k, mask=k_mask, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def dot_rows(
    x_ptr,
    w_ptr,
    rm,
    rn,
    K,
    stride_xm,
    stride_wn,
    M,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] fp32: rows rm of x [M, K] times rows rn of W [N, K], transposed.

    The `dot` variant's loop, shared with kernels/norm_epilogue.py. x is loaded as it is and fed to
    the tensor cores: an elementwise op on it inside the loop (normalizing, scaling by the norm
    weight, summing squares) cost 1.5-3x the loop's time on the H100 (bench/NOTES.md, session 21).
    """
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_mask = k < K
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + rn.to(tl.int64)[None, :] * stride_wn + k[:, None],
            mask=n_mask[None, :] & k_mask[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: W's tile, transposed by the addressing
        acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def program_tile(M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rows rm, columns rn, column tile) of a dot program on the 1-D grid `dot_grid` launches:
    row blocks x column tiles, a column tile's row blocks neighbours in launch order (and one
    axis has no 65535 cap)."""
    row_blocks = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    col_tile = pid // row_blocks
    rm = (pid % row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    return rm, col_tile * BLOCK_N + tl.arange(0, BLOCK_N), col_tile


@triton.jit
def _gemv_dot_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm, rn, _ = program_tile(M, BLOCK_M, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    acc = dot_rows(x_ptr, w_ptr, rm, rn, K, stride_xm, stride_wn, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


MAX_ROWS = 64  # the dot variant's row tile is the rows padded to 16, 32 or 64

# From the H200 sweep of bench/gemv.py (2026-12-03, NOTES.md "Small-batch linear layers"): at one
# row, few output rows (N <= 4096: 256 programs) want long K tiles and 8 warps, mid-size N short
# programs, large N (gate_up, lm_head) 256-wide tiles; with 2-16 rows the tensor-core variant
# (the step's chain of linear layers 1.5-4% faster than torch's GEMM at 4 and 16 rows).
NARROW_CONFIG = GemvConfig("reduce", block_n=16, block_k=1024, num_warps=8, num_stages=3)
MID_CONFIG = GemvConfig("reduce", block_n=8, block_k=512, num_warps=4, num_stages=4)
WIDE_CONFIG = GemvConfig("reduce", block_n=16, block_k=256, num_warps=4, num_stages=4)
DOT_CONFIG = GemvConfig("dot", block_n=32, block_k=128, num_warps=4, num_stages=6)
# 2-16 rows, from the H200 sweep of 2026-12-04 (NOTES.md, "per-shape configs at 2-16 rows"): wide
# N wants 64x256 tiles (gate_up 63.3 -> 57.8 us at 4 rows, lm_head within 1%), long K 512-long
# tiles (down 32.6 -> 31.8 us); qkv and o keep DOT_CONFIG.
WIDE_DOT_CONFIG = GemvConfig("dot", block_n=64, block_k=256, num_warps=4, num_stages=3)
LONG_K_DOT_CONFIG = GemvConfig("dot", block_n=32, block_k=512, num_warps=4, num_stages=3)
# 2-16 rows of a small model (K <= 2048: SmolLM2's 576 and 1536), from the H100 sweep of
# 2026-12-05 18:33 (NOTES.md, session 22): its layers are latency-bound (0.06-0.6 of the copy
# bandwidth), and two warps on 16-wide tiles start sooner: qkv, o and down at 5-7 rows 3.78 / 3.54
# / 4.76 us against DOT_CONFIG's 3.87 / 3.63 / 5.37; the LM head (49152 x 576) 31.5 vs 33.4 us.
SMALL_DOT_CONFIG = GemvConfig("dot", block_n=16, block_k=256, num_warps=2, num_stages=4)
SMALL_VOCAB_DOT_CONFIG = GemvConfig("dot", block_n=16, block_k=128, num_warps=2, num_stages=6)
# and for 17-64 rows of a small model (config_for says why): two-warp 16x128 tiles over 16-row
# blocks where N <= 2048, one 64x64 tile for a vocabulary
SMALL_ROWS_DOT_CONFIG = GemvConfig("dot", block_n=16, block_k=128, num_warps=2, num_stages=6, block_m=16)
SMALL_WIDE_ROWS_DOT_CONFIG = GemvConfig("dot", block_n=64, block_k=64, num_warps=4, num_stages=6)
DEFAULT_CONFIG = WIDE_CONFIG
# PAGEDINFER_GEMV_ROW_BLOCKS=0: a small model's 17-64 rows in one tile, as before the row blocks
# (the A/B switch of the benchmarks).
ROW_BLOCKS = os.environ.get("PAGEDINFER_GEMV_ROW_BLOCKS", "1") != "0"


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS; the reduce variant is meant for 1-2), weight [N, K] with contiguous
    rows, bias [N] or None -> [M, N]."""
    config = config or DEFAULT_CONFIG
    num_rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(
            f"gemv needs x [M, K] and weight [N, K] with unit column strides, got {x.shape} and {weight.shape}"
        )
    if num_rows > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {num_rows}")
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y
    common = dict(
        HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    args = (
        x,
        weight,
        bias if bias is not None else y,
        y,
        num_rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
    )
    if config.variant == "dot":
        grid, block_m = dot_grid(config, num_rows, n)
        _gemv_dot_kernel[grid](*args, BLOCK_M=block_m, **common)
    else:
        _gemv_reduce_kernel[(triton.cdiv(n, config.block_n),)](*args, **common)
    return y


def padded_rows(num_rows: int) -> int:
    """The rows rounded up to 16, 32 or 64 (tl.dot wants at least 16): one tile of every row."""
    return max(16, triton.next_power_of_2(num_rows))


def row_block(config: GemvConfig, num_rows: int) -> int:
    """A dot program's row tile: the config's block_m, at most padded_rows (which it divides)."""
    if config.block_m not in (0, 16, 32, 64):
        raise ValueError(f"block_m is 0, 16, 32 or 64, got {config.block_m}")
    rows = padded_rows(num_rows)
    return min(config.block_m, rows) if config.block_m else rows


def dot_grid(config: GemvConfig, num_rows: int, n: int) -> tuple[tuple[int], int]:
    """(grid, BLOCK_M) of a dot kernel's launch (this one's and kernels/norm_epilogue.py's): a
    program per row block and column tile, as `program_tile` reads them."""
    block_m = row_block(config, num_rows)
    return (triton.cdiv(num_rows, block_m) * triton.cdiv(n, config.block_n),), block_m


# 17-64 rows (a batch-8 verification: 8 x (K + 1)), from the H200 sweep of 2026-12-04 12:20
# (NOTES.md "17-64 rows"): the dot kernel beats torch's GEMM on the lm_head (252-260 vs 264-277 us),
# o at 24-40 rows (12.3-13.2 vs 13.7-14.3; a tie at 56) and, from 33 rows (64-row tiles), down
# (33.2-33.6 vs 33.7-34.8); torch wins qkv and gate_up (by 1-3 us) and down at 17-32 rows (32.8
# vs 38.0).
VOCAB_DOT_CONFIG = GemvConfig("dot", block_n=128, block_k=128, num_warps=4, num_stages=4)


def config_for(num_rows: int, n: int, k: int) -> GemvConfig | None:
    """The kernel config for a shape (measured on the H200 at the Llama-3-8B layer shapes and on
    the H100 at SmolLM2-135M's), or None where torch's GEMM measured faster (some 8B-class shapes
    at 17-64 rows). Every K up to SMALL_MODEL_MAX_K has a dot config at 2-64 rows."""
    if num_rows > 16:
        if k <= SMALL_MODEL_MAX_K:
            # a small model's batch-8 verification (40-56 rows): the kernel for every N, so that
            # the norm epilogues apply (linear_ops.uses_norm_epilogue) and no norm kernel runs.
            # SmolLM2 at 40 / 56 rows (H100, 2026-12-05 22:12, bench/NOTES.md session 23): 16x128
            # tiles over 16-row blocks, qkv 3.79 / 3.78 us, o 3.39 / 3.46, down 4.72 / 4.87, against
            # one 64-row tile (DOT_CONFIG) 4.11 / 4.13, 3.81 / 3.86, 5.50 / 5.53 and torch's GEMM
            # 4.1, 3.8-3.9, 5.2-5.3. gate_up (3072 wide) keeps one tile: 4.75 vs 5.8-5.9 in blocks.
            # The LM head on 64x64 tiles 31.8 vs torch 33.8. Other small models are not measured.
            if n > 8192:
                return SMALL_WIDE_ROWS_DOT_CONFIG
            return SMALL_ROWS_DOT_CONFIG if n <= 2048 and ROW_BLOCKS else DOT_CONFIG
        if k < 4096:
            return None  # (measured at the 8B shapes only: mid-size models keep torch's GEMM here)
        if n > 32768:
            return VOCAB_DOT_CONFIG
        if k > 8192:
            return DOT_CONFIG if num_rows > 32 else None
        return DOT_CONFIG if n <= 4096 else None
    if num_rows > 1:  # the tensor-core variant reads the weights once for all rows
        if k <= SMALL_MODEL_MAX_K:
            if n > 8192:
                return SMALL_VOCAB_DOT_CONFIG
            return SMALL_DOT_CONFIG if n <= 2048 else DOT_CONFIG
        if k > 8192:  # 64 x 512 x tiles at 3 stages would exceed the H200's shared memory
            return LONG_K_DOT_CONFIG if num_rows <= 16 else DOT_CONFIG
        return WIDE_DOT_CONFIG if n > 8192 else DOT_CONFIG
    if n <= 4096:
        return NARROW_CONFIG
    return MID_CONFIG if n <= 8192 else WIDE_CONFIG
