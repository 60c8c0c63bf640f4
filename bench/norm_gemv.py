"""The RMSNorm folded into the small-batch GEMV (kernels/norm_gemv.py) vs a norm kernel + the GEMV.

Decode at 1-16 tokens a step is a chain of GEMVs; in front of two of each layer's four (qkv and
gate_up) sits an RMSNorm of those rows: a tiny kernel whose time is launch and round trips.
This bench times, as CUDA graphs, (a) one norm + GEMV pair per shape over one weight copy per
layer (cold L2 for the 8B shape; SmolLM2's copies partly fit in L2, as its real weights partly do)
and (b) the whole step's chain of linear layers as the model runs it (layers x [norm, qkv, o,
norm, gate_up, down]), each way: "separate" = fused_ops.add_rms_norm then
gemv, "folded" = add_norm_gemv. The floor is the weight bytes over the device-to-device copy
bandwidth measured in the same run; prints each side's ratio to it and separate / folded.

    python bench/norm_gemv.py --out OUTDIR [--rep-ms 40] [--rows 1,4,16] [--models llama3-8b,smollm2-135m]

Writes norm_gemv.json and norm_gemv_summary.txt (a PNG is not worth it for four numbers).
"""

from __future__ import annotations

import argparse
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
# model: (hidden, intermediate, layers, {shape: (N, K)})
MODELS = {
    "llama3-8b": (4096, 14336, 32, {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}),
    "smollm2-135m": (576, 1536, 30, {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}),
}  # fmt: skip


def separate(x, res, g, w):
    normed, _ = fused_ops.add_rms_norm(x, res, g, EPS, "triton")
    return gemv(normed, w, None, config_for(x.shape[0], *w.shape))


def folded(x, res, g, w):
    return add_norm_gemv(x, res, g, EPS, w, None, config_for(x.shape[0], *w.shape))[0]


def measure(model: str, rows: int, copy_gbps: float, rep_ms: int, say) -> dict:
    """Pairs (qkv, gate_up) and the chain of one model's linear layers at `rows` rows, both ways."""
    hidden, inter, layers, shapes = MODELS[model]
    dtype = torch.bfloat16
    weights = {
        s: [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(layers)]
        for s, (n, k) in shapes.items()
    }
    x, res = (torch.randn(rows, hidden, device="cuda", dtype=dtype) for _ in range(2))
    x_inter = torch.randn(rows, inter, device="cuda", dtype=dtype)
    g = 1.0 + 0.1 * torch.randn(hidden, device="cuda", dtype=dtype)
    out: dict = {"model": model, "rows": rows}
    # The two paths agree (bf16 rounding of the normed rows aside).
    a, b = separate(x, res, g, weights["qkv"][0]).float(), folded(x, res, g, weights["qkv"][0]).float()
    out["rel_diff"] = float((a - b).norm() / a.norm())
    say(f"{model} rows={rows}: separate vs folded output, qkv: rel diff {out['rel_diff']:.2e}")
    out["pairs"] = []
    for shape in ("qkv", "gate_up"):
        n, k = shapes[shape]
        floor_us = n * k * 2 / (copy_gbps * 1e9) * 1e6
        t = {
            name: 1e3 * _bench_graph([lambda w=w, fn=fn: fn(x, res, g, w) for w in weights[shape]], rep_ms)
            for name, fn in (("separate", separate), ("folded", folded))
        }
        row = {"shape": shape, "n": n, "k": k, "floor_us": floor_us, **{f"{k_}_us": v for k_, v in t.items()}}
        row["separate_over_folded"] = t["separate"] / t["folded"]
        out["pairs"].append(row)
        say(
            f"  {shape:8s} {n}x{k}: floor {floor_us:6.1f} us | separate {t['separate']:6.1f} "
            f"({t['separate'] / floor_us:.3f}x) | folded {t['folded']:6.1f} ({t['folded'] / floor_us:.3f}x) "
            f"| separate/folded {row['separate_over_folded']:.3f}x"
        )

    def chain(norm_gemv):
        for layer in range(layers):
            norm_gemv(x, res, g, weights["qkv"][layer])
            gemv(x, weights["o"][layer], None, config_for(rows, *shapes["o"]))
            norm_gemv(x, res, g, weights["gate_up"][layer])
            gemv(x_inter, weights["down"][layer], None, config_for(rows, *shapes["down"]))

    total_bytes = sum(n * k * 2 * layers for n, k in shapes.values())
    floor_ms = total_bytes / (copy_gbps * 1e9) * 1e3
    t = {
        name: _bench_graph([lambda fn=fn: chain(fn)], rep_ms)
        for name, fn in (("separate", separate), ("folded", folded))
    }
    out["chain"] = {"bytes": total_bytes, "floor_ms": floor_ms, **{f"{k}_ms": v for k, v in t.items()}}
    out["chain"]["separate_minus_folded_ms"] = t["separate"] - t["folded"]
    say(
        f"  chain of {layers} layers ({total_bytes / 1e9:.3f} GB): floor {floor_ms:.3f} ms | separate "
        f"{t['separate']:.3f} ms ({t['separate'] / floor_ms:.3f}x) | folded {t['folded']:.3f} ms "
        f"({t['folded'] / floor_ms:.3f}x) | saved {1e3 * (t['separate'] - t['folded']):.0f} us a step"
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rep-ms", type=int, default=40)
    ap.add_argument("--rows", default="1,4,16", help="rows of x (1: the reduce kernel, 2-16: the dot kernel)")
    ap.add_argument("--models", default="llama3-8b,smollm2-135m")
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
    }
    results["copy_gbps"] = copy_gbps
    lines = [f"copy bandwidth {copy_gbps:,.0f} GB/s ({results['device']})"]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    results["runs"] = [
        measure(model, int(rows), copy_gbps, args.rep_ms, say)
        for model in args.models.split(",")
        for rows in args.rows.split(",")
    ]
    results["time_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (args.out / "norm_gemv.json").write_text(json.dumps(results, indent=1))
    (args.out / "norm_gemv_summary.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
