"""Launchers of the fused elementwise kernels of a decoder layer: argument checks, then dispatch.

Backends as in ops.py: "triton" (on CUDA, or on the CPU under TRITON_INTERPRET=1) and
"reference" (fused_reference.py, the CPU production path, the pre-fusion layer code).
`backend=None` (or "auto") picks ops.select_backend(device). Checks look at shapes, dtypes and
devices only, so a launch inside CUDA-graph capture never synchronizes.
"""

from __future__ import annotations

import os

import torch

from pagedinfer.kernels import checks, fused_reference, ops
from pagedinfer.kernels.ops import select_backend

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton kernels take
# Escape hatch for a Triton build these kernels fail on: PAGEDINFER_FUSED_KERNELS=0 runs the
# (pre-fusion) reference ops everywhere; the attention kernels are unaffected.
FUSED_KERNELS_ENABLED = os.environ.get("PAGEDINFER_FUSED_KERNELS", "1") != "0"


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _use_triton(t: torch.Tensor, backend: str | None) -> bool:
    """Triton for the kernels' dtypes; fp64 (tests) and anything else runs the reference."""
    return (
        FUSED_KERNELS_ENABLED and select_backend(t.device, backend) == "triton" and t.dtype in KERNEL_DTYPES
    )


def _check_rows(name: str, t: torch.Tensor, ndim: int | None = 2) -> None:
    """A float tensor of `ndim` dims (None: any >= 1) whose last dim is contiguous."""
    if not isinstance(t, torch.Tensor) or (t.dim() != ndim if ndim else t.dim() < 1):
        _fail(f"{name} must be a {ndim or '>= 1'}-dim tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if t.dtype not in checks.FLOAT_DTYPES:
        _fail(f"{name} dtype must be one of {checks.FLOAT_DTYPES}, got {t.dtype}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(f"{name} must be contiguous in its last dim")


def _check_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    _check_rows("x", x, None)
    _check_rows("weight", weight, 1)
    if weight.shape[0] != x.shape[-1] or weight.device != x.device:
        _fail(f"weight {tuple(weight.shape)} on {weight.device} must be [{x.shape[-1]}] on {x.device}")
    if residual is not None:
        _check_rows("residual", residual, None)
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            _fail(
                f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
            )


def _norm_on_triton(x: torch.Tensor, weight: torch.Tensor, backend: str | None) -> bool:
    return _use_triton(x, backend) and x.numel() > 0 and weight.dtype in KERNEL_DTYPES


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str | None = None) -> torch.Tensor:
    """x [..., N], weight [N] -> weight * x / sqrt(mean(x^2) + eps) [..., N] (fp32 statistics)."""
    _check_norm(x, weight, None)
    if not _norm_on_triton(x, weight, backend):
        return fused_reference.rms_norm(x, weight, eps)
    from pagedinfer.kernels import rms_norm as kernel

    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    return kernel.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, out_dtype).view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, residual) [..., N] -> (rms_norm(h), h) with h = x + residual, the next residual."""
    _check_norm(x, weight, residual)
    if not _norm_on_triton(x, weight, backend):
        return fused_reference.add_rms_norm(x, residual, weight, eps)
    from pagedinfer.kernels import rms_norm as kernel

    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    rows = (x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1]))  # [T, N] each
    out, hidden = kernel.add_rms_norm(*rows, weight, eps, out_dtype)
    return out.view(x.shape), hidden.view(x.shape)


def _check_rotary(qkv, cos, sin, key_cache, value_cache, slot_mapping) -> None:
    checks.check_caches(key_cache, value_cache)
    _check_rows("qkv", qkv)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if head_dim % 2 or qkv.shape[1] % head_dim or qkv.shape[1] // head_dim <= 2 * num_kv_heads:
        _fail(
            f"qkv [T, (H + 2 KVH) D] needs an even D={head_dim} dividing {qkv.shape[1]} and H >= 1 "
            f"(KVH={num_kv_heads})"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        _check_rows(name, t)
        if t.dtype != torch.float32 or tuple(t.shape) != (qkv.shape[0], head_dim // 2):
            _fail(f"{name} must be fp32 [{qkv.shape[0]}, {head_dim // 2}], got {t.dtype} {tuple(t.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in checks.INDEX_DTYPES:
        _fail(f"slot_mapping must be int32/int64 [T], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if slot_mapping.shape[0] != qkv.shape[0]:
        _fail(f"slot_mapping has {slot_mapping.shape[0]} slots for {qkv.shape[0]} tokens")
    devices = {t.device for t in (qkv, cos, sin, key_cache, value_cache, slot_mapping)}
    if len(devices) > 1:
        _fail(f"tensors must share one device, got {devices}")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        capacity = key_cache.shape[0] * key_cache.shape[1]
        if int(slot_mapping.min()) < 0 or int(slot_mapping.max()) >= capacity:
            _fail(f"slot_mapping values must lie in [0, {capacity})")


def rotary_cache_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str | None = None,
) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) D] -> rotated q [T, H, D]; rotated k and v go into the cache slots.

    cos/sin [T, D/2] fp32 (RotaryEmbedding, once per step); caches [num_blocks, block_size, KVH, D].
    """
    _check_rotary(qkv, cos, sin, key_cache, value_cache, slot_mapping)
    if not _use_triton(qkv, backend) or qkv.shape[0] == 0 or key_cache.dtype not in KERNEL_DTYPES:
        # With the fused kernels switched off on a GPU, the cache write stays the Triton kernel
        # it was before fusion (ops.write_kv_cache picks it), not the reference scatter.
        def write(k, v, kc, vc, slots):
            ops.write_kv_cache(k, v, kc, vc, slots, backend=backend)

        return fused_reference.rotary_cache_write(qkv, cos, sin, key_cache, value_cache, slot_mapping, write)
    from pagedinfer.kernels import rotary_cache as kernel

    return kernel.rotary_cache_write(qkv, cos, sin, key_cache, value_cache, slot_mapping)


def silu_mul(gate_up: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """gate_up [T, 2 I] (rows [gate; up]) -> silu(gate) * up [T, I]."""
    _check_rows("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        _fail(f"gate_up must have an even number of columns [T, 2 I], got {tuple(gate_up.shape)}")
    if not _use_triton(gate_up, backend) or gate_up.shape[0] == 0:
        return fused_reference.silu_mul(gate_up)
    from pagedinfer.kernels import silu_mul as kernel

    return kernel.silu_mul(gate_up)
