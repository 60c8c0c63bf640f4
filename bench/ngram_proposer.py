"""CPU time of the batched n-gram matcher (`find_ngram_drafts`) on long, repetitive and random text.

B sequences of L tokens each ask for K drafts with ngram 1..4 (the engine's defaults). Token
patterns: constant (one repeated token: every position ties), periodic (period 7: every 7th
position ties), random over 32000 ids (few ties) and random over 4 ids (many short ties).
Median wall time of `--repeats` calls after one warm-up call, single-threaded numpy.

    OMP_NUM_THREADS=1 python -P bench/ngram_proposer.py --out bench/results --name NAME [--impl FILE]

--impl times `find_ngram_drafts` from another copy of engine/spec_decode/ngram.py (e.g. the
previous commit's, written to /tmp) for a before/after comparison on the same machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

PATTERNS = ("constant", "periodic7", "random32000", "random4")


def make_tokens(pattern: str, num_seqs: int, length: int, seed: int) -> np.ndarray:
    """[B, L] int32 token ids."""
    rng = np.random.default_rng(seed)
    if pattern == "constant":
        return np.full((num_seqs, length), 42, dtype=np.int32)
    if pattern == "periodic7":
        base = rng.integers(0, 32000, (num_seqs, 7))
        return np.tile(base, (1, length // 7 + 1))[:, :length].astype(np.int32)
    vocab = int(pattern.removeprefix("random"))
    return rng.integers(0, vocab, (num_seqs, length)).astype(np.int32)


def load_impl(path: Path | None):
    if path is None:
        from pagedinfer.engine.spec_decode import ngram

        return ngram
    spec = importlib.util.spec_from_file_location("ngram_impl", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_pattern(impl, pattern: str, args: argparse.Namespace) -> dict:
    tokens = make_tokens(pattern, args.batch, args.length, seed=0)
    lengths = np.full(args.batch, args.length, dtype=np.int64)  # [B]
    starts = np.cumsum(lengths) - lengths  # [B]
    max_drafts = np.full(args.batch, args.k, dtype=np.int64)  # [B]
    flat = tokens.reshape(-1)  # [B * L]

    def call():
        return impl.find_ngram_drafts(flat, starts, lengths, 1, 4, max_drafts)

    drafts = call()  # warm-up
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return {
        "median_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * min(times),
        "num_drafted": sum(1 for d in drafts if d),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="ngram_proposer_cpu")
    parser.add_argument("--impl", type=Path, default=None, help="ngram.py copy to time instead")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    impl = load_impl(args.impl)
    results = {pattern: time_pattern(impl, pattern, args) for pattern in PATTERNS}
    for pattern, r in results.items():
        print(f"{pattern:>12}: {r['median_ms']:8.2f} ms median, {r['min_ms']:8.2f} ms min")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "impl": str(args.impl) if args.impl else "pagedinfer.engine.spec_decode.ngram",
        "batch": args.batch,
        "length": args.length,
        "k": args.k,
        "ngram": [1, 4],
        "repeats": args.repeats,
        "machine": platform.processor() or platform.machine(),
        "numpy": np.__version__,
        "results": results,
    }
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
