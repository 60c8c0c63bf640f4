"""The fused elementwise kernels at Llama-3-8B shapes on a CUDA GPU, in bf16 and fp16.

Run by bench/run_gpu.sh (`-m gpu tests/kernels`). CPU counterpart: test_fused_interpret.py.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from pagedinfer.kernels.fused_testing import FusedCase, run_case

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

_C = FusedCase
LLAMA = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "rope_theta": 500000.0}
GPU_CASES = (
    _C("norm_b1", "norm", 1, 4096),
    _C("norm_b256", "norm", 256, 4096),
    _C("add_norm_b1", "add_norm", 1, 4096),
    _C("add_norm_b256", "add_norm", 256, 4096),
    _C("add_norm_prefill_strided", "add_norm", 3000, 4096, row_pad=64),
    _C("add_norm_smollm", "add_norm", 300, 576),
    _C("add_norm_8192", "add_norm", 77, 8192),
    _C("rotary_llama_b1", "rotary", 1, max_position=131072, **LLAMA),
    _C("rotary_llama_b256", "rotary", 256, max_position=131072, **LLAMA),
    _C("rotary_llama_prefill", "rotary", 4096, max_position=8192, **LLAMA),
    _C("rotary_smollm", "rotary", 300, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0),
    _C("rotary_d80_bs32", "rotary", 100, num_heads=16, num_kv_heads=4, head_dim=80, block_size=32),
    _C("silu_b1", "silu", 1, 2 * 14336),
    _C("silu_b256", "silu", 256, 2 * 14336),
    _C("silu_smollm", "silu", 300, 2 * 1536),
)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.name for c in GPU_CASES])
def test_fused_kernel_on_gpu(case, dtype):
    result = run_case(case, dtype, "cuda", backend="triton", seed=zlib.crc32(case.name.encode()) % 1000)
    assert result.ok, result


ROTARY_CASES = [c for c in GPU_CASES if c.kind == "rotary"]


@pytest.mark.parametrize("case", ROTARY_CASES, ids=[c.name for c in ROTARY_CASES])
def test_rotary_is_exact_in_fp32(case):
    # cos/sin come from the same torch ops and the kernel rounds each product (no FMA), like the
    # pre-fusion torch code: the rotation is bit-exact, not merely close.
    result = run_case(case, torch.float32, "cuda", backend="triton")
    assert result.err_ulp == 0.0 and result.caches_equal, result
