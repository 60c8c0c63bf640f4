"""Workload (b) of bench/speculative.py: a Llama-3-8B-shaped random target with a draft that agrees.

Two independently random models never agree, so the pair is constructed: the draft is the
target's own first L layers plus final norm and LM head (`self:first=L`: shared weights, its own
KV cache), and in the target's later layers o_proj and down_proj are multiplied by a factor s,
so those layers add only a small perturbation to the residual stream the draft also computes.
s is found by bisection such that teacher-forced greedy agreement (draft argmax == target argmax
on a random token sequence) is about `target_agreement`; alpha in the benchmark is then measured
on the engine's own generated text, and c is measured, not derived.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from pagedinfer.engine.config import ModelConfig
from pagedinfer.engine.models.llama import LlamaForCausalLM
from pagedinfer.engine.models.shapes import LLAMA3_8B
from pagedinfer.engine.spec_decode.self_draft import LayerSubsetDraft
from pagedinfer.engine.worker.attn_metadata import AttentionMetadata
from pagedinfer.engine.worker.kv_cache import allocate_kv_caches

# Same construction at toy size, for a CPU smoke run of the benchmark code.
SMOKE = replace(
    LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=16,
)  # fmt: skip


@dataclass
class PairConstruction:
    """What was built, for the JSON and NOTES."""

    target_shape: str
    draft: str  # the self-draft spec
    num_draft_layers: int
    later_layer_scale: float  # s: o_proj / down_proj of layers >= L multiplied by it
    target_agreement: float
    teacher_forced_agreement: float  # at the chosen s
    weight_init: str = "normal(0, 0.02); norm weights normal(1, 0.02); seed 0"


def random_model(mc: ModelConfig, dtype: torch.dtype, device: str, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(mc, dtype, device)
    model.requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.02) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    return model.eval()


def _scale_later_layers(model: LlamaForCausalLM, first: int, factor: float) -> None:
    with torch.no_grad():
        for layer in model.model.layers[first:]:
            layer.self_attn.o_proj.weight.mul_(factor)
            layer.mlp.down_proj.weight.mul_(factor)


@torch.inference_mode()
def _greedy_rows(model, token_ids: torch.Tensor, num_layers: int, backend: str | None) -> torch.Tensor:
    """Teacher-forced argmax [T] of `model` over one sequence, on a throwaway cache."""
    num_tokens, block_size = token_ids.shape[0], 16
    num_blocks = -(-num_tokens // block_size)
    device = token_ids.device
    caches = allocate_kv_caches(model.config, num_blocks, block_size, device, model.dtype)[:num_layers]
    positions = torch.arange(num_tokens, device=device)
    md = AttentionMetadata(
        slot_mapping=positions,
        positions=positions,
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        logits_indices=positions,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        is_pure_decode=False,
        backend=backend,
    )
    hidden = model(token_ids, positions, caches, md)  # [T, hidden]
    return model.compute_logits(hidden).argmax(dim=-1)  # [T]


def build_pair(
    mc: ModelConfig,
    num_draft_layers: int,
    target_agreement: float,
    device: str,
    dtype: torch.dtype,
    backend: str | None = None,
) -> tuple[LlamaForCausalLM, PairConstruction]:
    """The target (later layers scaled) and how it was built; draft = `self:first=L` of it."""
    model = random_model(mc, dtype, device)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, mc.vocab_size, (512,), generator=gen).to(device)  # [T]
    draft = LayerSubsetDraft(model, list(range(num_draft_layers)))
    draft_rows = _greedy_rows(draft, tokens, num_draft_layers, backend)
    lo, hi = math.log(1e-4), 0.0  # log s: agreement falls as s grows
    scale, best = 1.0, (2.0, 1.0, 0.0)  # (|agreement - target|, s, agreement)
    for _ in range(12):
        mid = (lo + hi) / 2
        _scale_later_layers(model, num_draft_layers, math.exp(mid) / scale)
        scale = math.exp(mid)
        agreement = float((_greedy_rows(model, tokens, mc.num_layers, backend) == draft_rows).float().mean())
        best = min(best, (abs(agreement - target_agreement), scale, agreement))
        lo, hi = (mid, hi) if agreement > target_agreement else (lo, mid)
    _scale_later_layers(model, num_draft_layers, best[1] / scale)
    construction = PairConstruction(
        target_shape=(
            f"hidden {mc.hidden_size}, intermediate {mc.intermediate_size}, {mc.num_layers} layers, "
            f"{mc.num_heads}/{mc.num_kv_heads} heads, vocab {mc.vocab_size}, random {dtype}"
        ),
        draft=f"self:first={num_draft_layers}",
        num_draft_layers=num_draft_layers,
        later_layer_scale=round(best[1], 6),
        target_agreement=target_agreement,
        teacher_forced_agreement=round(best[2], 4),
    )
    return model, construction
