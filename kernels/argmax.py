"""Greedy token ids: the argmax of each row of logits [N, V], with V a vocabulary (~32k-256k).

torch's argmax reduces a long row with few rows in flight: on the H200 one call over [1-5,
128256] took 27-38 us (bench/results/profile_spec.json, batch 1), and a chained speculative step
makes K + 1 of them (K draft steps, one verification). A first kernel gives every 2048-column
piece of every row its own program (one load each: a 128k row is 63 programs, all in flight at
once), a second merges each row's pieces. (One program walking its row tile by tile measured
31 us a 128k row on the H100, 2026-12-05: each tile waited for its load in turn.)

Same answer as torch.argmax(x, dim=-1) for finite and infinite values: the first index of the
maximum (ties go to the lower index; a row of -inf gives 0). A NaN counts as the largest value,
as torch's does. CPU tensors run torch.argmax unless backend="triton" (TRITON_INTERPRET=1 tests).
"""

from __future__ import annotations

import os

import torch

from pagedinfer.kernels.ops import launch_or_fallback, select_backend, triton_available

# PAGEDINFER_ARGMAX_KERNEL=0 keeps torch.argmax everywhere (the A/B switch of the benchmarks).
ARGMAX_KERNEL_ENABLED = os.environ.get("PAGEDINFER_ARGMAX_KERNEL", "1") != "0"

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _first_max(values, cols, n_cols):
        """(maximum, its lowest column) of values with columns cols; a NaN wins over everything
        (+inf too), the first NaN among several, as in torch. The maximum is NaN then."""
        nan = values != values
        first_nan = tl.min(tl.where(nan, cols, n_cols), axis=0)
        values = tl.where(nan, float("-inf"), values)  # (max stays NaN-free: maxnum)
        top = tl.max(values, axis=0)
        first_top = tl.min(tl.where(values == top, cols, n_cols), axis=0)  # (a -inf row: its first)
        has_nan = first_nan < n_cols
        return tl.where(has_nan, float("nan"), top), tl.where(has_nan, first_nan, first_top)

    @triton.jit
    def _chunk_argmax(x_ptr, row, chunk, n_cols, row_stride, CHUNK: tl.constexpr):
        """(maximum, its first column) of one CHUNK-wide piece of a row."""
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row.to(tl.int64) * row_stride + cols, mask=cols < n_cols, other=float("-inf"))
        return _first_max(x.to(tl.float32), cols, n_cols)

    @triton.jit
    def _argmax_chunks_kernel(
        x_ptr, out_ptr, best_ptr, idx_ptr, n_cols, row_stride, num_chunks, CHUNK: tl.constexpr
    ):
        # grid (rows, chunks): every piece of every row in flight at once (one load round trip),
        # not one program walking its row tile after tile (latency-bound: ~30 us a 128k row)
        row, chunk = tl.program_id(0), tl.program_id(1)
        top, idx = _chunk_argmax(x_ptr, row, chunk, n_cols, row_stride, CHUNK)
        if num_chunks == 1:
            tl.store(out_ptr + row, idx.to(tl.int64))
        else:
            tl.store(best_ptr + row * num_chunks + chunk, top)
            tl.store(idx_ptr + row * num_chunks + chunk, idx)

    @triton.jit
    def _argmax_merge_kernel(best_ptr, idx_ptr, out_ptr, n_cols, num_chunks, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        lanes = tl.arange(0, BLOCK)
        mask = lanes < num_chunks
        best = tl.load(best_ptr + row * num_chunks + lanes, mask=mask, other=float("-inf"))
        idx = tl.load(idx_ptr + row * num_chunks + lanes, mask=mask, other=n_cols)
        # each piece holds its first maximum (NaN: its first NaN): the lowest column wins ties
        _, first = _first_max(best, idx, n_cols)
        tl.store(out_ptr + row, first.to(tl.int64))


# Columns a program of the first kernel reduces (one load: 16 values a thread over 4 warps).
CHUNK = 2048


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
    return launch_or_fallback("argmax", lambda: argmax_rows_kernel(x), lambda: x.argmax(dim=-1))


def argmax_rows_kernel(x: torch.Tensor) -> torch.Tensor:
    """`argmax_rows` through the kernels, unguarded (the tests' entry): x [N >= 1, V >= 1]."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, n_cols = x.shape
    chunk = min(CHUNK, triton.next_power_of_2(n_cols))
    num_chunks = triton.cdiv(n_cols, chunk)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    best = torch.empty((rows, num_chunks), dtype=torch.float32, device=x.device) if num_chunks > 1 else out
    idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=x.device) if num_chunks > 1 else out
    _argmax_chunks_kernel[(rows, num_chunks)](
        x, out, best, idx, n_cols, x.stride(0), num_chunks, CHUNK=chunk, num_warps=4
    )
    if num_chunks > 1:  # the pieces' maxima, merged (a second launch: no atomics, deterministic)
        block = triton.next_power_of_2(num_chunks)
        _argmax_merge_kernel[(rows,)](
            best, idx, out, n_cols, num_chunks, BLOCK=block, num_warps=1 if block <= 128 else 4
        )
    return out
