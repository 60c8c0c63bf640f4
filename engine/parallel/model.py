"""The Llama-family decoder of one tensor-parallel rank (Megatron-LM, Shoeybi et al., 2019).

Built from the rank's ModelConfig (plan.ShardPlan.rank_config: its query/KV heads, its
intermediate columns, its vocabulary rows), so every module and the weight loading are the
plain model's. What differs is the forward:
- qkv and gate/up are column-parallel: the replicated input times this rank's output rows;
- o_proj and down are row-parallel: this rank's heads / columns give a partial sum, one
  all-reduce each per layer makes it the full block output (before the residual add);
- the embedding looks up only this rank's vocabulary rows (zeros elsewhere), one all-reduce;
- the LM head computes this rank's vocabulary columns, one all-gather gives every logit.
Every rank computes the same residual stream; attention and the KV cache hold only its heads.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedinfer.engine.config import ModelConfig
from pagedinfer.engine.models.llama import LlamaForCausalLM, load_hf_weights
from pagedinfer.engine.parallel.group import TPGroup
from pagedinfer.engine.parallel.plan import ShardPlan
from pagedinfer.engine.worker.attn_metadata import AttentionMetadata
from pagedinfer.kernels import fused_ops
from pagedinfer.kernels.linear_ops import linear, norm_linear


class TensorParallelLlama(LlamaForCausalLM):
    """One rank's shard; `config` is the full model's (what the runner and sampler see)."""

    def __init__(
        self, plan: ShardPlan, group: TPGroup, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__(plan.rank_config(), dtype, device)
        self.rank_config: ModelConfig = self.config
        self.config = plan.config
        self.plan = plan
        self.group = group

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T]; this rank's KV caches -> hidden [T, hidden] (the same on every rank)."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        backend = attn_metadata.backend
        hidden = self._embed(input_ids)  # [T, hidden]
        rope = self.rotary_emb(positions)  # (cos, sin) [T, D/2]
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            qkv, residual = norm_linear(
                hidden, residual, norm.weight, norm.eps, attn.qkv_proj.weight, attn.qkv_proj.bias, backend
            )  # [T, (H_r + 2 KVH_r) D]
            heads = attn.attend_heads(qkv, rope, kv_cache, attn_metadata)  # [T, H_r D]
            out = self.group.all_reduce(linear(heads, attn.o_proj.weight, None, backend))  # [T, hidden]
            norm = layer.post_attention_layernorm
            gate_up, residual = norm_linear(
                out, residual, norm.weight, norm.eps, mlp.gate_up_proj.weight, None, backend
            )  # [T, 2 I_r]
            act = fused_ops.silu_mul(gate_up, backend=backend)  # [T, I_r]
            hidden = self.group.all_reduce(linear(act, mlp.down_proj.weight, None, backend))
        hidden, _ = self.model.norm(hidden, residual, backend=backend)
        return hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: rows outside [vocab_start, vocab_end) are zero here and
        come from their rank in the all-reduce."""
        start = self.plan.vocab_start
        local = input_ids - start
        is_mine = (local >= 0) & (local < self.plan.vocab_end - start)  # [T]
        rows = self.model.embed_tokens(local.clamp(0, self.plan.vocab_size - 1))  # [T, hidden]
        rows = rows * is_mine[:, None].to(rows.dtype)
        return self.group.all_reduce(rows)

    def compute_logits(
        self, hidden: torch.Tensor, upcast: bool = True, backend: str | None = None
    ) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab]: this rank's columns, gathered from every rank."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        local = linear(hidden, weight, None, backend)  # [N, V_r]
        logits = self.group.all_gather_rows(local)[:, : self.config.vocab_size]  # [N, vocab]
        return logits.float() if upcast else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """This rank's slices (weights.py), by Hugging Face name, into its parameters."""
        load_hf_weights(self, weights, self.rank_config)
