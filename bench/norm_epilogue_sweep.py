"""Config sweep of the norm-epilogue GEMVs at a batch-8 verification's rows (SmolLM2-135M shapes).

A batch-8 verifying pass of K drafts runs every linear layer at 8 (K + 1) rows: 40 at K 4, 56 at
K 6. There `add_prenorm` (o, down) and `rstd_linear` (qkv, gate_up) took 3.94 / 4.29 us a call
in the engine against 3.59 / 4.08 at a plain step's 8 rows (H100 profile, bench/NOTES.md session
34): ~34 us of a ~870 us pass, the largest part of what a verifying pass costs over a plain one.
This times each kernel over 30 distinct weight copies in one CUDA graph (as bench/norm_epilogue.py)
for candidate configs at each row count, against the config the engine routes the shape to
(`gemv.config_for`) and against that routed config at 8 rows (the plain step: the peer the
verifying pass is compared with), then the chain of linear layers routed vs best per shape.

    python bench/norm_epilogue_sweep.py --out OUTDIR [--rows 8,40,56] [--rep-ms 10]

Writes norm_epilogue_sweep.json, norm_epilogue_sweep_summary.txt and norm_epilogue_sweep.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plotting  # noqa: E402
from attention import _bench_graph  # noqa: E402
from gemv import name_of  # noqa: E402  (bench/gemv.py's config labels)

from pagedinfer.kernels.gemv import GemvConfig, config_for  # noqa: E402
from pagedinfer.kernels.norm_epilogue import add_prenorm, rstd_linear  # noqa: E402

EPS = 1e-5
HIDDEN, INTER, LAYERS, QKV = 576, 1536, 30, 960  # SmolLM2-135M
SHAPES = {
    "qkv": (QKV, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}
PRENORM = ("o", "down")  # the GEMVs before a norm; qkv and gate_up come after one

CANDIDATES = [
    GemvConfig("dot", 16, 128, 2, 6, block_m=16),  # the routed config at 17-64 rows, N <= 2048
    GemvConfig("dot", 16, 64, 2, 6, block_m=16),
    GemvConfig("dot", 16, 256, 2, 4, block_m=16),
    GemvConfig("dot", 16, 128, 1, 6, block_m=16),
    GemvConfig("dot", 16, 128, 4, 6, block_m=16),
    GemvConfig("dot", 32, 128, 2, 6, block_m=16),
    GemvConfig("dot", 32, 64, 2, 6, block_m=16),
    GemvConfig("dot", 16, 128, 2, 6, block_m=32),
    GemvConfig("dot", 16, 128, 4, 6, block_m=32),
    GemvConfig("dot", 16, 256, 4, 4, block_m=32),
    GemvConfig("dot", 32, 128, 4, 6, block_m=32),
    GemvConfig("dot", 32, 128, 2, 4, block_m=32),
    GemvConfig("dot", 16, 128, 4, 6),  # one tile of all the rows (padded to 16, 32 or 64)
    GemvConfig("dot", 16, 256, 2, 4),  # the routed config at 2-16 rows, N <= 2048
    GemvConfig("dot", 32, 128, 4, 6),  # DOT_CONFIG: gate_up's at 17-64 rows
    GemvConfig("dot", 32, 128, 4, 4),
    GemvConfig("dot", 64, 64, 4, 6),
]


def kernel_fns(name, config, rows, weights, g, pre_routed):
    """One call per weight copy of the shape's epilogue kernel under `config`."""
    n, k = SHAPES[name]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    if name in PRENORM:
        return [lambda w=w: add_prenorm(x, w, res, g, config) for w in weights[name]]
    return [lambda w=w: rstd_linear(pre_routed, EPS, w, None, config) for w in weights[name]]


def time_config(name, config, rows, weights, g, pre_routed, rep_ms) -> float | None:
    try:
        return 1e3 * _bench_graph(kernel_fns(name, config, rows, weights, g, pre_routed), rep_ms)
    except OutOfResources:
        return None


def chain(rows, configs, weights, g):
    """The step's linear layers as the engine runs them at `rows`: add_prenorm / rstd_linear pairs."""
    x_o = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    x_down = torch.randn(rows, INTER, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    start = add_prenorm(x_o, weights["o"][0], res, g, configs["o"])

    def run():
        pre = start
        for i in range(LAYERS):
            rstd_linear(pre, EPS, weights["qkv"][i], None, configs["qkv"])
            pre = add_prenorm(x_o, weights["o"][i], pre.h, g, configs["o"])
            rstd_linear(pre, EPS, weights["gate_up"][i], None, configs["gate_up"])
            pre = add_prenorm(x_down, weights["down"][i], pre.h, g, configs["down"])
        return pre

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="8,40,56")
    ap.add_argument("--rep-ms", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("norm_epilogue_sweep: needs a CUDA GPU; nothing measured")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    weights = {
        name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        for name, (n, k) in SHAPES.items()
    }
    g = 1.0 + 0.1 * torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    rows_list = [int(r) for r in args.rows.split(",")]
    results: dict = {
        "benchmark": "norm_epilogue_sweep",
        "device": torch.cuda.get_device_name(),
        "kernels": [],
    }
    lines = [
        f"norm-epilogue GEMVs, SmolLM2-135M shapes, bf16, 30 weight copies a graph ({results['device']})"
    ]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    plain_us: dict[str, float] = {}
    chains = []
    for rows in rows_list:
        routed = {name: config_for(rows, n, k) for name, (n, k) in SHAPES.items()}
        x_o = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        pre_routed = add_prenorm(x_o, weights["o"][0], res, g, routed["o"])
        best = {}
        for name in SHAPES:
            configs = {name_of(routed[name]): routed[name]}
            if rows > 16:  # the plain step's rows keep their routing; the sweep is for a verification
                configs.update({name_of(c): c for c in CANDIDATES})
            times = {
                label: time_config(name, c, rows, weights, g, pre_routed, args.rep_ms)
                for label, c in configs.items()
            }
            routed_us = times[name_of(routed[name])]
            if rows == 8:
                plain_us[name] = routed_us
            ok = {label: t for label, t in times.items() if t is not None}
            best_label = min(ok, key=ok.get)
            best[name] = configs[best_label]
            peer = plain_us.get(name) if rows != 8 else None
            results["kernels"].append(
                {
                    "shape": name,
                    "rows": rows,
                    "routed": name_of(routed[name]),
                    "routed_us": routed_us,
                    "best": best_label,
                    "best_us": ok[best_label],
                    "plain_8_rows_us": peer,
                    "times_us": times,
                }
            )
            say(
                f"{name:7s} rows {rows:2d}: routed {name_of(routed[name]):22s} {routed_us:5.2f} us | best "
                f"{best_label:22s} {ok[best_label]:5.2f} us | routed / best {routed_us / ok[best_label]:.3f}x"
                + (f" | best / plain 8 rows {ok[best_label] / peer:.3f}x" if peer else "")
            )
        t_routed = 1e3 * _bench_graph([chain(rows, routed, weights, g)], args.rep_ms)
        t_best = 1e3 * _bench_graph([chain(rows, best, weights, g)], args.rep_ms)
        chains.append({"rows": rows, "routed_us": t_routed, "best_us": t_best})
        base = chains[0]["routed_us"] if rows_list[0] == 8 else None
        say(
            f"chain of {LAYERS} layers at {rows:2d} rows: routed {t_routed:6.1f} us | best per shape "
            f"{t_best:6.1f} us | routed / best {t_routed / t_best:.3f}x"
            + (f" | best - plain 8 rows {t_best - base:+.1f} us" if base else "")
        )
    results["chains"] = chains
    results["time_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (args.out / "norm_epilogue_sweep.json").write_text(json.dumps(results, indent=1))
    (args.out / "norm_epilogue_sweep_summary.txt").write_text("\n".join(lines) + "\n")
    plot(results, args.out / "norm_epilogue_sweep.png")
    return 0


def plot(results: dict, path: Path) -> None:
    """Per shape and row count: the plain step's 8 rows (routed), the routed and the best config."""
    rows = [r for r in results["kernels"] if r["plain_8_rows_us"] is not None]
    drawn = plotting.subplots(path, figsize=(9, 4))
    if drawn is None or not rows:
        return
    fig, ax = drawn
    xs = range(len(rows))
    for offset, key, label in (
        (-0.27, "plain_8_rows_us", "routed at 8 rows (plain step)"),
        (0.0, "routed_us", "routed"),
        (0.27, "best_us", "best of the sweep"),
    ):
        ax.bar([i + offset for i in xs], [r[key] for r in rows], 0.27, label=label)
    ax.set_xticks(list(xs), [f"{r['shape']}\nM={r['rows']}" for r in rows], fontsize=7)
    ax.set_ylabel("us a call (CUDA graph, 30 weight copies)")
    ax.legend(fontsize=7)
    plotting.save(fig, path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
