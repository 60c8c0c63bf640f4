"""A draft made of a subset of the target's own layers (self-speculation, early exit).

`SpeculativeConfig.draft_model = "self:layers=0-7,29"` drafts with the target's embedding,
layers 0..7 and 29, final norm and LM head: no extra weights, only a small KV cache of its own.
It always shares the target's tokenizer. Acceptance is lower than with a trained draft, but it is
real acceptance on real text, which random-weight pairs cannot give.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedinfer.engine.worker.attn_metadata import AttentionMetadata

SELF_PREFIX = "self:"


def parse_layer_ids(spec: str, num_layers: int) -> list[int]:
    """'self:layers=0-7,29' or 'self:first=8' -> sorted unique layer ids; ValueError when bad."""
    body = spec[len(SELF_PREFIX) :] if spec.startswith(SELF_PREFIX) else spec
    key, _, value = body.partition("=")
    try:
        if key == "first":
            ids = list(range(int(value)))
        elif key == "layers":
            ids = []
            for part in value.split(","):
                lo, _, hi = part.partition("-")
                ids.extend(range(int(lo), int(hi or lo) + 1))
        else:
            raise ValueError(f"unknown key {key!r}")
    except ValueError as exc:
        raise ValueError(
            f"bad self-draft spec {spec!r} ({exc}); expected 'self:first=N' or 'self:layers=0-7,29'"
        ) from exc
    ids = sorted(set(ids))
    if not ids or ids[0] < 0 or ids[-1] >= num_layers or len(ids) >= num_layers:
        raise ValueError(f"self-draft {spec!r} must pick a proper subset of the target's {num_layers} layers")
    return ids


class LayerSubsetDraft:
    """Runs the target's embedding, the chosen decoder layers, final norm and LM head.

    Same call interface as `LlamaForCausalLM`; KV caches are one pair per *chosen* layer.
    """

    def __init__(self, target, layer_ids: list[int]) -> None:
        self.target = target
        self.layer_ids = layer_ids
        self.layers = [target.model.layers[i] for i in layer_ids]
        self.config = dataclasses.replace(target.config, num_layers=len(layer_ids))

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} draft layers")
        hidden = self.target.model.embed_tokens(input_ids)  # [T, hidden]
        rope = self.target.rotary_emb(positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, kv_cache, attn_metadata)
        hidden, _ = self.target.model.norm(hidden, residual)
        return hidden  # [T, hidden]

    def compute_logits(
        self, hidden: torch.Tensor, upcast: bool = True, backend: str | None = None
    ) -> torch.Tensor:
        return self.target.compute_logits(hidden, upcast, backend)
