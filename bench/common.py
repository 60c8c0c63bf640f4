"""What the bench scripts share: device timing, the GPU scripts' command line and result files,
headless plots.

Imported as a sibling (`import common`, bench/ on sys.path) or as `bench.common` (repository root
on sys.path). torch and matplotlib are imported inside the functions that need them: the CPU
benchmarks (operator, native core) import this module without either.

Timing. Every GPU floor is bytes over `measure_copy_bandwidth()`, measured in the same run.
`graph_ms` times a CUDA graph over input sets larger than L2 (cold reads, as in a real step: the
engine replays its steps from graphs too); `bench_ms` is Triton's do_bench median (L2 cleared
before every call); `graph_us` holds many calls of one small function in a graph, for kernels that
read what the call before them wrote.

Plots:
    drawn = common.subplots(path, 1, 2, figsize=(10, 4))
    if drawn is None:      # matplotlib missing: the JSON is written, say so and go on
        return
    fig, (ax1, ax2) = drawn
    ...
    common.save(fig, path, dpi=120)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ROTATE_BYTES = 256 << 20  # input sets per shape: at least this much (an H200's L2 is 60 MB)


# ---- timing ------------------------------------------------------------------------------------
def bench_ms(fn: Callable[[], Any], rep_ms: int) -> float:
    """Median milliseconds with device events; do_bench clears L2 before every call."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median"))


def measure_copy_bandwidth(rep_ms: int) -> float:
    """Device-to-device copy of 2 GiB, counting bytes read + written, in GB/s."""
    import torch

    src = torch.randn(2**29, device="cuda")  # 2 GiB fp32
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), rep_ms)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def _capture(fns: list[Callable[[], Any]], calls: int = 1, warmups: int = 1):
    """A CUDA graph of `calls` rounds of fns, each fn run `warmups` times on a side stream first
    (compiles, plans and allocations stay out of the capture)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            for fn in fns:
                fn()
    return graph


def graph_ms(fns: list[Callable[[], Any]], rep_ms: int) -> float:
    """Median ms per call of one CUDA graph that runs every fn once, each on its own input set:
    no host launch cost, and rotating over sets larger than L2 keeps each call's reads cold."""
    graph = _capture(fns)
    ms = bench_ms(graph.replay, rep_ms) / len(fns)
    del graph
    return ms


def graph_us(fn: Callable[[], Any], calls: int, trials: int) -> float:
    """Median microseconds per fn() call: one CUDA graph holds `calls` of it, replayed `trials`
    times (no L2 flush between calls)."""
    import torch

    graph = _capture([fn], calls, warmups=2)
    graph.replay()
    samples = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(samples)


# ---- command line ------------------------------------------------------------------------------
def gpu_parser(doc: str, rep_ms: int) -> argparse.ArgumentParser:
    """The GPU scripts' common flags: --out DIR (required) and --rep-ms (do_bench's budget)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rep-ms", type=int, default=rep_ms)
    return parser


def has_cuda(name: str) -> bool:
    """True where CUDA is present; else says that `name` measured nothing (a CPU run is no error)."""
    import torch

    if torch.cuda.is_available():
        return True
    print(f"{name}: needs a CUDA GPU; nothing measured")
    return False


def write_results(out: Path, name: str, results: dict, lines: list[str] | None = None) -> None:
    """OUT/NAME.json (stamped `time_utc`) and, given the printed lines, OUT/NAME_summary.txt."""
    results["time_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    if lines is not None:
        (out / f"{name}_summary.txt").write_text("\n".join(lines) + "\n")


# ---- plots -------------------------------------------------------------------------------------
def subplots(path: Path, *args: Any, **kwargs: Any) -> tuple[Figure, Any] | None:
    """`plt.subplots(*args, **kwargs)` on the Agg backend, or None (after a line) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib not installed: no plot {Path(path).name}")
        return None
    matplotlib.use("Agg")  # no display on a benchmark machine
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save(fig: Figure, path: Path, dpi: int) -> None:
    """Lay out, write the PNG and close the figure (pyplot keeps every open figure alive)."""
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
