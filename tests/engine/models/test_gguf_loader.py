"""GGUF loading: name mapping, Q/K un-permutation, dequantization, metadata config, bad files.

Quantization is per block of 32 along a row, so it commutes with llama.cpp's Q/K row permutation:
an HF model whose weights are replaced by their qtype round trip must match our model loaded
from the qtype GGUF to fp32 tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_tiny import Q, quantize_hf_model_, write_gguf
from hf_tiny import build_hf_model, hf_logits
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedinfer._native import BlockManager
from pagedinfer.engine.models.errors import ModelLoadError, UnsupportedModelError
from pagedinfer.engine.models.gguf_file import GGUFFile
from pagedinfer.engine.models.layers.rotary import compute_inv_freq
from pagedinfer.engine.models.loader import load_model
from pagedinfer.engine.models.testing import PagedRunner

FP32_ATOL = 1e-4
TOKENS = [5, 77, 300, 12, 9, 250, 31, 8, 100, 101, 102, 3, 4, 5, 6, 7, 200, 201]


def _our_logits(path) -> torch.Tensor:
    loaded = load_model(str(path), "cpu", torch.float32)
    assert loaded.tokenizer is None  # these tiny files carry no vocabulary
    runner = PagedRunner(loaded.model, BlockManager(8, 16, True), 8, 16)
    runner.add(0, TOKENS)
    return runner.step([0], [len(TOKENS)])


@pytest.mark.parametrize(
    "qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16], ids=lambda q: q.name
)
def test_llama_gguf_matches_hf(tmp_path, qtype):
    hf = build_hf_model("llama-gqa")
    quantize_hf_model_(hf, qtype)
    path = write_gguf(tmp_path / "tiny.gguf", hf, "llama", qtype)
    assert {t.tensor_type for t in GGUFFile(path).tensors.values()} == {qtype, Q.F32}
    diff = (_our_logits(path) - hf_logits(hf, TOKENS)).abs().max().item()
    assert diff <= FP32_ATOL, diff


def test_qwen2_gguf_with_biases_and_tied_embeddings(tmp_path):
    hf = build_hf_model("qwen2", tie_word_embeddings=True)
    path = write_gguf(tmp_path / "qwen.gguf", hf, "qwen2", Q.Q8_0)
    quantize_hf_model_(hf, Q.Q8_0)
    diff = (_our_logits(path) - hf_logits(hf, TOKENS)).abs().max().item()
    assert diff <= FP32_ATOL, diff


def test_metadata_config(tmp_path):
    hf = build_hf_model("llama-mha")
    path = write_gguf(tmp_path / "tiny.gguf", hf)
    config = load_model(str(path), "cpu", torch.float32).model_config
    assert (config.architecture, config.num_heads, config.num_kv_heads, config.head_dim) == (
        "llama",
        4,
        4,
        16,
    )
    assert config.tie_word_embeddings and config.max_position_embeddings == 512


def test_unsupported_quant_type_is_named(tmp_path, no_allocation):
    hf = build_hf_model("llama-gqa")
    path = write_gguf(
        tmp_path / "bad.gguf", hf, extra={"blk.0.attn_extra.weight": np.zeros((4, 8), np.int32)}
    )
    with pytest.raises(
        UnsupportedModelError, match=r"bad.gguf: tensor 'blk.0.attn_extra.weight' has type I32"
    ):
        load_model(str(path), "cpu", torch.float32)


def test_unknown_tensor_is_rejected(tmp_path, no_allocation):
    hf = build_hf_model("llama-gqa")
    odd = write_gguf(tmp_path / "odd.gguf", hf, extra={"blk.0.attn_sinks.weight": np.zeros(4, np.float32)})
    with pytest.raises(UnsupportedModelError, match="unexpected tensor 'blk.0.attn_sinks.weight'"):
        load_model(str(odd), "cpu", torch.float32)


def test_llama31_rope_freqs_tensor_matches_hf_llama3_scaling(tmp_path):
    """llama.cpp stores Llama-3.1 rope scaling as per-frequency factors in rope_freqs.weight."""
    hf = build_hf_model("llama3-rope")
    cfg = hf.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    plain = compute_inv_freq(head_dim, cfg.rope_parameters["rope_theta"], None)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    factors = (plain / scaled).numpy().astype(np.float32)
    assert (factors > 1.0).any()  # the scaling is not a no-op at this size
    path = write_gguf(tmp_path / "l31.gguf", hf, extra={"rope_freqs.weight": factors})
    diff = (_our_logits(path) - hf_logits(hf, TOKENS)).abs().max().item()
    assert diff <= FP32_ATOL, diff
    bad = write_gguf(tmp_path / "bad.gguf", hf, extra={"rope_freqs.weight": np.ones(3, np.float32)})
    with pytest.raises(ModelLoadError, match="rope_freqs.weight has 3 values, expected 8"):
        load_model(str(bad), "cpu", torch.float32)


def test_unsupported_architecture(tmp_path, no_allocation):
    hf = build_hf_model("llama-gqa")
    path = write_gguf(tmp_path / "phi.gguf", hf, arch="phi3")
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'phi3'"):
        load_model(str(path), "cpu", torch.float32)


def test_truncated_file(tmp_path, no_allocation):
    hf = build_hf_model("llama-gqa")
    path = write_gguf(tmp_path / "cut.gguf", hf)
    data = path.read_bytes()
    for keep in (len(data) - 100, 200, 10):
        path.write_bytes(data[:keep])
        with pytest.raises(ModelLoadError, match="cut.gguf: not a readable GGUF file"):
            load_model(str(path), "cpu", torch.float32)
