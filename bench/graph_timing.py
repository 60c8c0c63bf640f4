"""Device time of a small call: one CUDA graph holds `calls` of it, replayed `trials` times.

A graph leaves the host's launch cost out (the engine replays its steps from graphs too), and
`calls` per replay spreads the replay's own overhead. No L2 flush between calls: for kernels that
read what the step before them wrote (bench/attention.py's `_bench_graph` flushes, for cold KV).
"""

from __future__ import annotations

import statistics

import torch


def graph_us(fn, calls: int, trials: int) -> float:
    """Median microseconds per fn() call (fn is run twice first, off the capture: compiles)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
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
