"""The kernel checks at full shapes on a CUDA GPU, in bf16 and fp16 (run by bench/run_gpu.sh).

CPU counterparts: tests/kernels/test_triton_interpret.py (small shapes, fp32/fp16).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from pagedinfer.kernels import ops
from pagedinfer.kernels.testing import AttentionCase, run_case

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

_C = AttentionCase
LLAMA = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
SMOLLM = {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64}
GPU_CASES = (
    _C("write_llama", "write", (1000, 37, 513), num_heads=32, num_kv_heads=8, head_dim=128),
    _C("decode_llama_b64", "decode", tuple(range(1000, 3000, 31)), **LLAMA),
    _C("decode_llama_b1_8k_splitk", "decode", (8192,), **LLAMA),
    _C("decode_llama_b3_fused", "decode", (8192, 1, 3000), fused_reduce=True, **LLAMA),
    _C("decode_smollm_b5_fused", "decode", (5000, 0, 17, 2048, 999), fused_reduce=True, **SMOLLM),
    _C("decode_llama_b4_shared", "decode", (4000, 4001, 4017, 33), shared_blocks=200, **LLAMA),
    _C("decode_smollm_b33", "decode", tuple(range(1, 3300, 100)), **SMOLLM),
    _C("decode_mha_d256", "decode", (300, 1, 17, 1500), num_heads=8, num_kv_heads=8, head_dim=256),
    _C("decode_d80_bs32", "decode", (300, 2000, 17), num_heads=16, num_kv_heads=4, head_dim=80, block_size=32),
    _C("decode_d96", "decode", (300, 2000), num_heads=12, num_kv_heads=4, head_dim=96),
    _C("extend_llama_prefill", "extend", (2048, 1000), q_lens=(2048, 1000), **LLAMA),
    _C("extend_llama_mixed", "extend", (3000, 1, 700, 4100), q_lens=(512, 1, 700, 5), **LLAMA),
    _C("extend_smollm_chunk", "extend", (1500, 515), q_lens=(333, 1), shared_blocks=16, **SMOLLM),
    _C("extend_d256", "extend", (600, 300), q_lens=(200, 300), num_heads=4, num_kv_heads=2, head_dim=256),
    _C("extend_d80", "extend", (600, 300), q_lens=(200, 300), num_heads=4, num_kv_heads=2, head_dim=80),
)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.name for c in GPU_CASES])
def test_triton_kernel_on_gpu(case, dtype):
    result = run_case(case, dtype, "cuda", backend="triton", seed=zlib.crc32(case.name.encode()) % 1000)
    assert result.ok, result


@pytest.mark.parametrize("case", GPU_CASES[:3], ids=[c.name for c in GPU_CASES[:3]])
def test_reference_on_gpu(case):
    result = run_case(case, torch.float32, "cuda", backend="reference")
    assert result.ok, result


def test_auto_backend_is_triton_on_cuda():
    assert ops.select_backend(torch.device("cuda")) == "triton"
