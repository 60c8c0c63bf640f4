"""Optional raw-CUDA paged decode kernel, for the benchmark's side-by-side comparison only.

Built on first use with nvcc (no torch headers: a plain shared library loaded through ctypes, a
few seconds to compile) and cached under the temp dir by source hash. load_extension() returns
None wherever CUDA, a GPU or nvcc is missing, so nothing fails on a CPU machine. Supports bf16,
head_dim 128 and GQA groups of 1, 2, 4 or 8; splits merge in the Triton reduction kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "cuda" / "paged_decode.cu"
LOG2E = 1.4426950408889634


def _nvcc() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    found = shutil.which("nvcc")
    if found:
        return found
    candidate = Path(CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


def load_extension() -> ctypes.CDLL | None:
    """Compile (once) and load the kernel library; None where it cannot be built here."""
    nvcc = _nvcc()
    if not torch.cuda.is_available() or nvcc is None or not SOURCE.exists():
        return None
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    digest = hashlib.sha256(SOURCE.read_bytes() + arch.encode()).hexdigest()[:16]
    lib_path = Path(tempfile.gettempdir()) / "pagedinfer_cuda" / f"paged_decode_{digest}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            nvcc,
            "-O3",
            f"-arch={arch}",
            "-shared",
            "-Xcompiler",
            "-fPIC",
            "-o",
            str(lib_path),
            str(SOURCE),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"cuda_decode: nvcc failed, skipping the CUDA variant:\n{proc.stderr[-2000:]}")
            return None
    lib = ctypes.CDLL(str(lib_path))
    lib.pagedinfer_cuda_decode.restype = ctypes.c_int
    lib.pagedinfer_cuda_decode.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_float] + [ctypes.c_int] * 6
    lib.pagedinfer_cuda_decode.argtypes += [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    return lib


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the CUDA variant handles this layout (bf16, head_dim 128, GQA group 1/2/4/8)."""
    return dtype == torch.bfloat16 and head_dim == 128 and num_heads // num_kv_heads in (1, 2, 4, 8)


def paged_decode_attention(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as ops.paged_decode_attention, restricted to bf16 / head_dim 128."""
    from pagedinfer.kernels import decode_attention

    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if not supports(num_heads, num_kv_heads, head_dim, query.dtype):
        raise ValueError("the CUDA decode variant supports bf16, head_dim 128, GQA groups 1/2/4/8 only")
    if key_cache.stride() != value_cache.stride() or not query.is_contiguous():
        raise ValueError("the CUDA decode variant needs a contiguous query and equal cache strides")
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = decode_attention.default_num_splits(num_seqs, num_kv_heads, max_context, query.device)
    out = torch.empty_like(query)
    part_out = torch.empty(
        num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
    )
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    stream = torch.cuda.current_stream(query.device).cuda_stream
    rc = lib.pagedinfer_cuda_decode(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), out.data_ptr(), part_out.data_ptr(), part_lse.data_ptr(),
        scale * LOG2E, num_seqs, num_heads, num_kv_heads, block_size, block_tables.shape[1], num_splits,
        *key_cache.stride()[:3], stream,
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"pagedinfer_cuda_decode failed with CUDA error {rc}")
    if num_splits > 1:
        decode_attention.reduce_splits(part_out, part_lse, out)
    return out
