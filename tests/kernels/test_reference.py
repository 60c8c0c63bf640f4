"""The PyTorch references against dense naive float64 attention; ops checks and dispatch."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.kernels import ops, reference
from pagedinfer.kernels.testing import AttentionCase, make_block_tables, run_case


def _dense_kv(cache, table, seq_len, group):
    """[seq_len, H, D] keys or values of one sequence, KV heads repeated for their group."""
    pos = torch.arange(seq_len)
    block_ids = table[pos // cache.shape[1]].long()
    return cache[block_ids, pos % cache.shape[1]].repeat_interleave(group, dim=1)


def _naive_attention(q, k, v, first_pos, scale):
    """q [n, H, D] at positions first_pos.. over k/v [L, H, D], causal, in float64."""
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = first_pos + torch.arange(q.shape[0])
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


def _paged_inputs(seq_lens, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = make_block_tables(seq_lens, block_size, 1, gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc = torch.randn(shape, generator=gen, dtype=torch.float64)
    vc = torch.randn(shape, generator=gen, dtype=torch.float64)
    return tables, kc, vc, num_heads // num_kv_heads


@pytest.mark.parametrize("seq_lens", [[1, 16, 17, 50], [33], [0, 5]])
def test_decode_reference_matches_naive(seq_lens):
    tables, kc, vc, group = _paged_inputs(seq_lens)
    q = torch.randn(len(seq_lens), 9, 64, dtype=torch.float64)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125, backend="reference")
    for s, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[s], torch.zeros_like(out[s]))
            continue
        k, v = _dense_kv(kc, tables[s], n, group), _dense_kv(vc, tables[s], n, group)
        want = _naive_attention(q[s : s + 1], k, v, n - 1, 0.125)[0]
        torch.testing.assert_close(out[s], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("budget", [None, 2000], ids=["one-group", "tiny-budget-spans"])
def test_extend_reference_matches_naive(budget, monkeypatch):
    if budget is not None:  # forces query-row spans and many groups
        monkeypatch.setattr(reference, "_SCORE_BUDGET", budget)
    seq_lens, q_lens = [1, 40, 67, 20, 33], [1, 7, 67, 1, 16]
    tables, kc, vc, group = _paged_inputs(seq_lens, seed=1)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), 9, 64, dtype=torch.float64)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = ops.paged_extend_attention(q, kc, vc, tables, qsl, lens, 0.125, backend="reference")
    for s, (n, m) in enumerate(zip(seq_lens, q_lens, strict=True)):
        k, v = _dense_kv(kc, tables[s], n, group), _dense_kv(vc, tables[s], n, group)
        want = _naive_attention(q[qsl[s] : qsl[s + 1]], k, v, n - m, 0.125)
        torch.testing.assert_close(out[qsl[s] : qsl[s + 1]], want, rtol=1e-10, atol=1e-10)


def test_decode_reference_chunks_over_sequences(monkeypatch):
    monkeypatch.setattr(reference, "_SCORE_BUDGET", 3000)
    case = AttentionCase("chunked", "decode", (5, 70, 33, 1, 16), num_heads=9, num_kv_heads=3)
    assert run_case(case, torch.float32, "cpu", backend="reference").ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_backend_low_precision(dtype):
    for kind, q_lens in (("decode", ()), ("extend", (3, 1, 20))):
        case = AttentionCase(f"ref_{kind}", kind, (40, 1, 20), q_lens=q_lens, num_heads=9, num_kv_heads=3)
        result = run_case(case, dtype, "cpu", backend="reference")
        assert result.ok, result


def test_write_then_attend_sees_new_token():
    tables, kc, vc, _ = _paged_inputs([20], num_heads=3, num_kv_heads=3)
    kc, vc = kc.float(), vc.float()
    slot = int(tables[0, 19 // 16]) * 16 + 19 % 16
    key, value = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    ops.write_kv_cache(key, value, kc, vc, torch.tensor([slot]), backend="reference")
    q = key * 50.0  # the new key dominates the softmax, so attention returns its value
    out = ops.paged_decode_attention(q, kc, vc, tables, torch.tensor([20], dtype=torch.int32), 1.0)
    torch.testing.assert_close(out, value, rtol=1e-4, atol=1e-4)


def test_copy_blocks_all_layers():
    caches = [torch.randn(6, 4, 2, 16) for _ in range(4)]
    before = [c.clone() for c in caches]
    copies = torch.tensor([[0, 3], [3, 5]], dtype=torch.int64)  # reads happen before writes
    ops.copy_blocks(caches[:2], caches[2:], copies)
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[3], b[0]) and torch.equal(c[5], b[3])
        assert torch.equal(c[[0, 1, 2, 4]], b[[0, 1, 2, 4]])


def test_select_backend():
    assert ops.select_backend("cpu") == "reference"
    assert ops.select_backend(torch.device("cpu"), "reference") == "reference"
    with pytest.raises(ValueError, match="unknown attention backend"):
        ops.select_backend("cpu", "cudnn")


def _decode_args():
    tables, kc, vc, _ = _paged_inputs([20, 3])
    q = torch.randn(2, 9, 64, dtype=torch.float64)
    return [q, kc, vc, tables, torch.tensor([20, 3], dtype=torch.int32), 0.125]


@pytest.mark.parametrize(
    "index,bad,match",
    [
        (0, torch.randn(2, 9, 32, dtype=torch.float64), "head_dim"),
        (0, torch.randn(2, 8, 64, dtype=torch.float64), "multiple of num_kv_heads"),
        (0, torch.randn(2, 9, 64), "must equal the cache dtype"),
        (3, torch.zeros(2, 3, dtype=torch.int64), "block_tables must have dtype"),
        (4, torch.tensor([20, 300], dtype=torch.int32), "lengths must lie in"),
        (4, torch.tensor([20], dtype=torch.int32), "num_seqs=2"),
        (5, -1.0, "scale must be a positive"),
    ],
)
def test_decode_rejects_bad_arguments(index, bad, match):
    args = _decode_args()
    args[index] = bad
    with pytest.raises(ValueError, match=match):
        ops.paged_decode_attention(*args)


def test_extend_and_write_reject_bad_arguments():
    q, kc, vc, tables, lens, scale = _decode_args()
    with pytest.raises(ValueError, match="run from 0 to num_tokens"):
        ops.paged_extend_attention(q, kc, vc, tables, torch.tensor([0, 1, 3], dtype=torch.int32), lens, scale)
    with pytest.raises(ValueError, match="seq_lens must count cached"):
        ops.paged_extend_attention(
            q, kc, vc, tables, torch.tensor([0, 0, 2], dtype=torch.int32), lens * 0, scale
        )
    with pytest.raises(ValueError, match="below the longest query"):
        qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
        ops.paged_extend_attention(q, kc, vc, tables, qsl, lens, scale, max_query_len=0)
    with pytest.raises(ValueError, match="max_context_len=1 is below the longest context length"):
        ops.paged_decode_attention(q, kc, vc, tables, lens, scale, max_context_len=1)
    with pytest.raises(ValueError, match="max_context_len must be a positive int"):
        ops.paged_decode_attention(q, kc, vc, tables, lens, scale, max_context_len=0)
    bad_tables = tables.clone()
    bad_tables[0, 0] = kc.shape[0]
    with pytest.raises(ValueError, match="block_tables entries in use"):
        ops.paged_decode_attention(q, kc, vc, bad_tables, lens, scale)
    key = torch.randn(1, 3, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="slot_mapping values"):
        ops.write_kv_cache(key, key, kc, vc, torch.tensor([kc.shape[0] * 16]))
    with pytest.raises(ValueError, match="num_tokens, num_kv_heads, head_dim"):
        ops.write_kv_cache(key, key, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"block_copies must be \[n, 2\]"):
        ops.copy_blocks([kc], [vc], torch.zeros(2, 3, dtype=torch.int64))
