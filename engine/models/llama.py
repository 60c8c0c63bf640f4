"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, SmolLM2) over a paged KV cache.

One forward pass runs a flattened ragged batch: the new tokens of every sequence concatenated
([T] ids with per-token positions), no padding. Prefill chunks, decode tokens and speculative
verification tokens share the step; `AttentionMetadata` says where each token's K/V live.

Weights use Hugging Face names at the loading boundary (`load_weights`); inside, q/k/v and
gate/up are fused into one GEMM each. Parameters are created uninitialized on the target device
(built on the meta device first), so a model is only meaningful after `load_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedinfer.engine.config import ModelConfig
from pagedinfer.engine.models.layers.attention import PagedAttention
from pagedinfer.engine.models.layers.mlp import SwiGLUMLP
from pagedinfer.engine.models.layers.rms_norm import RMSNorm
from pagedinfer.engine.models.layers.rotary import RotaryEmbedding
from pagedinfer.engine.worker.attn_metadata import AttentionMetadata
from pagedinfer.kernels import fused_ops
from pagedinfer.kernels.linear_ops import Prenormed, linear, linear_residual, norm_linear

# Checkpoint names that carry no weights of ours (old HF checkpoints saved the rope table).
IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h)), residual adds fused into the norms
    (or, at 2-16 bf16 tokens on the GPU, 2-64 for a small model, into o_proj's and down's epilogues)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = PagedAttention(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            bias=config.attention_bias,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor | Prenormed,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        next_norm_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | Prenormed, torch.Tensor | None]:
        # hidden, residual [T, hidden]; returns the block output and the running residual. Each
        # norm runs with the projection after it (one kernel at one token a step: norm_linear).
        # At 2-16 tokens (2-64, small models) o_proj and down may carry the next norm in their epilogues instead
        # (linear_residual): then hidden is a Prenormed with the residual inside it, and residual
        # None. next_norm_weight is the next layer's input norm (None: leave the norm to the caller).
        backend = attn_metadata.backend  # the fused elementwise kernels follow the attention backend
        attn, mlp = self.self_attn, self.mlp
        norm = self.input_layernorm
        qkv, residual = norm_linear(
            hidden, residual, norm.weight, norm.eps, attn.qkv_proj.weight, attn.qkv_proj.bias, backend
        )
        heads = attn.attend_heads(qkv, rope, kv_cache, attn_metadata)
        norm = self.post_attention_layernorm
        hidden, residual = linear_residual(heads, attn.o_proj.weight, residual, norm.weight, backend)
        gate_up, residual = norm_linear(
            hidden, residual, norm.weight, norm.eps, mlp.gate_up_proj.weight, None, backend
        )
        act = fused_ops.silu_mul(gate_up, backend=backend)
        return linear_residual(act, mlp.down_proj.weight, residual, next_norm_weight, backend)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (Hugging Face's `model.*` submodule)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # An explicit (empty) weight skips nn.Embedding's normal_ init, which is slow on meta.
        embedding = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus its LM head. `forward` returns final hidden states, `compute_logits` logits."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.model = LlamaModel(config)
            self.lm_head = (
                None
                if config.tie_word_embeddings
                else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            )
        self.to(dtype).to_empty(device=device)  # one allocation, in the final dtype
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, device)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64; one (key_cache, value_cache) per layer -> hidden [T, hidden]."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        hidden = self.model.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary_emb(positions)  # (cos, sin) [T, D/2], shared by every layer
        residual = None
        layers = self.model.layers
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            # The last layer leaves the final norm (a kernel of its own) to the model.
            next_norm = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else None
            hidden, residual = layer(hidden, residual, rope, kv_cache, attn_metadata, next_norm)
        hidden, _ = self.model.norm(hidden, residual, backend=attn_metadata.backend)
        return hidden

    def compute_logits(
        self, hidden: torch.Tensor, upcast: bool = True, backend: str | None = None
    ) -> torch.Tensor:
        """hidden [N, hidden] (only the rows that need logits) -> logits [N, vocab] float32.

        upcast=False keeps the GEMM's dtype (no [N, vocab] fp32 copy): enough for plain greedy
        batches (engine.sample.sampler.is_plain_greedy), whose argmax is the same either way.
        backend "reference" keeps torch's GEMM (as the layers do under a forced reference backend).
        """
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight, None, backend)  # [N, vocab] in the model dtype
        return logits.float() if upcast else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters; every parameter must be set.

        Shapes were validated against `hf_weight_shapes` by the loader before any allocation;
        the checks here guard direct callers.
        """
        load_hf_weights(self, weights, self.config)


def load_hf_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
) -> None:
    """`LlamaForCausalLM.load_weights` for the modules of `config` (a tensor-parallel rank passes
    its own config: its heads, intermediate columns and vocabulary rows)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith(IGNORED_WEIGHT_SUFFIXES) or (name == "lm_head.weight" and model.lm_head is None):
            continue
        param_name, rows = fused_target(name, config)
        if param_name not in params:
            raise ValueError(f"unexpected weight {name!r} for {config.architecture}")
        target = params[param_name].data if rows is None else params[param_name].data[rows[0] : rows[1]]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(hf_weight_shapes(config)) - loaded)
    if missing:
        raise ValueError(
            f"weights missing from the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )


# Hugging Face projection name -> (our fused parameter, which block of its output rows).
_FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def fused_target(name: str, config: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    """HF name -> (our parameter name, (row_start, row_end) inside it, or None for all of it)."""
    parts = name.split(".")
    if len(parts) < 2 or parts[-2] not in _FUSED:
        return name, None
    proj = parts[-2]
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    rows = {
        "q_proj": (0, q_size),
        "k_proj": (q_size, q_size + kv_size),
        "v_proj": (q_size + kv_size, q_size + 2 * kv_size),
        "gate_proj": (0, inter),
        "up_proj": (inter, 2 * inter),
    }[proj]
    return ".".join([*parts[:-2], _FUSED[proj], parts[-1]]), rows


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must provide, by Hugging Face name, with its shape."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (q_size, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_size, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_size, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_size)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_size,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    return shapes
