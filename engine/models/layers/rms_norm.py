"""RMSNorm (Zhang & Sennrich, 2019), computed in fp32 like the Hugging Face reference."""

from __future__ import annotations

import torch
from torch import nn

from pagedinfer.kernels import fused_ops


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps); optionally fused with the residual add before it.

    `forward(x)` returns the normed x. `forward(x, residual)` first adds: h = x + residual, and
    returns (norm(h), h) so the caller carries h as the next residual. One fused Triton kernel on
    CUDA (add, fp32 statistics, scale), the PyTorch reference on the CPU (`backend` as in ops).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, backend: str | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x, residual [T, dim]; the statistics in fp32, the result back in x's dtype before the weight.
        if residual is None:
            return fused_ops.rms_norm(x, self.weight, self.eps, backend=backend)
        return fused_ops.add_rms_norm(x, residual, self.weight, self.eps, backend=backend)
