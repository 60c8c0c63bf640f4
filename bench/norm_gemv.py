"""The RMSNorm folded into the one-row GEMV (kernels/norm_gemv.py) vs a norm kernel + the GEMV.

Single-stream decode of the 8B shape is a chain of one-row GEMVs; in front of two of each layer's
four (qkv and gate_up) sits an RMSNorm of one row: a one-program kernel whose time is launch and
round trips. This bench times, as CUDA graphs, (a) one norm + GEMV pair per shape over 32 distinct
weight copies (cold L2) and (b) the whole step's chain of linear layers as the model runs it
(32 x [norm, qkv, o, norm, gate_up, down]), each way: "separate" = fused_ops.add_rms_norm then
gemv, "folded" = add_norm_gemv. The floor is the weight bytes over the device-to-device copy
bandwidth measured in the same run; prints each side's ratio to it and separate / folded.

    python bench/norm_gemv.py --out OUTDIR [--rep-ms 40]

Writes norm_gemv.json and norm_gemv_summary.txt (a PNG is not worth it for four numbers).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import gpu_parser, graph_ms, has_cuda, measure_copy_bandwidth, write_results  # noqa: E402

from pagedinfer.kernels import fused_ops  # noqa: E402
from pagedinfer.kernels.gemv import config_for, gemv  # noqa: E402
from pagedinfer.kernels.norm_gemv import add_norm_gemv  # noqa: E402

HIDDEN, INTER, LAYERS, EPS = 4096, 14336, 32, 1e-5
SHAPES = {
    "qkv": (6144, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}


def separate(x, res, g, w):
    normed, _ = fused_ops.add_rms_norm(x, res, g, EPS, "triton")
    return gemv(normed, w, None, config_for(1, *w.shape))


def folded(x, res, g, w):
    return add_norm_gemv(x, res, g, EPS, w, None, config_for(1, *w.shape))[0]


def main() -> int:
    args = gpu_parser(__doc__, rep_ms=40).parse_args()
    if not has_cuda("norm_gemv"):
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    dtype = torch.bfloat16
    copy_gbps = measure_copy_bandwidth(args.rep_ms)
    weights = {
        s: [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(LAYERS)]
        for s, (n, k) in SHAPES.items()
    }
    x, res = (torch.randn(1, HIDDEN, device="cuda", dtype=dtype) for _ in range(2))
    x_inter = torch.randn(1, INTER, device="cuda", dtype=dtype)
    g = 1.0 + 0.1 * torch.randn(HIDDEN, device="cuda", dtype=dtype)
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

    # The two paths agree (bf16 rounding of the normed row aside).
    a, b = separate(x, res, g, weights["qkv"][0]).float(), folded(x, res, g, weights["qkv"][0]).float()
    results["rel_diff"] = float((a - b).norm() / a.norm())
    say(f"separate vs folded output, qkv: rel diff {results['rel_diff']:.2e}")

    results["pairs"] = []
    for shape in ("qkv", "gate_up"):
        n, k = SHAPES[shape]
        floor_us = n * k * 2 / (copy_gbps * 1e9) * 1e6
        t = {
            name: 1e3 * graph_ms([lambda w=w, fn=fn: fn(x, res, g, w) for w in weights[shape]], args.rep_ms)
            for name, fn in (("separate", separate), ("folded", folded))
        }
        row = {"shape": shape, "n": n, "k": k, "floor_us": floor_us, **{f"{k_}_us": v for k_, v in t.items()}}
        row["separate_over_folded"] = t["separate"] / t["folded"]
        results["pairs"].append(row)
        say(
            f"{shape:8s} {n}x{k}: floor {floor_us:6.1f} us | separate {t['separate']:6.1f} "
            f"({t['separate'] / floor_us:.3f}x) | folded {t['folded']:6.1f} ({t['folded'] / floor_us:.3f}x) "
            f"| separate/folded {row['separate_over_folded']:.3f}x"
        )

    def chain(norm_gemv):
        for layer in range(LAYERS):
            norm_gemv(x, res, g, weights["qkv"][layer])
            gemv(x, weights["o"][layer], None, config_for(1, *SHAPES["o"]))
            norm_gemv(x, res, g, weights["gate_up"][layer])
            gemv(x_inter, weights["down"][layer], None, config_for(1, *SHAPES["down"]))

    total_bytes = sum(n * k * 2 * LAYERS for n, k in SHAPES.values())
    floor_ms = total_bytes / (copy_gbps * 1e9) * 1e3
    t = {
        name: graph_ms([lambda fn=fn: chain(fn)], args.rep_ms)
        for name, fn in (("separate", separate), ("folded", folded))
    }
    results["chain"] = {"bytes": total_bytes, "floor_ms": floor_ms, **{f"{k}_ms": v for k, v in t.items()}}
    results["chain"]["separate_minus_folded_ms"] = t["separate"] - t["folded"]
    say(
        f"chain of {LAYERS} layers ({total_bytes / 1e9:.2f} GB): floor {floor_ms:.3f} ms | separate {t['separate']:.3f} ms "
        f"({t['separate'] / floor_ms:.3f}x) | folded {t['folded']:.3f} ms ({t['folded'] / floor_ms:.3f}x) "
        f"| saved {1e3 * (t['separate'] - t['folded']):.0f} us a step"
    )
    write_results(args.out, "norm_gemv", results, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
