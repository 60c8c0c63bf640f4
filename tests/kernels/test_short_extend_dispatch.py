"""Which extend kernel a chunk goes to: short chunks (speculative verification) take the
GQA-packed split-K kernel of kernels/short_extend_attention.py, longer ones the tiled kernel.
Numerics of both are checked under the interpreter (test_triton_interpret.py) and on the GPU."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

from pagedinfer.kernels import extend_attention as ea  # noqa: E402
from pagedinfer.kernels import short_extend_attention as sea  # noqa: E402


@pytest.mark.parametrize(
    "max_query_len,num_heads,num_kv_heads,expect",
    [
        (1, 32, 8, True),
        (5, 32, 8, True),  # Llama-3-8B verifying K = 4: 8 tokens x 4 heads = 32 rows
        (16, 32, 8, True),  # 64 rows, the limit
        (17, 32, 8, False),
        (8, 16, 2, True),  # group 8: 8 x 8 = 64 rows
        (9, 16, 2, False),
        (7, 9, 3, True),  # SmolLM2 at K = 6: 8 x 4 rows
        (32, 2, 2, False),  # MHA: 32 rows, but a prefill chunk (past MAX_TOKENS) stays tiled
        (16, 2, 2, True),
        (0, 32, 8, False),
        (None, 32, 8, False),
    ],
)
def test_takes_short_chunks_only(max_query_len, num_heads, num_kv_heads, expect):
    assert sea.takes(max_query_len, num_heads, num_kv_heads) is expect


@pytest.mark.parametrize(
    "max_query_len,group,rows,packed",
    [
        (5, 3, 16, True),  # SmolLM2 at K = 4: 15 rows packed, 8 x 4 = 32 padded
        (3, 3, 16, False),  # K = 2: 16 either way, the padded layout
        (7, 3, 32, False),  # K = 6: 32 either way
        (5, 4, 32, False),  # Llama-3-8B: a power-of-two group packs the same
        (16, 3, 64, False),
        (3, 5, 16, True),  # 15 packed vs 4 x 8 = 32
    ],
)
def test_rows_pack_only_where_fewer(max_query_len, group, rows, packed):
    assert sea.rows_per_program(max_query_len, group) == rows
    assert sea.packs_rows(max_query_len, group) is packed


@pytest.mark.parametrize(
    "max_query_len,group,block_rows,tokens",
    [
        (7, 3, 16, 4),  # SmolLM2 at K = 6: 32 rows as blocks of 4 + 3 tokens (16 rows each)
        (5, 3, 16, 3),  # K = 4: 3 + 2 tokens (16 padded rows each), not one packed program of 15
        (3, 3, 16, 3),
        (5, 4, 16, 3),  # Llama-3-8B at K = 4: 20 rows as 3 + 2 tokens
        (7, 4, 16, 4),
        (3, 8, 16, 2),  # group 8: two tokens a block
        (16, 1, 16, 16),
        (7, 3, 0, 7),  # off
        (7, 32, 16, 7),  # a group wider than the block: no blocks
        (3, 5, 16, 2),  # group 5 (8 padded): 2 + 1 tokens
        (5, 3, 8, 2),  # 8-row blocks: 2 + 2 + 1
        (5, 3, 0, 5),  # off: one packed program
    ],
)
def test_token_blocks_split_evenly_within_the_rows(max_query_len, group, block_rows, tokens):
    assert sea.tokens_per_program(max_query_len, group, block_rows) == tokens
    if tokens < max_query_len:  # blocks: each within block_rows unpacked
        assert sea.padded_rows(tokens, group) <= max(16, block_rows)
        assert not sea.packs_rows(tokens, group)


def _inputs(q_lens: list[int], num_heads: int = 8, num_kv_heads: int = 2) -> dict:
    seq_lens = [n + 20 for n in q_lens]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "query": torch.randn(sum(q_lens), num_heads, 64),
        "key_cache": torch.randn(8, 16, num_kv_heads, 64),
        "value_cache": torch.randn(8, 16, num_kv_heads, 64),
        "block_tables": torch.arange(8, dtype=torch.int32).view(2, 4)[: len(q_lens)],
        "query_start_loc": qsl,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "scale": 0.125,
    }


class _Spy:
    """Stands in for a kernel launch (`kernel[grid](...)`) or a launcher function; records calls."""

    def __init__(self) -> None:
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(grid)

    def __call__(self, *args, **kwargs):
        self.calls.append(args)
        return "short"


@pytest.fixture
def spies(monkeypatch):
    short, tiled = _Spy(), _Spy()
    monkeypatch.setattr(sea, "paged_short_extend_attention", short)
    monkeypatch.setattr(ea, "_extend_kernel", tiled)
    return short, tiled


def test_dispatch_sends_short_chunks_to_the_short_kernel(spies):
    short, tiled = spies
    assert ea.paged_extend_attention(**_inputs([5, 3]), max_query_len=5) == "short"
    assert len(short.calls) == 1 and not tiled.calls


def test_dispatch_keeps_long_chunks_and_forced_configs_on_the_tiled_kernel(spies):
    short, tiled = spies
    ea.paged_extend_attention(**_inputs([40, 3]), max_query_len=40)
    config = ea.ExtendConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    ea.paged_extend_attention(**_inputs([5, 3]), max_query_len=5, config=config)
    assert not short.calls and len(tiled.calls) == 2


def test_dispatch_without_a_bound_reads_the_query_lengths(spies):
    """max_query_len None (callers that accept the device sync): the longest chunk, read from
    query_start_loc, decides, and the short kernel is sized by it."""
    short, tiled = spies
    assert ea.paged_extend_attention(**_inputs([5, 3])) == "short"
    assert short.calls[0][-1] == 5  # the max_query_len it was given
    ea.paged_extend_attention(**_inputs([40, 3]))
    assert len(short.calls) == 1 and len(tiled.calls) == 1


def test_switch_off_keeps_short_chunks_on_the_tiled_kernel(spies, monkeypatch):
    short, tiled = spies
    monkeypatch.setattr(sea, "SHORT_EXTEND_ENABLED", False)
    ea.paged_extend_attention(**_inputs([5, 3]), max_query_len=5)
    assert not short.calls and len(tiled.calls) == 1


def test_short_kernel_rejects_too_many_rows():
    x = _inputs([17])
    with pytest.raises(ValueError, match="exceed"):
        sea.paged_short_extend_attention(**x, max_query_len=17)


def test_grid_counts_the_sequences_the_tokens_fill_not_the_graph_pads(monkeypatch):
    # A verification graph of B = 4 sequences at q = 5 carries 4 pad sequences with no tokens; the
    # split count must be sized for 4 busy sequences, as an eager step of the same batch would be.
    seen, launches = [], []

    def splits(num_seqs, num_kv_heads, max_context, device, *args):
        seen.append(num_seqs * num_kv_heads)
        return 3

    monkeypatch.setattr(sea, "default_num_splits", splits)
    monkeypatch.setattr(sea, "_short_extend_kernel", _Spy())
    monkeypatch.setattr(sea, "reduce_splits", lambda *args, **kwargs: launches.append(args))
    b, q = 4, 5
    qsl = torch.tensor([0, 5, 10, 15, 20, 20, 20, 20, 20], dtype=torch.int32)
    sea.paged_short_extend_attention(
        torch.randn(b * q, 8, 64),
        torch.randn(8, 16, 2, 64),
        torch.randn(8, 16, 2, 64),
        torch.zeros(2 * b, 4, dtype=torch.int32),
        qsl,
        torch.tensor([30] * b + [1] * b, dtype=torch.int32),
        0.125,
        max_query_len=q,
        block_rows=0,  # (token blocks would count as programs too)
    )
    assert seen == [b * 2] and len(launches) == 1  # (sequence, KV head) programs


@pytest.mark.parametrize("cap, splits", [(0, 11), (4, 4), (16, 11)])
def test_split_cap_bounds_the_grids_splits_only(monkeypatch, cap, splits):
    # PAGEDINFER_SHORT_EXTEND_MAX_SPLITS (an A/B switch): the grid's choice, at most the cap.
    kernel = _Spy()
    monkeypatch.setattr(sea, "SPLIT_CAP", cap)
    monkeypatch.setattr(sea, "default_num_splits", lambda *args: 11)
    monkeypatch.setattr(sea, "_short_extend_kernel", kernel)
    monkeypatch.setattr(sea, "reduce_splits", lambda *args, **kwargs: None)
    x = _inputs([5, 3])
    sea.paged_short_extend_attention(**x, max_query_len=5)
    assert kernel.calls[-1][2] == splits


@pytest.fixture
def h100(monkeypatch):
    """A CUDA device of 132 SMs as far as the split rule asks."""
    props = types.SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    return torch.device("cuda")


@pytest.mark.parametrize(
    "programs, cap, splits",
    [
        (48, 8, 8),  # SmolLM2 batch 8, K 4 / 6: at most 8 (decode's rule: 11, the separate merge)
        (32, 8, 8),  # WIDE_GRID: capped from here
        (31, 8, 18),  # one program fewer: decode's rule
        (48, 0, 11),  # decode's rule restored (PAGEDINFER_SHORT_EXTEND_WIDE_GRID_SPLITS=0)
        (24, 8, 22),  # batch 8, K 2: below WIDE_GRID, decode's rule
        (6, 8, 32),  # batch 1: decode's rule (capped by the context: 2048 / 64)
        (96, 8, 3),  # decode's own 2-wave rule from 64 programs, under the cap
    ],
)
def test_wide_grids_take_at_most_the_fused_merges_splits(h100, monkeypatch, programs, cap, splits):
    monkeypatch.setattr(sea, "WIDE_GRID_SPLITS", cap)
    assert sea.grid_splits(programs, 2048, h100) == splits


def test_wide_grid_cap_defaults_to_the_fused_merges_most():
    assert sea.WIDE_GRID_SPLITS == 8 == sea.FUSED_MAX_SPLITS and sea.WIDE_GRID == 32


def test_grid_counts_token_blocks_as_programs(monkeypatch):
    # SmolLM2's heads (9 over 3 KV heads) at q = 5: blocks of 3 + 2 tokens, so 4 sequences make
    # 4 x 2 x 3 = 24 programs for the split rule (the merge still counts 4 x 3 sequence programs).
    seen = []

    def splits(num_programs, max_context, device):
        seen.append(num_programs)
        return 1

    monkeypatch.setattr(sea, "grid_splits", splits)
    monkeypatch.setattr(sea, "_short_extend_kernel", _Spy())
    b, q = 4, 5
    sea.paged_short_extend_attention(
        torch.randn(b * q, 9, 64),
        torch.randn(8, 16, 3, 64),
        torch.randn(8, 16, 3, 64),
        torch.zeros(b, 4, dtype=torch.int32),
        torch.arange(0, b * q + 1, q, dtype=torch.int32),
        torch.tensor([30] * b, dtype=torch.int32),
        0.125,
        max_query_len=q,
    )
    assert sea.tokens_per_program(q, 3) == 3 and seen == [b * 2 * 3]


def test_split_cap_leaves_an_explicit_split_count(monkeypatch):
    kernel = _Spy()
    monkeypatch.setattr(sea, "SPLIT_CAP", 4)
    monkeypatch.setattr(sea, "_short_extend_kernel", kernel)
    monkeypatch.setattr(sea, "reduce_splits", lambda *args, **kwargs: None)
    sea.paged_short_extend_attention(**_inputs([5, 3]), max_query_len=5, num_splits=11)
    assert kernel.calls[-1][2] == 11
