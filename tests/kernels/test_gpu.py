"""The kernel checks at full shapes on a CUDA GPU, in bf16 and fp16 (run by bench/run_gpu.sh).

CPU counterparts: tests/kernels/test_triton_interpret.py (small shapes, fp32/fp16).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib

import pytest
import torch
import triton
import triton.language as tl

from pagedinfer.kernels import ops, reference
from pagedinfer.kernels.decode_merge import gdc_launch_dependents
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
    # short chunks (speculative verification) through the dispatch, forced splits and the tiled kernel
    _C("extend_llama_verify_b1_8k", "extend", (8192,), q_lens=(5,), **LLAMA),
    _C("extend_llama_verify_b8", "extend", (600, 5, 2049, 700, 31, 4100, 17, 1000), q_lens=(5, 5, 3, 1, 5, 5, 2, 5),
       shared_blocks=1, **LLAMA),
    _C("extend_llama_verify_q16_splits", "extend", (3000, 16, 700), q_lens=(16, 16, 9), num_splits=64,
       extend_path="short", **LLAMA),
    _C("extend_smollm_verify", "extend", (2048, 5, 7, 999, 1), q_lens=(7, 5, 7, 2, 0), **SMOLLM),
    # the merge in the kernel (the dispatch's choice from 16 programs: batch 8 x 8 KV heads above)
    _C("extend_smollm_verify_b8_fused", "extend", (2048, 5, 7, 999, 1, 300, 64, 4000), q_lens=(5, 5, 5, 2, 0, 5, 5, 5),
       merge="fused", repeat_splits=(22, 3), extend_path="short", **SMOLLM),
    _C("extend_llama_verify_fused_splits", "extend", (3000, 16, 700), q_lens=(16, 16, 9), num_splits=64,
       merge="fused", repeat_splits=(5,), extend_path="short", **LLAMA),
    # a sequence's tokens over programs of <= 16 rows (token blocks), PDL / fused merges
    _C("extend_smollm_verify_token_blocks", "extend", (2048, 7, 9, 999, 1, 420, 64, 4000),
       q_lens=(7, 7, 7, 2, 0, 7, 5, 7), block_rows=16, extend_path="short", **SMOLLM),
    _C("extend_smollm_verify_token_blocks_fused", "extend", (2048, 7, 9, 999, 1, 420), q_lens=(7, 7, 7, 2, 0, 7),
       merge="fused", repeat_splits=(11, 3), block_rows=16, extend_path="short", **SMOLLM),
    _C("extend_llama_verify_token_blocks", "extend", (3000, 16, 700, 5), q_lens=(7, 7, 5, 1), num_splits=8,
       block_rows=16, extend_path="short", **LLAMA),
    # one packed program of 5 x 3 rows (token blocks off: the layout the default no longer takes)
    _C("extend_smollm_verify_packed", "extend", (2048, 5, 9, 999, 1, 420), q_lens=(5, 5, 5, 2, 0, 5), block_rows=0,
       extend_path="short", **SMOLLM),
    _C("extend_llama_verify_tiled", "extend", (600, 2049, 31), q_lens=(5, 3, 5), extend_path="tiled", **LLAMA),
    # 64 rows (16 tokens x group 4) at head_dim 256; a graph's bound (q = 8) above every chunk with
    # pad sequences in one shared 64-token block (q_len == seq_len, q_len 0)
    _C("extend_d256_verify_rows64", "extend", (2000, 300, 17), q_lens=(16, 5, 1), num_heads=8, num_kv_heads=2,
       head_dim=256),
    _C("extend_llama_verify_graph_pads_bs64", "extend", (3000, 700, 4, 1, 2), q_lens=(3, 5, 4, 0, 2), block_size=64,
       shared_blocks=1, max_query_len=8, **LLAMA),
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


def test_short_extend_under_graph_replay():
    """A verification step's attention (the short-chunk kernel, its split partials merged by the
    PDL reduce where supported) replayed from one CUDA graph: every replay's fresh query is seen."""
    from pagedinfer.kernels import extend_attention as ea
    from pagedinfer.kernels import short_extend_attention as sea

    gen = torch.Generator().manual_seed(13)
    lens, q_lens, bound = [8192, 300, 4000, 1], [5, 2, 4, 0], 5
    assert sea.takes(bound, 32, 8)
    tables, num_blocks = make_block_tables(lens, 16, 0, gen)
    kc, vc = (
        torch.randn((num_blocks, 16, 8, 128), generator=gen).to("cuda", torch.bfloat16) for _ in range(2)
    )
    tables, seq_lens = tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    query = torch.zeros(sum(q_lens), 32, 128, dtype=torch.bfloat16, device="cuda")
    graph, out = _capture(
        lambda: ea.paged_extend_attention(query, kc, vc, tables, qsl, seq_lens, 128**-0.5, bound)
    )
    errors = []
    for _ in range(3):
        query.copy_(torch.randn(query.shape, generator=gen).to("cuda", torch.bfloat16))
        graph.replay()
        ref = reference.paged_extend_attention(
            query.double(), kc.double(), vc.double(), tables, qsl, seq_lens, 128**-0.5
        )
        errors.append(float((out.double() - ref).norm() / ref.norm()))
    assert max(errors) <= TOLERANCE[torch.bfloat16], errors


@pytest.mark.parametrize("prefetch_ids", [False, True], ids=["ids_in_loop", "prefetch"])
@pytest.mark.parametrize("capacity_splits", [True, False], ids=["capacity", "context"])
@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("merge", ["pdl", "fused", "kernel"])
def test_small_grid_config_with_wide_tables(block_n, merge, capacity_splits, prefetch_ids):
    """The small-grid config (query loaded in the loop; splits placed by the table's capacity or by
    each context; block ids loaded one tile early or not) at batch 1 and 2, contexts far shorter
    than the table (empty splits with capacity splits), default and odd split counts."""
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
        prefetch_ids=prefetch_ids,
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


@pytest.mark.parametrize("block_n", [32, 64])
def test_prefetch_ids_on_large_grids(block_n):
    """prefetch_ids where programs stream whole contexts (no splits, many tiles each): batch 64
    and 256 with ragged contexts (0, one token, block edges, 2048) in shuffled blocks."""
    from pagedinfer.kernels import decode_attention as da

    gen = torch.Generator().manual_seed(11 + block_n)
    gpu_gen = torch.Generator("cuda").manual_seed(11 + block_n)  # caches drawn on the device
    bf16 = {"device": "cuda", "dtype": torch.bfloat16, "generator": gpu_gen}
    for batch in (64, 256):
        lens = torch.randint(1, 2049, (batch,), generator=gen)
        lens[:5] = torch.tensor([0, 1, 16, 17, 2048])
        tables, num_blocks = make_block_tables(lens.tolist(), 16, 0, gen)
        kc, vc = (torch.randn(num_blocks, 16, 8, 128, **bf16) for _ in range(2))
        query = torch.randn(batch, 32, 128, **bf16)
        context_lens, tables = lens.to("cuda", torch.int32), tables.cuda()
        config = da.DecodeConfig(block_n, prefetch_ids=True)
        out = da.paged_decode_attention(query, kc, vc, tables, context_lens, 128**-0.5, 1, config)
        ref = reference.paged_decode_attention(
            query.double(), kc.double(), vc.double(), tables, context_lens, 128**-0.5
        )
        # per sequence: an error in one sequence's boundary tile must not average away
        err = (out.double() - ref).flatten(1).norm(dim=1)  # [S]
        rel = err / ref.flatten(1).norm(dim=1).clamp_min(1.0)  # the empty sequence's ref is 0
        worst = int(rel.argmax())
        assert float(rel[worst]) <= TOLERANCE[torch.bfloat16], (batch, block_n, worst, int(lens[worst]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_told_the_longest_context(dtype):
    """max_context_len (the eager engine step's longest context) picks the bounded small-grid
    config, whose splits follow that bound even in tables wider than it; batch >= 2 sequences and
    a bound above the longest context too."""
    from pagedinfer.kernels import decode_attention as da

    gen = torch.Generator().manual_seed(5)
    tables, num_blocks = make_block_tables([8192, 8192], 16, 0, gen)
    cache_shape = (num_blocks, 16, 8, 128)
    kc, vc = (torch.randn(cache_shape, generator=gen).to("cuda", dtype) for _ in range(2))
    tables = tables.cuda()
    for lens, bound in (([8192], 8192), ([2048], 2048), ([3000], 4000), ([512], 512), ([300, 7], 400)):
        if len(lens) == 1:  # the bounded config is for small grids (< 16 programs)
            assert da.bounded_config(128, kc.device, 8, bound).capacity_splits
        context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        query = torch.randn(len(lens), 32, 128, generator=gen).to("cuda", dtype)
        rows = tables[: len(lens)]
        out = ops.paged_decode_attention(query, kc, vc, rows, context_lens, 128**-0.5, max_context_len=bound)
        ref = reference.paged_decode_attention(
            query.double(), kc.double(), vc.double(), rows, context_lens, 128**-0.5
        )
        rel = float((out.double() - ref).norm() / ref.norm())
        assert rel <= TOLERANCE[dtype], (lens, bound, rel)


@triton.jit
def _slow_write_kernel(src_k, src_v, key_cache, value_cache, idx_ptr, num, spin, one, BLOCK: tl.constexpr):
    """cache[idx[i]] = src[i] (K and V), after ~spin dependent multiplies: PDL dependents start first."""
    gdc_launch_dependents()  # as rotary_cache and the PDL merge do
    x = one
    for _ in range(spin):  # one is 1.0 at run time: no folding, x stays 1.0
        x = x * one
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < num
    idx = tl.load(idx_ptr + i, mask=mask, other=0)
    tl.store(key_cache + idx, (tl.load(src_k + i, mask=mask) * x).to(key_cache.dtype.element_ty), mask=mask)
    tl.store(
        value_cache + idx, (tl.load(src_v + i, mask=mask) * x).to(value_cache.dtype.element_ty), mask=mask
    )


def _replay_check(graph, out, query, kc, vc, tables, lens, refresh):
    """refresh() sets new inputs; after each replay out must match the float64 reference."""
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    errors = []
    for _ in range(3):
        refresh()
        graph.replay()
        ref = reference.paged_decode_attention(
            query.double(), kc.double(), vc.double(), tables, context_lens, 128**-0.5
        )
        errors.append(float((out.double() - ref).norm() / ref.norm()))
    return errors


def _capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


PDL_PROLOGUE_RUNS = (
    ([8192], None, None),
    ([5000, 1, 300], 7, "fused"),
    ([3000, 17], 1, None),
    ([2048], 64, "kernel"),
)


def _pdl_inputs(lens, gen):
    from pagedinfer.kernels import decode_attention as da

    if not da.pdl_supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    tables, num_blocks = make_block_tables(lens, 16, 0, gen)
    kc, vc = (
        torch.randn((num_blocks, 16, 8, 128), generator=gen).to("cuda", torch.bfloat16) for _ in range(2)
    )
    newest = torch.tensor([int(tables[s, (n - 1) // 16]) * 16 + (n - 1) % 16 for s, n in enumerate(lens)])
    return tables.cuda(), kc, vc, newest.cuda()


@pytest.mark.parametrize("lens,num_splits,merge", PDL_PROLOGUE_RUNS)
def test_pdl_prologue_after_rotary_cache_write_in_graph(lens, num_splits, merge):
    """The engine's order in one CUDA graph: rotary + cache write (q and the newest token's K/V,
    its V large so a stale read shows), then the decode with pdl_prologue launched as its PDL
    dependent. Every replay's fresh q / K / V must be seen."""
    from pagedinfer.kernels import decode_attention as da
    from pagedinfer.kernels import fused_ops

    gen = torch.Generator().manual_seed(len(lens))
    tables, kc, vc, slots = _pdl_inputs(lens, gen)
    qkv = torch.empty(len(lens), (32 + 16) * 128, dtype=torch.bfloat16, device="cuda")
    angles = torch.rand(len(lens), 64, generator=gen).cuda() * 6.3
    cos, sin = angles.cos(), angles.sin()
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    config = da.DecodeConfig(32, q_in_loop=True, min_split_tokens=32, pdl_prologue=True)
    config = dataclasses.replace(config, merge=None if merge is None else da.SplitMerge(merge))
    q_out = []

    def step():
        q = fused_ops.rotary_cache_write(qkv, cos, sin, kc, vc, slots, "triton")
        q_out.append(q)
        return da.paged_decode_attention(q, kc, vc, tables, context_lens, 128**-0.5, num_splits, config)

    def refresh():
        fresh = torch.randn(qkv.shape, generator=gen)
        fresh[:, 40 * 128 :] *= 100  # the V heads: the newest token dominates the output
        qkv.copy_(fresh.to("cuda", torch.bfloat16))

    graph, out = _capture(step)
    errors = _replay_check(graph, out, q_out[-1], kc, vc, tables, lens, refresh)
    assert max(errors) <= TOLERANCE[torch.bfloat16], errors


@pytest.mark.parametrize("written", ["newest", "first"])
@pytest.mark.parametrize("lens,num_splits,merge", PDL_PROLOGUE_RUNS[:2])
def test_pdl_prologue_waits_for_a_slow_writer(lens, num_splits, merge, written):
    """A kernel that triggers its dependents at once, spins ~50 us, then writes K/V rows (NaN V
    before); the decode (pdl_prologue) follows in one CUDA graph. "newest": the rows at
    context_len - 1 (the contract): must be seen. "first": position 0, which the prologue reads
    before gdc_wait by design: must be missed (NaN out), which shows the decode does overlap the
    kernel before it (else the knob gains nothing and the "newest" case proves nothing)."""
    from pagedinfer.kernels import decode_attention as da

    gen = torch.Generator().manual_seed(7)
    tables, kc, vc, slots = _pdl_inputs(lens, gen)
    if written == "first":
        slots = tables[:, 0].long() * 16
    query = torch.randn(len(lens), 32, 128, generator=gen).to("cuda", torch.bfloat16)
    row = torch.arange(8 * 128, device="cuda")
    idx = (slots[:, None] * 8 * 128 + row).reshape(-1)  # the rows' elements in the flat caches
    src_k, src_v = (torch.empty(idx.numel(), dtype=torch.bfloat16, device="cuda") for _ in range(2))
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    config = da.DecodeConfig(32, q_in_loop=True, min_split_tokens=32, pdl_prologue=True)
    config = dataclasses.replace(config, merge=None if merge is None else da.SplitMerge(merge))

    def step():
        grid = (triton.cdiv(idx.numel(), 1024),)
        _slow_write_kernel[grid](src_k, src_v, kc, vc, idx, idx.numel(), 20000, 1.0, BLOCK=1024)
        return da.paged_decode_attention(query, kc, vc, tables, context_lens, 128**-0.5, num_splits, config)

    def refresh():
        kc.view(-1)[idx] = 0.0  # stale rows until the writer runs: a read of them gives NaN
        vc.view(-1)[idx] = float("nan")
        src_k.copy_(torch.randn(idx.numel(), generator=gen).to("cuda", torch.bfloat16))
        src_v.copy_(torch.randn(idx.numel(), generator=gen).to("cuda", torch.bfloat16))

    graph, out = _capture(step)
    errors = _replay_check(graph, out, query, kc, vc, tables, lens, refresh)
    if written == "newest":
        assert max(errors) <= TOLERANCE[torch.bfloat16], errors
    else:
        assert all(math.isnan(e) for e in errors), errors
