"""Rotary position embedding (Su et al., 2021), half-split ("NeoX") layout, with rope scaling.

Hugging Face q/k weights use this layout; GGUF llama weights are un-permuted into it at load.
Scaling: none, "linear" (positions / factor), "llama3" (Llama-3.1's frequency-dependent
interpolation) and "freq_factors" (the same, precomputed per frequency, as llama.cpp stores it).
Cos/sin are computed from the positions of each step (once, shared by every layer), so there is
no max-position table to size and no state besides the inverse frequencies. The rotation itself
runs fused with the KV-cache write (kernels/fused_ops.rotary_cache_write); `apply_rotary` is its
PyTorch reference.
"""

from __future__ import annotations

import math

import torch

from pagedinfer.engine.config import RopeScaling
from pagedinfer.kernels import fused_reference

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """inv_freq[i] = base^(-2i / head_dim) for i < head_dim / 2, fp32 on the CPU."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [D/2]
    return 1.0 / (base**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama-3.1: low frequencies divided by `factor`, high kept, a smooth blend in between."""
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / scaling.low_freq_factor
    high_freq_wavelen = old_context_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The inverse frequencies [head_dim / 2] (fp32, CPU) for a rope configuration."""
    inv_freq = default_inv_freq(head_dim, base)
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return llama3_inv_freq(inv_freq, scaling)
    if scaling.rope_type == "freq_factors" and scaling.freq_factors is not None:
        factors = torch.tensor(scaling.freq_factors, dtype=torch.float32)  # [D/2]
        if factors.shape != inv_freq.shape:
            raise ValueError(f"{factors.numel()} rope frequency factors for head_dim {head_dim}")
        return inv_freq / factors
    raise ValueError(
        f"unsupported rope scaling type {scaling.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
    )


class RotaryEmbedding:
    """Maps positions [T] to (cos, sin) [T, head_dim / 2] fp32. Plain object: nothing to load."""

    def __init__(
        self, head_dim: int, base: float, scaling: RopeScaling | None, device: torch.device | str
    ) -> None:
        self.head_dim = head_dim
        self.inv_freq = compute_inv_freq(head_dim, base, scaling).to(device)  # [D/2] fp32

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_reference.rope_cos_sin(positions, self.inv_freq)  # (cos, sin) [T, D/2]


# Rotate x [T, H, D] by (cos, sin) [T, D/2] (half-split layout); the model path uses the fused kernel.
apply_rotary = fused_reference.apply_rotary
