"""Small-grid decode (issue 3): the v4 kernel against the current one and its knobs, interleaved.

    python bench/decode_tune_b1.py --out DIR [--shapes 1x8192,1x2048w8192,...] [--rounds 3]
        [--set v5|pdl|bound|prefetch]

A shape is BATCHxCONTEXT, or BATCHxCONTEXTwCAPACITY for a block table wider than the context
(as in the engine, whose tables are sized for the longest context). Every variant is timed like
bench/attention.py (one CUDA graph over rotated input sets >= 256 MB, median per call), all
variants once per round, so slow drift hits them alike. "v4" is the v4 code itself when a copy
of it is importable as the package `headk` (decode_attention.py / decode_merge.py from before
v5, with the merge import pointed at headk); "default" is the current default config.
--set pdl (issue 3): the small-grid config with and without DecodeConfig.pdl_prologue, alone and
after the rotary + cache-write kernel (the engine's order: it writes the query and the newest
token's K/V; the timed graph holds both kernels, so "rot+" rows include the rotary kernel).
Writes DIR/decode_tune.jsonl (one line per timing), prints one line per timing and a table of
medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention as bench  # noqa: E402  (bench/ is not a package)
import attention_cases as cases  # noqa: E402

from pagedinfer.kernels import decode_attention as da  # noqa: E402
from pagedinfer.kernels import fused_ops  # noqa: E402
from pagedinfer.kernels.decode_attention import DecodeConfig, SplitMerge, default_config  # noqa: E402

SMALL = {"capacity_splits": True, "q_in_loop": True}
# Variants for grids under SMALL_GRID programs (merge PDL there); label -> DecodeConfig.
SMALL_GRID_VARIANTS = {
    "v4 tiles, v5 merge": DecodeConfig(64, 4, 3, SplitMerge.PDL),
    "64/4/3 cap+qloop": DecodeConfig(64, 4, 3, SplitMerge.PDL, **SMALL),
    "32/4/3 min32": DecodeConfig(32, 4, 3, SplitMerge.PDL, min_split_tokens=32),
    "32/4/3 min32 cap": DecodeConfig(32, 4, 3, SplitMerge.PDL, capacity_splits=True, min_split_tokens=32),
    "32/4/3 min32 qloop": DecodeConfig(32, 4, 3, SplitMerge.PDL, q_in_loop=True, min_split_tokens=32),
    "32/4/3 min32 cap+qloop": DecodeConfig(32, 4, 3, SplitMerge.PDL, **SMALL, min_split_tokens=32),
    "32/4/5 min32 cap+qloop": DecodeConfig(32, 4, 5, SplitMerge.PDL, **SMALL, min_split_tokens=32),
    "32/2/3 min32 cap+qloop": DecodeConfig(32, 2, 3, SplitMerge.PDL, **SMALL, min_split_tokens=32),
}


# --set pdl: the v5 small-grid config with / without the PDL prologue, and v4's 64-token tiles.
SMALL_V5 = DecodeConfig(32, 4, 3, q_in_loop=True, min_split_tokens=32)
PDL_VARIANTS = {
    "v5 small": SMALL_V5,
    "v5 small +pdl": replace(SMALL_V5, pdl_prologue=True),
    "64/4/3": DecodeConfig(),
    "64/4/3 +pdl": DecodeConfig(pdl_prologue=True),
}
# --set bound (v7): configs told the context length (max_context_len), for the 1x8192 latency.
BOUNDED = {"capacity_splits": True, "q_in_loop": True}
BOUND_VARIANTS = {
    "b 64/4/3 (default)": DecodeConfig(64, 4, 3, **BOUNDED),
    "b 64/8/3": DecodeConfig(64, 8, 3, **BOUNDED),
    "b 64/4/4": DecodeConfig(64, 4, 4, **BOUNDED),
    "b 64/4/3 reg128": DecodeConfig(64, 4, 3, maxnreg=128, **BOUNDED),
    "b 128/8/3": DecodeConfig(128, 8, 3, **BOUNDED),
    "b 128/8/3 32spl": DecodeConfig(128, 8, 3, min_split_tokens=256, **BOUNDED),
    "b 64/4/3 32spl": DecodeConfig(64, 4, 3, min_split_tokens=256, **BOUNDED),
    "b 32/2/3": DecodeConfig(32, 2, 3, min_split_tokens=32, **BOUNDED),
    "b 64/4/3 kernel": DecodeConfig(64, 4, 3, SplitMerge.KERNEL, **BOUNDED),
}
ROTARY_VARIANTS = ("v5 small", "v5 small +pdl")  # also timed after the rotary + cache-write kernel


def _launcher_config(x: dict, told: bool):
    """The config ops.paged_decode_attention picks for this input: told the context (the eager
    step, the benchmark's triton column) or from the table's width (the CUDA-graph step)."""
    bound = x["context"] if told else None
    return da.launcher_config(x["query"], x["key_cache"], x["block_tables"], bound)[0]


def _prefetch_variants(batch: int) -> dict:
    """--set prefetch: the launcher's own configs, told and table-only, with and without
    DecodeConfig.prefetch_ids (any batch: the large grids walk many tiles a program too)."""
    out: dict = {}
    for told in (True, False):
        for prefetch in (False, True):
            label = ("told" if told else "table") + (" +prefetch" if prefetch else "")

            out[label] = lambda x, told=told, prefetch=prefetch: _decode_call(
                x, replace(_launcher_config(x, told), prefetch_ids=prefetch), told
            )
    if batch * cases.LLAMA.num_kv_heads >= da.SMALL_GRID:
        return out
    # Small grids: the told configs around the v10 default (32/2/3 + capacity splits + prefetch
    # from 2048-token bounds) and v7's 64-token told tile for reference; and candidates for the
    # table-only path (CUDA-graph steps, no bound, no capacity splits), which v10 left unchanged.
    for label, (config, told) in PREFETCH_SMALL_VARIANTS.items():
        out[label] = lambda x, config=config, told=told: _decode_call(x, config, told)
    return out


def _decode_call(x: dict, config: DecodeConfig, told: bool):
    """The timed call: config on x's cache, told x's context as max_context_len or not."""
    bound = {"max_context_len": x["context"]} if told else {}
    return lambda: cases.triton_decode(*_args(x), config=config, **bound)


TABLE = {"q_in_loop": True}  # the table-only small-grid config's fields (default_config)
PREFETCH_SMALL_VARIANTS = {  # label -> (config, told the longest context)
    "told 64/4/3 cap (v7)": (DecodeConfig(64, 4, 3, **BOUNDED), True),
    "told 16/2/3 cap +prefetch": (
        DecodeConfig(16, 2, 3, min_split_tokens=16, prefetch_ids=True, **BOUNDED),
        True,
    ),
    "told 32/2/4 cap +prefetch": (
        DecodeConfig(32, 2, 4, min_split_tokens=32, prefetch_ids=True, **BOUNDED),
        True,
    ),
    "table 32/2/3 +prefetch": (
        DecodeConfig(32, 2, 3, min_split_tokens=32, prefetch_ids=True, **TABLE),
        False,
    ),
    "table 16/2/3 +prefetch": (
        DecodeConfig(16, 2, 3, min_split_tokens=16, prefetch_ids=True, **TABLE),
        False,
    ),
}


def _v4_module():
    try:
        from headk import decode_attention
    except ImportError:
        return None
    return decode_attention


def _inputs(batch: int, context: int, capacity: int) -> dict:
    x = cases.decode_inputs(batch, capacity)
    x["context_lens"].fill_(context)
    x["context"] = context
    # the rotary + cache-write kernel's inputs: one token a sequence, written at position context - 1
    heads = cases.LLAMA
    x["qkv"] = torch.randn(batch, (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim, device="cuda")
    x["qkv"] = x["qkv"].to(cases.DTYPE)
    angles = torch.rand(batch, heads.head_dim // 2, device="cuda") * 6.3
    x["rope"] = (angles.cos(), angles.sin())
    last = context - 1
    x["slots"] = (
        x["block_tables"][:, last // cases.BLOCK_SIZE].long() * cases.BLOCK_SIZE + last % cases.BLOCK_SIZE
    )
    return x


def _rotary_then_decode(x: dict, config: DecodeConfig):
    """The engine's order: rotary + cache write (q, newest K/V), then the decode on that q."""

    def fn():
        kc, vc = x["key_cache"], x["value_cache"]
        q = fused_ops.rotary_cache_write(x["qkv"], *x["rope"], kc, vc, x["slots"], "triton")
        return cases.triton_decode(q, kc, vc, x["block_tables"], x["context_lens"], x["scale"], config=config)

    return fn


def _pdl_variants(batch: int) -> dict:
    out: dict = {"default": lambda x: cases.ours_decode(x)}
    if batch * cases.LLAMA.num_kv_heads >= 16:
        return out
    for label, config in PDL_VARIANTS.items():
        out[label] = lambda x, config=config: cases.ours_decode(x, config)
    for label in ROTARY_VARIANTS:
        out["rot+" + label] = lambda x, config=PDL_VARIANTS[label]: _rotary_then_decode(x, config)
    return out


def _bound_variants(batch: int) -> dict:
    out: dict = {"default": lambda x: cases.ours_decode(x), "unbounded": cases.ours_unbounded_decode}
    if batch * cases.LLAMA.num_kv_heads >= 16:
        return out
    for label, config in BOUND_VARIANTS.items():
        out[label] = lambda x, config=config: (
            lambda: cases.triton_decode(*_args(x), config=config, max_context_len=x["context"])
        )
    return out


def _variants(batch: int) -> dict:
    v4 = _v4_module()
    out: dict = {}
    if v4 is not None:
        out["v4"] = lambda x: lambda: v4.paged_decode_attention(*_args(x))
    out["default"] = lambda x: cases.ours_decode(x)  # told the context length (max_context_len)
    out["unbounded"] = lambda x: cases.ours_unbounded_decode(x)  # the table's width only
    if batch * cases.LLAMA.num_kv_heads < 16:
        for label, config in SMALL_GRID_VARIANTS.items():
            out[label] = lambda x, config=config: cases.ours_decode(x, config)
    return out


def _args(x: dict) -> tuple:
    return x["query"], x["key_cache"], x["value_cache"], x["block_tables"], x["context_lens"], x["scale"]


def run_shape(shape: str, rounds: int, rep_ms: int, log, variant_set: str = "v5") -> list[dict]:
    bc, _, cap = shape.partition("w")
    batch, context = (int(v) for v in bc.split("x"))
    capacity = int(cap) if cap else context
    kv_bytes = cases.decode_kv_bytes(batch, capacity)
    sets = [_inputs(batch, context, capacity) for _ in range(min(64, -(-bench.ROTATE_BYTES // kv_bytes)))]
    ref = cases.ours_decode(sets[0])()
    sets_of = {
        "v5": _variants,
        "pdl": _pdl_variants,
        "bound": _bound_variants,
        "prefetch": _prefetch_variants,
    }
    variants = sets_of[variant_set](batch)
    rows = []
    for r in range(rounds):
        for label, factory in variants.items():
            row = {"shape": shape, "label": label, "round": r}
            try:
                fns = [factory(x) for x in sets]
                if not label.startswith("rot+"):  # the rotary rows decode another query
                    row["rel_err"] = bench._rel_err(fns[0](), ref)
                row["us"] = bench._bench_graph(fns, rep_ms) * 1e3
            except Exception as e:  # noqa: BLE001 - a variant that fails to build is recorded
                row["error"] = str(e)[:300]
            log(row)
            rows.append(row)
    del sets
    torch.cuda.empty_cache()
    return rows


def print_medians(rows: list[dict]) -> None:
    """One line per variant: the median us per call over the rounds, one column per shape."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    width = max([22, *(len(label) + 1 for label in labels)])
    print(f"\nmedian us over rounds\n{'variant':<{width}}" + "".join(f"{s:>12}" for s in shapes))
    for label in labels:
        cells = []
        for shape in shapes:
            us = [r["us"] for r in rows if r["label"] == label and r["shape"] == shape and "us" in r]
            cells.append(f"{statistics.median(us):12.2f}" if us else f"{'-':>12}")
        print(f"{label:<{width}}" + "".join(cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="1x8192,1x2048,1x512,1x2048w8192,1x512w8192,16x2048,64x2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep-ms", type=int, default=25)
    ap.add_argument(
        "--set",
        choices=("v5", "pdl", "bound", "prefetch"),
        default="v5",
        help="variants: v5 tiles, the PDL prologue, configs told the context length, or the "
        "launcher's configs with and without prefetch_ids",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "decode_tune.jsonl"

    def log(row: dict) -> None:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        us = f"{row['us']:8.2f}" if "us" in row else "   error"
        err = f"err {row['rel_err']:.1e}" if "rel_err" in row else row.get("error", "")
        print(f"{row['shape']:>11} {row['label']:<24} {us} us  {err}", flush=True)

    copy_gbps = bench.measure_copy_bandwidth(args.rep_ms)
    log({"shape": "copy", "label": f"{copy_gbps:.0f} GB/s", "copy_gbps": copy_gbps})
    rows = []
    for shape in args.shapes.split(","):
        rows += run_shape(shape, args.rounds, args.rep_ms, log, args.set)
    print_medians(rows)
    print(f"default_config(1x8192): {default_config(128, torch.device('cuda'), 8, 8192)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
