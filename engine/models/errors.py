"""Typed errors of model resolution and loading; each names the file and the problem."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model that cannot be loaded: bad URI, missing file, unsupported architecture or
    quantization, mismatched tensor shapes. Raised before any device memory is taken."""

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem


class UnsupportedModelError(ModelLoadError):
    """A well-formed checkpoint of an architecture, rope type or quantization we do not run."""
