"""Grouped-query self-attention over the paged KV cache.

qkv projection (one fused GEMM) -> rotary + write the new K/V into the cache (one fused kernel)
-> paged attention
(the decode kernel when every sequence brings exactly one token, else the extend kernel) -> o_proj.
Heads here are the heads of this rank: tensor parallelism divides num_heads and num_kv_heads.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedinfer.engine.worker.attn_metadata import AttentionMetadata
from pagedinfer.kernels import fused_ops, ops
from pagedinfer.kernels.linear_ops import linear


class PagedAttention(nn.Module):
    """Self-attention of one decoder layer; `qkv_proj.weight` rows are [q; k; v]."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        # x [T, hidden]; rope (cos, sin) [T, D/2]; caches [num_blocks, block_size, KVH, D]
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias, attn_metadata.backend)
        return self.attend(qkv, rope, kv_cache, attn_metadata)

    def attend(
        self,
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Everything after the qkv projection: qkv [T, (H + 2 KVH) D] -> [T, hidden]."""
        heads = self.attend_heads(qkv, rope, kv_cache, attn_metadata)
        return linear(heads, self.o_proj.weight, None, attn_metadata.backend)  # [T, hidden]

    def attend_heads(
        self,
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`attend` up to o_proj (which the layer may run with the next norm in its epilogue):
        qkv [T, (H + 2 KVH) D] -> the heads' outputs [T, H * D]."""
        key_cache, value_cache = kv_cache
        # Rotates q and k; the new K/V go into the cache first, attention then reads only the cache.
        q = fused_ops.rotary_cache_write(
            qkv, *rope, key_cache, value_cache, attn_metadata.slot_mapping, backend=attn_metadata.backend
        )  # [T, H, D]
        out = self._attend(q, key_cache, value_cache, attn_metadata)  # [T, H, D]
        return out.reshape(qkv.shape[0], self.q_size)

    def _attend(self, q, key_cache, value_cache, md: AttentionMetadata) -> torch.Tensor:
        if md.is_pure_decode:
            bound = md.max_seq_len if md.max_seq_len_exact else None
            return ops.paged_decode_attention(
                q,
                key_cache,
                value_cache,
                md.block_tables,
                md.seq_lens,
                self.scale,
                backend=md.backend,
                max_context_len=bound,
            )
        return ops.paged_extend_attention(
            q,
            key_cache,
            value_cache,
            md.block_tables,
            md.query_start_loc,
            md.seq_lens,
            self.scale,
            max_query_len=md.max_query_len,
            backend=md.backend,
        )
