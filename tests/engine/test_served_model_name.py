"""The `model` name clients use is derived from the model URI unless given explicitly."""

import pytest

from pagedinfer.engine.config import EngineConfig


@pytest.mark.parametrize(
    ("uri", "served", "expected"),
    [
        ("builtin://smollm2-135m", None, "smollm2-135m"),
        ("hf://meta-llama/Llama-3.1-8B-Instruct@main", None, "meta-llama/Llama-3.1-8B-Instruct"),
        ("hf://Qwen/Qwen2-0.5B", None, "Qwen/Qwen2-0.5B"),
        ("/models/llama", None, "/models/llama"),
        ("builtin://smollm2-135m", "chat", "chat"),
    ],
)
def test_resolved_served_model_name(uri, served, expected):
    assert EngineConfig(model=uri, served_model_name=served).resolved_served_model_name == expected
