"""Paged attention on the GPU: our Triton kernels side by side with torch SDPA and a naive baseline.

Decode (one query token, batch x context, 32 query / 8 KV heads, head dim 128, bf16, block 16,
shuffled block tables): our Triton paged kernel, the optional raw-CUDA variant, torch SDPA on a
contiguous cache (best backend and layout found), and gather-then-SDPA on the paged cache.
Reported: median time per call from CUDA-graph replay over rotated input sets (the engine replays
decode graphs; eager times are kept too), KV bytes read / time, and its fraction of the
device-to-device copy bandwidth measured in the same run. Prefill / extend: TFLOP/s against SDPA's causal flash path (and cuDNN).

    python bench/attention.py --out bench/results [--quick] [--tune decode|extend|all]
        [--decode-shapes 1x512,1x8192,64x2048] [--skip-prefill] [--merge-variants]

Writes OUT/attention.json, OUT/attention.png and prints a table with ratios. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_cases as cases  # noqa: E402  (bench/ is not a package)
import common  # noqa: E402
from common import ROTATE_BYTES, bench_ms, graph_ms  # noqa: E402

BATCHES, CONTEXTS = (1, 16, 64, 256), (512, 2048, 8192)
PREFILL_SHAPES = ((1, 8192, 8192), (4, 2048, 2048), (16, 512, 512), (4, 512, 4096))  # (B, new, seq_len)
# The embedded model (head_dim 64, a GQA group of 3): a few extra rows, same columns.
SMOLLM2_DECODE = ((1, 2048), (64, 2048), (256, 2048))
SMOLLM2_PREFILL = ((1, 2048, 2048), (4, 512, 2048))
TUNE_MAX_BATCH = 16  # large batches are plain streaming: one config wins everywhere (NOTES.md)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def bench_decode(batch: int, context: int, copy_gbps: float, args, heads=cases.LLAMA) -> dict:
    kv_bytes = cases.decode_kv_bytes(batch, context, heads)
    num_sets = min(64, -(-ROTATE_BYTES // kv_bytes))
    sets = [cases.decode_inputs(batch, context, heads) for _ in range(num_sets)]
    row: dict = {"model": heads.name, "batch": batch, "context": context, "kv_bytes": kv_bytes}
    row["input_sets"] = num_sets
    ref = cases.ours_decode(sets[0])()
    sdpa_name = cases.pick_sdpa_decode(sets[0], lambda fn: bench_ms(fn, args.rep_ms))
    row["sdpa_backend"] = sdpa_name
    factories = {
        "triton": cases.ours_decode,
        "unbounded": cases.ours_unbounded_decode,
        "fused": lambda x: cases.ours_variant_decode(x, merge=cases.SplitMerge.FUSED),
        "pdl": lambda x: cases.ours_variant_decode(x, merge=cases.SplitMerge.PDL),
        "sdpa": lambda x: cases.sdpa_decode(x, sdpa_name),
        "gather": lambda x: cases.gather_decode(x, sdpa_name),
    }
    if args.cuda_lib is not None and cases.cuda_supported(heads):
        factories["cuda"] = lambda x: cases.cuda_decode(x, args.cuda_lib)
    if not args.merge_variants or not cases.decode_splits(sets[0]) > 1:
        # off by default (run_gpu.sh's time budget); without split-K they are the same kernel anyway
        del factories["fused"], factories["pdl"]
    for name, factory in factories.items():
        fns = [factory(x) for x in sets]
        try:
            err = _rel_err(fns[0](), ref)
            ms = graph_ms(fns, args.rep_ms)
        except Exception as e:  # noqa: BLE001 - a variant that fails to build or run is recorded, not fatal
            row[name] = {"error": str(e)[:300]}
            print(f"{name} {batch}x{context}: {row[name]['error']}", flush=True)
            continue
        gbps = kv_bytes / ms / 1e6
        eager_ms = bench_ms(fns[0], args.rep_ms)
        row[name] = {
            "ms": ms,
            "gbps": gbps,
            "frac_copy": gbps / copy_gbps,
            "eager_ms": eager_ms,
            "rel_err_vs_triton": err,
        }
        del fns
    if args.tune in ("decode", "all") and batch <= TUNE_MAX_BATCH:
        row["tune"] = cases.tune_decode(sets, lambda fns: graph_ms(fns, max(10, args.rep_ms // 3)), kv_bytes)
    del sets
    torch.cuda.empty_cache()
    return row


def bench_prefill(batch: int, new: int, seq_len: int, args, heads=cases.LLAMA) -> dict:
    x = cases.extend_inputs(batch, new, seq_len, heads)
    flops = cases.extend_flops(batch, new, seq_len, heads)
    row: dict = {"model": heads.name, "batch": batch, "new_tokens": new, "seq_len": seq_len, "flops": flops}
    ours = cases.ours_extend(x)
    ref = ours()
    variants = {"triton": ours, **cases.sdpa_prefill_variants(x)}
    for name, fn in variants.items():
        try:
            out = fn()
        except RuntimeError as e:  # a backend that does not take this shape
            row[name] = {"error": str(e).splitlines()[0][:200]}
            continue
        ms = bench_ms(fn, args.rep_ms)
        row[name] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err_vs_triton": _rel_err(out, ref)}
    if args.tune in ("extend", "all"):
        row["tune"] = cases.tune_extend(x, lambda fn: bench_ms(fn, max(10, args.rep_ms // 2)), flops)
    del x
    torch.cuda.empty_cache()
    return row


def _ratio(row: dict, a: str, b: str, key: str) -> float | None:
    if a in row and b in row and key in row[a] and key in row[b]:
        return row[a][key] / row[b][key]
    return None


def _rows(result: dict, kind: str, model: str = cases.LLAMA.name) -> list[dict]:
    return [r for r in result[kind] if r.get("model", cases.LLAMA.name) == model]


def _decode_lines(rows: list[dict]) -> list[str]:
    names = ("triton", "unbounded", "fused", "pdl", "cuda", "sdpa", "gather")
    lines = [
        f"{'batch':>5} {'ctx':>5} | "
        + " | ".join(f"{n:>22}" for n in names)
        + f" | {'vs sdpa':>7} {'vs gather':>9}"
    ]
    for r in rows:
        cells = []
        for name in names:
            v = r.get(name)
            ok = v and "ms" in v
            cells.append(f"{v['ms']:8.4f} {v['gbps']:6.0f} {v['frac_copy']:5.2f}" if ok else f"{'-':>22}")
        vs_sdpa = _ratio(r, "triton", "sdpa", "gbps") or 0.0
        vs_gather = _ratio(r, "triton", "gather", "gbps") or 0.0
        lines.append(
            f"{r['batch']:>5} {r['context']:>5} | "
            + " | ".join(cells)
            + f" | {vs_sdpa:7.2f} {vs_gather:9.2f}"
        )
    return lines


def _prefill_lines(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        tflops = {name: v["tflops"] for name, v in r.items() if isinstance(v, dict) and "tflops" in v}
        cells = " ".join(f"{name}={value:.0f}" for name, value in tflops.items())
        ratio = _ratio(r, "triton", "sdpa_flash", "tflops") or 0.0
        lines.append(
            f"B={r['batch']} new={r['new_tokens']} len={r['seq_len']}: {cells}  triton/flash={ratio:.2f}"
        )
    return lines


def summarize(result: dict) -> str:
    lines = [f"device: {result['device']}  copy bandwidth {result['copy_gbps']:.0f} GB/s (read+write)"]
    for heads in (cases.LLAMA, cases.SMOLLM2):
        desc = f"{heads.name}: {heads.num_heads}q/{heads.num_kv_heads}kv heads, d{heads.head_dim}, bf16, block 16"
        if _rows(result, "decode", heads.name):
            lines.append(f"decode ({desc}): ms | GB/s | fraction of copy bw")
            lines += _decode_lines(_rows(result, "decode", heads.name))
        if _rows(result, "prefill", heads.name):
            lines.append(f"prefill/extend ({desc}): TFLOP/s")
            lines += _prefill_lines(_rows(result, "prefill", heads.name))
    b1 = [r for r in _rows(result, "decode") if r["batch"] == 1 and r["context"] == max(CONTEXTS)]
    if b1:
        floor_ms = b1[0]["kv_bytes"] / result["copy_gbps"] / 1e6
        got = ", ".join(
            f"{n} {b1[0][n]['ms'] * 1e3:.1f} us ({b1[0][n]['ms'] / floor_ms:.2f}x)"
            for n in ("triton", "unbounded", "fused", "pdl")
            if "ms" in b1[0].get(n, {})
        )
        lines.append(f"llama batch 1 x ctx 8192: bandwidth floor {floor_ms * 1e3:.1f} us; {got}")
    lines += _tune_lines(result["decode"])
    return "\n".join(lines)


def _tune_lines(rows: list[dict]) -> list[str]:
    """Best (tile, splits) per merge for every tuned decode shape, and the default's time."""
    lines = []
    for r in rows:
        if not r.get("tune"):
            continue
        best: dict[str, dict] = {}
        for t in r["tune"]:
            merge = t["config"]["merge"] if t["num_splits"] > 1 else "none"
            if "ms" in t and (merge not in best or t["ms"] < best[merge]["ms"]):
                best[merge] = t
        cells = [
            f"{m} {t['ms'] * 1e3:.1f}us ({t['config']['block_n']}/{t['config']['num_warps']}/"
            f"{t['config']['num_stages']}{'/r' + str(t['config']['maxnreg']) if t['config'].get('maxnreg') else ''}"
            f", {t['num_splits']} sp)"
            for m, t in sorted(best.items())
        ]
        lines.append(
            f"tune {r['model']} {r['batch']}x{r['context']}: default {r['triton']['ms'] * 1e3:.1f}us; "
            + "; ".join(cells)
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--quick", action="store_true", help="fewer shapes and shorter timing")
    ap.add_argument(
        "--tune", choices=("none", "decode", "extend", "all"), default="none", help="sweep tile configs"
    )
    ap.add_argument("--no-cuda-variant", dest="cuda_variant", action="store_false")
    ap.add_argument("--decode-shapes", default=None, help="only these llama decode rows, e.g. 1x512,64x2048")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument(
        "--merge-variants", action="store_true", help="also time the FUSED and PDL split merges forced on"
    )
    args = ap.parse_args(argv)
    if not common.has_cuda("bench/attention.py"):
        return 0
    warnings.filterwarnings("ignore")
    args.rep_ms = 30 if args.quick else 100
    args.cuda_lib = cases.load_cuda_variant() if args.cuda_variant else None
    torch.manual_seed(0)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "copy_gbps": common.measure_copy_bandwidth(args.rep_ms),
        "decode": [],
        "prefill": [],
    }
    batches = BATCHES[1::2] if args.quick else BATCHES
    shapes = [(b, c) for b in batches for c in CONTEXTS]
    if args.decode_shapes:
        shapes = [tuple(int(n) for n in s.split("x")) for s in args.decode_shapes.split(",")]
    for batch, context in shapes:
        result["decode"].append(bench_decode(batch, context, result["copy_gbps"], args))
        print(json.dumps({k: v for k, v in result["decode"][-1].items() if k != "tune"}), flush=True)
    for batch, context in () if args.quick or args.decode_shapes else SMOLLM2_DECODE:
        result["decode"].append(bench_decode(batch, context, result["copy_gbps"], args, cases.SMOLLM2))
        print(json.dumps({k: v for k, v in result["decode"][-1].items() if k != "tune"}), flush=True)
    prefill = [] if args.skip_prefill else [(shape, cases.LLAMA) for shape in PREFILL_SHAPES]
    prefill += (
        [] if args.quick or args.skip_prefill else [(shape, cases.SMOLLM2) for shape in SMOLLM2_PREFILL]
    )
    for (batch, new, seq_len), heads in prefill:
        result["prefill"].append(bench_prefill(batch, new, seq_len, args, heads))
        print(json.dumps({k: v for k, v in result["prefill"][-1].items() if k != "tune"}), flush=True)
    (out_dir / "attention.json").write_text(json.dumps(result, indent=1))
    summary = summarize(result)
    (out_dir / "attention_summary.txt").write_text(summary + "\n")
    cases.plot(result, out_dir / "attention.png")
    print(summary)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
