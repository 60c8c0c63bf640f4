"""RMSNorm (Zhang & Sennrich, 2019), computed in fp32 like the Hugging Face reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps); optionally fused with the residual add before it.

    `forward(x)` returns the normed x. `forward(x, residual)` first adds: h = x + residual, and
    returns (norm(h), h) so the caller carries h as the next residual.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, dim]; the statistics in fp32, the result back in x's dtype before the weight.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        hidden = x + residual
        return self._norm(hidden), hidden
