"""Write tiny GGUF files from Hugging Face models the way llama.cpp's converter does."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType

_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_GLOBAL["lm_head.weight"] = "output.weight"


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


def permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (half-split -> interleaved pairs)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def roundtrip(w: np.ndarray, qtype: Q) -> np.ndarray:
    """The fp32 weights a reader gets back after storing w as qtype."""
    if qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)


def quantize_hf_model_(model, qtype: Q) -> None:
    """Replace every 2-D weight by its qtype round trip, so HF and a qtype GGUF hold equal weights."""
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.dim() == 2:
                param.copy_(torch.from_numpy(roundtrip(param.numpy(), qtype)))


def write_gguf(path: Path, model, arch: str = "llama", qtype: Q = Q.F32, extra=None) -> Path:
    """GGUF of an HF Llama/Qwen2 model: 2-D weights in qtype, norms and biases in F32."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    for name, tensor in (extra or {}).items():
        writer.add_tensor(name, tensor)
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = param.float().numpy().copy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = permute(w, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = permute(w, cfg.num_key_value_heads)
        if w.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(gguf_name(name), w)
        elif qtype == Q.F16:
            writer.add_tensor(gguf_name(name), w.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
