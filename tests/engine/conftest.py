"""Engine-wide fixtures: a tiny random Llama checkpoint on disk (HF format, no tokenizer)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A 2-layer GQA Llama (vocab 256) saved with transformers' save_pretrained."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # spread the logits so greedy choices are not near-ties
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.2) if name.endswith("norm.weight") else param.normal_(0.0, 0.15)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder, safe_serialization=True)
    return folder
