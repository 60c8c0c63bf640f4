"""What the linear launcher (linear_ops.py) and its kernels (gemv.py, norm_epilogue.py) share
without Triton: the shape limits both sides test, and the half-normed block output."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SMALL_MODEL_MAX_K = 2048  # gemv.config_for's small-model rules apply up to this K
NORM_EPILOGUE_MAX_ROWS = 64  # norm_epilogue's widest row tile


@dataclass
class Prenormed:
    """A block output whose next RMSNorm is half done (kernels/norm_epilogue.py): h [M, K] the
    residual stream, u = h * g [M, K] (g that norm's weight), partial sums of h^2 [programs, R]
    (R: M rounded up to 16, 32 or 64). Only rows [:M] are meaningful: with row blocks
    (gemv.row_block) the rows past the last block's are never written."""

    h: torch.Tensor
    u: torch.Tensor
    partials: torch.Tensor
