"""The RMSNorm carried by GEMV epilogues at 2-16 rows (kernels/norm_epilogue.py) vs a norm kernel.

A verification step runs every linear layer at a few rows, and in front of qkv and gate_up sits
an RMSNorm kernel (~1.6 us in a graph at SmolLM2's shapes, 60 a step). The epilogue path has
o_proj / down write h, u = h * g and partial sums of h^2 (`add_prenorm`), and qkv / gate_up scale
their rows by rstd (`rstd_linear`). Timed as CUDA graphs, bf16, for the SmolLM2-135M and
Llama-3-8B layer shapes at 2, 5 and 16 rows:
(a) per kernel, over distinct weight copies: o / down as the plain GEMV vs `add_prenorm`; qkv /
    gate_up as norm kernel + GEMV vs `rstd_linear`;
(b) the step's chain of linear layers (layers x [qkv, o, gate_up, down], attention and SwiGLU left
    out), norm kernels vs epilogues.
The floor is the weight bytes over the device-to-device copy bandwidth measured in the same run;
prints each side's ratio to it and norm kernels / epilogues.

    python bench/norm_epilogue.py --out OUTDIR [--rep-ms 25]

Writes norm_epilogue.json and norm_epilogue_summary.txt.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import gpu_parser, graph_ms, has_cuda, measure_copy_bandwidth, write_results  # noqa: E402

from pagedinfer.kernels import fused_ops  # noqa: E402
from pagedinfer.kernels.gemv import config_for, gemv  # noqa: E402
from pagedinfer.kernels.norm_epilogue import add_prenorm, rstd_linear  # noqa: E402

EPS = 1e-5
# name: (hidden, intermediate, layers, qkv rows)
MODELS = {"SmolLM2": (576, 1536, 30, 960), "8B": (4096, 14336, 32, 6144)}
ROWS = (2, 5, 16)


def norm_then_gemv(x, res, g, w):
    normed, _ = fused_ops.add_rms_norm(x, res, g, EPS, "triton")
    return gemv(normed, w, None, config_for(x.shape[0], *w.shape))


def plain_gemv(x, res, g, w):
    return gemv(x, w, None, config_for(x.shape[0], *w.shape))


def prenorm(x, res, g, w):
    return add_prenorm(x, w, res, g, config_for(x.shape[0], *w.shape))


def rstd(pre, w):
    return rstd_linear(pre, EPS, w, None, config_for(pre.u.shape[0], *w.shape))


def bench_model(model: str, copy_gbps: float, rep_ms: int, say) -> tuple[list, list]:
    hidden, inter, layers, qkv = MODELS[model]
    dtype = torch.bfloat16
    shapes = {
        "qkv": (qkv, hidden),
        "o": (hidden, hidden),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }
    weights = {
        name: [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(layers)]
        for name, (n, k) in shapes.items()
    }
    g = [1.0 + 0.1 * torch.randn(hidden, device="cuda", dtype=dtype) for _ in range(layers + 1)]
    kernels, chains = [], []
    total_bytes = sum(n * k * 2 * layers for n, k in shapes.values())
    floor_ms = total_bytes / (copy_gbps * 1e9) * 1e3
    for rows in ROWS:
        x = {name: torch.randn(rows, k, device="cuda", dtype=dtype) for name, (_, k) in shapes.items()}
        res = torch.randn(rows, hidden, device="cuda", dtype=dtype)
        pre = prenorm(x["o"], res, g[0], weights["o"][0])
        # (a) one kernel at a time
        for name in ("o", "down"):
            ways = {
                "gemv": [functools.partial(plain_gemv, x[name], res, g[0], w) for w in weights[name]],
                "epilogue": [functools.partial(prenorm, x[name], res, g[0], w) for w in weights[name]],
            }
            kernels.append(time_ways(model, name, rows, shapes[name], ways, copy_gbps, rep_ms, say))
        for name in ("qkv", "gate_up"):
            ways = {
                "norm+gemv": [
                    functools.partial(norm_then_gemv, x[name], res, g[0], w) for w in weights[name]
                ],
                "epilogue": [functools.partial(rstd, pre, w) for w in weights[name]],
            }
            kernels.append(time_ways(model, name, rows, shapes[name], ways, copy_gbps, rep_ms, say))

        # (b) the chain of linear layers
        def with_norm_kernels(x=x, res=res, rows=rows):
            h = res
            for i in range(layers):
                normed, h = fused_ops.add_rms_norm(x["o"], h, g[i], EPS, "triton")
                gemv(normed, weights["qkv"][i], None, config_for(rows, *shapes["qkv"]))
                o = gemv(x["o"], weights["o"][i], None, config_for(rows, *shapes["o"]))
                normed, h = fused_ops.add_rms_norm(o, h, g[i], EPS, "triton")
                gemv(normed, weights["gate_up"][i], None, config_for(rows, *shapes["gate_up"]))
                x_next = gemv(x["down"], weights["down"][i], None, config_for(rows, *shapes["down"]))
            return fused_ops.add_rms_norm(x_next, h, g[layers], EPS, "triton")

        def with_epilogues(x=x, res=res, rows=rows):
            pending = None  # the previous layer's down output: the next norm half done
            h = res
            for i in range(layers):
                if pending is None:  # layer 0: no GEMV before its input norm
                    normed, h = fused_ops.add_rms_norm(x["o"], h, g[i], EPS, "triton")
                    gemv(normed, weights["qkv"][i], None, config_for(rows, *shapes["qkv"]))
                else:
                    rstd(pending, weights["qkv"][i])
                    h = pending.h
                pre = prenorm(x["o"], h, g[i], weights["o"][i])
                rstd(pre, weights["gate_up"][i])
                if i + 1 < layers:
                    pending = prenorm(x["down"], pre.h, g[i + 1], weights["down"][i])
            # As the engine: the last down is a plain GEMV and the final norm a kernel.
            out = gemv(x["down"], weights["down"][layers - 1], None, config_for(rows, *shapes["down"]))
            return fused_ops.add_rms_norm(out, pre.h, g[layers], EPS, "triton")

        t = {
            "norm kernels": graph_ms([with_norm_kernels], rep_ms),
            "epilogues": graph_ms([with_epilogues], rep_ms),
        }
        entry = {"model": model, "rows": rows, "bytes": total_bytes, "floor_ms": floor_ms}
        entry.update({f"{way}_ms": v for way, v in t.items()})
        entry["saved_us"] = 1e3 * (t["norm kernels"] - t["epilogues"])
        chains.append(entry)
        say(
            f"{model:7s} chain of {layers} layers at {rows:2d} rows: floor {floor_ms:.3f} ms | norm kernels "
            f"{t['norm kernels']:.3f} ms ({t['norm kernels'] / floor_ms:.2f}x) | epilogues "
            f"{t['epilogues']:.3f} ms ({t['epilogues'] / floor_ms:.2f}x) | norm kernels / epilogues "
            f"{t['norm kernels'] / t['epilogues']:.3f}x, saved {entry['saved_us']:.0f} us a step"
        )
    return kernels, chains


def time_ways(model, name, rows, shape, ways, copy_gbps, rep_ms, say) -> dict:
    n, k = shape
    floor_us = n * k * 2 / (copy_gbps * 1e9) * 1e6
    t = {way: 1e3 * graph_ms(fns, rep_ms) for way, fns in ways.items()}
    base = next(iter(t))
    row = {"model": model, "shape": name, "rows": rows, "n": n, "k": k, "floor_us": floor_us}
    row.update({f"{way}_us": v for way, v in t.items()})
    say(
        f"{model:7s} {name:7s} {n}x{k} rows {rows:2d}: floor {floor_us:5.1f} us | "
        + " | ".join(f"{way} {v:5.2f}" for way, v in t.items())
        + f" | {base} / epilogue {t[base] / t['epilogue']:.3f}x"
    )
    return row


def main() -> int:
    args = gpu_parser(__doc__, rep_ms=25).parse_args()
    if not has_cuda("norm_epilogue"):
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    copy_gbps = measure_copy_bandwidth(args.rep_ms)
    results: dict = {
        "benchmark": "norm_epilogue",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_gbps": copy_gbps,
        "kernels": [],
        "chains": [],
    }
    lines = [f"copy bandwidth {copy_gbps:,.0f} GB/s ({results['device']})"]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    for model in MODELS:
        kernels, chains = bench_model(model, copy_gbps, args.rep_ms, say)
        results["kernels"] += kernels
        results["chains"] += chains
        torch.cuda.empty_cache()
    write_results(args.out, "norm_epilogue", results, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
