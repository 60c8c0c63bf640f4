"""Paged attention on the GPU: our Triton kernels side by side with torch SDPA and a naive baseline.

Decode (one query token, batch x context, 32 query / 8 KV heads, head dim 128, bf16, block 16,
shuffled block tables): our Triton paged kernel, the optional raw-CUDA variant, torch SDPA on a
contiguous cache (best backend and layout found), and gather-then-SDPA on the paged cache.
Reported: median time, KV bytes read / time, its fraction of the device-to-device copy bandwidth
measured in the same run. Prefill / extend: TFLOP/s against SDPA's causal flash path (and cuDNN).

    python bench/attention.py --out bench/results [--quick] [--tune]

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

BATCHES, CONTEXTS = (1, 16, 64, 256), (512, 2048, 8192)
PREFILL_SHAPES = ((1, 8192, 8192), (4, 2048, 2048), (16, 512, 512), (4, 512, 4096))  # (B, new, seq_len)


def _bench(fn, rep_ms: int) -> float:
    """Median milliseconds with device events; do_bench clears L2 before every call."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median"))


def measure_copy_bandwidth(rep_ms: int) -> float:
    """Device-to-device copy of 2 GiB, counting bytes read + written, in GB/s."""
    src = torch.randn(2**29, device="cuda")  # 2 GiB fp32
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src), rep_ms)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def bench_decode(batch: int, context: int, copy_gbps: float, args) -> dict:
    x = cases.decode_inputs(batch, context)
    kv_bytes = 2 * x["key_cache"].numel() * x["key_cache"].element_size()
    row: dict = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
    ours = cases.ours_decode(x)
    ref = ours()
    variants = {"triton": ours}
    sdpa, sdpa_name = cases.best_sdpa_decode(x, lambda fn: _bench(fn, args.rep_ms))
    if sdpa is not None:
        variants["sdpa"] = sdpa
        row["sdpa_backend"] = sdpa_name
    variants["gather"] = cases.gather_decode(x, sdpa_name)
    cuda_fn = cases.cuda_decode(x) if args.cuda_variant else None
    if cuda_fn is not None:
        variants["cuda"] = cuda_fn
    for name, fn in variants.items():
        err = _rel_err(fn(), ref)
        ms = _bench(fn, args.rep_ms)
        gbps = kv_bytes / ms / 1e6
        row[name] = {"ms": ms, "gbps": gbps, "frac_copy": gbps / copy_gbps, "rel_err_vs_triton": err}
    if args.tune:
        row["tune"] = cases.tune_decode(x, lambda fn: _bench(fn, max(10, args.rep_ms // 2)), kv_bytes)
    del x
    torch.cuda.empty_cache()
    return row


def bench_prefill(batch: int, new: int, seq_len: int, args) -> dict:
    x = cases.extend_inputs(batch, new, seq_len)
    flops = cases.extend_flops(batch, new, seq_len)
    row: dict = {"batch": batch, "new_tokens": new, "seq_len": seq_len, "flops": flops}
    ours = cases.ours_extend(x)
    ref = ours()
    variants = {"triton": ours, **cases.sdpa_prefill_variants(x)}
    for name, fn in variants.items():
        try:
            out = fn()
        except RuntimeError as e:  # a backend that does not take this shape
            row[name] = {"error": str(e).splitlines()[0][:200]}
            continue
        ms = _bench(fn, args.rep_ms)
        row[name] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err_vs_triton": _rel_err(out, ref)}
    if args.tune:
        row["tune"] = cases.tune_extend(x, lambda fn: _bench(fn, max(10, args.rep_ms // 2)), flops)
    del x
    torch.cuda.empty_cache()
    return row


def _ratio(row: dict, a: str, b: str, key: str) -> float | None:
    if a in row and b in row and key in row[a] and key in row[b]:
        return row[a][key] / row[b][key]
    return None


def summarize(result: dict) -> str:
    lines = [
        f"device: {result['device']}  copy bandwidth {result['copy_gbps']:.0f} GB/s (read+write)",
        "decode (32q/8kv heads, d128, bf16, block 16): ms | GB/s | frac of copy bw",
        f"{'batch':>5} {'ctx':>5} | {'triton':>22} | {'cuda':>22} | {'sdpa':>22} | {'gather':>22}"
        f" | {'vs sdpa':>7} {'vs gather':>9}",
    ]
    for r in result["decode"]:
        cells = []
        for name in ("triton", "cuda", "sdpa", "gather"):
            v = r.get(name)
            cells.append(f"{v['ms']:8.4f} {v['gbps']:6.0f} {v['frac_copy']:5.2f}" if v else f"{'-':>22}")
        vs_sdpa = _ratio(r, "triton", "sdpa", "gbps")
        vs_gather = _ratio(r, "triton", "gather", "gbps")
        lines.append(
            f"{r['batch']:>5} {r['context']:>5} | "
            + " | ".join(cells)
            + f" | {vs_sdpa or 0:7.2f} {vs_gather or 0:9.2f}"
        )
    b1 = [r for r in result["decode"] if r["batch"] == 1 and r["context"] == max(CONTEXTS)]
    if b1:
        floor_ms = b1[0]["kv_bytes"] / result["copy_gbps"] / 1e6
        lines.append(
            f"batch 1 x ctx 8192: floor {floor_ms * 1e3:.1f} us, triton {b1[0]['triton']['ms'] * 1e3:.1f} us"
        )
    lines.append("prefill/extend (32q/8kv, d128, bf16): TFLOP/s")
    for r in result["prefill"]:
        cells = " ".join(
            f"{name}={r[name]['tflops']:.0f}"
            for name in r
            if isinstance(r[name], dict) and "tflops" in r[name]
        )
        ratio = _ratio(r, "triton", "sdpa_flash", "tflops")
        lines.append(
            f"B={r['batch']} new={r['new_tokens']} len={r['seq_len']}: {cells}  triton/flash={ratio or 0:.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--quick", action="store_true", help="fewer shapes and shorter timing")
    ap.add_argument("--tune", action="store_true", help="also sweep kernel tile configs")
    ap.add_argument("--no-cuda-variant", dest="cuda_variant", action="store_false")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA GPU; nothing measured")
        return 0
    warnings.filterwarnings("ignore")
    args.rep_ms = 30 if args.quick else 100
    torch.manual_seed(0)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "copy_gbps": measure_copy_bandwidth(args.rep_ms),
        "decode": [],
        "prefill": [],
    }
    batches = BATCHES[1::2] if args.quick else BATCHES
    for batch in batches:
        for context in CONTEXTS:
            result["decode"].append(bench_decode(batch, context, result["copy_gbps"], args))
            print(json.dumps({k: v for k, v in result["decode"][-1].items() if k != "tune"}), flush=True)
    for batch, new, seq_len in PREFILL_SHAPES:
        result["prefill"].append(bench_prefill(batch, new, seq_len, args))
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
