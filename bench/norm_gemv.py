"""The RMSNorm folded into the GEMV (kernels/norm_gemv.py) vs a norm kernel + the GEMV.

A decode step at a few tokens is a chain of small GEMVs; in front of two of each layer's four (qkv
and gate_up) sits an RMSNorm: a small kernel whose time is launch and round trips. This bench
times, as CUDA graphs, for the Llama-3-8B and SmolLM2-135M layer shapes (bf16):
(a) one norm + GEMV pair per shape over distinct weight copies (cold L2), at 1, 2, 5 and 16 rows:
    "separate" = fused_ops.add_rms_norm then gemv, "folded" = add_norm_gemv with the norm applied
    after the GEMV (the engine's bf16 path), and at one row also "before" (statistics first: the
    fp16 path, and the bf16 one until session 21);
(b) the step's whole chain of linear layers as the model runs it (layers x [norm, qkv, o, norm,
    gate_up, down]) at 1 and 5 rows, each way.
The floor is the weight bytes over the device-to-device copy bandwidth measured in the same run;
prints each side's ratio to it and separate / folded.

    python bench/norm_gemv.py --out OUTDIR [--rep-ms 40]

Writes norm_gemv.json and norm_gemv_summary.txt (a PNG is not worth it for these tables).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import _bench_graph, measure_copy_bandwidth  # noqa: E402

from pagedinfer.kernels import fused_ops  # noqa: E402
from pagedinfer.kernels.gemv import config_for, gemv  # noqa: E402
from pagedinfer.kernels.norm_gemv import add_norm_gemv  # noqa: E402

EPS = 1e-5
# name: (hidden, intermediate, layers, qkv rows)
MODELS = {"8B": (4096, 14336, 32, 6144), "SmolLM2": (576, 1536, 30, 960)}
ROWS = (1, 2, 5, 16)
CHAIN_ROWS = (1, 5)


def shapes(model: str) -> dict[str, tuple[int, int]]:
    hidden, inter, _, qkv = MODELS[model]
    return {
        "qkv": (qkv, hidden),
        "o": (hidden, hidden),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


def separate(x, res, g, w):
    normed, _ = fused_ops.add_rms_norm(x, res, g, EPS, "triton")
    return gemv(normed, w, None, config_for(x.shape[0], *w.shape))


def folded(x, res, g, w):  # the norm applied after the GEMV (bf16's default)
    return add_norm_gemv(x, res, g, EPS, w, None, config_for(x.shape[0], *w.shape), scale_after=True)[0]


def before(x, res, g, w):  # one row only: the statistics pass first
    return add_norm_gemv(x, res, g, EPS, w, None, config_for(1, *w.shape), scale_after=False)[0]


def bench_model(model: str, copy_gbps: float, rep_ms: int, say) -> tuple[list, list, list]:
    """(pairs, chains, agreement) rows of one model's shapes."""
    hidden, inter, layers, _ = MODELS[model]
    shape = shapes(model)
    dtype = torch.bfloat16
    weights = {
        name: [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(layers)]
        for name, (n, k) in shape.items()
    }
    g = 1.0 + 0.1 * torch.randn(hidden, device="cuda", dtype=dtype)
    pairs, chains, agreement = [], [], []

    def ways(rows: int) -> list:
        return [("separate", separate), ("folded", folded)] + ([("before", before)] if rows == 1 else [])

    for rows in ROWS:
        x, res = (torch.randn(rows, hidden, device="cuda", dtype=dtype) for _ in range(2))
        # The paths agree (bf16 rounding of the normed row aside).
        a = separate(x, res, g, weights["qkv"][0]).float()
        b = folded(x, res, g, weights["qkv"][0]).float()
        diff = float(((a - b).norm(dim=-1) / a.norm(dim=-1)).max())
        agreement.append({"model": model, "rows": rows, "rel_diff": diff})
        for name in ("qkv", "gate_up"):
            n, k = shape[name]
            floor_us = n * k * 2 / (copy_gbps * 1e9) * 1e6
            calls = {
                way: [functools.partial(fn, x, res, g, w) for w in weights[name]] for way, fn in ways(rows)
            }
            t = {way: 1e3 * _bench_graph(fns, rep_ms) for way, fns in calls.items()}
            row = {"model": model, "shape": name, "rows": rows, "n": n, "k": k, "floor_us": floor_us}
            row.update({f"{way}_us": v for way, v in t.items()})
            row["separate_over_folded"] = t["separate"] / t["folded"]
            pairs.append(row)
            extra = f" | before {t['before']:6.1f}" if "before" in t else ""
            say(
                f"{model:7s} {name:7s} {n}x{k} rows {rows:2d}: floor {floor_us:6.1f} us | separate "
                f"{t['separate']:6.1f} ({t['separate'] / floor_us:.2f}x) | folded {t['folded']:6.1f} "
                f"({t['folded'] / floor_us:.2f}x){extra} | separate/folded {row['separate_over_folded']:.3f}x "
                f"| rel diff {diff:.1e}"
            )

    def chain(norm_gemv, x, res, x_inter) -> None:
        rows = x.shape[0]
        for layer in range(layers):
            norm_gemv(x, res, g, weights["qkv"][layer])
            gemv(x, weights["o"][layer], None, config_for(rows, *shape["o"]))
            norm_gemv(x, res, g, weights["gate_up"][layer])
            gemv(x_inter, weights["down"][layer], None, config_for(rows, *shape["down"]))

    total_bytes = sum(n * k * 2 * layers for n, k in shape.values())
    floor_ms = total_bytes / (copy_gbps * 1e9) * 1e3
    for rows in CHAIN_ROWS:
        x, res = (torch.randn(rows, hidden, device="cuda", dtype=dtype) for _ in range(2))
        x_inter = torch.randn(rows, inter, device="cuda", dtype=dtype)
        t = {
            way: _bench_graph([functools.partial(chain, fn, x, res, x_inter)], rep_ms)
            for way, fn in ways(rows)
        }
        entry = {"model": model, "rows": rows, "bytes": total_bytes, "floor_ms": floor_ms}
        entry.update({f"{way}_ms": v for way, v in t.items()})
        entry["separate_minus_folded_us"] = 1e3 * (t["separate"] - t["folded"])
        chains.append(entry)
        extra = f" | before {t['before']:.3f} ms" if "before" in t else ""
        say(
            f"{model:7s} chain of {layers} layers at {rows} rows ({total_bytes / 1e9:.2f} GB): floor "
            f"{floor_ms:.3f} ms | separate {t['separate']:.3f} ms ({t['separate'] / floor_ms:.2f}x) | "
            f"folded {t['folded']:.3f} ms ({t['folded'] / floor_ms:.2f}x){extra} | saved "
            f"{entry['separate_minus_folded_us']:.0f} us a step"
        )
    return pairs, chains, agreement


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rep-ms", type=int, default=40)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("norm_gemv: needs a CUDA GPU; nothing measured")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    copy_gbps = measure_copy_bandwidth(args.rep_ms)
    results: dict = {
        "benchmark": "norm_gemv",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_gbps": copy_gbps,
        "pairs": [],
        "chains": [],
        "agreement": [],
    }
    lines = [f"copy bandwidth {copy_gbps:,.0f} GB/s ({results['device']})"]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    for model in MODELS:
        pairs, chains, agreement = bench_model(model, copy_gbps, args.rep_ms, say)
        results["pairs"] += pairs
        results["chains"] += chains
        results["agreement"] += agreement
        torch.cuda.empty_cache()
    results["time_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (args.out / "norm_gemv.json").write_text(json.dumps(results, indent=1))
    (args.out / "norm_gemv_summary.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
