"""The embedded model on the CPU: our loader and paged model side by side with transformers.

SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32), greedy, same prompts for both:
  - load: builtin://smollm2-135m through our loader vs transformers' from_pretrained(gguf_file=...)
  - generate: batch 1 and batch B chat prompts, N new tokens each (ours: PagedRunner over the
    native block manager, reference attention; transformers: generate() with its dynamic cache,
    left-padded for B > 1). Tokens per second of generated tokens, and the ratio ours / theirs.

    python -P bench/model_cpu.py --out bench/results [--new-tokens 32] [--batch 8] [--threads N]

Writes OUT/model_cpu.json and OUT/model_cpu.png. Numbers depend on how busy the machine is: both
sides run in the same process, interleaved, so the ratio is the figure to read.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from pagedinfer._native import BlockManager
from pagedinfer.engine.models.builtin import builtin_path
from pagedinfer.engine.models.loader import load_model
from pagedinfer.engine.models.testing import PagedRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish.",
    "Give me a synonym for 'happy'.",
    "What is 12 times 12?",
    "Name a planet in our solar system.",
]


def _ours(loaded, prompts, new_tokens) -> float:
    runner = PagedRunner(loaded.model, BlockManager(512, 16, True), 512, 16)
    start = time.perf_counter()
    outputs = runner.generate(prompts, new_tokens)  # no stop ids: exactly new_tokens each
    elapsed = time.perf_counter() - start
    return sum(len(o) for o in outputs) / elapsed


def _theirs(hf, prompts, new_tokens) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
    elapsed = time.perf_counter() - start
    return (out.shape[1] - width) * len(prompts) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    start = time.perf_counter()
    loaded = load_model("builtin://smollm2-135m", "cpu", torch.float32)
    ours_load = time.perf_counter() - start
    path = builtin_path("smollm2-135m")
    start = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    hf.eval()
    theirs_load = time.perf_counter() - start

    tok = loaded.tokenizer
    chats = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    rows = []
    for batch in (1, args.batch):
        prompts = [chats[i % len(chats)] for i in range(batch)]
        ours = _ours(loaded, prompts, args.new_tokens)
        theirs = _theirs(hf, prompts, args.new_tokens)
        rows.append(
            {"batch": batch, "ours_tok_s": ours, "transformers_tok_s": theirs, "ratio": ours / theirs}
        )
        print(
            f"batch {batch:3d}: ours {ours:7.1f} tok/s  transformers {theirs:7.1f} tok/s  ratio {ours / theirs:.2f}x"
        )
    print(
        f"load: ours {ours_load:.1f} s  transformers {theirs_load:.1f} s  ratio {theirs_load / ours_load:.1f}x faster"
    )
    result = {
        "model": "builtin://smollm2-135m (fp32, CPU)",
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "new_tokens": args.new_tokens,
        "load_s": {"ours": ours_load, "transformers": theirs_load},
        "generate": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model_cpu.json").write_text(json.dumps(result, indent=2))
    _plot(result, args.out / "model_cpu.png")


def _plot(result: dict, path: Path) -> None:
    drawn = common.subplots(path, 1, 2, figsize=(10, 4))
    if drawn is None:
        return
    fig, (ax1, ax2) = drawn
    labels = [f"batch {r['batch']}" for r in result["generate"]]
    x = range(len(labels))
    ax1.bar([i - 0.2 for i in x], [r["ours_tok_s"] for r in result["generate"]], 0.4, label="paged-infer")
    ax1.bar(
        [i + 0.2 for i in x], [r["transformers_tok_s"] for r in result["generate"]], 0.4, label="transformers"
    )
    ax1.set_xticks(list(x), labels)
    ax1.set_ylabel("generated tokens / s")
    ax1.set_title("SmolLM2-135M greedy, fp32 CPU")
    ax1.legend()
    loads = result["load_s"]
    ax2.bar(["paged-infer", "transformers"], [loads["ours"], loads["transformers"]], color=["C0", "C1"])
    ax2.set_ylabel("seconds")
    ax2.set_title("load builtin GGUF")
    common.save(fig, path, dpi=100)


if __name__ == "__main__":
    main()
