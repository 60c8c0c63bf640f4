"""Each rank's slices of a checkpoint, read without loading the rest.

safetensors: `get_slice` on the memory-mapped file reads only the rows or columns of the slice.
GGUF: row slices take whole quantized rows; column slices take whole quantization blocks of each
row (the bytes of the slice only) when the slice starts and ends on a block boundary, else one
tensor is dequantized and cut (peak host memory: one tensor, never the model). Q/K rows are
un-permuted per head (llama.cpp's interleaved RoPE layout), which a slice of whole heads allows.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize
from safetensors import safe_open

from pagedinfer.engine.models.gguf_file import GGUFTensor
from pagedinfer.engine.models.gguf_loader import ROPE_FREQS, GGUFCheckpoint, hf_name, unpermute_rope_rows
from pagedinfer.engine.models.safetensors_loader import SafetensorsCheckpoint
from pagedinfer.engine.parallel.plan import ShardPlan, WeightSlice


def _pad_rows(tensor: torch.Tensor, piece: WeightSlice) -> torch.Tensor:
    if piece.pad_to is None or tensor.shape[0] == piece.pad_to:
        return tensor
    pad = tensor.new_zeros((piece.pad_to - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, pad])


def safetensors_shards(
    checkpoint: SafetensorsCheckpoint, plan: ShardPlan
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, this rank's CPU tensor) for every tensor, file by file."""
    by_file: dict = {}
    for name, info in checkpoint.tensors.items():
        by_file.setdefault(info.file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in names:
                piece = plan.weight_slice(name)
                if piece is None:
                    yield name, f.get_tensor(name)
                    continue
                view = f.get_slice(name)
                rows = view[piece.start : piece.end] if piece.dim == 0 else view[:, piece.start : piece.end]
                yield name, _pad_rows(rows, piece)


def _gguf_slice(tensor: GGUFTensor, piece: WeightSlice) -> np.ndarray:
    """The fp32 values of `piece` of a GGUF tensor (torch order), reading as little as it can."""
    block, type_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
    if piece.dim == 0:  # whole rows (a 1-D bias: whole elements, unquantized)
        shape = (piece.end - piece.start, *tensor.shape[1:])
        raw = tensor.data[piece.start : piece.end]
        return dequantize(np.ascontiguousarray(raw), tensor.tensor_type).reshape(shape)
    rows = tensor.shape[0]
    if tensor.data.dtype != np.uint8:  # F32 / F16: a typed view, columns are elements
        raw, shape = tensor.data[:, piece.start : piece.end], (rows, piece.end - piece.start)
    elif piece.start % block == 0 and piece.end % block == 0:  # whole blocks of every row
        lo, hi = piece.start // block * type_bytes, piece.end // block * type_bytes
        raw, shape = np.ascontiguousarray(tensor.data[:, lo:hi]), (rows, piece.end - piece.start)
    else:
        full = dequantize(tensor.data, tensor.tensor_type).reshape(tensor.shape)
        return full[:, piece.start : piece.end]
    return dequantize(np.ascontiguousarray(raw), tensor.tensor_type).reshape(shape)


def gguf_shards(checkpoint: GGUFCheckpoint, plan: ShardPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, this rank's fp32 CPU tensor) for every tensor, un-permuted like
    GGUFCheckpoint.iter_weights."""
    permuted = checkpoint.metadata.get("general.architecture") == "llama"
    for name, tensor in checkpoint.file.tensors.items():
        if name == ROPE_FREQS:
            continue
        mapped = hf_name(name)
        assert mapped is not None, name  # the loader's hf_shapes() validated the names
        piece = plan.weight_slice(mapped)
        if piece is None:
            array = dequantize(tensor.data, tensor.tensor_type).reshape(tensor.shape)
        else:
            array = _gguf_slice(tensor, piece)
        if permuted and mapped.endswith("q_proj.weight"):
            array = unpermute_rope_rows(array, plan.num_heads)
        elif permuted and mapped.endswith("k_proj.weight"):
            array = unpermute_rope_rows(array, plan.num_kv_heads)
        array = np.array(array, dtype=np.float32)  # a writable copy (F32 views map the file)
        out = torch.from_numpy(array)
        yield mapped, out if piece is None else _pad_rows(out, piece)


def shard_weights(checkpoint, plan: ShardPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's slices of a safetensors or GGUF checkpoint."""
    if isinstance(checkpoint, GGUFCheckpoint):
        return gguf_shards(checkpoint, plan)
    return safetensors_shards(checkpoint, plan)
