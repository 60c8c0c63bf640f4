"""Greedy argmax over a vocabulary: torch.argmax vs kernels/argmax.py, side by side, with the
byte floor (the logits' bytes over the copy bandwidth measured in the same run).

Rows 1 / 8 / 40 / 56 are a decode step at batch 1 and 8 and a batch-8 verification at K 4 / 6;
vocabularies are Llama-3's 128256 and SmolLM2's 49152. Each call runs in one CUDA graph over
distinct logits buffers (the engine replays its steps from graphs; cold L2 as in a step).
The engine calls argmax eagerly after the step's graph, so the host's cost of one eager call
(launches and allocations, no wait for the device) is timed too: a step whose host is slower
than its device pays that instead of the device time.

    python bench/argmax.py --out OUTDIR [--rows 1,8,40,56] [--rep-ms 25]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import gpu_parser, graph_ms, has_cuda, measure_copy_bandwidth  # noqa: E402

from pagedinfer.kernels.argmax import argmax_rows  # noqa: E402

SETS = 16  # distinct logits buffers per graph
HOST_CALLS = 200  # eager calls timed on the host (fewer than the launch queue holds)


def host_us_per_call(fns) -> float:
    """Host time of one eager call: the calls are queued without waiting for the device (a
    kernel of a few us each does not fill the launch queue in HOST_CALLS calls)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for i in range(HOST_CALLS):
            fns[i % len(fns)]()
        best = min(best, time.perf_counter() - start)
        torch.cuda.synchronize()
    return best / HOST_CALLS * 1e6


def main() -> None:
    ap = gpu_parser(__doc__.splitlines()[0], rep_ms=25)
    ap.add_argument("--rows", default="1,8,40,56")
    ap.add_argument("--vocabs", default="128256,49152")
    args = ap.parse_args()
    if not has_cuda("argmax"):
        return
    args.out.mkdir(parents=True, exist_ok=True)
    copy_gbps = measure_copy_bandwidth(args.rep_ms)
    rows_out = []
    for vocab in map(int, args.vocabs.split(",")):
        for dtype in (torch.bfloat16, torch.float32):
            for rows in map(int, args.rows.split(",")):
                xs = [torch.randn(rows, vocab, device="cuda").to(dtype) for _ in range(SETS)]
                assert all(torch.equal(argmax_rows(x), x.argmax(-1)) for x in xs)
                torch_ms = graph_ms([lambda x=x: x.argmax(-1) for x in xs], args.rep_ms)
                triton_ms = graph_ms([lambda x=x: argmax_rows(x) for x in xs], args.rep_ms)
                torch_host = host_us_per_call([lambda x=x: x.argmax(-1) for x in xs])
                triton_host = host_us_per_call([lambda x=x: argmax_rows(x) for x in xs])
                floor_us = rows * vocab * xs[0].element_size() / copy_gbps / 1e3
                row = {
                    "vocab": vocab,
                    "dtype": str(dtype).removeprefix("torch."),
                    "rows": rows,
                    "floor_us": round(floor_us, 2),
                    "torch_us": round(torch_ms * 1e3, 2),
                    "triton_us": round(triton_ms * 1e3, 2),
                    "torch_over_triton": round(torch_ms / triton_ms, 2),
                    "torch_host_us": round(torch_host, 1),
                    "triton_host_us": round(triton_host, 1),
                    "triton_over_floor": round(triton_ms * 1e3 / floor_us, 1),
                }
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    result = {
        "benchmark": "argmax",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_gbps": round(copy_gbps, 1),
        "rows": rows_out,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (args.out / "argmax.json").write_text(json.dumps(result, indent=1))
    plot(rows_out, args.out / "argmax.png")


def plot(rows: list[dict], path: Path) -> None:
    made = common.subplots(path, 1, 1, figsize=(7, 4))
    if made is None:
        return
    fig, ax = made
    for vocab in sorted({r["vocab"] for r in rows}):
        for dtype in ("bfloat16", "float32"):
            pts = [r for r in rows if r["vocab"] == vocab and r["dtype"] == dtype]
            x = [r["rows"] for r in pts]
            ax.plot(x, [r["torch_us"] for r in pts], "--o", label=f"torch V={vocab} {dtype}")
            ax.plot(x, [r["triton_us"] for r in pts], "-s", label=f"kernel V={vocab} {dtype}")
    ax.set_xlabel("rows")
    ax.set_ylabel("us per call (graph replay)")
    ax.set_yscale("log")
    ax.legend(fontsize=6)
    common.save(fig, path, dpi=120)


if __name__ == "__main__":
    main()
