"""Time of one n-gram accept + propose call (kernels/ngram_ops.accept_and_propose) per backend.

Two kinds of histories:
- `random`: tokens from a small vocabulary (many candidate matches: the kernel's worst case for
  the search; the torch version's work does not depend on the tokens), filled to 90% of L, K = 8
  drafts per sequence of which a random prefix is accepted;
- `copy`: the engine's batch-1 case: word ids of bench/editing_tasks.py's texts, each text twice
  (so the longest match has a tie to rank), 420 or 1,500 tokens, K = 4, n-gram 1-4.
Each with the tie ranking off (context 0) and on (the engine's CONTEXT_WINDOW), and on with a
match-key table (the engine's folded keys: one table gather per compared token).

On the CPU: the torch version (wall clock, median of --reps calls). On CUDA: the Triton kernel in
a CUDA graph of 20 calls, each after a reset of the history lengths, less a graph of the resets
alone (device time; an eager launch's host cost would hide it).

    python bench/ngram_propose.py --device cpu --out bench/results [--reps 20] [--threads N]
    python bench/ngram_propose.py --tile-sweep --out OUT   (CUDA: the kernel per tile and warps)

Writes ngram_propose_<device>.json: one row per (history, B, L, context, keys) with the median
microseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import graph_us  # noqa: E402
from bench.editing_tasks import TEXTS  # noqa: E402
from pagedinfer.engine.spec_decode.ngram import CONTEXT_WINDOW  # noqa: E402
from pagedinfer.kernels import ngram_ops  # noqa: E402

RANDOM_SHAPES = [(1, 2048), (8, 2048), (64, 2048), (64, 8192), (256, 8192), (256, 32768)]
COPY_SHAPES = [(1, 420), (1, 1500), (8, 420)]
MAX_DRAFTS, NGRAM_MIN, NGRAM_MAX, NUM_NEXT, VOCAB = 8, 1, 8, 8, 64
COPY_K, COPY_NGRAM_MAX, COPY_CAP = 4, 4, 2048 + 4 + 1
GRAPH_CALLS = 20
KEY_VOCAB = 49152  # SmolLM2's


def random_args(num_seqs: int, hist_cap: int, device: str) -> tuple:
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


def copy_history(length: int, offset: int) -> list[int]:
    """Word ids of the editing texts, each text twice, from text `offset` on."""
    vocab: dict[str, int] = {}
    words = []
    for i in range(len(TEXTS)):
        text = TEXTS[(offset + i) % len(TEXTS)]
        words += ("Rewrite this text: " + text + " " + text).split()
    ids = [vocab.setdefault(w, len(vocab)) for w in words]
    return (ids * (1 + length // len(ids)))[:length]


def copy_args(num_seqs: int, length: int, device: str) -> tuple:
    """Each sequence's last K + 1 tokens as its argmax rows; the first two drafts accepted."""
    hists = [copy_history(length, b) for b in range(num_seqs)]
    history = torch.zeros((num_seqs, COPY_CAP), dtype=torch.int32)
    for b, h in enumerate(hists):
        history[b, :length] = torch.tensor(h, dtype=torch.int32)
    history_len = torch.full((num_seqs,), length, dtype=torch.int32)
    argmax = torch.tensor([t for h in hists for t in h[length - COPY_K - 1 :]], dtype=torch.int64)
    drafts = argmax.view(num_seqs, COPY_K + 1)[:, :COPY_K].clone()
    drafts[:, 2:] += 1
    first_rows = torch.arange(num_seqs) * (COPY_K + 1)
    num_drafts = torch.full((num_seqs,), COPY_K)
    return tuple(t.to(device) for t in (argmax, first_rows, drafts, num_drafts, history, history_len))


def key_table(device: str) -> torch.Tensor:
    """A match-key table the size of SmolLM2's vocabulary, ids folded in pairs (2i, 2i + 1 -> 2i):
    the engine's folded keys cost one gather per compared token, whatever the table says."""
    ids = torch.arange(KEY_VOCAB, dtype=torch.int32)
    return (ids - ids % 2).to(device)


def time_us(
    args: tuple, ngram_max: int, num_next: int, context: int, reps: int, tile=None, keys=None
) -> float:
    """Median microseconds of one call (see the module docstring for the method per device);
    tile (block, num_warps): the Triton kernel with that tile (CUDA); keys: a match-key table."""
    lens0 = args[5].clone()
    lens = args[5]

    def call() -> None:
        lens.copy_(lens0)
        if tile is None:
            ngram_ops.accept_and_propose(
                *args, NGRAM_MIN, ngram_max, num_next, context_window=context, match_keys=keys
            )
        else:
            from pagedinfer.kernels import ngram_propose

            block, warps = tile
            ngram_propose.accept_and_propose(
                *args, NGRAM_MIN, ngram_max, num_next, context, block=block, num_warps=warps
            )

    if not args[0].is_cuda:
        call()  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    return graph_us(call, GRAPH_CALLS, reps) - graph_us(lambda: lens.copy_(lens0), GRAPH_CALLS, reps)


TILES = [(2048, 8), (2048, 16), (1024, 16), (1024, 8), (512, 16), (512, 8)]  # (block, num_warps)


def tile_sweep(out: Path, reps: int) -> None:
    """The Triton kernel per tile at batch 1 on copy and random histories, ranking off / on."""
    from pagedinfer.kernels import ngram_propose

    cases = [("copy", n, copy_args(1, n, "cuda"), COPY_NGRAM_MAX, COPY_K) for n in (420, 1500)]
    cases += [("random", n, random_args(1, n, "cuda"), NGRAM_MAX, NUM_NEXT) for n in (512, 2048)]
    rows = []
    for kind, length, call_args, ngram_max, num_next in cases:
        for context in (0, CONTEXT_WINDOW):
            for tile in TILES:
                us = time_us(call_args, ngram_max, num_next, context, reps, tile)
                rows.append(
                    {"history": kind, "length": length, "context": context, "block": tile[0],
                     "num_warps": tile[1], "median_us": round(us, 2)}
                )  # fmt: skip
                print(f"{kind:6s} L {length:5d} context {context} tile {tile}: {us:8.2f} us", flush=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "engine_tile": [ngram_propose.BLOCK, ngram_propose.NUM_WARPS],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "ngram_propose_tiles_cuda.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--tile-sweep", action="store_true", help="CUDA: the kernel per (block, warps) instead")
    args = ap.parse_args()
    if args.tile_sweep:
        tile_sweep(args.out, args.reps)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    backend = "triton" if args.device.startswith("cuda") else "reference"
    cases = [("random", b, n, random_args(b, n, args.device), NGRAM_MAX, NUM_NEXT) for b, n in RANDOM_SHAPES]
    cases += [("copy", b, n, copy_args(b, n, args.device), COPY_NGRAM_MAX, COPY_K) for b, n in COPY_SHAPES]
    rows = []
    table = key_table(args.device)
    for kind, num_seqs, length, call_args, ngram_max, num_next in cases:
        # ranking off / on (exact ids), then on with the engine's folded keys (a table gather)
        for context, keys in ((0, None), (CONTEXT_WINDOW, None), (CONTEXT_WINDOW, table)):
            us = time_us(call_args, ngram_max, num_next, context, args.reps, keys=keys)
            row = {
                "backend": backend,
                "history": kind,
                "num_seqs": num_seqs,
                "length": length,
                "context": context,
                "keys": keys is not None,
            }
            rows.append({**row, "median_us": round(us, 2)})
            print(
                f"{backend:9s} {kind:6s} B {num_seqs:3d} L {length:5d} context {context} keys "
                f"{int(keys is not None)}: {us:10.2f} us",
                flush=True,
            )
        keyed, ranked, plain = (r["median_us"] for r in rows[-1:-4:-1])
        print(
            f"  tie ranking on / off: {ranked / max(plain, 1e-9):.2f}x; keys on / off: {keyed / max(ranked, 1e-9):.2f}x",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device).type
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "timing": "CUDA graph of 20 calls less the resets alone" if device == "cuda" else "wall clock",
    }
    (args.out / f"ngram_propose_{device}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
