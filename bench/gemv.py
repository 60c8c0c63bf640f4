"""Small-batch linear layers (decode GEMV): torch's GEMM (cuBLAS) vs kernels/gemv.py, side by side.

At batch 1 a decode step of the 8B shape reads ~15 GB of weights through 129 linear layers; the
floor is those bytes over the device-to-device copy bandwidth measured in the same run. For each
layer shape of Llama-3-8B (qkv, o, gate_up, down, lm_head) and row counts M, the script times one
CUDA graph that runs the layer over 32 distinct weight copies (cold L2, as in a real step), for
torch's `F.linear` and a sweep of Triton configs; then the whole step's chain of linear layers
with torch and with the best Triton config per shape. Prints GB/s, the fraction of copy bandwidth
and the torch / Triton ratio; writes gemv.json (+ gemv.png).

    python bench/gemv.py --out OUTDIR [--rows 1,2,4,8] [--rep-ms 40] [--model smollm2]

--model smollm2 takes SmolLM2-135M's shapes (hidden 576: every layer is a few launch latencies,
the regime of the n-gram benchmark's verification at 3-7 rows). Each layer row also times the
config the engine routes that shape to (`gemv.config_for`, torch where it says None), and the
chain a third time routed so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import gpu_parser, graph_ms, has_cuda, measure_copy_bandwidth, write_results  # noqa: E402

from pagedinfer.kernels.gemv import GemvConfig, config_for, gemv  # noqa: E402

# name: (hidden, intermediate, vocabulary, layers, qkv rows)
MODELS = {
    "llama3-8b": (4096, 14336, 128256, 32, 6144),
    "smollm2": (576, 1536, 49152, 30, 960),  # 9 query heads, 3 KV heads of 64
}


def model_shapes(model: str) -> tuple[int, int, int, dict[str, tuple[int, int, int]]]:
    """hidden, intermediate, layers and {name: (N, K, copies in the chain)} of a model."""
    hidden, inter, vocab, layers, qkv = MODELS[model]
    shapes = {
        "qkv": (qkv, hidden, layers),
        "o": (hidden, hidden, layers),
        "gate_up": (2 * inter, hidden, layers),
        "down": (hidden, inter, layers),
        "lm_head": (vocab, hidden, 1),
    }
    return hidden, inter, layers, shapes


_, _, LAYERS, SHAPES = model_shapes("llama3-8b")  # (bench/gemm_batch.py's shapes)

CONFIGS = [
    GemvConfig("reduce", 8, 512, 4, 4),
    GemvConfig("reduce", 16, 512, 4, 4),
    GemvConfig("reduce", 16, 256, 4, 4),
    GemvConfig("reduce", 32, 256, 4, 4),
    GemvConfig("reduce", 16, 1024, 8, 3),
    GemvConfig("reduce", 32, 512, 8, 3),
    GemvConfig("reduce", 16, 512, 4, 6),
    GemvConfig("reduce", 8, 1024, 4, 3),
    GemvConfig("dot", 32, 128, 4, 4),
    GemvConfig("dot", 64, 128, 4, 4),
    GemvConfig("dot", 32, 256, 4, 3),
    GemvConfig("dot", 64, 256, 4, 3),
    GemvConfig("dot", 128, 128, 4, 4),
    GemvConfig("dot", 16, 256, 4, 4),
    GemvConfig("dot", 32, 128, 4, 6),
    GemvConfig("dot", 64, 64, 4, 6),
    # K of a few hundred (SmolLM2's 576): one or two tiles a program instead of 5 at BLOCK_K 128
    GemvConfig("dot", 16, 512, 4, 2),
    GemvConfig("dot", 32, 512, 4, 2),
    GemvConfig("dot", 16, 1024, 4, 1),
    # two and eight warps (session 22: two on 16-wide tiles serve SmolLM2's shapes at 2-16 rows)
    GemvConfig("dot", 16, 128, 2, 6),
    GemvConfig("dot", 16, 256, 2, 4),
    GemvConfig("dot", 32, 128, 8, 6),
    GemvConfig("dot", 32, 128, 2, 6),
    # 17-64 rows over 16-row blocks (session 23): each block as fast as 16 rows alone?
    GemvConfig("dot", 16, 256, 2, 4, block_m=16),
    GemvConfig("dot", 16, 128, 2, 6, block_m=16),
    GemvConfig("dot", 32, 128, 4, 6, block_m=16),
    GemvConfig("dot", 32, 128, 4, 4, block_m=16),
    GemvConfig("dot", 16, 256, 4, 4, block_m=16),
    GemvConfig("dot", 64, 64, 4, 6, block_m=16),
    GemvConfig("dot", 32, 128, 4, 6, block_m=32),
]


def name_of(config: GemvConfig) -> str:
    c = config
    rows = f"/m{c.block_m}" if c.block_m else ""
    return f"{c.variant}/{c.block_n}x{c.block_k}/w{c.num_warps}/s{c.num_stages}{rows}"


def time_layer(fn, weights, x, rep_ms) -> float:
    """ms per call over the distinct weight copies (one graph)."""
    return graph_ms([lambda w=w: fn(x, w) for w in weights], rep_ms)


def main() -> None:
    ap = gpu_parser(__doc__, rep_ms=40)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    args = ap.parse_args()
    if not has_cuda("gemv"):
        return
    hidden, inter, layers, shapes = model_shapes(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    copy_gbps = measure_copy_bandwidth(args.rep_ms)
    print(f"copy bandwidth {copy_gbps:,.0f} GB/s ({torch.cuda.get_device_name()})")
    weights = {}
    for shape, (n, k, copies) in shapes.items():
        weights[shape] = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    results: dict = {
        "benchmark": "gemv",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "model": args.model,
        "copy_gbps": copy_gbps,
        "layers": [],
        "chain": [],
    }
    best: dict[tuple[str, int], tuple[float, GemvConfig]] = {}
    lines = [f"copy bandwidth {copy_gbps:,.0f} GB/s"]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    for shape, (n, k, _copies) in shapes.items():
        layer_bytes = n * k * weights[shape][0].element_size()
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = F.linear(x, weights[shape][0])
            torch_ms = time_layer(F.linear, weights[shape], x, args.rep_ms)
            row = {"shape": shape, "n": n, "k": k, "m": m, "bytes": layer_bytes, "torch_us": torch_ms * 1e3}
            row["torch_frac_copy"] = layer_bytes / (torch_ms * 1e-3) / 1e9 / copy_gbps
            row["configs"] = {}
            for config in CONFIGS:
                if config.variant == "reduce" and m > 2:
                    continue
                try:
                    out = gemv(x, weights[shape][0], None, config)
                except OutOfResources as exc:  # e.g. a 64-row tile's shared memory at many stages
                    row["configs"][name_of(config)] = {"error": str(exc)[:120]}
                    continue
                err = float((out.float() - ref.float()).norm() / ref.float().norm())
                ms = time_layer(lambda a, w, c=config: gemv(a, w, None, c), weights[shape], x, args.rep_ms)
                row["configs"][name_of(config)] = {"us": ms * 1e3, "rel_err": err}
                if err < 1e-2 and ms < best.get((shape, m), (float("inf"), None))[0]:
                    best[(shape, m)] = (ms, config)
            routed = config_for(m, n, k)  # what the engine runs (None: torch's GEMM)
            row["routed"] = "torch" if routed is None else name_of(routed)
            row["routed_us"] = (
                torch_ms * 1e3
                if routed is None
                else row["configs"].get(name_of(routed), {}).get("us")
                or time_layer(lambda a, w, c=routed: gemv(a, w, None, c), weights[shape], x, args.rep_ms)
                * 1e3
            )
            ms, config = best[(shape, m)]
            row["best"] = name_of(config)
            row["best_us"] = ms * 1e3
            row["best_frac_copy"] = layer_bytes / (ms * 1e-3) / 1e9 / copy_gbps
            row["torch_over_best"] = torch_ms / ms
            results["layers"].append(row)
            say(
                f"{shape:8s} M={m:2d} {n}x{k}: torch {torch_ms * 1e3:7.1f} us ({row['torch_frac_copy']:.2f} of copy)"
                f"  best {row['best']} {ms * 1e3:7.1f} us ({row['best_frac_copy']:.2f})  torch/best {row['torch_over_best']:.2f}x"
                f"  routed {row['routed']} {row['routed_us']:7.1f} us"
            )
    # The whole step's chain of linear layers, in layer order, one graph each way.
    for m in rows:
        x_h = torch.randn(m, hidden, device="cuda", dtype=dtype)
        x_i = torch.randn(m, inter, device="cuda", dtype=dtype)
        total_bytes = sum(n * k * c * 2 for n, k, c in shapes.values())

        def chain(linear, x_h=x_h, x_i=x_i):
            for layer in range(layers):
                for shape in ("qkv", "o", "gate_up"):
                    linear(shape, x_h, weights[shape][layer])
                linear("down", x_i, weights["down"][layer])
            linear("lm_head", x_h, weights["lm_head"][0])

        def with_torch(shape, a, w):
            return F.linear(a, w)

        def with_best(shape, a, w, m=m):
            return gemv(a, w, None, best[(shape, m)][1])

        def routed(shape, a, w):
            config = config_for(a.shape[0], w.shape[0], w.shape[1])
            return F.linear(a, w) if config is None else gemv(a, w, None, config)

        t = {}
        for label, fn in (("torch", with_torch), ("triton", with_best), ("routed", routed)):
            t[label] = graph_ms([lambda fn=fn: chain(fn)], args.rep_ms)
        floor_ms = total_bytes / (copy_gbps * 1e9) * 1e3
        entry = {
            "m": m,
            "bytes": total_bytes,
            "floor_ms": floor_ms,
            "torch_ms": t["torch"],
            "triton_ms": t["triton"],
            "torch_over_floor": t["torch"] / floor_ms,
            "triton_over_floor": t["triton"] / floor_ms,
            "torch_over_triton": t["torch"] / t["triton"],
            "routed_ms": t["routed"],
            "routed_over_floor": t["routed"] / floor_ms,
        }
        results["chain"].append(entry)
        say(
            f"chain M={m}: {total_bytes / 1e9:.2f} GB, floor {floor_ms:.3f} ms | torch {t['torch']:.3f} ms "
            f"({entry['torch_over_floor']:.2f}x floor) | triton {t['triton']:.3f} ms ({entry['triton_over_floor']:.2f}x) "
            f"| torch/triton {entry['torch_over_triton']:.3f}x | routed {t['routed']:.3f} ms"
        )
    results["best_configs"] = {f"{s}/{m}": name_of(c) for (s, m), (_, c) in best.items()}
    write_results(args.out, "gemv", results, lines)
    plot(results, args.out / "gemv.png")


def plot(results: dict, path: Path) -> None:
    drawn = common.subplots(path, figsize=(9, 4))
    if drawn is None:
        return
    fig, ax = drawn
    labels = [f"{r['shape']}\nM={r['m']}" for r in results["layers"]]
    xs = range(len(labels))
    ax.bar(
        [i - 0.2 for i in xs], [r["torch_frac_copy"] for r in results["layers"]], 0.4, label="torch F.linear"
    )
    ax.bar(
        [i + 0.2 for i in xs],
        [r["best_frac_copy"] for r in results["layers"]],
        0.4,
        label="Triton gemv (best)",
    )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(list(xs), labels, fontsize=6)
    ax.set_ylabel("weight bytes / time, fraction of copy bw")
    ax.legend()
    common.save(fig, path, dpi=120)


if __name__ == "__main__":
    main()
