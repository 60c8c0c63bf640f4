"""GGUF checkpoints (llama.cpp): metadata, name mapping to Hugging Face names, dequantization.

Tensors are dequantized to fp32 with the `gguf` package (F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/
Q8_0 and the K-quants Q2_K..Q6_K) and then cast to the model dtype. llama.cpp stores the Q and K
projections of llama-arch models row-permuted for its interleaved RoPE; they are un-permuted
into Hugging Face's half-split layout here, so one rotary implementation serves both formats.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from pagedinfer.engine.config import ModelConfig
from pagedinfer.engine.models.errors import ModelLoadError, UnsupportedModelError
from pagedinfer.engine.models.gguf_file import GGUFFile, GGUFFormatError

Q = GGMLQuantizationType
SUPPORTED_QUANT_TYPES = frozenset(
    [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Not a weight: llama.cpp's per-frequency rope factors (Llama 3.1+), read into the ModelConfig.
ROPE_FREQS = "rope_freqs.weight"
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name, or None if it has no counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation: interleaved pairs back to half-split halves."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """One .gguf file: its metadata and tensors (by Hugging Face name), read without dequantizing."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(str(self.path), "GGUF file not found")
        try:
            self.file = GGUFFile(self.path)
        except (GGUFFormatError, OSError) as exc:
            raise ModelLoadError(str(self.path), f"not a readable GGUF file: {exc}") from exc
        self.metadata: dict[str, Any] = self.file.metadata
        self._tensors = self.file.tensors

    def field(self, key: str) -> Any:
        """The value of a metadata key, or None when absent."""
        return self.metadata.get(key)

    def rope_freq_factors(self) -> list[float] | None:
        """The values of `rope_freqs.weight`, or None when the file has none."""
        tensor = self._tensors.get(ROPE_FREQS)
        if tensor is None:
            return None
        return dequantize(tensor.data, tensor.tensor_type).reshape(-1).tolist()

    def gguf_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name -> shape in torch order (GGUF lists dimensions fastest-first)."""
        return {name: t.shape for name, t in self._tensors.items()}

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face name -> shape; raises for tensors with no counterpart or unsupported quant types."""
        shapes = {}
        for name, shape in self.gguf_shapes().items():
            if name == ROPE_FREQS:
                continue
            tensor_type = self._tensors[name].tensor_type
            if tensor_type not in SUPPORTED_QUANT_TYPES:
                supported = sorted(q.name for q in SUPPORTED_QUANT_TYPES)
                raise UnsupportedModelError(
                    str(self.path), f"tensor {name!r} has type {tensor_type.name}; supported: {supported}"
                )
            mapped = hf_name(name)
            if mapped is None:
                raise UnsupportedModelError(str(self.path), f"unexpected tensor {name!r}")
            shapes[mapped] = shape
        return shapes

    def iter_weights(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, fp32 CPU tensor) for every tensor, dequantized and un-permuted."""
        permuted = self.metadata.get("general.architecture") == "llama"
        for name, tensor in self._tensors.items():
            if name == ROPE_FREQS:
                continue
            mapped = hf_name(name)
            assert mapped is not None, name  # hf_shapes() validated the names
            array = dequantize(tensor.data, tensor.tensor_type).reshape(tensor.shape)
            if permuted and mapped.endswith("q_proj.weight"):
                array = unpermute_rope_rows(array, config.num_heads)
            elif permuted and mapped.endswith("k_proj.weight"):
                array = unpermute_rope_rows(array, config.num_kv_heads)
            array = np.ascontiguousarray(array, dtype=np.float32)
            # F32 tensors are read-only views of the file map: copy those before handing them out.
            yield mapped, torch.from_numpy(array if array.flags.writeable else array.copy())
