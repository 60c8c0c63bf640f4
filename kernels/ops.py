"""Public launchers of the paged-attention kernels: argument checks, then backend dispatch.

Backends: "triton" (the kernels in this package; on CUDA, or on the CPU under TRITON_INTERPRET=1)
and "reference" (kernels/reference.py: vectorized PyTorch, the CPU production path).
`backend=None` (or "auto") picks select_backend(query.device). In every step the model first
writes the new tokens' K/V into the cache, then attention reads K/V only from the cache.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from pagedinfer.kernels import checks, reference

BACKENDS = ("triton", "reference")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


_FAILED_KERNELS: set[str] = set()
_BUILD_ERRORS: tuple[type[BaseException], ...] | None = None


def build_errors() -> tuple[type[BaseException], ...]:
    """Triton's build-time errors, resolved once (two imports a launch cost 6-13 us of host time
    on the H100's host, for a kernel whose device time is ~4 us)."""
    global _BUILD_ERRORS
    if _BUILD_ERRORS is None:
        from triton.compiler.errors import CompilationError
        from triton.runtime import errors

        _BUILD_ERRORS = (
            CompilationError,
            errors.OutOfResources,
            getattr(errors, "PTXASError", CompilationError),
        )
    return _BUILD_ERRORS


def launch_or_fallback(name: str, launch, fallback):
    """launch() unless kernel `name` failed to build for this GPU before; fallback() instead when
    it does not build (a Triton compile error, ptxas refusing its PTX, or a resource limit: all
    raised before anything runs on the device): logged once, and the kernel is not tried again
    in this process. The kernels' own tests call them directly, so a kernel that does not build
    still fails its tests. (An MLIR pass failure is a plain RuntimeError, like a CUDA error:
    raised, not hidden.)"""
    if name in _FAILED_KERNELS:
        return fallback()
    try:
        return launch()
    except build_errors() as exc:
        _FAILED_KERNELS.add(name)
        logging.getLogger(__name__).warning(
            "kernel %s failed to build (%s): the torch ops instead", name, exc
        )
        return fallback()


def select_backend(device: torch.device | str, requested: str | None = "auto") -> str:
    """'triton' on CUDA when triton is importable, else 'reference'; an explicit request wins."""
    requested = "auto" if requested is None else requested
    if requested == "auto":
        is_cuda = torch.device(device).type == "cuda"
        return "triton" if is_cuda and triton_available() else "reference"
    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; expected 'auto' or one of {BACKENDS}")
    if requested == "triton" and not triton_available():
        raise ValueError("attention backend 'triton' requested but triton is not importable")
    return requested


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str | None = None,
) -> None:
    """Scatter key/value [num_tokens, num_kv_heads, head_dim] into slot_mapping's slots (in place)."""
    checks.check_write(key, value, key_cache, value_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    if select_backend(key.device, backend) == "triton":
        from pagedinfer.kernels import cache_write

        cache_write.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    else:
        reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    backend: str | None = None,
    num_splits: int | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """query [num_seqs, num_heads, head_dim] -> out of the same shape and dtype.

    context_lens int32 [num_seqs] include the token being decoded. num_splits (Triton only)
    fixes the split-K factor; None picks it from the batch shape so the grid fills the GPU.
    max_context_len (optional, a host int >= every context length, like vLLM's max_seq_len)
    lets the Triton kernel size its splits from it instead of the block table's width.
    """
    checks.check_decode(query, key_cache, value_cache, block_tables, context_lens, scale, max_context_len)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if select_backend(query.device, backend) == "triton":
        from pagedinfer.kernels import decode_attention

        return decode_attention.paged_decode_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            float(scale),
            num_splits,
            max_context_len=max_context_len,
        )
    return reference.paged_decode_attention(
        query, key_cache, value_cache, block_tables, context_lens, float(scale)
    )


def paged_extend_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention of a ragged chunk of new tokens over the cache (which already holds them).

    query [num_tokens, num_heads, head_dim]; query_start_loc int32 [num_seqs + 1]; seq_lens int32
    [num_seqs] = cached + new. Row i of sequence s sits at position seq_lens[s] - q_len_s + i.
    max_query_len (host int) sizes the Triton grid; None reads it from query_start_loc (a sync).
    """
    checks.check_extend(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)
    if max_query_len is not None and (not isinstance(max_query_len, int) or max_query_len < 0):
        raise ValueError(f"max_query_len must be a non-negative int or None, got {max_query_len!r}")
    if max_query_len is not None and query_start_loc.device.type == "cpu" and seq_lens.numel():
        longest = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        if max_query_len < longest:
            raise ValueError(f"max_query_len={max_query_len} is below the longest query ({longest} tokens)")
    if select_backend(query.device, backend) == "triton":
        from pagedinfer.kernels import extend_attention

        return extend_attention.paged_extend_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            float(scale),
            max_query_len,
        )
    return reference.paged_extend_attention(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, float(scale)
    )


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_copies: torch.Tensor
) -> None:
    """Copy-on-write for every layer at once: block_copies int64 [n, 2] rows are (src, dst)."""
    checks.check_copy_blocks(key_caches, value_caches, block_copies)
    reference.copy_blocks(key_caches, value_caches, block_copies)
