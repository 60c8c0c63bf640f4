"""Attention of a speculative verification step on the GPU: short chunks of q tokens a sequence.

Side by side in one run, per (model heads, batch, q, context): the short-chunk kernel
(kernels/short_extend_attention.py, what the extend dispatch picks for these shapes: q <= 16 at
groups 3 and 4; each row records the pick), the same with its split partials merged by a second
kernel (its only merge before the in-kernel one for grids of >= 16 programs), the tiled
extend kernel the engine used before for the same chunks (its default tiles for the table), the
decode kernel at one token a sequence (what a plain decode step's attention costs: the speculative
formula charges a verification as one plain step), and the floor: the KV bytes read over the
device-to-device copy bandwidth measured in the same run. Timing: CUDA-graph replay over input
sets larger than L2 (bench/attention.py's method). Tables are `width` tokens wide (the engine's
graphs use max_model_len-wide tables: splits follow their capacity).

    python bench/verify_attention.py --out OUTDIR [--quick]

Writes OUT/verify_attention.json and .png, prints a table with the ratios. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_cases as cases  # noqa: E402  (bench/ is not a package)
import common  # noqa: E402
from common import ROTATE_BYTES, graph_ms, has_cuda, measure_copy_bandwidth  # noqa: E402

from pagedinfer.kernels import extend_attention as ea  # noqa: E402
from pagedinfer.kernels import ops  # noqa: E402
from pagedinfer.kernels import short_extend_attention as sea  # noqa: E402
from pagedinfer.kernels.decode_merge import SplitMerge, pdl_supported  # noqa: E402

# (heads, batch, q tokens a sequence, context, table width in tokens)
SHAPES = [
    *[(cases.LLAMA, b, 5, c, 8192) for b in (1, 8, 64) for c in (512, 2048, 8192)],
    *[(cases.LLAMA, 1, q, 1024, 8192) for q in (3, 7, 16)],
    *[(cases.SMOLLM2, b, q, 1024, 8192) for b in (1, 8) for q in (3, 5, 7)],
    # the n-gram benchmark's contexts (~200-450 tokens) in its 1,024-token tables
    *[(cases.SMOLLM2, 8, q, 420, 1024) for q in (3, 5, 7)],
]
QUICK = [s for s in SHAPES if s[3] in (420, 1024, 2048) and s[1] <= 8]


def verify_inputs(heads, batch: int, q: int, context: int, width: int) -> dict:
    """q new tokens a sequence at the end of `context`, tables `width` tokens wide, plus the last
    token alone for the one-token decode."""
    x = cases.extend_inputs(batch, q, context, heads, width)
    x["decode_query"] = x["query"][q - 1 :: q].contiguous()
    return x


def _short_fn(x: dict, **kw):
    args = cases.extend_args(x)
    return lambda: sea.paged_short_extend_attention(*args, x["scale"], max_query_len=x["new"], **kw)


def _decode_fn(x: dict):
    dec = (x["decode_query"], x["key_cache"], x["value_cache"], x["block_tables"], x["seq_lens"], x["scale"])
    return lambda: ops.paged_decode_attention(*dec)


def _variants(x: dict) -> dict:
    args = cases.extend_args(x)
    tiled = ea.default_config(
        x["heads"].head_dim, x["block_tables"].shape[1] * cases.BLOCK_SIZE, x["query"].device
    )
    # the split partials merged by a second kernel (PDL), as before 2026-12-05 on every grid
    separate = SplitMerge.PDL if pdl_supported(x["query"].device) else SplitMerge.KERNEL
    # the short kernel named, not through the dispatch: PAGEDINFER_SHORT_EXTEND=0 or a changed
    # MAX_ROWS would otherwise time the tiled kernel under this name (the row records the dispatch)
    return {
        "short": _short_fn(x),
        "short_merge_kernel": _short_fn(x, merge=separate),
        # the last split's program merging in the kernel, whatever the split count
        "short_fused": _short_fn(x, merge=SplitMerge.FUSED),
        # every token of a sequence in one program (before token blocks, 2026-12-06; the A/B)
        "short_one_program": _short_fn(x, block_rows=0),
        "tiled": lambda: ea.paged_extend_attention(*args, x["scale"], max_query_len=x["new"], config=tiled),
        "decode_1tok": _decode_fn(x),
    }


def bench_shape(heads, batch: int, q: int, context: int, width: int, copy_gbps: float, rep_ms: int) -> dict:
    kv_bytes = cases.decode_kv_bytes(batch, context, heads)
    table_bytes = cases.decode_kv_bytes(batch, width, heads)
    num_sets = max(1, min(32, -(-ROTATE_BYTES // table_bytes)))
    sets = [verify_inputs(heads, batch, q, context, width) for _ in range(num_sets)]
    row = {
        "model": heads.name,
        "batch": batch,
        "q": q,
        "context": context,
        "width": width,
        "kv_bytes": kv_bytes,
        "dispatch": "short" if sea.takes(q, heads.num_heads, heads.num_kv_heads) else "tiled",
    }
    row["floor_ms"] = kv_bytes / copy_gbps / 1e6
    ref = _variants(sets[0])["tiled"]()
    row["tokens_per_program"] = sea.tokens_per_program(q, heads.num_heads // heads.num_kv_heads)
    for name in ("short", "short_merge_kernel", "short_fused", "short_one_program", "tiled", "decode_1tok"):
        fns = [_variants(x)[name] for x in sets]
        out = fns[0]()
        err = (
            float((out.float() - ref.float()).norm() / ref.float().norm()) if name != "decode_1tok" else None
        )
        row[name] = {"ms": graph_ms(fns, rep_ms), "rel_err_vs_tiled": err}
    del sets
    torch.cuda.empty_cache()
    row["short_vs_tiled"] = row["tiled"]["ms"] / row["short"]["ms"]
    row["short_vs_merge_kernel"] = row["short"]["ms"] / row["short_merge_kernel"]["ms"]
    row["fused_vs_merge_kernel"] = row["short_fused"]["ms"] / row["short_merge_kernel"]["ms"]
    row["short_vs_one_program"] = row["short"]["ms"] / row["short_one_program"]["ms"]
    row["short_vs_decode"] = row["short"]["ms"] / row["decode_1tok"]["ms"]
    row["short_vs_floor"] = row["short"]["ms"] / row["floor_ms"]
    return row


def summarize(result: dict) -> str:
    lines = [
        f"verification attention, {result['device']}, copy {result['copy_gbps']:.0f} GB/s; us per call",
        "| model | B x q @ ctx | short | short, merge kernel | ratio | short, fused merge | fused / kernel "
        "| (tokens a program) | one program | short / one program "
        "| tiled (before) | speedup | decode 1 tok | short / decode | floor | short / floor |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['batch']}x{r['q']} @ {r['context']} | {r['short']['ms'] * 1e3:.1f} | "
            f"{r['short_merge_kernel']['ms'] * 1e3:.1f} | {r['short_vs_merge_kernel']:.2f} | "
            f"{r['short_fused']['ms'] * 1e3:.1f} | {r['fused_vs_merge_kernel']:.2f} | "
            f"({r['tokens_per_program']}) | {r['short_one_program']['ms'] * 1e3:.1f} | "
            f"{r['short_vs_one_program']:.2f} | "
            f"{r['tiled']['ms'] * 1e3:.1f} | {r['short_vs_tiled']:.2f}x | {r['decode_1tok']['ms'] * 1e3:.1f} | "
            f"{r['short_vs_decode']:.2f} | {r['floor_ms'] * 1e3:.1f} | {r['short_vs_floor']:.2f} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    drawn = common.subplots(path, 1, 1, figsize=(10, 4))
    if drawn is None:
        return
    fig, ax = drawn
    rows = result["rows"]
    labels = [f"{r['model'][:6]} {r['batch']}x{r['q']}@{r['context']}" for r in rows]
    xs = range(len(rows))
    for i, name in enumerate(("short", "tiled", "decode_1tok")):
        ax.bar([x + (i - 1) * 0.27 for x in xs], [r[name]["ms"] * 1e3 for r in rows], 0.27, label=name)
    ax.scatter(list(xs), [r["floor_ms"] * 1e3 for r in rows], color="k", marker="_", s=200, label="KV floor")
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("us per call (graph replay)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("verification attention: short-chunk kernel vs tiled extend vs one-token decode")
    common.save(fig, path, dpi=120)


# --split-sweep: the short kernel at the speculative benchmark's shapes (q 5, block tables 1,024
# tokens wide: bench/speculative.py's max_model_len), per split count and tile, against its
# default pick and the one-token decode
SWEEP_SHAPES = [(h, b, c) for h in (cases.SMOLLM2, cases.LLAMA) for b in (1, 8) for c in (420, 1024)]
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64)
SWEEP_TILES = ((64, 4), (32, 4), (32, 2))  # (block_n, num_warps)


def _sweep_row(heads, batch: int, context: int, sets: list[dict], rep_ms: int) -> dict:
    def timed(make) -> float:
        return graph_ms([make(x) for x in sets], rep_ms) * 1e3

    row = {"model": heads.name, "batch": batch, "context": context, "width": 1024}
    row["default_us"] = timed(_short_fn)
    row["decode_1tok_us"] = timed(_decode_fn)
    row["variants"] = []
    for splits in SWEEP_SPLITS:
        for block_n, warps in SWEEP_TILES:
            config = sea.ShortExtendConfig(block_n, warps)
            us = timed(lambda x, s=splits, c=config: _short_fn(x, num_splits=s, config=c))
            row["variants"].append({"splits": splits, "block_n": block_n, "num_warps": warps, "us": us})
    row["best"] = min(row["variants"], key=lambda v: v["us"])
    return row


def split_sweep(rep_ms: int) -> list[dict]:
    rows = []
    for heads, batch, context in SWEEP_SHAPES:
        table_bytes = cases.decode_kv_bytes(batch, 1024, heads)
        num_sets = max(1, min(32, -(-ROTATE_BYTES // table_bytes)))
        sets = [verify_inputs(heads, batch, 5, context, 1024) for _ in range(num_sets)]
        row = _sweep_row(heads, batch, context, sets, rep_ms)
        best = row["best"]
        print(
            f"{heads.name} {batch}x5 @ {context}: default {row['default_us']:.2f} us, best {best['us']:.2f} "
            f"(splits {best['splits']}, {best['block_n']} x {best['num_warps']} warps), ratio "
            f"{row['default_us'] / best['us']:.2f}; decode 1 tok {row['decode_1tok_us']:.2f}",
            flush=True,
        )
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--split-sweep", action="store_true", help="only the split / tile sweep (see SWEEP_SHAPES)"
    )
    args = ap.parse_args(argv)
    if not has_cuda("bench/verify_attention.py"):
        return 0
    torch.manual_seed(0)
    rep_ms = 20 if args.quick else 50
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.split_sweep:
        sweep = {"device": torch.cuda.get_device_name(), "rows": split_sweep(20)}
        (out / "verify_attention_split_sweep.json").write_text(json.dumps(sweep, indent=1))
        return 0
    result = {
        "device": torch.cuda.get_device_name(),
        "copy_gbps": measure_copy_bandwidth(rep_ms),
        "rows": [],
    }
    for shape in QUICK if args.quick else SHAPES:
        result["rows"].append(bench_shape(*shape, result["copy_gbps"], rep_ms))
        print(json.dumps(result["rows"][-1]), flush=True)
    (out / "verify_attention.json").write_text(json.dumps(result, indent=1))
    summary = summarize(result)
    (out / "verify_attention_summary.txt").write_text(summary + "\n")
    plot(result, out / "verify_attention.png")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
