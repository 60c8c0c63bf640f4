"""Pure-PyTorch references of the paged-attention kernels; also the CPU production path.

Same signatures as the Triton launchers (minus `backend`). Vectorized: K/V are gathered through
the block table into a padded [num_seqs, max_len, num_kv_heads, head_dim] copy and attention runs
through torch's scaled_dot_product_attention with an explicit boolean mask, in fp32 (fp64 for fp64
inputs); on the CPU that is its tiled flash kernel, which never materializes the scores. Work is chunked over sequences (and over query
rows of long prefills) so the padded score tensor stays under a memory budget; there is no loop
over tokens.

Layouts (shared with the kernels):
  key_cache/value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables: int32 [num_seqs, max_blocks_per_seq]; slot = block_id * block_size + offset
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Elements of the padded score tensor (fp32) one chunk may hold: 2**25 -> 128 MiB.
_SCORE_BUDGET = 1 << 25


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value [num_tokens, num_kv_heads, head_dim] into their slots of the caches."""
    block_size = key_cache.shape[1]
    slots = slot_mapping.long()
    block_ids, offsets = slots // block_size, slots % block_size
    key_cache[block_ids, offsets] = key.to(key_cache.dtype)
    value_cache[block_ids, offsets] = value.to(value_cache.dtype)


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_copies: torch.Tensor
) -> None:
    """Copy whole blocks src -> dst in every layer's caches; block_copies is int64 [n, 2].

    All sources are read before any destination is written (index_select copies first).
    """
    if block_copies.numel() == 0:
        return
    for cache in [*key_caches, *value_caches]:
        copies = block_copies.to(cache.device)
        cache.index_copy_(0, copies[:, 1], cache.index_select(0, copies[:, 0]))


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """cache [NB, BS, KVH, D], block_tables [n, MB] -> the first max_len tokens [n, max_len, KVH, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(max_len, device=cache.device)
    block_ids = block_tables[:, pos // block_size].long()  # [n, max_len]
    return cache[block_ids, pos % block_size]


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence: query [S, H, D] -> out [S, H, D] (a zero row where len is 0)."""
    num_seqs = query.shape[0]
    out = torch.zeros_like(query)
    if num_seqs == 0:
        return out
    max_len = int(context_lens.max())
    if max_len == 0:
        return out
    num_heads, kv_elems = query.shape[1], key_cache.shape[2] * key_cache.shape[3]
    per_seq = max(num_heads, kv_elems) * max_len
    step = max(1, _SCORE_BUDGET // per_seq)
    for lo in range(0, num_seqs, step):
        hi = min(num_seqs, lo + step)
        seq_lens = context_lens[lo:hi]
        out[lo:hi] = _decode_chunk(
            query[lo:hi], key_cache, value_cache, block_tables[lo:hi], seq_lens, scale, max_len
        )
    return out


def _decode_chunk(query, key_cache, value_cache, block_tables, context_lens, scale, max_len):
    cdt = _compute_dtype(query.dtype)
    k = _gather_kv(key_cache, block_tables, max_len).to(cdt).transpose(1, 2)  # [n, KVH, L, D]
    v = _gather_kv(value_cache, block_tables, max_len).to(cdt).transpose(1, 2)
    pos = torch.arange(max_len, device=query.device)
    lens = context_lens.to(pos.device)
    visible = pos[None, :] < lens[:, None]  # [n, L]
    q = query.to(cdt).unsqueeze(2)  # [n, H, 1, D]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=visible[:, None, None, :], scale=scale, enable_gqa=True
    )
    out = torch.where(lens[:, None, None, None] > 0, out.nan_to_num(0.0), 0.0)  # len 0 -> zeros
    return out.squeeze(2).to(query.dtype)


@dataclass(frozen=True)
class _QuerySpan:
    """A run of query rows [start, start + q_len) whose last row sits at position seq_len - 1."""

    seq: int
    start: int
    q_len: int
    seq_len: int


def _query_spans(query_start_loc: list[int], seq_lens: list[int], num_heads: int) -> list[_QuerySpan]:
    """Split each sequence's query rows so one span's scores [q_len, seq_len] fit the budget.

    A tail span [a, b) of a sequence is itself a causal extend with q_len b - a and seq_len
    seq_len - (q_len - b): the position formula seq_len - q_len + i still holds.
    """
    spans = []
    for seq, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[seq], query_start_loc[seq + 1]
        rows = max(1, _SCORE_BUDGET // max(1, seq_len * num_heads))
        for a in range(start, end, rows):
            b = min(end, a + rows)
            spans.append(_QuerySpan(seq, a, b - a, seq_len - (end - b)))
    return spans


def _group_spans(spans: list[_QuerySpan], num_heads: int) -> list[list[_QuerySpan]]:
    """Greedy groups (longest queries first) whose padded scores fit the budget."""
    groups: list[list[_QuerySpan]] = []
    cur: list[_QuerySpan] = []
    for span in sorted(spans, key=lambda s: (-s.q_len, -s.seq_len)):
        trial = [*cur, span]
        cost = len(trial) * max(s.q_len for s in trial) * max(s.seq_len for s in trial) * num_heads
        if cur and cost > _SCORE_BUDGET:
            groups.append(cur)
            trial = [span]
        cur = trial
    if cur:
        groups.append(cur)
    return groups


def paged_extend_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of ragged new tokens over their cached prefix plus themselves.

    query [T, H, D] (sequences concatenated; query_start_loc int32 [S + 1]); seq_lens [S] count
    cached + new tokens; row i of sequence s sits at position seq_lens[s] - q_len_s + i and sees
    positions <= its own. max_query_len is accepted for signature parity and not needed here.
    """
    del max_query_len
    out = torch.zeros_like(query)
    num_heads = query.shape[1]
    spans = _query_spans(query_start_loc.tolist(), seq_lens.tolist(), num_heads)
    for group in _group_spans([s for s in spans if s.q_len > 0], num_heads):
        _extend_group(query, key_cache, value_cache, block_tables, group, scale, out)
    return out


def _extend_group(query, key_cache, value_cache, block_tables, group, scale, out):
    device, cdt = query.device, _compute_dtype(query.dtype)
    max_q, max_len = max(s.q_len for s in group), max(s.seq_len for s in group)

    def col(name: str) -> torch.Tensor:
        return torch.tensor([getattr(s, name) for s in group], device=device)

    seqs, starts, q_lens, lens = col("seq"), col("start"), col("q_len"), col("seq_len")
    rows = torch.arange(max_q, device=device)
    is_row = rows[None, :] < q_lens[:, None]  # [n, Qmax]
    tokens = torch.where(is_row, starts[:, None] + rows[None, :], 0)  # [n, Qmax]
    q = query[tokens].to(cdt).transpose(1, 2)  # [n, H, Qmax, D]
    tables = block_tables[seqs.to(block_tables.device)]
    k = _gather_kv(key_cache, tables, max_len).to(cdt).transpose(1, 2)  # [n, KVH, L, D]
    v = _gather_kv(value_cache, tables, max_len).to(cdt).transpose(1, 2)
    q_pos = (lens - q_lens)[:, None] + rows[None, :]  # [n, Qmax]
    k_pos = torch.arange(max_len, device=device)
    visible = k_pos[None, None, :] <= q_pos[:, :, None]  # [n, Qmax, L]; padded rows are discarded
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=scale, enable_gqa=True)
    o = o.transpose(1, 2)  # [n, Qmax, H, D]
    out[tokens[is_row]] = o[is_row].to(out.dtype)
