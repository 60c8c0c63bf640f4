"""Greedy token ids: the argmax of each row of logits [N, V], with V a vocabulary (~32k-256k).

torch's argmax reduces a long row with few rows in flight: on the H200 one call over [1-5,
128256] took 27-38 us (bench/results/profile_spec.json, batch 1), and a chained speculative step makes K + 1
of them (K draft steps, one verification). Here one program owns one row and walks it in
BLOCK-wide tiles with `num_warps` warps, keeping a running maximum per lane: the row's 256 KB
(bf16) stream through one SM in a few microseconds, and a verification's 8-56 rows run side by
side.

Same answer as torch.argmax(x, dim=-1) for finite and infinite values: the first index of the
maximum (ties go to the lower index; a row of -inf gives 0). A NaN counts as the largest value,
as torch's does. CPU tensors run torch.argmax unless backend="triton" (TRITON_INTERPRET=1 tests).
"""

from __future__ import annotations

import os

import torch

from pagedinfer.kernels.ops import select_backend, triton_available

# PAGEDINFER_ARGMAX_KERNEL=0 keeps torch.argmax everywhere (the A/B switch of the benchmarks).
ARGMAX_KERNEL_ENABLED = os.environ.get("PAGEDINFER_ARGMAX_KERNEL", "1") != "0"

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _argmax_rows_kernel(x_ptr, out_ptr, n_cols, row_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * row_stride
        lanes = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int32)
        for start in range(0, n_cols, BLOCK):
            cols = start + lanes
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            x = tl.where(x != x, float("inf"), x)  # NaN wins, as in torch (ties with +inf: rare)
            # strictly greater: a lane keeps its earliest column of an equal maximum
            take = x > best
            best = tl.where(take, x, best)
            best_idx = tl.where(take, cols, best_idx)
        top = tl.max(best, axis=0)
        # the lowest column among the lanes holding the maximum (a -inf row: every lane, column 0)
        idx = tl.min(tl.where(best == top, best_idx, n_cols), axis=0)
        tl.store(out_ptr + row, idx.to(tl.int64))


def argmax_rows(x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """[N] int64 argmax of each row of a 2-dim float tensor whose last dim is contiguous."""
    if x.dim() != 2:
        raise ValueError(f"argmax_rows takes [N, V] logits, got shape {tuple(x.shape)}")
    use_kernel = (  # (fp64 would lose its ties to the kernel's fp32 compare: torch keeps it)
        ARGMAX_KERNEL_ENABLED
        and select_backend(x.device, backend) == "triton"
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    )
    if not use_kernel or x.shape[0] == 0 or x.shape[1] == 0:
        return x.argmax(dim=-1)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    # 4096-wide tiles over 8 warps: 16 values in flight per thread (chosen, not yet swept on the
    # H200: bench/argmax.py times it); small vocabularies use one tile.
    block = min(4096, triton.next_power_of_2(x.shape[1]))
    _argmax_rows_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=block, num_warps=8)
    return out
