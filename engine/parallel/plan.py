"""Which slice of the model one tensor-parallel rank holds. Pure arithmetic: no torch.

Query heads, the MLP's intermediate columns and the vocabulary are split evenly over the ranks.
KV heads are split too while tp <= num_kv_heads; past that each KV head is replicated on
tp / num_kv_heads consecutive ranks (as vLLM does), so every rank still holds the KV heads its
query heads read. The vocabulary is padded up to a multiple of tp (padding rows are zero and
never looked up; their logits are cut off after the gather).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedinfer.engine.config import ModelConfig


class TensorParallelConfigError(ValueError):
    """The model's shape cannot be split over this many ranks (the message names the numbers)."""


@dataclass(frozen=True)
class WeightSlice:
    """Rows (dim 0) or columns (dim 1) [start, end) of a checkpoint tensor; `pad_to` rows in all
    (the vocabulary's last shard: zero rows past the real ones)."""

    dim: int
    start: int
    end: int
    pad_to: int | None = None


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `tp_size`: the ranges of the full model it holds."""

    config: ModelConfig  # the full model
    tp_size: int
    rank: int

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.tp_size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.tp_size)

    @property
    def head_start(self) -> int:
        return self.rank * self.num_heads

    @property
    def kv_head_start(self) -> int:
        replicas = max(1, self.tp_size // self.config.num_kv_heads)
        return (self.rank // replicas) * self.num_kv_heads

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.tp_size

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding / LM head shard (padded: the same on every rank)."""
        return -(-self.config.vocab_size // self.tp_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_size

    @property
    def vocab_end(self) -> int:
        """End of the real vocabulary rows of this rank (<= vocab_start + vocab_size)."""
        return min(self.config.vocab_size, self.vocab_start + self.vocab_size)

    def rank_config(self) -> ModelConfig:
        """The ModelConfig of this rank's modules: its heads, intermediate columns and vocab rows."""
        return dataclasses.replace(
            self.config,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
        )

    def weight_slice(self, name: str) -> WeightSlice | None:
        """The slice of a Hugging Face-named tensor this rank reads (None: all of it, replicated)."""
        d = self.config.head_dim
        parts = name.split(".")
        proj = parts[-2] if len(parts) >= 2 else ""
        if proj == "q_proj":
            return WeightSlice(0, self.head_start * d, (self.head_start + self.num_heads) * d)
        if proj in ("k_proj", "v_proj"):
            start = self.kv_head_start
            return WeightSlice(0, start * d, (start + self.num_kv_heads) * d)
        if proj == "o_proj":
            return WeightSlice(1, self.head_start * d, (self.head_start + self.num_heads) * d)
        inter, r = self.intermediate_size, self.rank
        if proj in ("gate_proj", "up_proj"):
            return WeightSlice(0, r * inter, (r + 1) * inter)
        if proj == "down_proj":
            return WeightSlice(1, r * inter, (r + 1) * inter)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return WeightSlice(0, self.vocab_start, self.vocab_end, pad_to=self.vocab_size)
        return None


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Raise TensorParallelConfigError when `tp_size` cannot split this model's heads or MLP."""
    if tp_size < 1:
        raise TensorParallelConfigError(f"tensor parallel size must be >= 1, got {tp_size}")
    heads, kv_heads, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    if heads % tp_size:
        raise TensorParallelConfigError(
            f"tensor parallel size {tp_size} does not divide the model's {heads} attention heads "
            f"({kv_heads} KV heads); use a size that divides {heads}"
        )
    if tp_size <= kv_heads and kv_heads % tp_size:
        raise TensorParallelConfigError(
            f"tensor parallel size {tp_size} does not divide the model's {kv_heads} KV heads"
        )
    if tp_size > kv_heads and tp_size % kv_heads:
        raise TensorParallelConfigError(
            f"tensor parallel size {tp_size} is larger than the model's {kv_heads} KV heads and not "
            "a multiple of it (each KV head must be replicated on the same number of ranks)"
        )
    if inter % tp_size:
        raise TensorParallelConfigError(
            f"tensor parallel size {tp_size} does not divide the model's intermediate size {inter}"
        )
