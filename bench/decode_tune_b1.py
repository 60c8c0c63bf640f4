"""Small-grid decode (issue 3): the v4 kernel against the current one and its knobs, interleaved.

    python bench/decode_tune_b1.py --out DIR [--shapes 1x8192,1x2048w8192,...] [--rounds 3]

A shape is BATCHxCONTEXT, or BATCHxCONTEXTwCAPACITY for a block table wider than the context
(as in the engine, whose tables are sized for the longest context). Every variant is timed like
bench/attention.py (one CUDA graph over rotated input sets >= 256 MB, median per call), all
variants once per round, so slow drift hits them alike. "v4" is the v4 code itself when a copy
of it is importable as the package `headk` (decode_attention.py / decode_merge.py from before
v5, with the merge import pointed at headk); "default" is the current default config.
Writes DIR/decode_tune.jsonl (one line per timing) and prints one line per timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention as bench  # noqa: E402  (bench/ is not a package)
import attention_cases as cases  # noqa: E402

from pagedinfer.kernels.decode_attention import DecodeConfig, SplitMerge  # noqa: E402

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
    return x


def _variants(batch: int) -> dict:
    v4 = _v4_module()
    out: dict = {}
    if v4 is not None:
        out["v4"] = lambda x: lambda: v4.paged_decode_attention(*_args(x))
    out["default"] = lambda x: cases.ours_decode(x)
    if batch * cases.LLAMA.num_kv_heads < 16:
        for label, config in SMALL_GRID_VARIANTS.items():
            out[label] = lambda x, config=config: cases.ours_decode(x, config)
    return out


def _args(x: dict) -> tuple:
    return x["query"], x["key_cache"], x["value_cache"], x["block_tables"], x["context_lens"], x["scale"]


def run_shape(shape: str, rounds: int, rep_ms: int, log) -> None:
    bc, _, cap = shape.partition("w")
    batch, context = (int(v) for v in bc.split("x"))
    capacity = int(cap) if cap else context
    kv_bytes = cases.decode_kv_bytes(batch, capacity)
    sets = [_inputs(batch, context, capacity) for _ in range(min(64, -(-bench.ROTATE_BYTES // kv_bytes)))]
    ref = cases.ours_decode(sets[0])()
    variants = _variants(batch)
    for r in range(rounds):
        for label, factory in variants.items():
            row = {"shape": shape, "label": label, "round": r}
            try:
                fns = [factory(x) for x in sets]
                row["rel_err"] = bench._rel_err(fns[0](), ref)
                row["us"] = bench._bench_graph(fns, rep_ms) * 1e3
            except Exception as e:  # noqa: BLE001 - a variant that fails to build is recorded
                row["error"] = str(e)[:300]
            log(row)
    del sets
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="1x8192,1x2048,1x512,1x2048w8192,1x512w8192,16x2048,64x2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep-ms", type=int, default=25)
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
    for shape in args.shapes.split(","):
        run_shape(shape, args.rounds, args.rep_ms, log)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
