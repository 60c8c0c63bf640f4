"""fused_ops launchers on the CPU: argument checks, dispatch, and the references' semantics.

The Triton kernels themselves: test_fused_interpret.py (CPU) and test_fused_gpu.py (CUDA).
"""

from __future__ import annotations

import pytest
import torch

from pagedinfer.kernels import fused_ops, fused_reference


def _rope(num_tokens: int, head_dim: int, theta: float = 10000.0):
    positions = torch.arange(num_tokens) * 7 + 3
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).double() / head_dim)  # [D/2]
    angles = positions.double()[:, None] * inv_freq[None, :]  # [T, D/2]
    return angles, angles.cos(), angles.sin()


def test_rotary_cache_write_rotates_pairs_as_complex_numbers():
    num_tokens, heads, kv_heads, dim, block = 5, 3, 1, 8, 4
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, dtype=torch.float64)
    angles, cos, sin = _rope(num_tokens, dim)
    caches = [torch.zeros(4, block, kv_heads, dim, dtype=torch.float64) for _ in range(2)]
    slots = torch.tensor([9, 0, 15, 4, 3])
    q = fused_ops.rotary_cache_write(qkv, cos.float(), sin.float(), *caches, slots)
    x = qkv.view(num_tokens, heads + 2 * kv_heads, dim)
    # Half-split layout: element i pairs with i + D/2 and turns by angle(position, i).
    z = (
        torch.complex(x[..., : dim // 2], x[..., dim // 2 :])
        * torch.polar(torch.ones_like(angles), angles)[:, None]
    )
    expect = torch.cat((z.real, z.imag), dim=-1)  # [T, H + 2 KVH, D]
    torch.testing.assert_close(q, expect[:, :heads], rtol=1e-6, atol=1e-6)  # cos/sin were fp32
    key_cache, value_cache = (c.view(-1, kv_heads, dim) for c in caches)
    torch.testing.assert_close(key_cache[slots], expect[:, heads : heads + kv_heads], rtol=1e-6, atol=1e-6)
    assert torch.equal(value_cache[slots], x[:, heads + kv_heads :])
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert not key_cache[untouched].any() and not value_cache[untouched].any()


def test_add_rms_norm_matches_the_formula_and_rounds_in_the_activation_dtype():
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(4, 32, generator=gen).half(), torch.randn(4, 32, generator=gen).half()
    weight = torch.rand(32, generator=gen).half() + 0.5
    out, hidden = fused_ops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(hidden, x + residual) and out.dtype == torch.float16
    h = hidden.double()
    normed = (h / (h.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()).half()  # rounded before the weight
    # fp32 statistics vs these fp64 ones may flip a last-bit rounding: one fp16 ulp.
    torch.testing.assert_close(out, (normed.double() * weight.double()).half(), rtol=2**-10, atol=0)
    assert torch.equal(fused_ops.rms_norm(hidden, weight, 1e-6), out)
    three_d = fused_ops.rms_norm(hidden.view(2, 2, 32), weight, 1e-6)
    assert torch.equal(three_d.view(4, 32), out)


def test_silu_mul_halves():
    gate_up = torch.randn(3, 10, dtype=torch.float64)
    gate, up = gate_up[:, :5], gate_up[:, 5:]
    torch.testing.assert_close(fused_ops.silu_mul(gate_up), gate * torch.sigmoid(gate) * up)
    assert fused_ops.silu_mul(gate_up[:0]).shape == (0, 5)


def test_cpu_runs_the_reference():
    x = torch.randn(2, 16)
    weight = torch.ones(16)
    assert torch.equal(fused_ops.rms_norm(x, weight, 1e-5), fused_reference.rms_norm(x, weight, 1e-5))
    assert fused_ops._use_triton(x, None) is False
    assert fused_ops._use_triton(x.double(), "triton") is False  # fp64: the reference only


def _rotary_args(**change):
    args = {
        "qkv": torch.randn(3, (4 + 2 * 2) * 8),
        "cos": torch.ones(3, 4),
        "sin": torch.zeros(3, 4),
        "key_cache": torch.zeros(2, 4, 2, 8),
        "value_cache": torch.zeros(2, 4, 2, 8),
        "slot_mapping": torch.tensor([0, 1, 7]),
    }
    return {**args, **change}


@pytest.mark.parametrize(
    "change",
    [
        {"qkv": torch.randn(3, 36)},  # not a multiple of head_dim
        {"qkv": torch.randn(3, 32)},  # no query heads left
        {"cos": torch.ones(3, 4, dtype=torch.float64)},
        {"sin": torch.zeros(2, 4)},
        {"slot_mapping": torch.tensor([0, 1, 8])},  # past the cache
        {"slot_mapping": torch.tensor([0, 1])},
        {"slot_mapping": torch.tensor([0.0, 1.0, 2.0])},
    ],
    ids=["width", "no-q", "cos-dtype", "sin-rows", "slot-range", "slot-count", "slot-dtype"],
)
def test_rotary_cache_write_rejects(change):
    with pytest.raises(ValueError):
        fused_ops.rotary_cache_write(**_rotary_args(**change))


def test_norm_and_silu_reject_bad_shapes():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="weight"):
        fused_ops.rms_norm(x, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        fused_ops.add_rms_norm(x, x.half(), torch.ones(16), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        fused_ops.rms_norm(torch.randn(16, 2).t(), torch.ones(16), 1e-5)
    with pytest.raises(ValueError, match="even"):
        fused_ops.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="backend"):
        fused_ops.silu_mul(torch.randn(2, 8), backend="cuda-graphs")
