"""Fingerprints of the short-extend attention kernel's PTX for sm_90, compiled without a GPU.

Why: an engine A/B of two versions of kernels/short_extend_attention.py costs GPU time and is
noisy at the 1-3% level; where two versions should generate the same code for a shape (e.g. one
token block against the kernel before token blocks), identical PTX settles it on any machine.

    python bench/short_extend_ptx.py OTHER_MODULE.py [--shapes "3,3 5,3 5,4 7,3"]

OTHER_MODULE.py: another version of the module (e.g. `git show REV:kernels/short_extend_attention.py`).
For each shape (tokens a sequence, GQA group) and merge (PDL, fused) it prints the md5 of the PTX's
instruction lines (comments and debug lines dropped) of both versions and whether they match
(shapes where token blocks apply differ by design: 5,3, 7,3 and 5,4). Compiles with the local Triton
(`triton.compile` of an `ASTSource`, target cuda sm_90) at one fixed configuration: split-K on,
head_dim 64, bf16, no divisibility hints on pointers and strides (the JIT adds them at launch),
so the PTX hashed is a close relative of the one launched, compiled alike for both versions. The
other module imports this tree's helpers (decode_attention, decode_merge): it compares this file.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from pagedinfer.kernels.decode_merge import fused_split_chunk  # noqa: E402

HERE = Path(__file__).resolve().parent.parent / "kernels" / "short_extend_attention.py"
TYPES = {
    "q_ptr": "*bf16",
    "k_cache_ptr": "*bf16",
    "v_cache_ptr": "*bf16",
    "block_tables_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "out_ptr": "*bf16",
    "part_out_ptr": "*fp32",
    "part_lse_ptr": "*fp32",
    "qk_scale": "fp32",
}


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def ptx_md5(module, tokens: int, group: int, fused: bool) -> str:
    """md5 of the PTX instruction lines of the kernel as the module's launcher would pick it for
    `tokens` a sequence at `group` (its token blocks, rows, layout), bf16, head_dim 64, split."""
    kernel = module._short_extend_kernel
    per_block = module.tokens_per_program(tokens, group) if hasattr(module, "tokens_per_program") else tokens
    rows = module.rows_per_program(per_block, group)
    values = {
        "IS_SPLIT": True,
        "MERGE_FUSED": fused,
        "LAUNCH_DEPENDENTS": not fused,
        "GROUP": group,
        "GROUP_P2": triton.next_power_of_2(group),
        "PACKED": module.packs_rows(per_block, group),
        "ROWS": rows,
        "BLOCK_SIZE": 16,
        "BLOCK_N": 64,
        "D_PAD": 64,
        "SPLITS_PAD": 2,
        "SPLIT_CHUNK": fused_split_chunk(rows, 64, 2),
        "TOKENS": per_block,
        "TOKEN_BLOCKS": triton.cdiv(tokens, per_block),
    }
    signature, constexprs = {}, {}
    for param in kernel.params:
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(kernel.arg_names.index(param.name),)] = values[param.name]
        elif param.name == "counter_ptr":
            signature[param.name] = "*i32" if fused else "*bf16"
        else:
            signature[param.name] = TYPES.get(param.name, "i32")
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3}
    )
    skip = ("//", ".loc", ".file", ".section", ".b8", ".b32")
    lines = [x for x in compiled.asm["ptx"].splitlines() if x.strip() and not x.strip().startswith(skip)]
    return hashlib.md5("\n".join(lines).encode()).hexdigest()[:12]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("other", type=Path)
    ap.add_argument("--shapes", default="3,3 5,3 7,3 5,4", help="tokens,group pairs")
    args = ap.parse_args(argv)
    this, other = load(HERE, "_sea_this"), load(args.other, "_sea_other")
    for shape in args.shapes.split():
        tokens, group = map(int, shape.split(","))
        for fused in (False, True):
            a, b = ptx_md5(this, tokens, group, fused), ptx_md5(other, tokens, group, fused)
            merge = "fused" if fused else "pdl"
            print(
                f"tokens {tokens} group {group} {merge:5}: this {a} other {b} {'same' if a == b else 'DIFFERENT'}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
