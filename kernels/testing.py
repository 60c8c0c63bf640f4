"""Test cases shared by the kernel tests (CPU interpreter, GPU) and the benchmark.

A case builds a random paged batch (shuffled block tables, optional blocks shared by every
sequence, random ids past each sequence's end, random data everywhere) and compares a backend's
output with the reference evaluated in float64 on the same inputs, by ||out - ref|| / ||ref||.

`python -m pagedinfer.kernels.testing OUT.json` runs INTERPRETER_CASES on the CPU (set
TRITON_INTERPRET=1 in its environment) and writes one result per case.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass

import torch

from pagedinfer.kernels import ops, reference

# Relative Frobenius error allowed per dtype (CUDA fp32 dots run as tf32).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
CUDA_FP32_TOLERANCE = 3e-3


@dataclass(frozen=True)
class AttentionCase:
    """One kernel check. kind: 'decode', 'extend' or 'write'."""

    name: str
    kind: str
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...] = ()  # extend: new tokens per sequence (<= seq_len)
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    num_splits: int | None = None
    shared_blocks: int = 0  # leading blocks every sequence shares (a common prefix)
    # decode and the short extend kernel, Triton: "kernel" / "pdl" / "fused" (SplitMerge); None: default
    merge: str | None = None
    repeat_splits: tuple[int, ...] = ()  # decode: call again with each split count (fused counters reset)
    max_context_len: int | None = None  # decode, Triton: the host-side bound on the contexts
    extend_path: str | None = None  # extend, Triton: "tiled" / "short" forces a kernel; None: dispatch
    max_query_len: int | None = None  # extend: the host-side bound passed (a graph's q); None: max(q_lens)
    block_rows: int | None = None  # short extend: rows a token block may take (tokens_per_program)


@dataclass(frozen=True)
class CaseResult:
    name: str
    dtype: str
    rel_err: float
    max_abs_err: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.rel_err) and self.rel_err <= self.tolerance


def make_block_tables(
    seq_lens: list[int], block_size: int, shared_blocks: int, gen: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Shuffled int32 block tables [S, MB] and the number of blocks the cache needs."""
    needed = [max(0, math.ceil(n / block_size) - shared_blocks) for n in seq_lens]
    num_blocks = shared_blocks + sum(needed) + 3  # a few blocks nobody uses
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max([math.ceil(n / block_size) for n in seq_lens] + [1]) + 1
    tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen)  # junk tail
    shared, cursor = perm[:shared_blocks], shared_blocks
    for s, n_own in enumerate(needed):
        tables[s, :shared_blocks] = shared
        tables[s, shared_blocks : shared_blocks + n_own] = perm[cursor : cursor + n_own]
        cursor += n_own
    return tables.to(torch.int32), num_blocks


def _random(shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)


def _make_attention_inputs(case: AttentionCase, dtype, device, gen) -> dict:
    tables, num_blocks = make_block_tables(list(case.seq_lens), case.block_size, case.shared_blocks, gen)
    cache_shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    q_lens = case.q_lens or (1,) * len(case.seq_lens)
    num_tokens = sum(q_lens) if case.kind == "extend" else len(case.seq_lens)
    return {
        "query": _random((num_tokens, case.num_heads, case.head_dim), dtype, device, gen),
        "key_cache": _random(cache_shape, dtype, device, gen),
        "value_cache": _random(cache_shape, dtype, device, gen),
        "block_tables": tables.to(device),
        "lens": torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
        "query_start_loc": torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device),
        "max_query_len": max(q_lens) if case.max_query_len is None else case.max_query_len,
        "scale": case.head_dim**-0.5,
    }


def _run_attention(case: AttentionCase, x: dict, backend: str, upcast: bool) -> torch.Tensor:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.double() if upcast else t

    q, kc, vc = cast(x["query"]), cast(x["key_cache"]), cast(x["value_cache"])
    if backend == "reference64":
        fn_decode, fn_extend = reference.paged_decode_attention, reference.paged_extend_attention
        kw: dict = {}
    else:
        fn_decode, fn_extend = ops.paged_decode_attention, ops.paged_extend_attention
        kw = {"backend": backend}
    if case.kind == "decode":
        if case.merge is not None and backend == "triton":
            from pagedinfer.kernels import decode_attention as da

            config = da.default_config(q.shape[2], q.device)
            config = dataclasses.replace(config, merge=da.SplitMerge(case.merge))
            fn_decode, kw = da.paged_decode_attention, {"config": config}
        if backend != "reference64":
            kw["num_splits"] = case.num_splits
            if case.max_context_len is not None:
                kw["max_context_len"] = case.max_context_len
        return fn_decode(q, kc, vc, x["block_tables"], x["lens"], x["scale"], **kw)
    if case.extend_path is not None and backend == "triton":
        fn_extend, kw = _forced_extend(case, q.device)
    return fn_extend(
        q, kc, vc, x["block_tables"], x["query_start_loc"], x["lens"], x["scale"], x["max_query_len"], **kw
    )


def _forced_extend(case: AttentionCase, device: torch.device):
    """The extend kernel case.extend_path names, bypassing the dispatch on the query length."""
    if case.extend_path == "short":
        from pagedinfer.kernels import short_extend_attention as sea
        from pagedinfer.kernels.decode_merge import SplitMerge

        merge = None if case.merge is None else SplitMerge(case.merge)
        kw = {"num_splits": case.num_splits, "merge": merge, "block_rows": case.block_rows}
        return sea.paged_short_extend_attention, kw
    from pagedinfer.kernels import extend_attention as ea

    block_table_tokens = 1 << 20  # any capacity: the tiles only
    return ea.paged_extend_attention, {"config": ea.default_config(case.head_dim, block_table_tokens, device)}


def _tolerance(dtype: torch.dtype, device: torch.device) -> float:
    if dtype == torch.float32 and device.type == "cuda":
        return CUDA_FP32_TOLERANCE
    return TOLERANCE[dtype]


def _compare(case: AttentionCase, dtype, device, out: torch.Tensor, ref: torch.Tensor) -> CaseResult:
    diff = out.double() - ref.double()
    ref_norm = float(ref.double().norm())
    rel = float(diff.norm()) / max(ref_norm, 1e-30)
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    if not bool(torch.isfinite(out).all()):
        rel = float("nan")
    return CaseResult(case.name, str(dtype).removeprefix("torch."), rel, max_abs, _tolerance(dtype, device))


def _run_write(case: AttentionCase, dtype, device, backend: str, gen) -> CaseResult:
    """Write every sequence's tokens (shuffled order) into its slots; compare the whole caches."""
    tables, num_blocks = make_block_tables(list(case.seq_lens), case.block_size, 0, gen)
    slots = [
        int(tables[s, p // case.block_size]) * case.block_size + p % case.block_size
        for s, n in enumerate(case.seq_lens)
        for p in range(n)
    ]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)[torch.randperm(len(slots), generator=gen)]
    shape = (len(slots), case.num_kv_heads, case.head_dim)
    key, value = _random(shape, dtype, device, gen), _random(shape, dtype, device, gen)
    cache_shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    caches = [_random(cache_shape, dtype, device, gen) for _ in range(2)]
    expect = [c.clone() for c in caches]
    slot_mapping = slot_mapping.to(device=device, dtype=torch.int32)
    ops.write_kv_cache(key, value, caches[0], caches[1], slot_mapping, backend=backend)
    reference.write_kv_cache(key, value, expect[0], expect[1], slot_mapping)
    out, ref = torch.stack(caches), torch.stack(expect)
    result = _compare(case, dtype, device, out, ref)
    exact = torch.equal(out, ref)  # a copy must be bit-exact
    return CaseResult(result.name, result.dtype, 0.0 if exact else float("inf"), result.max_abs_err, 0.0)


def run_case(
    case: AttentionCase,
    dtype: torch.dtype,
    device: str | torch.device,
    backend: str = "triton",
    seed: int = 0,
) -> CaseResult:
    """Run one case on `backend` and compare with the float64 reference on the same inputs."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    if case.kind == "write":
        return _run_write(case, dtype, device, backend, gen)
    x = _make_attention_inputs(case, dtype, device, gen)
    out = _run_attention(case, x, backend, upcast=False)
    ref = _run_attention(case, x, "reference64", upcast=True)
    if out.dtype != dtype or out.shape != ref.shape:
        raise AssertionError(
            f"{case.name}: got {out.dtype} {tuple(out.shape)}, want {dtype} {tuple(ref.shape)}"
        )
    result = _compare(case, dtype, device, out, ref)
    for splits in case.repeat_splits:  # back-to-back calls: a counter left non-zero breaks these
        again = _run_attention(dataclasses.replace(case, num_splits=splits), x, backend, upcast=False)
        result = max(result, _compare(case, dtype, device, again, ref), key=_badness)
    if case.merge == "fused" and backend == "triton" and not _fused_counters_zero(device):
        result = dataclasses.replace(result, rel_err=float("inf"))
    return result


def _badness(result: CaseResult) -> float:
    return result.rel_err if math.isfinite(result.rel_err) else float("inf")


def _fused_counters_zero(device: torch.device) -> bool:
    """Every fused-merge arrival counter is back at 0 after the calls (they are never cleared)."""
    from pagedinfer.kernels import decode_attention as da

    counters = da.FUSED_COUNTERS.get(device, 0)
    return counters is not None and not bool(counters.any())


_C = AttentionCase
# Small shapes for the CPU interpreter: block boundaries (1, 15, 16, 17, 32, 33), odd lengths,
# GQA with a non-power-of-two group (SmolLM2: 9/3), MHA, shared prefix blocks, split-K.
INTERPRETER_CASES = (
    _C("write_gqa", "write", (5, 16, 33), num_heads=9, num_kv_heads=3),
    _C("write_mha_d80", "write", (7, 17), num_heads=4, num_kv_heads=4, head_dim=80),
    _C("decode_smollm_split1", "decode", (1, 15, 16, 17, 33, 70), num_heads=9, num_kv_heads=3, num_splits=1),
    _C("decode_smollm_split3", "decode", (1, 16, 33, 70), num_heads=9, num_kv_heads=3, num_splits=3),
    _C("decode_auto_splits_shared", "decode", (40, 47, 95), num_heads=8, num_kv_heads=2, shared_blocks=2),
    _C("decode_mha_d80_bs8", "decode", (9, 24, 31), num_heads=4, num_kv_heads=4, head_dim=80, block_size=8),
    _C("decode_empty_seq", "decode", (0, 13, 32), num_splits=2),
    _C("decode_fused_merge", "decode", (0, 1, 33, 70), num_heads=9, num_kv_heads=3, num_splits=3, merge="fused",
       repeat_splits=(3, 5, 1, 2)),
    _C("decode_fused_group4_d128", "decode", (130, 7), num_heads=8, num_kv_heads=2, head_dim=128, num_splits=4,
       merge="fused"),
    _C("decode_pdl_merge_cpu", "decode", (17, 40), num_splits=3, merge="pdl"),
    _C("decode_fused_mqa_g16", "decode", (3, 64, 100), num_heads=16, num_kv_heads=1, num_splits=5, merge="fused"),
    _C("decode_fused_bs8", "decode", (70, 130), num_heads=8, num_kv_heads=2, block_size=8, merge="fused",
       num_splits=3, repeat_splits=(1, 4)),
    _C("decode_mqa_group16_bs64", "decode", (3, 64, 65, 100), num_heads=16, num_kv_heads=1, block_size=64),
    _C("decode_d128_many_splits", "decode", (130, 7), num_heads=4, num_kv_heads=1, head_dim=128, num_splits=5),
    _C("extend_prefill", "extend", (16, 33, 5), q_lens=(16, 33, 5), num_heads=9, num_kv_heads=3),
    _C("extend_mixed", "extend", (1, 40, 67, 20), q_lens=(1, 7, 40, 1), num_heads=6, num_kv_heads=2),
    # pinned to the tiled kernel: at these lengths the dispatch would pick the short-chunk kernel
    _C("extend_shared_prefix", "extend", (50, 45), q_lens=(3, 13), shared_blocks=2, extend_path="tiled"),
    _C("extend_chunk_d128", "extend", (97,), q_lens=(70,), num_heads=4, num_kv_heads=1, head_dim=128),
    _C("extend_mha_d80_bs8", "extend", (30, 9), q_lens=(17, 9), num_heads=2, num_kv_heads=2, head_dim=80, block_size=8,
       extend_path="tiled"),
    _C("extend_short_tiled", "extend", (50, 45, 7), q_lens=(5, 3, 5), shared_blocks=2, extend_path="tiled"),
    # short chunks (speculative verification): GQA-packed rows, split-K, causal within the chunk
    _C("extend_short_verify_splits", "extend", (37, 70, 5, 130), q_lens=(5, 5, 5, 1), num_heads=8, num_kv_heads=2,
       num_splits=3, shared_blocks=1, extend_path="short"),
    _C("extend_short_smollm_prefill", "extend", (16, 17, 33, 7), q_lens=(7, 7, 1, 7), num_heads=9, num_kv_heads=3,
       num_splits=1, extend_path="short"),
    _C("extend_short_pad_rows", "extend", (1, 20, 9), q_lens=(0, 4, 2), num_splits=4, extend_path="short"),
    # the split that arrives last merges in the kernel: pad rows, empty splits, SmolLM2's group 3,
    # calls back to back at other split counts (a counter left non-zero breaks those)
    _C("extend_short_fused", "extend", (37, 70, 5, 130, 1), q_lens=(5, 5, 5, 1, 0), num_heads=9, num_kv_heads=3,
       num_splits=3, shared_blocks=1, merge="fused", repeat_splits=(1, 5), extend_path="short"),
    _C("extend_short_fused_d128", "extend", (50, 64), q_lens=(8, 6), num_heads=8, num_kv_heads=2, head_dim=128,
       num_splits=4, merge="fused", extend_path="short"),
    # a sequence's tokens over several programs (token blocks; 7 x 3 rows as 4 + 3 tokens, 16 rows)
    _C("extend_short_token_blocks", "extend", (37, 70, 9, 130), q_lens=(7, 5, 7, 1), num_heads=9, num_kv_heads=3,
       num_splits=3, shared_blocks=1, block_rows=16, extend_path="short"),
    _C("extend_short_token_blocks_fused", "extend", (37, 70, 9, 130), q_lens=(7, 4, 7, 0), num_heads=9,
       num_kv_heads=3, num_splits=3, merge="fused", repeat_splits=(1, 4), block_rows=16, extend_path="short"),
    # one program a sequence above 16 rows (token blocks off: PAGEDINFER_SHORT_EXTEND_BLOCK_ROWS=0)
    _C("extend_short_one_program", "extend", (37, 70, 9, 130), q_lens=(7, 5, 7, 1), num_heads=9, num_kv_heads=3,
       num_splits=3, shared_blocks=1, block_rows=0, extend_path="short"),
    _C("extend_short_packed_one_program", "extend", (37, 70, 5, 130), q_lens=(5, 5, 5, 1), num_heads=9,
       num_kv_heads=3, num_splits=3, shared_blocks=1, block_rows=0, extend_path="short"),  # 5 x 3 packed in 16
    _C("extend_short_one_program_fused", "extend", (37, 70, 5, 130), q_lens=(5, 5, 5, 1), num_heads=8,
       num_kv_heads=2, num_splits=3, merge="fused", repeat_splits=(1, 5), block_rows=0, extend_path="short"),
    _C("extend_short_token_blocks_exact", "extend", (40, 8, 64), q_lens=(8, 8, 5), num_heads=6, num_kv_heads=2,
       num_splits=2, block_rows=16, extend_path="short"),  # 8 x 3: two blocks of 4 exactly
    _C("extend_short_token_blocks_three", "extend", (40, 9, 64), q_lens=(6, 5, 6), num_heads=16, num_kv_heads=2,
       num_splits=1, block_rows=16, extend_path="short"),  # group 8: three blocks of 2
    _C("extend_short_token_blocks_group4", "extend", (40, 9, 64), q_lens=(5, 2, 5), num_heads=8, num_kv_heads=2,
       num_splits=1, block_rows=16, extend_path="short"),
    _C("extend_short_mha_d80_bs8", "extend", (30, 9), q_lens=(3, 2), num_heads=4, num_kv_heads=4, head_dim=80,
       block_size=8, extend_path="short"),
    _C("extend_short_group8_d128", "extend", (50, 64), q_lens=(8, 6), num_heads=16, num_kv_heads=2, head_dim=128,
       num_splits=2, extend_path="short"),
    _C("extend_short_dispatch", "extend", (40, 47, 95), q_lens=(4, 1, 4), num_heads=8, num_kv_heads=2),
    # a verification graph's inputs: the bound (q = 5) above every q_len, pad sequences in one shared
    # block with q_len == seq_len and q_len 0 (seq_len 1), the dispatch picking the kernel
    _C("extend_short_graph_pads", "extend", (150, 37, 3, 1, 2), q_lens=(3, 1, 3, 0, 2), num_heads=8, num_kv_heads=2,
       shared_blocks=1, max_query_len=5),
    # 64 rows (16 tokens x group 4) at head_dim 256 in 64-token blocks; splits of 64 keys where the
    # chunk straddles a split boundary (rows that see no key of the last split)
    _C("extend_short_rows64_d256_bs64", "extend", (130, 70, 16), q_lens=(4, 16, 1), num_heads=8, num_kv_heads=2,
       head_dim=256, block_size=64, num_splits=3, extend_path="short"),
)  # fmt: skip
INTERPRETER_DTYPES = (torch.float32, torch.float16)


def main(argv: list[str]) -> int:
    results = [
        asdict(run_case(case, dtype, "cpu", backend="triton", seed=i))
        for i, case in enumerate(INTERPRETER_CASES)
        for dtype in INTERPRETER_DTYPES
    ]
    with open(argv[0], "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
