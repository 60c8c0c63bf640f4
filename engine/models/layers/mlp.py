"""SwiGLU feed-forward (Shazeer, 2020) with the gate and up projections fused into one GEMM."""

from __future__ import annotations

import torch
from torch import nn

from pagedinfer.kernels import fused_ops
from pagedinfer.kernels.linear_ops import linear


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); `gate_up_proj.weight` rows are [gate; up]."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        return self.down(linear(x, self.gate_up_proj.weight, None, backend), backend)  # [T, hidden]

    def down(self, gate_up: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        """gate_up [T, 2 * I] (the gate and up projections' output) -> [T, hidden]."""
        # silu(gate) * up in one pass (Triton on CUDA, the PyTorch reference on the CPU).
        return linear(fused_ops.silu_mul(gate_up, backend=backend), self.down_proj.weight, None, backend)
