"""The kernel checks at full shapes on a CUDA GPU, in bf16 and fp16 (run by bench/run_gpu.sh).

CPU counterparts: tests/kernels/test_triton_interpret.py (small shapes, fp32/fp16).
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from pagedinfer.kernels import ops, reference
from pagedinfer.kernels.testing import TOLERANCE, AttentionCase, make_block_tables, run_case

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
    _C("decode_llama_b1_8k_fused", "decode", (8192,), num_splits=64, merge="fused", repeat_splits=(128, 16, 64, 3), **LLAMA),
    _C("decode_llama_b3_fused", "decode", (8192, 1, 3000), merge="fused", **LLAMA),
    _C("decode_smollm_b5_fused", "decode", (5000, 0, 17, 2048, 999), merge="fused", repeat_splits=(7, 2), **SMOLLM),
    _C("decode_mqa_g16_fused", "decode", (3000, 65), num_heads=16, num_kv_heads=1, merge="fused", num_splits=40),
    _C("decode_llama_b1_8k_pdl", "decode", (8192,), num_splits=64, merge="pdl", repeat_splits=(128, 5), **LLAMA),
    _C("decode_smollm_b5_pdl", "decode", (5000, 0, 17, 2048, 999), merge="pdl", **SMOLLM),
    _C("decode_d80_bs32_fused", "decode", (300, 2000, 17), num_heads=16, num_kv_heads=4, head_dim=80,
       block_size=32, merge="fused", num_splits=6),
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


@pytest.mark.parametrize("merge", ["fused", "pdl"])
def test_split_merge_under_graph_replay(merge):
    """Replayed from one CUDA graph, the fused merge's counters reset themselves and the PDL merge
    still waits for the split kernel: every replay with a fresh query matches the reference."""
    from pagedinfer.kernels import decode_attention as da

    gen = torch.Generator().manual_seed(11)
    lens = [8192, 300, 4000]
    tables, num_blocks = make_block_tables(lens, 16, 0, gen)
    cache_shape = (num_blocks, 16, 8, 128)
    kc, vc = (torch.randn(cache_shape, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    tables, context_lens = tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")
    query = torch.randn(len(lens), 32, 128, generator=gen).to("cuda", torch.bfloat16)
    config = dataclasses.replace(da.default_config(128, query.device), merge=da.SplitMerge(merge))

    def decode():
        return da.paged_decode_attention(query, kc, vc, tables, context_lens, 128**-0.5, 32, config)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        decode()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode()
    for _ in range(3):
        query.copy_(torch.randn(query.shape, generator=gen).to("cuda", torch.bfloat16))
        graph.replay()
        ref = reference.paged_decode_attention(
            query.double(), kc.double(), vc.double(), tables, context_lens, 128**-0.5
        )
        rel = float((out.double() - ref).norm() / ref.norm())
        assert rel <= TOLERANCE[torch.bfloat16], rel


@pytest.mark.parametrize("capacity_splits", [True, False], ids=["capacity", "context"])
@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("merge", ["pdl", "fused", "kernel"])
def test_small_grid_config_with_wide_tables(block_n, merge, capacity_splits):
    """The small-grid config (query loaded in the loop; splits placed by the table's capacity or by
    each context) at batch 1 and 2, contexts far shorter than the table (empty splits with
    capacity splits), default and odd split counts."""
    from pagedinfer.kernels import decode_attention as da

    gen = torch.Generator().manual_seed(block_n)
    tables, num_blocks = make_block_tables([8192, 8192], 16, 0, gen)
    cache_shape = (num_blocks, 16, 8, 128)
    kc, vc = (torch.randn(cache_shape, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    tables = tables.cuda()
    config = da.DecodeConfig(
        block_n,
        merge=da.SplitMerge(merge),
        capacity_splits=capacity_splits,
        q_in_loop=True,
        min_split_tokens=32,
    )
    for lens, num_splits in (
        ([8192], None),
        ([300], None),
        ([1], 64),
        ([5000], 7),
        ([8000, 17], None),
        ([33, 0], 3),
    ):
        context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        query = torch.randn(len(lens), 32, 128, generator=gen).to("cuda", torch.bfloat16)
        rows = tables[: len(lens)]
        out = da.paged_decode_attention(query, kc, vc, rows, context_lens, 128**-0.5, num_splits, config)
        ref = reference.paged_decode_attention(
            query.double(), kc.double(), vc.double(), rows, context_lens, 128**-0.5
        )
        rel = float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))
        assert rel <= TOLERANCE[torch.bfloat16], (lens, num_splits, rel)
