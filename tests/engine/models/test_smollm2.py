"""The embedded model end to end: builtin://smollm2-135m greedy output equals transformers'.

transformers loads the same GGUF (dequantized to fp32 by its own code); our loader dequantizes
with the gguf package. Five chat prompts run through our model as one batch (prefill together,
then batched decode over the native block manager), 48 new tokens each, and must be token-for-
token identical to transformers' greedy generate run one prompt at a time.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from pagedinfer._native import BlockManager
from pagedinfer.engine.models.builtin import BUILTIN_MODELS
from pagedinfer.engine.models.loader import load_model
from pagedinfer.engine.models.testing import PagedRunner

MAX_NEW_TOKENS = 48
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish and German.",
]


def _gguf_path() -> Path:
    entry = BUILTIN_MODELS["smollm2-135m"]
    spec = importlib.util.find_spec(entry.package)
    return Path(next(iter(spec.submodule_search_locations))) / entry.filename


@pytest.fixture(scope="module")
def ours():
    return load_model("builtin://smollm2-135m", "cpu", torch.float32)


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    path = _gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def test_builtin_config_and_tokenizer(ours):
    config = ours.model_config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.hidden_size) == (30, 9, 3, 576)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0 and config.vocab_size == 49152
    assert ours.tokenizer.bos_token_id == 1 and ours.tokenizer.stop_token_ids == (2,)
    assert sum(p.numel() for p in ours.model.parameters()) == 134_515_008
    assert ours.source_path == _gguf_path()


def test_greedy_chat_matches_transformers_token_for_token(ours, hf_model):
    tokenizer = ours.tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    runner = PagedRunner(ours.model, BlockManager(128, 16, True), 128, 16)
    outputs = runner.generate(prompts, MAX_NEW_TOKENS, stop_token_ids=tokenizer.stop_token_ids)
    with torch.inference_mode():
        for prompt, got in zip(prompts, outputs, strict=True):
            ids = torch.tensor([prompt])
            out = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS, do_sample=False
            )
            expected = out[0, len(prompt) :].tolist()
            assert got == expected, f"{tokenizer.decode(got)!r} != {tokenizer.decode(expected)!r}"
    assert "Paris" in tokenizer.decode(outputs[0])
    assert sum(len(o) for o in outputs) > 3 * MAX_NEW_TOKENS  # real continuations, not early stops
