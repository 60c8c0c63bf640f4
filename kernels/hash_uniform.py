"""Counter-based uniforms [S, V] in one kernel: engine/sample/rng.py's `hash_uniform`, bit for bit.

The torch form spells the 32-bit hash as ~90 elementwise ops (shifts, xors, multiplies, masks on
int64), each a kernel launch: a seeded sampled step paid them on the host before every draw (~1
ms of launches on a GPU host, for ~0.2 ms of device work). Here one program computes a block of
a row: the row's key from (seed, position) once, then the hash of every column, with the same
int64 arithmetic on values below 2**32 and the same fp32 rounding of the result, so the uniforms
and every token drawn from them are unchanged.
"""

from __future__ import annotations

import os

import torch

from pagedinfer.kernels.ops import select_backend, triton_available

# PAGEDINFER_HASH_KERNEL=0 keeps the torch ops (the A/B switch of the benchmarks).
HASH_KERNEL_ENABLED = os.environ.get("PAGEDINFER_HASH_KERNEL", "1") != "0"
BLOCK = 1024

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _mix32(x):
        """rng._mix32: int64 holding a uint32 in, the same out (products stay below 2**63)."""
        x = x & 0xFFFFFFFF
        x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
        x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
        x = ((x ^ (x >> 15)) * 0x297A2D39) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def _hash_uniform_kernel(seeds_ptr, positions_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        seed = tl.load(seeds_ptr + row).to(tl.int64)
        position = tl.load(positions_ptr + row).to(tl.int64)
        seed_lo = seed & 0xFFFFFFFF
        seed_hi = (seed >> 32) & 0xFFFFFFFF
        row_key = _mix32(_mix32(seed_lo ^ _mix32(seed_hi + 0x3C6EF372)) + position * 0x9E37)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        h = _mix32(row_key ^ _mix32(cols.to(tl.int64) + 0x61C88647))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / (1 << 24))
        tl.store(out_ptr + row.to(tl.int64) * vocab + cols, u, mask=cols < vocab)


def uses_kernel(seeds: torch.Tensor) -> bool:
    return HASH_KERNEL_ENABLED and select_backend(seeds.device) == "triton"


def hash_uniform_kernel(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, backend: str | None = None
) -> torch.Tensor:
    """Uniforms [S, vocab_size] fp32 for seeds [S] and positions [S] (int64, one device)."""
    num_rows = seeds.shape[0]
    out = torch.empty((num_rows, vocab_size), dtype=torch.float32, device=seeds.device)
    if num_rows == 0 or vocab_size == 0:
        return out
    if select_backend(seeds.device, backend) != "triton":
        raise ValueError("hash_uniform_kernel needs the triton backend")
    grid = (num_rows, triton.cdiv(vocab_size, BLOCK))
    _hash_uniform_kernel[grid](
        seeds.contiguous(), positions.contiguous(), out, vocab_size, BLOCK=BLOCK, enable_fp_fusion=False
    )
    return out
