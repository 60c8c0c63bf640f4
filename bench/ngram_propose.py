"""Time of one n-gram accept + propose call (kernels/ngram_ops.accept_and_propose) per backend.

Histories of random tokens from a small vocabulary (many candidate matches: the Triton kernel's
worst case; the torch version's work does not depend on the tokens), filled to 90% of L, K = 8
drafts per sequence of which a random prefix is accepted. On the CPU: the torch version
(wall clock, median of --reps calls). On CUDA: both backends (CUDA events around --reps calls,
after a warm-up; each call gets a fresh copy of the history so lengths stay put).

    python bench/ngram_propose.py --device cpu --out bench/results [--reps 20] [--threads N]

Writes ngram_propose_<device>.json: one row per (backend, B, L) with the median microseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pagedinfer.kernels import ngram_ops

SHAPES = [(1, 2048), (8, 2048), (64, 2048), (64, 8192), (256, 8192), (256, 32768)]
MAX_DRAFTS, NGRAM_MIN, NGRAM_MAX, NUM_NEXT, VOCAB = 8, 1, 8, 8, 64


def make_args(num_seqs: int, hist_cap: int, device: str) -> tuple:
    gen = torch.Generator().manual_seed(num_seqs * hist_cap)
    num_drafts = torch.full((num_seqs,), MAX_DRAFTS)
    first_rows = torch.arange(num_seqs) * (MAX_DRAFTS + 1)
    argmax = torch.randint(0, VOCAB, (num_seqs * (MAX_DRAFTS + 1),), generator=gen)
    drafts = argmax.view(num_seqs, MAX_DRAFTS + 1)[:, :MAX_DRAFTS].clone()
    cut = torch.randint(0, MAX_DRAFTS + 1, (num_seqs,), generator=gen)  # accepted prefix
    drafts[torch.arange(MAX_DRAFTS) >= cut[:, None]] += 1
    history = torch.randint(0, VOCAB, (num_seqs, hist_cap), generator=gen, dtype=torch.int32)
    history_len = torch.full((num_seqs,), int(0.9 * hist_cap), dtype=torch.int32)
    return tuple(t.to(device) for t in (argmax, first_rows, drafts, num_drafts, history, history_len))


def time_us(args: tuple, backend: str, reps: int) -> float:
    """Median microseconds of one call; each call on its own copy of history and history_len."""
    copies = [(args[4].clone(), args[5].clone()) for _ in range(reps + 1)]
    is_cuda = args[0].is_cuda

    def call(i: int) -> None:
        ngram_ops.accept_and_propose(*args[:4], *copies[i], NGRAM_MIN, NGRAM_MAX, NUM_NEXT, backend=backend)

    call(reps)  # warm-up (Triton compiles here)
    times = []
    for i in range(reps):
        if is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            call(i)
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    backends = ["triton", "reference"] if args.device.startswith("cuda") else ["reference"]
    rows = []
    for num_seqs, hist_cap in SHAPES:
        call_args = make_args(num_seqs, hist_cap, args.device)
        for backend in backends:
            us = time_us(call_args, backend, args.reps)
            rows.append(
                {"backend": backend, "num_seqs": num_seqs, "hist_cap": hist_cap, "median_us": round(us, 1)}
            )
            print(f"{backend:9s} B {num_seqs:3d} L {hist_cap:5d}: {us:10.1f} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device).type
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
    }
    (args.out / f"ngram_propose_{device}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
