"""Speculative decoding: tokens/s and ms/token with and without speculation, side by side.

One engine per run (the model loads once); each configuration is measured against the same
engine with `use_speculation=False` requests, same prompts, greedy, so outputs must be
identical (checked). Workloads:
  (a) n-gram proposer on an editing task (rewrite a given text with one substitution): the
      output copies long spans of the prompt, the case prompt lookup is made for;
  (b) draft model: SmolLM2-135M verified by itself with a draft made of a subset of its own
      layers (`self:layers=...`, shared weights, own KV cache). Random-weight targets give
      meaningless acceptance; this pair has real acceptance on real text with no second
      checkpoint to carry. c (draft/target cost) is measured, not assumed.
For each: acceptance alpha (solved from the mean tokens emitted per verifying step), c, K, the
theoretical speedup (1 - alpha^(K+1)) / ((1 - alpha) (K c + 1)) and measured / theoretical.

    python -P bench/speculative.py --out bench/results               # CPU (or --device cuda)
    python -P bench/speculative.py --device cuda --model /path/SmolLM2-135M-Instruct.Q4_1.gguf
(-P: bench/operator.py must not shadow the stdlib `operator`.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from pagedinfer.engine.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedinfer.engine.llm import LLM  # noqa: E402
from pagedinfer.engine.sampling_params import SamplingParams  # noqa: E402
from pagedinfer.engine.spec_decode.factory import build_speculative_decoder  # noqa: E402


def _load_throughput_lib():
    # By path: bench/ holds operator.py, which must never shadow the stdlib module on sys.path.
    path = Path(__file__).resolve().parent / "throughput_lib.py"
    spec = importlib.util.spec_from_file_location("throughput_lib", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["throughput_lib"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


run_engine_requests = _load_throughput_lib().run_engine_requests

TEXTS = [
    "The committee met on Monday to review the budget. The committee approved the budget for the "
    "library and the budget for the park, and asked the treasurer for a new report on Friday.",
    "Our train leaves the station at nine in the morning. The train stops in three towns before it "
    "reaches the coast, and the last stop is a small harbor with a lighthouse and a fish market.",
    "To make the soup, cut two onions and three carrots, cook them in butter for ten minutes, then "
    "add the water and the salt, and let the soup simmer for half an hour before serving it hot.",
    "The library opens at eight and closes at six. Visitors may borrow five books at a time, and "
    "books must be returned within three weeks, or the library charges a small fee for each day.",
]
EDITS = [("Monday", "Tuesday"), ("nine", "ten"), ("two onions", "one onion"), ("five", "four")]


def tasks(num: int) -> list[str]:
    out = []
    for i in range(num):
        text, (old, new) = TEXTS[i % len(TEXTS)], EDITS[i % len(EDITS)]
        verb = ["Rewrite", "Copy"][(i // len(TEXTS)) % 2]
        out.append(f"{verb} the following text, replacing '{old}' with '{new}'. Text: {text}")
    return out


def solve_alpha(mean_emitted: float, k: int) -> float:
    """alpha with (1 - alpha^(k+1)) / (1 - alpha) == mean_emitted (bisection; 1 <= mean <= k+1)."""
    target = min(max(mean_emitted, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        value = sum(mid**i for i in range(k + 1))
        lo, hi = (mid, hi) if value < target else (lo, mid)
    return (lo + hi) / 2


def theoretical_speedup(alpha: float, k: int, c: float) -> float:
    if alpha >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


class Timed:
    """Wraps a bound method, summing its wall time (the callee ends in a host sync)."""

    def __init__(self, fn) -> None:
        self.fn, self.durations = fn, []

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.durations.append(time.perf_counter() - start)

    @property
    def median_s(self) -> float:
        # Median: the first call of a run also prefills the prompts into the draft cache.
        return statistics.median(self.durations) if self.durations else 0.0


def decode_ms_per_token(run) -> float:
    """Per-sequence ms per output token over the decode steps (the prefill step excluded)."""
    decode_ms = sum(s["ms"] for s in run.steps if s["pure_decode"])
    tokens_per_seq = (run.output_tokens - run.num_requests) / run.num_requests
    return decode_ms / max(tokens_per_seq, 1e-9)


def measure(llm: LLM, prompts: list[list[int]], max_tokens: int, k: int) -> dict:
    core, spec = llm.core, llm.core.spec_decoder
    plain = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, use_speculation=False)
    base = run_engine_requests(core, prompts, plain)
    base_steps = sorted(s["ms"] for s in base.steps if s["pure_decode"])
    base_step_ms = base_steps[len(base_steps) // 2]  # median plain decode step at this batch
    before = replace(spec.stats)
    timer = Timed(spec.proposer.propose)
    spec.proposer.propose = timer
    try:
        fast = run_engine_requests(core, prompts, replace(plain, use_speculation=True))
    finally:
        del spec.proposer.propose  # back to the class method
    stats = spec.stats
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    verifying = stats.num_verified_sequences - before.num_verified_sequences
    emitted = stats.num_emitted_tokens - before.num_emitted_tokens
    mean_emitted = emitted / verifying if verifying else 1.0
    alpha = solve_alpha(mean_emitted, k)
    # c: one draft token's proposer time per step over one plain decode step of the same batch.
    c = (timer.median_s / k) / (base_step_ms / 1e3)
    theory = theoretical_speedup(alpha, k, c)
    base_ms, fast_ms = decode_ms_per_token(base), decode_ms_per_token(fast)
    measured = base_ms / fast_ms
    return {
        "batch": len(prompts),
        "identical_outputs": base.token_ids == fast.token_ids,
        "base_tok_s": round(base.output_tok_s, 2),
        "spec_tok_s": round(fast.output_tok_s, 2),
        "base_ms_per_token": round(base_ms, 2),
        "spec_ms_per_token": round(fast_ms, 2),
        "base_decode_step_ms": round(base_step_ms, 2),
        "k": k,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_ratio": round(accepted / drafted, 4) if drafted else 0.0,
        "mean_emitted_per_verify_step": round(mean_emitted, 3),
        "alpha": round(alpha, 4),
        "c": round(c, 4),
        "theoretical_speedup": round(theory, 3),
        "measured_speedup": round(measured, 3),
        "measured_over_theoretical": round(measured / theory, 3),
    }


def build(args) -> LLM:
    config = EngineConfig(
        model=args.model,
        cache=CacheConfig(block_size=16, num_blocks=args.num_blocks),
        scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=16),
        device=DeviceConfig(device=args.device, dtype=args.dtype),
        speculative=SpeculativeConfig(
            method="ngram", num_speculative_tokens=args.k, ngram_min=1, ngram_max=3
        ),
    )
    return LLM(config)


def use_draft(llm: LLM, args) -> None:
    """Swap the engine's speculative decoder for a draft-model one over the same target."""
    runner = llm.core.runner
    spec = build_speculative_decoder(
        SpeculativeConfig(method="draft", num_speculative_tokens=args.k, draft_model=args.draft),
        runner.model,
        llm.tokenizer,
        num_blocks=args.num_blocks,
        block_size=16,
        max_model_len=1024,
        attention_backend=runner.config.attention_backend,
    )
    llm.core.spec_decoder = runner.spec_decoder = spec


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default="builtin://smollm2-135m")
    parser.add_argument("--draft", default="self:layers=0-9,20-29", help="draft spec for workload (b)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=512)
    args = parser.parse_args()
    llm = build(args)
    batches = [int(b) for b in args.batches.split(",")]
    encode = lambda text: llm.tokenizer.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    warm = [encode(tasks(1)[0])]
    results: dict = {"machine": _machine(args), "workloads": {}}
    for name in ("ngram", "draft"):
        if name == "draft":
            use_draft(llm, args)
        measure(llm, warm, 8, args.k)  # warm-up: allocator, kernels, first-call costs
        rows = []
        for batch in batches:
            row = measure(llm, [encode(t) for t in tasks(batch)], args.max_tokens, args.k)
            rows.append(row)
            print(name, json.dumps(row), flush=True)
        results["workloads"][name] = {"draft": args.draft if name == "draft" else None, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.json").write_text(json.dumps(results, indent=2))
    (out / "speculative_summary.txt").write_text(_summary(results))
    _plot(results, out / "speculative.png")
    print(_summary(results))


def _machine(args) -> dict:
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    return {
        "device": device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": args.model,
        "k": args.k,
        "max_tokens": args.max_tokens,
    }


def _summary(results: dict) -> str:
    lines = [f"speculative decoding on {results['machine']['device']} (K={results['machine']['k']}, greedy)"]
    lines.append(
        f"{'workload':8} {'B':>2} {'base tok/s':>10} {'spec tok/s':>10} {'ms/tok':>13} {'alpha':>6} "
        f"{'c':>6} {'theory':>6} {'meas.':>6} {'ratio':>6} same"
    )
    for name, workload in results["workloads"].items():
        for r in workload["rows"]:
            lines.append(
                f"{name:8} {r['batch']:>2} {r['base_tok_s']:>10} {r['spec_tok_s']:>10} "
                f"{r['base_ms_per_token']:>6}->{r['spec_ms_per_token']:<6} {r['alpha']:>6} {r['c']:>6} "
                f"{r['theoretical_speedup']:>6} {r['measured_speedup']:>6} "
                f"{r['measured_over_theoretical']:>6} {r['identical_outputs']}"
            )
    return "\n".join(lines) + "\n"


def _plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    labels, base, fast = [], [], []
    for name, workload in results["workloads"].items():
        for r in workload["rows"]:
            labels.append(f"{name}\nB={r['batch']}\nalpha={r['alpha']}")
            base.append(r["base_tok_s"])
            fast.append(r["spec_tok_s"])
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(1.8 * len(labels) + 2, 4))
    ax.bar([x - 0.2 for x in xs], base, 0.4, label="no speculation")
    ax.bar([x + 0.2 for x in xs], fast, 0.4, label="speculative")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Speculative decoding, {results['machine']['device']}, K={results['machine']['k']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
