"""Hugging Face safetensors checkpoints: one file or shards listed in model.safetensors.index.json.

`SafetensorsCheckpoint.scan` reads only the headers (names, shapes, dtypes), so the whole
checkpoint is validated before any device memory is taken; `iter_weights` then streams tensors
from the memory-mapped files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagedinfer.engine.models.errors import ModelLoadError, UnsupportedModelError

INDEX_FILE = "model.safetensors.index.json"
SUPPORTED_DTYPES = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors spelling: "F32", "BF16", ...


def _shard_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(str(index), f"unreadable shard index: {exc!r}") from exc
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(str(file), f"shard listed in {INDEX_FILE} is missing")
        return files
    single = folder / "model.safetensors"
    files = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(str(folder), "no *.safetensors files in the model folder")
    return files


class SafetensorsCheckpoint:
    """The tensors of a safetensors model folder, by name."""

    def __init__(self, folder: Path, tensors: dict[str, TensorInfo]) -> None:
        self.folder = folder
        self.tensors = tensors

    @classmethod
    def scan(cls, folder: str | Path) -> SafetensorsCheckpoint:
        """Read every shard's header; raise ModelLoadError for unreadable files or unsupported dtypes."""
        folder = Path(folder)
        tensors: dict[str, TensorInfo] = {}
        for file in _shard_files(folder):
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                        piece = f.get_slice(name)
                        tensors[name] = TensorInfo(file, tuple(piece.get_shape()), piece.get_dtype())
            except (SafetensorError, OSError) as exc:
                raise ModelLoadError(str(file), f"unreadable safetensors file: {exc}") from exc
        for name, info in tensors.items():
            if info.dtype not in SUPPORTED_DTYPES:
                raise UnsupportedModelError(
                    str(info.file), f"tensor {name!r} has dtype {info.dtype}; supported: {SUPPORTED_DTYPES}"
                )
        return cls(folder, tensors)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: info.shape for name, info in self.tensors.items()}

    def files_by_tensor(self) -> dict[str, str]:
        return {name: str(info.file) for name, info in self.tensors.items()}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, CPU tensor) for every tensor, shard by shard (memory-mapped, no full copy)."""
        by_file: dict[Path, list[str]] = {}
        for name, info in self.tensors.items():
            by_file.setdefault(info.file, []).append(name)
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in names:
                    yield name, f.get_tensor(name)
