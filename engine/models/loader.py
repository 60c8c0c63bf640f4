"""load_model(uri, ...): resolve, validate everything from metadata, then allocate and fill.

Order matters: the config, every tensor's name/shape/type and the tokenizer are checked from
file headers first, so bad input fails with a `ModelLoadError` naming the file before any
device memory is taken. Then the model is allocated (uninitialized) and weights are streamed in.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pagedinfer.engine.config import ModelConfig
from pagedinfer.engine.models.builtin import CheckpointFormat, resolve_model_uri
from pagedinfer.engine.models.config_loader import model_config_from_gguf, model_config_from_hf
from pagedinfer.engine.models.errors import ModelLoadError
from pagedinfer.engine.models.gguf_loader import GGUFCheckpoint
from pagedinfer.engine.models.llama import LlamaForCausalLM
from pagedinfer.engine.models.registry import model_class
from pagedinfer.engine.models.safetensors_loader import SafetensorsCheckpoint
from pagedinfer.engine.models.weight_check import check_weight_shapes
from pagedinfer.engine.tokenizer import Tokenizer, TokenizerError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready to run, with what serving it needs."""

    model: LlamaForCausalLM
    model_config: ModelConfig
    tokenizer: Tokenizer | None  # None: a checkpoint folder without tokenizer files
    source_path: Path  # the local GGUF file or safetensors folder


@dataclass
class ModelLoadPlan:
    """Everything validated, nothing allocated: the config, the tokenizer and a weight stream
    (`checkpoint`: the GGUFCheckpoint or SafetensorsCheckpoint, for readers of slices)."""

    model_config: ModelConfig
    tokenizer: Tokenizer | None
    num_tensors: int
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    checkpoint: GGUFCheckpoint | SafetensorsCheckpoint
    path: Path


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA, float32 on the CPU; names map to torch dtypes."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _read_json(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise ModelLoadError(str(path), "file not found")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(str(path), f"unreadable JSON: {exc}") from exc


def _plan_safetensors(folder: Path) -> ModelLoadPlan:
    config_path = folder / "config.json"
    generation = _read_json(folder / "generation_config.json", required=False)
    config = model_config_from_hf(_read_json(config_path, required=True), str(config_path), generation)
    checkpoint = SafetensorsCheckpoint.scan(folder)
    check_weight_shapes(checkpoint.shapes(), config, str(folder), checkpoint.files_by_tensor())
    tokenizer = None
    if (folder / "tokenizer.json").is_file():
        try:
            tokenizer = Tokenizer.from_pretrained(folder, extra_stop_token_ids=config.eos_token_ids)
        except TokenizerError as exc:
            raise ModelLoadError(str(folder), str(exc)) from exc
    else:
        logger.warning("%s: no tokenizer.json; the model loads without a tokenizer", folder)
    return ModelLoadPlan(
        config, tokenizer, len(checkpoint.tensors), checkpoint.iter_weights, checkpoint, folder
    )


def _plan_gguf(path: Path) -> ModelLoadPlan:
    checkpoint = GGUFCheckpoint(path)
    config = model_config_from_gguf(
        checkpoint.metadata, checkpoint.gguf_shapes(), str(path), checkpoint.rope_freq_factors()
    )
    check_weight_shapes(checkpoint.hf_shapes(), config, str(path))
    tokenizer = None
    if "tokenizer.ggml.model" in checkpoint.metadata:
        try:
            tokenizer = Tokenizer.from_gguf(checkpoint, extra_stop_token_ids=config.eos_token_ids)
        except TokenizerError as exc:
            raise ModelLoadError(str(path), str(exc)) from exc
    else:
        logger.warning("%s: no tokenizer metadata; the model loads without a tokenizer", path)
    return ModelLoadPlan(
        config,
        tokenizer,
        len(checkpoint.hf_shapes()),
        lambda: checkpoint.iter_weights(config),
        checkpoint,
        path,
    )


def plan_model_load(
    uri: str,
    revision: str | None = None,
    *,
    download_dir: str | Path | None = None,
    local_files_only: bool = False,
) -> ModelLoadPlan:
    """Resolve a model URI and validate its config, tensors and tokenizer from the file headers."""
    resolved = resolve_model_uri(uri, revision, cache_dir=download_dir, local_files_only=local_files_only)
    if resolved.format is CheckpointFormat.GGUF:
        return _plan_gguf(resolved.path)
    return _plan_safetensors(resolved.path)


def load_model(
    uri: str,
    device: torch.device | str,
    dtype: torch.dtype | str,
    revision: str | None = None,
    *,
    download_dir: str | Path | None = None,
    local_files_only: bool = False,
) -> LoadedModel:
    """Load a model URI (see builtin.py) onto `device` in `dtype`; raises ModelLoadError on bad input."""
    start = time.perf_counter()
    torch_dtype = resolve_dtype(dtype, device)
    plan = plan_model_load(uri, revision, download_dir=download_dir, local_files_only=local_files_only)
    config = plan.model_config
    model = model_class(config.architecture)(config, torch_dtype, device)
    model.requires_grad_(False)
    progress = tqdm(
        plan.weights(),
        total=plan.num_tensors,
        desc=f"loading {plan.path.name}",
        unit="tensor",
        leave=False,
    )
    model.load_weights(progress)
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s (%s, %d layers, %.1fM params) as %s on %s in %.1f s",
        uri,
        config.architecture,
        config.num_layers,
        num_params / 1e6,
        torch_dtype,
        device,
        time.perf_counter() - start,
    )
    return LoadedModel(model, config, plan.tokenizer, plan.path)
