"""Counter-based randomness: uniforms that depend only on (seed, output position, token id).

A seeded sequence therefore samples the same tokens whatever else is in the batch, after a
preemption, or on another device. All arithmetic stays in int64 on values below 2**32, with
the constants below 2**31 so no product overflows.
"""

from __future__ import annotations

import torch

from pagedinfer.kernels import hash_uniform as kernel
from pagedinfer.kernels.ops import launch_or_fallback

_MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x2C1B3C6D
_M3 = 0x297A2D39


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (xorshift-multiply rounds) on int64 tensors holding uint32."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * _M1) & _MASK32
    x = ((x ^ (x >> 15)) * _M2) & _MASK32
    x = ((x ^ (x >> 15)) * _M3) & _MASK32
    return x ^ (x >> 16)


def hash_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1) of shape [N, vocab_size] for seeds [N] int64 and positions [N] int64.

    On a GPU one kernel computes the same bits (kernels/hash_uniform.py); the ops below are the
    reference, and the CPU's path."""

    def reference() -> torch.Tensor:
        return hash_uniform_reference(seeds, positions, vocab_size)

    if seeds.dtype == positions.dtype == torch.int64 and kernel.uses_kernel(seeds):
        return launch_or_fallback(
            "hash_uniform", lambda: kernel.hash_uniform_kernel(seeds, positions, vocab_size), reference
        )
    return reference()


def hash_uniform_reference(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`hash_uniform` as torch ops (~90 elementwise kernels on a GPU)."""
    seed_lo = seeds & _MASK32
    seed_hi = (seeds >> 32) & _MASK32
    row_key = _mix32(_mix32(seed_lo ^ _mix32(seed_hi + 0x3C6EF372)) + positions * 0x9E37)  # [N]
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)  # [V]
    h = _mix32(row_key[:, None] ^ _mix32(cols + 0x61C88647)[None, :])  # [N, V]
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
