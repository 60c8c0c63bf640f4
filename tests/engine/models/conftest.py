"""Shared fixtures: tiny random HF checkpoints saved as safetensors, loaded through our loader."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from hf_tiny import build_hf_model, save_hf_model  # noqa: E402

from pagedinfer.engine.models import loader as loader_module  # noqa: E402


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if the loader gets as far as building (allocating) a model."""

    def forbidden(_architecture):
        raise AssertionError("model allocated before validation finished")

    monkeypatch.setattr(loader_module, "model_class", forbidden)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """variant -> (hf_model, folder); built lazily, once per module."""
    cache: dict[str, tuple] = {}

    def get(variant: str):
        if variant not in cache:
            model = build_hf_model(variant)
            folder = save_hf_model(model, tmp_path_factory.mktemp(variant))
            cache[variant] = (model, folder)
        return cache[variant]

    return get
