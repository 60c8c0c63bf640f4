"""Host-side choices of the split-K merge (kernels/decode_merge.py, decode_attention.py) on the CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedinfer.kernels import decode_attention as da  # noqa: E402
from pagedinfer.kernels.decode_merge import CounterPool, SplitMerge, fused_split_chunk, pdl_supported  # noqa: E402

CPU = torch.device("cpu")


def test_counter_pool_gives_one_zeroed_buffer_per_device():
    pool = CounterPool()
    first = pool.get(CPU, 10)
    assert first is not None and first.dtype == torch.int32 and not bool(first.any())
    assert pool.get(CPU, CounterPool.SIZE) is first  # the same buffer: graphs keep its address
    assert pool.get(CPU, CounterPool.SIZE + 1) is None  # too many (seq, kv_head) pairs: caller falls back


def test_merge_choice_on_the_cpu():
    config = da.DecodeConfig(merge=SplitMerge.PDL)
    assert not pdl_supported(CPU)
    assert da.choose_merge(config.merge, 4, 8, CPU) is SplitMerge.KERNEL  # PDL needs Hopper
    assert da.choose_merge(config.merge, 1, 8, CPU) is None  # nothing to merge
    assert da.choose_merge(da.DecodeConfig(merge=SplitMerge.FUSED).merge, 4, 8, CPU) is SplitMerge.FUSED
    assert da.default_merge(8, CPU) is SplitMerge.KERNEL  # the interpreter keeps the plain kernel


def test_merge_choice_by_grid_on_cuda():
    """decode_attention.choose_merge, which the short extend kernel uses too: a separate merge
    kernel on small grids (PDL on Hopper; this CPU machine reports no PDL, so KERNEL), the merge in
    the split kernel from 16 (sequence, KV head) programs: a SmolLM2 verification at batch 8 (8 x 3)."""
    cuda = torch.device("cuda")  # a device object only: the choice itself touches no GPU
    assert da.default_merge(3, cuda) is SplitMerge.PDL and da.default_merge(24, cuda) is SplitMerge.FUSED
    assert da.choose_merge(None, 22, 24, cuda) is SplitMerge.FUSED
    assert da.choose_merge(None, 1, 24, cuda) is None
    assert da.choose_merge(SplitMerge.KERNEL, 22, 24, cuda) is SplitMerge.KERNEL  # a caller's choice stands


@pytest.mark.parametrize("group_p2,d_pad,expect", [(4, 128, 16), (16, 128, 4), (1, 256, 32), (64, 256, 2)])
def test_fused_tile_stays_within_budget(group_p2, d_pad, expect):
    chunk = fused_split_chunk(group_p2, d_pad, 128)
    assert chunk == expect
    assert chunk == 2 or group_p2 * chunk * d_pad <= 8192


def test_small_grid_config_choice():
    """The v5 latency config only for < SMALL_GRID programs, head_dim 128 and tables of >= 2048
    tokens (no CUDA call is made: the choice reads the device type alone)."""
    cuda = torch.device("cuda")
    small = da.default_config(128, cuda, 8, 8192)
    assert (small.block_n, small.q_in_loop, small.min_split_tokens) == (32, True, 32)
    assert not small.capacity_splits  # off by default: it loses on tables wider than the context
    assert not small.pdl_prologue  # opt-in: measured slower at 1x8192 and after the rotary kernel
    assert not da.default_config(128, torch.device("cpu"), 8, 8192).pdl_prologue  # interpreter
    assert da.default_config(128, cuda, 8, 2048) == small
    for args in ((128, cuda, 8, 1024), (128, cuda, 16, 8192), (64, cuda, 3, 8192), (128, cuda)):
        assert da.default_config(*args) == da.DecodeConfig()


def test_bounded_config_choice():
    """Told the longest context: capacity splits and block ids one tile early for small grids at
    head_dim 128, 32-token tiles at 2 warps for bounds of >= 2048 tokens, 64-token tiles at 4 below;
    nothing for large grids, other head dims, CPU."""
    cuda = torch.device("cuda")
    long = da.DecodeConfig(
        32, 2, q_in_loop=True, min_split_tokens=32, capacity_splits=True, prefetch_ids=True
    )
    short = da.DecodeConfig(64, 4, q_in_loop=True, capacity_splits=True, prefetch_ids=True)
    for bound in (2048, 4095, 8192, 131072):
        assert da.bounded_config(128, cuda, 8, bound) == long
    for bound in (1, 512, 2047):
        assert da.bounded_config(128, cuda, 8, bound) == short
    for args in ((128, cuda, 16, 8192), (64, cuda, 3, 8192), (128, torch.device("cpu"), 8, 8192)):
        assert da.bounded_config(*args) is None


def test_short_extend_merges_in_kernel_only_over_few_splits():
    """The short extend kernel's merge: in the kernel from 16 programs up to FUSED_MAX_SPLITS
    splits (an 8B batch-8 verification: 64 programs, 5 splits), the separate merge above it (a
    SmolLM2 batch-8 one: 24 programs, 22 splits; PDL, or KERNEL on a machine without it)."""
    from pagedinfer.kernels import short_extend_attention as sea

    cuda = torch.device("cuda")
    assert sea.merge_for(None, 5, 64, cuda) is SplitMerge.FUSED
    assert sea.merge_for(None, sea.FUSED_MAX_SPLITS, 24, cuda) is SplitMerge.FUSED
    separate = SplitMerge.PDL if pdl_supported(cuda) else SplitMerge.KERNEL
    assert sea.merge_for(None, 22, 24, cuda) is separate
    assert sea.merge_for(SplitMerge.FUSED, 22, 24, cuda) is SplitMerge.FUSED  # a caller's choice stands
    assert sea.merge_for(None, 1, 64, cuda) is None
