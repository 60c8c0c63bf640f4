"""Large-batch linear layers (the batch-256 decode step's GEMMs): which cuBLAS path is fastest.

At batch 256 the 8B shape's decode step spends ~6 ms in cuBLAS GEMMs (bench/results/
profile_decode.json): ~640 TFLOP/s, and the o/down projections run split-K kernels plus a
reduction. Issue 4 wants that step within 1.4x of its byte floor. This script asks whether
torch's other GEMM paths do better at the step's shapes, side by side in one run:

- `cublas`: torch's default (`F.linear`);
- `cublaslt`: `torch.backends.cuda.preferred_blas_library("cublaslt")`;
- `tunableop`: `torch.cuda.tunable` (TunableOp) timing cuBLAS/cuBLASLt solutions per shape first.

Each layer shape runs in one CUDA graph over distinct weight copies (cold L2, as in a step);
then the step's whole chain of linear layers. The ceiling, in the same run: an 8192^3 bf16 GEMM's
TFLOP/s, and the byte floor of each shape (weights + activations over the copy bandwidth).

    python bench/gemm_batch.py --out OUTDIR [--rows 64,256] [--rep-ms 40]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import bench_ms, gpu_parser, graph_ms, has_cuda, measure_copy_bandwidth  # noqa: E402
from gemv import LAYERS, SHAPES  # noqa: E402

COPIES = 4  # distinct weights per shape: 4 x 235 MB for gate_up already exceeds L2 (50 MB)
VARIANTS = ("cublas", "cublaslt", "tunableop")


def set_variant(name: str, tune_file: str) -> None:
    """Put torch's GEMM dispatch into the state one variant names (and undo the others)."""
    torch.backends.cuda.preferred_blas_library("cublaslt" if name == "cublaslt" else "cublas")
    tunable = torch.cuda.tunable
    tunable.enable(name == "tunableop")
    tunable.tuning_enable(name == "tunableop")
    if name == "tunableop":
        tunable.set_filename(tune_file)
        tunable.set_max_tuning_duration(30)  # ms of timing per candidate solution


def gemm_ceiling(rep_ms: int) -> float:
    """TFLOP/s of one 8192^3 bf16 GEMM (the compute ceiling as the default path reaches it)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, rep_ms)
    return 2 * 8192**3 / ms / 1e9


def main() -> None:
    parser = gpu_parser(__doc__.splitlines()[0], rep_ms=40)
    parser.add_argument("--rows", default="256")
    args = parser.parse_args()
    if not has_cuda("gemm_batch"):
        return
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    dtype = torch.bfloat16
    copy_gbps = measure_copy_bandwidth(args.rep_ms)
    ceiling = gemm_ceiling(args.rep_ms)
    weights = {
        shape: [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(COPIES if c > 1 else 1)]
        for shape, (n, k, c) in SHAPES.items()
    }
    tune_file = str(Path(tempfile.mkdtemp()) / "tunableop_results.csv")
    lines = [
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  copy {copy_gbps:.0f} GB/s  "
        f"8192^3 GEMM {ceiling:.0f} TFLOP/s"
    ]
    print(lines[0])
    results: dict = {
        "benchmark": "gemm_batch",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_gbps": copy_gbps,
        "gemm_ceiling_tflops": ceiling,
        "rows": [],
    }
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {shape: torch.randn(m, k, device="cuda", dtype=dtype) for shape, (_n, k, _c) in SHAPES.items()}
        refs = {shape: F.linear(xs[shape], weights[shape][0]).float() for shape in SHAPES}
        for variant in VARIANTS:
            set_variant(variant, tune_file)
            row: dict = {"m": m, "variant": variant, "shapes": {}}
            for shape, (n, k, _c) in SHAPES.items():
                out = F.linear(xs[shape], weights[shape][0])  # tunes here (outside any capture)
                err = ((out.float() - refs[shape]).abs().max() / refs[shape].abs().max()).item()
                fns = [lambda w=w, x=xs[shape]: F.linear(x, w) for w in weights[shape]]
                ms = graph_ms(fns, args.rep_ms)
                floor_ms = (n * k + m * (n + k)) * 2 / copy_gbps / 1e6
                row["shapes"][shape] = {
                    "ms": ms,
                    "tflops": 2 * m * n * k / ms / 1e9,
                    "floor_ms": max(floor_ms, 2 * m * n * k / ceiling / 1e9),
                    "rel_err": err,
                }

            def chain(xs=xs):
                for layer in range(LAYERS):
                    for shape in ("qkv", "o", "gate_up", "down"):
                        F.linear(xs[shape], weights[shape][layer % len(weights[shape])])
                F.linear(xs["lm_head"], weights["lm_head"][0])

            row["chain_ms"] = graph_ms([chain], args.rep_ms)
            results["rows"].append(row)
            cells = "  ".join(
                f"{s} {v['ms'] * 1e3:7.1f} us {v['tflops']:4.0f} TF/s" for s, v in row["shapes"].items()
            )
            line = f"M={m:4d} {variant:9s} | {cells} | chain {row['chain_ms']:.3f} ms"
            print(line)
            lines.append(line)
        base = next(r for r in results["rows"] if r["m"] == m and r["variant"] == "cublas")["chain_ms"]
        for r in results["rows"]:
            if r["m"] == m:
                lines.append(
                    f"M={m} {r['variant']}: chain cublas/{r['variant']} = {base / r['chain_ms']:.3f}"
                )
    set_variant("cublas", tune_file)
    (args.out / "gemm_batch.json").write_text(json.dumps(results, indent=1))
    (args.out / "gemm_batch_summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-3:]))
    plot(results, args.out / "gemm_batch.png")


def plot(results: dict, path: Path) -> None:
    """TFLOP/s per layer shape and variant (one panel per row count), the ceiling as a line."""
    ms = sorted({r["m"] for r in results["rows"]})
    drawn = common.subplots(path, 1, len(ms), figsize=(5 * len(ms), 4), squeeze=False)
    if drawn is None:
        return
    fig, axes = drawn
    shapes = list(SHAPES)
    for ax, m in zip(axes[0], ms, strict=True):
        rows = [r for r in results["rows"] if r["m"] == m]
        width = 0.8 / len(rows)
        for i, r in enumerate(rows):
            xs = [j + i * width for j in range(len(shapes))]
            ax.bar(xs, [r["shapes"][s]["tflops"] for s in shapes], width, label=r["variant"])
        ax.axhline(results["gemm_ceiling_tflops"], color="k", ls="--", lw=1, label="8192^3 GEMM")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
        ax.set_title(f"M = {m}")
        ax.set_ylabel("TFLOP/s")
        ax.legend(fontsize=7)
    common.save(fig, path, dpi=110)


if __name__ == "__main__":
    main()
