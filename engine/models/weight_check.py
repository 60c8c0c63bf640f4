"""Checks a checkpoint's tensor names and shapes against the config, before anything is allocated."""

from __future__ import annotations

from collections.abc import Mapping

from pagedinfer.engine.config import ModelConfig
from pagedinfer.engine.models.errors import ModelLoadError
from pagedinfer.engine.models.llama import IGNORED_WEIGHT_SUFFIXES, hf_weight_shapes


def check_weight_shapes(
    found: Mapping[str, tuple[int, ...]],
    config: ModelConfig,
    source: str,
    where: Mapping[str, str] | None = None,
) -> None:
    """`found` maps Hugging Face names to shapes; every expected tensor must be there with its shape.

    `where` optionally names the file holding each tensor, for the error message. A checkpoint
    with tied embeddings may still carry `lm_head.weight`; it is ignored.
    """
    expected = hf_weight_shapes(config)
    missing = sorted(set(expected) - set(found))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(source, f"missing tensors {missing[:5]}{more}")
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(
        name
        for name in found
        if name not in expected and name not in ignorable and not name.endswith(IGNORED_WEIGHT_SUFFIXES)
    )
    if unexpected:
        raise ModelLoadError(
            source, f"unexpected tensors {unexpected[:5]} for architecture {config.architecture!r}"
        )
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            file = f" in {where[name]}" if where and name in where else ""
            raise ModelLoadError(
                source, f"tensor {name!r}{file} has shape {tuple(found[name])}, expected {shape}"
            )
