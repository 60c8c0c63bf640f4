"""Which checkpoint architectures map to which model class, and under which ModelConfig name."""

from __future__ import annotations

from pagedinfer.engine.models.llama import LlamaForCausalLM

# Hugging Face `architectures[0]` -> our architecture name.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

# GGUF `general.architecture` -> our architecture name (Mistral GGUFs say "llama").
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
}

# Our architecture name -> the class that runs it; all are Llama-shaped decoders.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The model class of an architecture name; KeyError-free: raises ValueError when unknown."""
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(MODEL_CLASSES)}")
    return MODEL_CLASSES[architecture]
