"""ModelConfig from a Hugging Face config.json or from GGUF metadata, validated.

Both paths raise `UnsupportedModelError` / `ModelLoadError` naming the file and the problem, and
touch no device memory.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pagedinfer.engine.config import ModelConfig, RopeScaling
from pagedinfer.engine.models.errors import ModelLoadError, UnsupportedModelError
from pagedinfer.engine.models.layers.rotary import SUPPORTED_ROPE_TYPES
from pagedinfer.engine.models.registry import GGUF_ARCHITECTURES, HF_ARCHITECTURES

logger = logging.getLogger(__name__)

_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _unique(ids: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


def hf_architecture(config: Mapping[str, Any], source: str) -> str:
    """Our architecture name from `architectures` (or `model_type`) of a config.json."""
    names = list(config.get("architectures") or [])
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    if not names and config.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[config["model_type"]]
    raise UnsupportedModelError(
        source,
        f"unsupported architecture {names or config.get('model_type')!r}; supported: {sorted(HF_ARCHITECTURES)}",
    )


def hf_rope(config: Mapping[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers v5 `rope_parameters` or v4 `rope_theta`/`rope_scaling`."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    spec = {**scaling, **params}
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            source, f"rope type {rope_type!r} is not supported ({SUPPORTED_ROPE_TYPES})"
        )
    if rope_type == "default":
        return theta, None
    factor = float(spec.get("factor", 1.0))
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=factor)
    return theta, RopeScaling(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(spec.get("low_freq_factor", 1.0)),
        high_freq_factor=float(spec.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(spec.get("original_max_position_embeddings", 8192)),
    )


def _check_hf_features(config: Mapping[str, Any], architecture: str, source: str) -> None:
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise UnsupportedModelError(source, f"quantized checkpoints ({method}) are not supported")
    act = config.get("hidden_act", config.get("hidden_activation", "silu"))
    if act != "silu":
        raise UnsupportedModelError(source, f"activation {act!r} is not supported (SwiGLU needs 'silu')")
    if config.get("mlp_bias"):
        raise UnsupportedModelError(source, "mlp_bias=true is not supported")
    if architecture != "qwen2" and config.get("attention_bias"):
        raise UnsupportedModelError(source, "attention_bias=true (with an o_proj bias) is not supported")
    if float(config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError(source, "partial rotary embeddings are not supported")


def _max_positions(config: Mapping[str, Any], architecture: str, source: str) -> int:
    """max_position_embeddings, capped at an active sliding window: attention here is global, which
    equals windowed attention only while sequences stay within the window."""
    limit = int(config.get("max_position_embeddings", 2048))
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", architecture == "mistral") and int(window) < limit:
        logger.warning("%s: sliding_window=%s: max_position_embeddings capped from %d", source, window, limit)
        return int(window)
    return limit


def model_config_from_hf(
    config: Mapping[str, Any], source: str, generation_config: Mapping[str, Any] | None = None
) -> ModelConfig:
    """ModelConfig from a parsed config.json (and optional generation_config.json)."""
    architecture = hf_architecture(config, source)
    _check_hf_features(config, architecture, source)
    try:
        num_heads = int(config["num_attention_heads"])
        hidden_size = int(config["hidden_size"])
        rope_theta, rope_scaling = hf_rope(config, source)
        eos = _as_ids(config.get("eos_token_id")) + _as_ids((generation_config or {}).get("eos_token_id"))
        model_config = ModelConfig(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            max_position_embeddings=_max_positions(config, architecture, source),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=architecture == "qwen2",
            bos_token_id=None if config.get("bos_token_id") is None else int(config["bos_token_id"]),
            eos_token_ids=_unique(eos),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(source, f"invalid config: {exc!r}") from exc
    validate_model_config(model_config, source)
    return model_config


def validate_model_config(config: ModelConfig, source: str) -> None:
    """Positive sizes, heads that divide, an even head_dim (rotary halves)."""
    sizes = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_layers": config.num_layers,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
    }
    bad = {name: value for name, value in sizes.items() if value <= 0}
    if bad:
        raise ModelLoadError(source, f"config sizes must be positive, got {bad}")
    if config.num_heads % config.num_kv_heads:
        raise ModelLoadError(
            source, f"num_heads {config.num_heads} is not a multiple of num_kv_heads {config.num_kv_heads}"
        )
    if config.head_dim % 2:
        raise ModelLoadError(source, f"head_dim {config.head_dim} must be even for rotary embeddings")


def _gguf_rope(
    meta: Mapping[str, Any], prefix: str, source: str, freq_factors: Sequence[float] | None
) -> RopeScaling | None:
    kind = meta.get(f"{prefix}.rope.scaling.type", "none")
    if freq_factors is not None:  # Llama 3.1+: llama3 scaling baked into per-frequency factors
        if kind not in ("none", "llama3"):
            raise UnsupportedModelError(source, f"rope_freqs.weight together with rope scaling {kind!r}")
        return RopeScaling(
            rope_type="freq_factors", factor=1.0, freq_factors=tuple(float(f) for f in freq_factors)
        )
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=float(meta[f"{prefix}.rope.scaling.factor"]))
    raise UnsupportedModelError(source, f"GGUF rope scaling {kind!r} is not supported")


def model_config_from_gguf(
    meta: Mapping[str, Any],
    tensor_shapes: Mapping[str, tuple[int, ...]],
    source: str,
    rope_freq_factors: Sequence[float] | None = None,
) -> ModelConfig:
    """ModelConfig from GGUF metadata (key -> value), tensor shapes (name -> torch-order shape) and
    the values of the optional `rope_freqs.weight` tensor."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            source, f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    try:
        hidden = int(meta[f"{arch}.embedding_length"])
        num_heads = int(meta[f"{arch}.attention.head_count"])
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
        rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise UnsupportedModelError(source, f"partial rotary (rope dims {rope_dim} of {head_dim})")
        if rope_freq_factors is not None and len(rope_freq_factors) != head_dim // 2:
            raise ModelLoadError(
                source, f"rope_freqs.weight has {len(rope_freq_factors)} values, expected {head_dim // 2}"
            )
        vocab = int(meta.get(f"{arch}.vocab_size", tensor_shapes["token_embd.weight"][0]))
        eos = _as_ids(meta.get("tokenizer.ggml.eos_token_id")) + _as_ids(
            meta.get("tokenizer.ggml.eot_token_id")
        )
        config = ModelConfig(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
            num_layers=int(meta[f"{arch}.block_count"]),
            num_heads=num_heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            max_position_embeddings=int(meta[f"{arch}.context_length"]),
            rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope(meta, arch, source, rope_freq_factors),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            attention_bias="blk.0.attn_q.bias" in tensor_shapes,
            bos_token_id=None
            if meta.get("tokenizer.ggml.bos_token_id") is None
            else int(meta["tokenizer.ggml.bos_token_id"]),
            eos_token_ids=_unique(eos),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(source, f"invalid GGUF metadata: missing or bad {exc!r}") from exc
    validate_model_config(config, source)
    return config
