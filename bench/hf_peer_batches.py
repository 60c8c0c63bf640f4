"""Which static batch size is transformers' best on the offline workload (issue 4's peer)?

ENVIRONMENT.md's peer figure used a static batch of 64 requests. transformers' eager decode step
is host-bound, so it gains from a wider batch, and "transformers' best" needs the sweep: the same
random Llama-3-8B-shaped model and requests (512 prompt tokens, 256 greedy outputs each), one
static `generate` batch per size, side by side (bench/throughput.py now runs the widest, 512).

    python bench/hf_peer_batches.py --out OUTDIR [--batches 64,256,512] [--output-len 256]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="64,256,512")
    parser.add_argument("--output-len", type=int, default=256)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    hf = throughput.build_hf_model(throughput.LLAMA3_8B, "cuda")
    vocab = throughput.LLAMA3_8B["vocab_size"]
    sizes = [int(b) for b in args.batches.split(",")]
    rows = list(throughput.hf_static_sweep(hf, sizes, vocab, args.output_len).values())
    ok = [r for r in rows if "output_tok_s" in r]
    best = max(ok, key=lambda r: r["output_tok_s"]) if ok else None
    base = next((r for r in ok if r["requests"] == 64), None)
    if best and base:
        print(
            f"best static batch {best['requests']}: {best['output_tok_s'] / base['output_tok_s']:.2f}x batch 64"
        )
    result = {"benchmark": "hf_peer_batches", "device": torch.cuda.get_device_name(), "rows": rows}
    (args.out / "hf_peer_batches.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
